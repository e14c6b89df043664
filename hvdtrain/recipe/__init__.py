"""The training recipe that `hvdtrain.fit` runs (`trainer`), and its rooms: the flags
(`flags`), the model's optimizers distributed (`prepare`, `optim`, `rates`, `precision`),
the callbacks around Keras's `fit` (`callbacks`, `metrics`, `agreement`, `usercallbacks`),
checkpoints and resume (`checkpoint`, `resume`), what a run writes (`outputs`, `summary`) and
the same recipe under Horovod Elastic (`elastic`). It asks the data forms (`hvdtrain.data`)
for batches and the exchange (`hvdtrain.exchange`) how the ranks meet, without asking which
form or which mode it holds.
"""
