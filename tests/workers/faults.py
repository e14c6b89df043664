"""A small Keras fit loop on every rank; one rank injects a fault at a given step.

    horovodrun -np 2 -H localhost:2 python tests/workers/faults.py FAULT [STEP [RANK]] [--no-...]
        [--keras3]

FAULT: none | kill (SIGKILL itself) | raise (RuntimeError) | sleep (forever) | stop
(SIGSTOP itself: the whole process freezes, Horovod's background thread and the
watchdog too) | eval-alone (evaluates alone at the end of the first epoch: the classic
"validation on rank 0 only" stall). The fault fires on rank RANK (default 1) after its
global step STEP (default 5), inside a batch-end callback, i.e. mid-epoch. Stall times
come from HVDTRAIN_STALL_SHUTDOWN_SECONDS (read by `hvdtrain.init`). --keras3: the model,
optimizer and callbacks of Keras 3 (`import keras`), through the same building blocks. With
FAULT_STAMP set, the faulty rank writes the time of the fault (time.time()) to that file
first.
"""

import os
import signal
import sys
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdtrain

args = [a for a in sys.argv[1:] if not a.startswith("--")]
fault = args[0]
fault_step = int(args[1]) if len(args) > 1 else 5
fault_rank = int(args[2]) if len(args) > 2 else 1
watchdog = "--no-watchdog" not in sys.argv
if "--keras3" in sys.argv:
    import keras as K
else:
    K = tf.keras

hvdtrain.init(threads=1)
rank, size = hvd.rank(), hvd.size()


class Fault(K.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.step = 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if rank != fault_rank or self.step != fault_step or fault == "eval-alone":
            return
        stamp(f"{fault} after step {self.step}")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "raise":
            raise RuntimeError(f"injected failure on rank {rank} at step {self.step}")
        elif fault == "sleep":
            while True:
                time.sleep(3600)
        elif fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)

    def on_epoch_end(self, epoch, logs=None):
        if fault == "eval-alone" and rank == fault_rank and epoch == 0:
            stamp("evaluation on this rank alone")
            hvdtrain.evaluate(self.model, hvdtrain.eval_dataset(x, y, 256, 0, 1))


def stamp(what):
    if os.environ.get("FAULT_STAMP"):
        with open(os.environ["FAULT_STAMP"], "w") as f:
            f.write(repr(time.time()))
    print(f"worker rank {rank}: injecting {what}", flush=True)


rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 8)).astype(np.float32)
y = (x.sum(axis=1) > 0).astype(np.int32)
batch = 16
steps = hvdtrain.steps_per_epoch(len(x), batch, size)
model = K.Sequential([K.Input((8,)), K.layers.Dense(16, activation="relu"), K.layers.Dense(2)])
optimizer = hvdtrain.distributed_optimizer(K.optimizers.SGD(0.01))
loss = K.losses.SparseCategoricalCrossentropy(from_logits=True)
model.compile(optimizer=optimizer, loss=loss)
hvdtrain.broadcast_initial_state(model, optimizer)
callbacks = ([hvdtrain.WatchdogCallback()] if watchdog else []) + [Fault()]
model.fit(
    hvdtrain.train_dataset(x, y, batch, rank, size),
    steps_per_epoch=steps,
    epochs=3,
    verbose=0,
    callbacks=callbacks,
)
print(f"worker rank {rank}: finished {3 * steps} steps", flush=True)
