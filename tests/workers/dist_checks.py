"""Runs under `horovodrun -np N`: each rank records what the tests assert (one JSON per rank).

horovodrun -np 2 -H localhost:2 python tests/workers/dist_checks.py OUT_DIR [3]

With 3, the model, optimizer, losses and callbacks are Keras 3's (`import keras`).
"""

import json
import os
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdtrain

out = sys.argv[1]
if sys.argv[2:] == ["3"]:
    import keras as K
else:
    K = tf.keras
hvdtrain.init()
rank, size = hvd.rank(), hvd.size()
res = {"rank": rank, "size": size, "local_rank": hvd.local_rank()}

# Sharding: 1001 samples do not divide by 2 ranks.
n, batch = 1001, 10
res["shard"] = hvdtrain.shard_indices(n, rank, size).tolist()
res["steps"] = hvdtrain.steps_per_epoch(n, batch, size)
ids = np.arange(n)
ds = hvdtrain.train_dataset(ids.astype(np.float32)[:, None], ids, batch, rank, size, seed=1)
res["epoch_samples"] = [int(v) for _, yb in ds.take(res["steps"]) for v in yb.numpy()]

# Broadcast: every rank starts from a different random initialisation.
K.utils.set_random_seed(100 + rank)
model = K.Sequential([K.Input((4,)), K.layers.Dense(16, activation="relu"), K.layers.Dense(3)])
base_lr, warmup = 0.01, 4
optimizer = hvdtrain.distributed_optimizer(
    K.optimizers.Adam(hvdtrain.WarmupSchedule(base_lr, size, warmup))
)
loss_fn = K.losses.SparseCategoricalCrossentropy(from_logits=True)
model.compile(optimizer=optimizer, loss=loss_fn, metrics=["accuracy"])
res["keras"] = "2" if K is tf.keras else K.__version__
res["digest_init"] = hvdtrain.weights_digest(model)
hvdtrain.broadcast_initial_state(model, optimizer)
res["digest_broadcast"] = hvdtrain.weights_digest(model)

# Training on different data per rank must still leave identical weights everywhere.
rng = np.random.default_rng(rank)
x = rng.normal(size=(512, 4)).astype(np.float32)
y = rng.integers(0, 3, 512)
lrs = []
# The rate each step applies: Keras 2 reports it after the step (`_current_learning_rate`),
# Keras 3 at the optimizer's step, so before it.
when = "on_train_batch_begin" if K is not tf.keras else "on_train_batch_end"
record = K.callbacks.LambdaCallback(
    **{when: lambda b, logs: lrs.append(float(optimizer.learning_rate))}
)
model.fit(
    hvdtrain.train_dataset(x, y, 32, 0, 1),
    steps_per_epoch=8,
    epochs=1,
    verbose=0,
    callbacks=[record],
)
res["lrs"] = lrs
res["base_lr"], res["warmup"] = base_lr, warmup
res["digest_trained"] = hvdtrain.weights_digest(model)
res["optimizer_state"] = [float(np.sum(np.abs(v.numpy()))) for v in optimizer.variables]

# Evaluation over an uneven split (1001 samples): weighted exactly, each sample once.
xe = np.random.default_rng(7).normal(size=(1001, 4)).astype(np.float32)
ye = np.random.default_rng(8).integers(0, 3, 1001)
res["eval"] = hvdtrain.evaluate(model, hvdtrain.eval_dataset(xe, ye, 64, rank, size))
logits = model(xe, training=False).numpy()
loss = tf.keras.losses.sparse_categorical_crossentropy(ye, logits, from_logits=True).numpy()
res["eval_exact"] = {
    "loss": float(loss.mean()),
    "accuracy": float((logits.argmax(-1) == ye).mean()),
}
# The same from a stream of unknown length (a filter), 4 steps per execution: counted once.
model.compile(optimizer=optimizer, loss=loss_fn, metrics=["accuracy"], steps_per_execution=4)
stream = hvdtrain.eval_dataset(xe, ye, 64, rank, size).unbatch().filter(lambda x, y: True)
res["eval_stream"] = hvdtrain.evaluate(model, stream.batch(16))
shard = hvdtrain.shard_indices(1001, rank, size)
res["eval_shard_mean_loss"] = float(loss[shard].mean())
res["weighted_mean"] = hvdtrain.weighted_mean({"v": 10.0 * rank}, count=rank + 1)

with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(res, f)
