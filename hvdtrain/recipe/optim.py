"""Optimisation over the ranks: the distributed optimizer of either Keras, the state every
rank starts from (broadcast) and shares (BatchNorm's statistics averaged). The learning
rate's scaling and warmup are `hvdtrain.optimizers.rates`'; what differs between the two Keras is in
`hvdtrain.frontends`, which this module asks.
"""

import horovod.tensorflow as hvd

from hvdtrain import frontends
from hvdtrain.exchange import wire
from hvdtrain.frontends import keras2
from hvdtrain.frontends.keras2 import is_distributed
from hvdtrain.optimizers.rates import WarmupMath
from hvdtrain.runtime import compat

__all__ = [
    "distributed_optimizer",
    "is_distributed",
    "fp16_compression",
    "broadcast_initial_state",
    "average_model_state",
    "state_variables",
]


def distributed_optimizer(optimizer, compression=None, backward_passes_per_step=1, **kwargs):
    """Wraps a Keras optimizer so gradients are averaged across ranks before each update.

    Args:
        optimizer: a Keras optimizer.
        compression: e.g. `fp16_compression()` to send float16 gradients (opt-in: it
            changes the math slightly); None sends them as they are.
        backward_passes_per_step: average the gradients of this many local batches before
            each allreduce and update (local gradient accumulation; 1 = off).
        **kwargs: passed on to `hvd.DistributedOptimizer` (Keras 2).

    A Keras 3 optimizer (`import keras`) gets hvdtrain's own wrapper instead
    (`hvdtrain.frontends.keras3.distributed_optimizer`: its `apply` averages the gradients).
    """
    keras3 = compat.keras3_imported()
    if keras3 is not None and isinstance(optimizer, keras3.optimizers.Optimizer) and not kwargs:
        from hvdtrain.frontends import keras3 as frontend  # lazy: importing Keras 3 costs 1 s

        return frontend.distributed_optimizer(optimizer, compression, backward_passes_per_step)
    return keras2.horovod_optimizer(optimizer, compression, backward_passes_per_step, **kwargs)


def fp16_compression():
    """Horovod's float16 gradient compression, for `distributed_optimizer(compression=...)`."""
    return hvd.Compression.fp16


def broadcast_initial_state(model, optimizer=None, root_rank=0):
    """Makes every rank start from rank `root_rank`'s weights and optimizer state.

    Unlike Horovod's `BroadcastGlobalVariablesCallback`, which broadcasts after the first
    batch, this runs before any step: the optimizer's slots are created first, so a state
    restored from a checkpoint on rank 0 reaches every rank, and the first update already
    starts from identical weights. `optimizer` may be a list or a dict of them (a GAN's
    two); their slots are made for all the model's trainable variables if they have none.
    """
    for opt in _each(optimizer):
        if not _is_built(opt):
            opt.build(model.trainable_variables)
    wire.by_position(
        state_variables(model, optimizer),
        "hvdtrain.broadcast",
        lambda t, name: hvd.broadcast(t, root_rank, name=name),
    )


def state_variables(model, optimizer=None):
    """The `tf.Variable`s of `model` and `optimizer` (built; a loss scale's too; a list or a
    dict of optimizers), in a fixed order: what a rank must share with the others to train
    on as they do. A `WarmupSchedule`'s single-worker rate is among them (a callback may
    have set it)."""
    variables = list(model.variables)
    frontend = frontends.owner(model)
    for opt in _each(optimizer):
        variables += frontend.optimizer_variables(opt) if frontend else opt.variables
        schedule = wire.learning_rate_of(opt)
        if isinstance(schedule, WarmupMath) and schedule.rate is not None:
            variables.append(schedule.rate)
    return wire.tf_variables(variables)


def _each(optimizers):
    """The optimizers of None, one, a list or a dict of them, each once, in order."""
    if optimizers is None:
        return []
    if isinstance(optimizers, dict):
        optimizers = list(optimizers.values())
    elif not isinstance(optimizers, list | tuple):
        optimizers = [optimizers]
    seen, out = set(), []
    for opt in optimizers:
        if id(opt) not in seen:
            seen.add(id(opt))
            out.append(opt)
    return out


def _is_built(opt):
    return bool(getattr(opt, "built", False) or getattr(opt, "_built", False))


def average_model_state(model):
    """Averages the model's non-trainable float variables (BatchNorm's moving mean and
    variance) over all ranks.

    The distributed optimizer keeps trainable weights identical, but each rank updates its
    moving statistics from its own batches, so they drift apart; averaging them at the end
    of each epoch gives every rank (and rank 0's checkpoint) statistics of all the data.
    """
    state = [v for v in wire.tf_variables(model.non_trainable_variables) if v.dtype.is_floating]
    wire.average_variables(state, "hvdtrain.state")
