"""Local gradient accumulation: N micro-batches of b must equal one batch of N*b.

python tests/workers/accumulate.py OUT.npz BATCH ACCUMULATE MICRO_STEPS [KERAS]
horovodrun -np 2 -H localhost:2 python tests/workers/accumulate.py OUT.npz 16 2 8 3
(KERAS: 2, tf.keras, by default; 3, `import keras`)
"""

import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdtrain

out, batch, accumulate, steps = sys.argv[1], *map(int, sys.argv[2:5])
if sys.argv[5:] == ["3"]:
    import keras
else:
    keras = tf.keras
hvdtrain.init()
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 20)).astype(np.float32)
y = rng.integers(0, 5, 1024)
model = keras.Sequential(
    [keras.Input((20,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(5)]
)
optimizer = hvdtrain.distributed_optimizer(
    keras.optimizers.SGD(0.1), backward_passes_per_step=accumulate
)
model.compile(optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
hvdtrain.broadcast_initial_state(model, optimizer)
ds = hvdtrain.train_dataset(x, y, batch, hvd.rank(), hvd.size(), shuffle=False)
model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)
report = hvdtrain.rank_report(model)
if hvd.rank() == 0:
    np.savez(
        out, *model.get_weights(), iterations=int(np.array(optimizer.iterations)),
        digests=np.array([r["weights_digest"] for r in report]),
    )  # fmt: skip
