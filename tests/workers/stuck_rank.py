"""Rank 1 stops making progress in one place while rank 0 waits for it in the next
collective (issue 51): the launcher's summary must name rank 1, and rank 0 is never blamed.

    HVDTRAIN_STALL_SHUTDOWN_SECONDS=5 hvdtrain-run --backend gloo -np 2 -- \
        python tests/workers/stuck_rank.py callback|data|step|raise|raise-early

callback: it sleeps 120 s in a user's epoch-end callback (hvdtrain's watchdog names it).
data: its `Sequence` sleeps in `__getitem__` of its 7th batch (in tf.data's thread, while the
    training thread waits inside a step: the watchdog names it for its data).
raise: every rank raises the same error in a function of the user's (not stuck: its traceback
    once per host); raise-early: the same before `hvd.init()`, in the script's data code.
step: its model's `train_step` sleeps (a `tf.py_function`) before the gradients of its 7th
    step: rank 0 waits in their allreduce, and Horovod's stall check names rank 1 missing.
"""

import os
import sys
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import hvdtrain

where = sys.argv.pop(1)  # before the flags are parsed
STUCK_AT = 6  # batches (0-based) or steps done before rank 1 stops


def stop_here():
    print(f"rank {hvd.rank()}: stuck ({where})", flush=True)
    time.sleep(120)


class Sleepy(tf.keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() == 1 and epoch == 0:
            stop_here()


def check_labels(logs):
    raise ValueError(f"labels out of range after {len(logs)} logs")


def wait_for_every_rank_to_print(rank, size):
    """Each rank, once hvdtrain's hook printed its traceback (or its line), waits (30 s at
    most) for the others' to be printed too: else the launcher (plain mpirun at once) may
    end the slower rank before it raises, and the test would see one rank only."""
    printed = sys.excepthook

    def hook(*exc):
        printed(*exc)
        sys.stderr.flush()
        open(f"printed-{where}-{rank}", "w").close()  # one set per mode
        for _ in range(300):
            if all(os.path.exists(f"printed-{where}-{r}") for r in range(size)):
                break
            time.sleep(0.1)

    sys.excepthook = hook


class Raising(tf.keras.callbacks.Callback):  # `raise`: every rank, alike, in the user's code
    def on_train_begin(self, logs=None):
        wait_for_every_rank_to_print(hvd.rank(), hvd.size())

    def on_epoch_end(self, epoch, logs=None):
        check_labels(logs)


class Batches(tf.keras.utils.Sequence):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        if hvd.rank() == 1 and i // 2 == STUCK_AT:  # rank 1 loads the odd batches
            stop_here()
        return np.ones((8, 4), "float32"), np.ones((8,), "float32")


class Model(tf.keras.Model):
    def train_step(self, data):
        def maybe_stop(step):
            if hvd.rank() == 1 and int(step) == STUCK_AT:
                stop_here()
            return step

        step = tf.py_function(maybe_stop, [self._train_counter], tf.int64)
        x, y = data
        with tf.control_dependencies([step]):  # before the forward pass and its gradients
            x = tf.identity(x)
        return super().train_step((x, y))


def build():
    inputs = tf.keras.Input((4,))
    cls = Model if where == "step" else tf.keras.Model
    model = cls(inputs, tf.keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    return model


x = np.ones((256, 4), "float32")
args = hvdtrain.ArgumentParser(epochs=3, steps_per_execution=1).parse_args()
if where == "raise-early":  # before hvd.init(): the rank and size from the launcher
    from hvdtrain.errors import env_rank
    from hvdtrain.runtime.tuning import launcher_size

    wait_for_every_rank_to_print(env_rank(), launcher_size(os.environ) or 1)
    check_labels([])
data = hvdtrain.BatchData(Batches(), shuffle=False) if where == "data" else (x, x[:, 0])
callbacks = {"callback": [Sleepy()], "raise": [Raising()]}.get(where, [])
hvdtrain.fit(build, data, args, callbacks=callbacks)
