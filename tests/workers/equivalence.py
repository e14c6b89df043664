"""N ranks with per-rank batch b must match 1 rank with batch N*b (plain SGD, same data order).

python tests/workers/equivalence.py OUT.npz BATCH STEPS
horovodrun -np 2 -H localhost:2 python tests/workers/equivalence.py OUT.npz BATCH STEPS
"""

import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdtrain

out, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hvdtrain.init()
tf.keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
x = rng.normal(size=(1024, 20)).astype(np.float32)
y = rng.integers(0, 5, 1024)
model = tf.keras.Sequential(
    [tf.keras.Input((20,)), tf.keras.layers.Dense(32, activation="tanh"), tf.keras.layers.Dense(5)]
)
optimizer = hvdtrain.distributed_optimizer(tf.keras.optimizers.SGD(0.1))
model.compile(optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
hvdtrain.broadcast_initial_state(model, optimizer)
ds = hvdtrain.train_dataset(x, y, batch, hvd.rank(), hvd.size(), shuffle=False)
model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)
if hvd.rank() == 0:
    np.savez(out, *model.get_weights())
