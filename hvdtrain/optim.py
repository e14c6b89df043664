"""Optimisation: the learning rate scaled by the number of ranks, a warmup, and the
distributed optimizer.

With N ranks the global batch is N times the per-rank batch, so the learning rate is
scaled by N (Goyal et al., 2017). Starting at the full rate destabilises the first steps,
so it ramps linearly from the single-worker rate to N times that over the warmup.
"""

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import tensorflow as tf

from hvdtrain import compat
from hvdtrain.errors import invalid_value

__all__ = [
    "scaled_lr",
    "warmup_lr",
    "WarmupSchedule",
    "distributed_optimizer",
    "fp16_compression",
    "broadcast_initial_state",
    "average_model_state",
]


def scaled_lr(base_lr, size):
    """The learning rate for `size` ranks: `base_lr` (the single-worker rate) x `size`."""
    return base_lr * size


def warmup_lr(step, base_lr, size, warmup_steps):
    """The learning rate at `step`: `base_lr` at step 0, rising linearly to
    `scaled_lr(base_lr, size)` at `warmup_steps`, constant after."""
    if warmup_steps <= 0:
        return scaled_lr(base_lr, size)
    progress = min(1.0, step / warmup_steps)
    return base_lr * (1.0 + (size - 1) * progress)


@tf.keras.utils.register_keras_serializable(package="hvdtrain")
class WarmupSchedule(tf.keras.optimizers.schedules.LearningRateSchedule):
    """`warmup_lr` as a Keras schedule: it follows `optimizer.iterations`, so a resumed run
    continues the warmup where the checkpoint left it."""

    def __init__(self, base_lr, size, warmup_steps):
        if base_lr <= 0:
            raise invalid_value("lr", base_lr, "a positive single-worker learning rate")
        self.base_lr = float(base_lr)
        self.size = int(size)
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        if self.warmup_steps <= 0:
            return tf.constant(scaled_lr(self.base_lr, self.size), tf.float32)
        progress = tf.minimum(1.0, step / float(self.warmup_steps))
        return self.base_lr * (1.0 + (self.size - 1) * progress)

    def get_config(self):
        return {"base_lr": self.base_lr, "size": self.size, "warmup_steps": self.warmup_steps}


def distributed_optimizer(optimizer, compression=None, backward_passes_per_step=1, **kwargs):
    """Wraps a Keras optimizer so gradients are averaged across ranks before each update.

    Args:
        optimizer: a Keras optimizer.
        compression: e.g. `fp16_compression()` to send float16 gradients (opt-in: it
            changes the math slightly); None sends them as they are.
        backward_passes_per_step: average the gradients of this many local batches before
            each allreduce and update (local gradient accumulation; 1 = off).
        **kwargs: passed on to `hvd.DistributedOptimizer`.
    """
    compat.require_keras2()  # Horovod's wrapper fails deep inside `fit` on Keras 3
    if compression is not None:
        kwargs["compression"] = compression
    if backward_passes_per_step > 1:
        kwargs["backward_passes_per_step"] = backward_passes_per_step
        kwargs.setdefault("average_aggregated_gradients", True)
    return hvd_keras.DistributedOptimizer(optimizer, **kwargs)


def fp16_compression():
    """Horovod's float16 gradient compression, for `distributed_optimizer(compression=...)`."""
    return hvd.Compression.fp16


def broadcast_initial_state(model, optimizer=None, root_rank=0):
    """Makes every rank start from rank `root_rank`'s weights and optimizer state.

    Unlike Horovod's `BroadcastGlobalVariablesCallback`, which broadcasts after the first
    batch, this runs before any step: the optimizer's slots are created first, so a state
    restored from a checkpoint on rank 0 reaches every rank, and the first update already
    starts from identical weights.
    """
    variables = list(model.variables)
    if optimizer is not None:
        optimizer.build(model.trainable_variables)
        variables += list(optimizer.variables)
    if hvd.size() > 1:
        hvd.broadcast_variables(variables, root_rank=root_rank)


def average_model_state(model):
    """Averages the model's non-trainable float variables (BatchNorm's moving mean and
    variance) over all ranks.

    The distributed optimizer keeps trainable weights identical, but each rank updates its
    moving statistics from its own batches, so they drift apart; averaging them at the end
    of each epoch gives every rank (and rank 0's checkpoint) statistics of all the data.
    """
    if hvd.size() == 1:
        return
    for v in model.non_trainable_variables:
        if v.dtype.is_floating:
            v.assign(hvd.allreduce(v, op=hvd.Average, name=f"hvdtrain.state.{v.name}"))
