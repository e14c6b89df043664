"""Runs under `mpirun -np 2`: `hvdtrain.init(comm=...)` on an mpi4py communicator.

mpirun -np 2 python tests/workers/mpi4py_comm.py OUT_DIR split|world

`split`: `MPI.COMM_WORLD.Split(color=rank)` makes each process its own 1-rank Horovod job;
`world`: both processes form one 2-rank job. Each process trains on different data and
writes OUT_DIR/world<rank>.json.
"""

import json
import os
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from mpi4py import MPI  # initialises MPI here, before hvdtrain.init(): mpi4py owns it

import hvdtrain

out, mode = sys.argv[1], sys.argv[2]
world = MPI.COMM_WORLD
comm = world.Split(color=world.rank, key=world.rank) if mode == "split" else world
hvdtrain.init(comm=comm)
res = {
    "world_rank": world.rank,
    "world_size": world.size,
    "rank": hvd.rank(),
    "size": hvd.size(),
    "local_size": hvd.local_size(),
    "mpi_enabled": hvd.mpi_enabled(),
}

tf.keras.utils.set_random_seed(0)  # the same initial weights in every process
model = tf.keras.Sequential(
    [tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="tanh"), tf.keras.layers.Dense(3)]
)
optimizer = hvdtrain.distributed_optimizer(tf.keras.optimizers.SGD(0.1))
model.compile(optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
hvdtrain.broadcast_initial_state(model, optimizer)
res["digest_init"] = hvdtrain.weights_digest(model)

rng = np.random.default_rng(world.rank)  # different data in each process
x = rng.normal(size=(256, 8)).astype(np.float32)
y = rng.integers(0, 3, 256)
ds = hvdtrain.train_dataset(x, y, 32, 0, 1, shuffle=False)
model.fit(ds, steps_per_epoch=4, epochs=1, verbose=0)
res["digest_trained"] = hvdtrain.weights_digest(model)
res["steps"] = int(optimizer.iterations)
# A collective on the communicator: the sum over this job's ranks only.
res["allreduce_sum"] = float(hvd.allreduce(tf.constant(world.rank + 1.0), op=hvd.Sum).numpy())

with open(os.path.join(out, f"world{world.rank}.json"), "w") as f:
    json.dump(res, f)
