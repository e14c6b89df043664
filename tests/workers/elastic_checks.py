"""One process, no launcher: the Horovod 0.28.1 elastic pitfalls that hvdtrain.recipe.elastic works
around, each shown with Horovod's own piece and with hvdtrain's. Writes one JSON.

HOROVOD_CONTROLLER=gloo HOROVOD_CPU_OPERATIONS=gloo python tests/workers/elastic_checks.py OUT.json
"""

import json
import sys

import horovod.tensorflow.keras as hvd
import numpy as np
import tensorflow as tf

import hvdtrain
from hvdtrain.optimizers import rates
from hvdtrain.recipe import elastic

out = {}
hvdtrain.init(threads=1)


def one_weight_model(optimizer):
    """loss = w: every step's gradient is 1, so a step changes w by exactly -lr. w starts at
    0: a random start near 1 left the steps float32's 1e-7 apart from the rate (seen: a
    step of 0.02000004 for 0.02)."""
    dense = tf.keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    model = tf.keras.Sequential([tf.keras.Input((1,)), dense])
    model.compile(optimizer=optimizer, loss=lambda y, p: tf.reduce_mean(p))
    return model


ONES = (np.ones((1, 1), np.float32), np.zeros((1, 1), np.float32))


def step_size(model):
    before = float(model.weights[0].numpy().ravel()[0])
    model.fit(*ONES, batch_size=1, epochs=1, verbose=0)
    return before - float(model.weights[0].numpy().ravel()[0])


# 1. The LR scale after a size change from 2 ranks to 1 (0.02 -> 0.01). Horovod's
#    DistributedOptimizer uses a copy of the schedule (rebuilt from the config), and the
#    traced train step keeps the old rate until it is traced again.
for how in ("schedule_given", "repointed", "hvdtrain"):
    schedule = hvdtrain.WarmupSchedule(0.01, 2, 0)
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(schedule))
    if how != "schedule_given":
        optimizer.learning_rate = schedule  # what hvdtrain.recipe.elastic does
    model = one_weight_model(optimizer)
    first = step_size(model)
    if how == "hvdtrain":
        rates.rescale_schedule(model, schedule, 1, 0)
    else:
        schedule.size = 1
    out[f"lr_steps_{how}"] = [first, step_size(model)]


# 2. state.epoch after fit(initial_epoch=state.epoch) runs one epoch (horovod#2844), and
#    3. state.batch after 3 steps of an epoch that fit started 2 steps in.
class Stop(tf.keras.callbacks.Callback):
    """Notes state.batch after the third step, then stops (the epoch end resets it)."""

    def __init__(self, state, seen):
        super().__init__()
        self.state, self.seen = state, seen

    def on_train_batch_end(self, batch, logs=None):
        if batch == 2:
            self.seen.append(self.state.batch)
            self.model.stop_training = True


def states(epoch_cb, batch_cb):
    model = one_weight_model(hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)))
    model.optimizer.build(model.trainable_variables)
    state = hvd.elastic.KerasState(model, model.optimizer, epoch=1, batch=0)
    model.fit(*ONES, batch_size=1, initial_epoch=state.epoch, epochs=2, verbose=0,
              callbacks=[epoch_cb(state)])  # fmt: skip
    epoch, seen = state.epoch, []
    state.batch = 2
    x = np.ones((10, 1), np.float32)
    model.fit(x, x, batch_size=1, epochs=1, steps_per_epoch=8, verbose=0,
              callbacks=[batch_cb(state), Stop(state, seen)])  # fmt: skip
    return {"epoch": epoch, "batch": seen[0]}


horovods = hvd.elastic.UpdateEpochStateCallback, hvd.elastic.UpdateBatchStateCallback
out["horovod_state"] = states(*horovods)
out["hvdtrain_state"] = states(elastic.UpdateEpochStateCallback, elastic.UpdateBatchStateCallback)


# 4. An UnknownError that names no Horovod op: Horovod's wrapper returns None (as if the
#    training had ended well); hvdtrain's run() lets it out.
def fails(state):
    raise tf.errors.UnknownError(None, None, "a bug in a loader")


model = one_weight_model(hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.01)))
model.optimizer.build(model.trainable_variables)
state = hvd.elastic.KerasState(model, model.optimizer, epoch=0, batch=0)
out["horovod_run_returns"] = repr(hvd.elastic.run(fails)(state))
try:
    hvd.elastic.run(elastic.guarded(fails))(state)
    out["hvdtrain_run_raises"] = None
except RuntimeError as e:
    out["hvdtrain_run_raises"] = str(e)


# 5. A broadcast that fails while rank 0's state is synchronised (a worker died as another
#    joined): Horovod's state lets the error end the worker; hvdtrain's rolls back and
#    starts again (here, alone: re-initialised as 1 rank).
def sync_fails_once(state_class):
    failures = ["HorovodBroadcast_x_0: Horovod has been shut down"]
    state = state_class(model, model.optimizer, epoch=0, batch=0)
    real = state._bcast_model

    def flaky():
        if failures:
            raise tf.errors.UnknownError(None, None, failures.pop())
        real()

    state._bcast_model = flaky
    try:
        return hvd.elastic.run(lambda s: "trained")(state)
    except tf.errors.OpError as e:
        return type(e).__name__


out["horovod_sync_failure"] = sync_fails_once(hvd.elastic.KerasState)
out["hvdtrain_sync_failure"] = sync_fails_once(elastic.ModelState)

with open(sys.argv[1], "w") as f:
    json.dump(out, f)
