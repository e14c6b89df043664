"""Optimisation over the ranks: the distributed optimizer of either Keras, the state every
rank starts from (broadcast) and shares (BatchNorm's statistics averaged). The learning
rate's scaling and warmup are `hvdtrain.rates`'; what differs between the two Keras is in
`hvdtrain.frontends`, which this module asks.
"""

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdtrain import compat, frontends
from hvdtrain.frontends import keras2
from hvdtrain.frontends.keras2 import is_distributed
from hvdtrain.rates import WarmupMath

__all__ = [
    "distributed_optimizer",
    "is_distributed",
    "fp16_compression",
    "broadcast_initial_state",
    "average_model_state",
    "average_variables",
    "gate_gradients",
    "packed",
    "pack",
    "unpack",
    "slot_variables",
    "state_variables",
    "tf_variables",
    "weighted",
    "wire_bytes",
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
    _by_position(
        state_variables(model, optimizer),
        "hvdtrain.broadcast",
        lambda t, name: hvd.broadcast(t, root_rank, name=name),
    )


def gate_gradients(optimizer, gate):
    """Makes `optimizer` (one of hvdtrain's distributed optimizers, either Keras) average its
    gradients only while `gate` (a `hvdtrain.gate.Gate`) is on."""
    getattr(optimizer, "inner_optimizer", optimizer)._hvdtrain_gate = gate


def slot_variables(optimizer):
    """`optimizer`'s float state of its own (Adam's moments, momentum): its variables but its
    step counter and its learning rate (a variable, or a `WarmupSchedule`'s single-worker
    rate), found by what they are, not by their names."""
    held = _learning_rate(optimizer)
    held = getattr(held, "rate", held)  # a WarmupSchedule: its single-worker rate, or None
    rate = {id(held), id(getattr(held, "value", held))}
    return [
        v for v in tf_variables(optimizer.variables) if v.dtype.is_floating and id(v) not in rate
    ]


def _learning_rate(optimizer):
    """What `optimizer` holds as its learning rate: a variable, or a schedule."""
    return getattr(getattr(optimizer, "inner_optimizer", optimizer), "_learning_rate", None)


def state_variables(model, optimizer=None):
    """The `tf.Variable`s of `model` and `optimizer` (built; a loss scale's too; a list or a
    dict of optimizers), in a fixed order: what a rank must share with the others to train
    on as they do. A `WarmupSchedule`'s single-worker rate is among them (a callback may
    have set it)."""
    variables = list(model.variables)
    frontend = frontends.owner(model)
    for opt in _each(optimizer):
        variables += frontend.optimizer_variables(opt) if frontend else opt.variables
        schedule = _learning_rate(opt)
        if isinstance(schedule, WarmupMath) and schedule.rate is not None:
            variables.append(schedule.rate)
    return tf_variables(variables)


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
    state = [v for v in tf_variables(model.non_trainable_variables) if v.dtype.is_floating]
    average_variables(state, "hvdtrain.state")


def average_variables(variables, prefix):
    """Sets `variables` to their mean over the ranks, as they are (full precision), in one
    allreduce per dtype named by `prefix` (see `_by_position`)."""
    _by_position(variables, prefix, lambda t, name: hvd.allreduce(t, op=hvd.Average, name=name))


def _by_position(variables, prefix, collective):
    """Assigns `collective(tensor, name)` of `variables` to them: one call per dtype, over the
    variables packed into one buffer, named by `prefix` and the dtype.

    Horovod matches a collective across ranks by its name, and the names it makes itself come
    from the variables' names, which come from each rank's own Keras name counter: once rank 0
    alone has built a layer (the export of a model at the end of `hvdtrain.fit`, a callback of
    its own), a second `fit` in the same process had `dense_4/kernel` on rank 0 and
    `dense_2/kernel` on rank 1, and hung. Names by position cannot drift apart.
    """
    if hvd.size() == 1 or not variables:
        return
    variables = tf_variables(variables)
    for v, value in zip(variables, packed(variables, prefix, collective), strict=True):
        v.assign(value)


def packed(tensors, prefix, collective):
    """`collective(buffer, name)` of `tensors` packed by dtype (see `_by_position`): the
    results, in the order of `tensors`."""
    flats = pack(tensors)
    return unpack([collective(f, f"{prefix}.{f.dtype.name}") for f in flats], tensors)


def pack(tensors):
    """`tensors` flattened into one buffer per dtype, in the order of the dtypes' names."""
    return [
        tf.concat([tf.reshape(tensors[i], [-1]) for i in group], axis=0)
        for group in _by_dtype(tensors)
    ]


def unpack(flats, like):
    """`pack`'s buffers `flats` back into tensors shaped as `like` (what was packed)."""
    out = [None] * len(like)
    for flat, group in zip(flats, _by_dtype(like), strict=True):
        parts = tf.split(flat, [int(like[i].shape.num_elements()) for i in group])
        for i, part in zip(group, parts, strict=True):
            out[i] = tf.reshape(part, like[i].shape)
    return out


def _by_dtype(tensors):
    """The positions of `tensors`, grouped by dtype, in the order of the dtypes' names."""
    groups = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype.name, []).append(i)
    return [group for _, group in sorted(groups.items())]


def tf_variables(variables):
    """The `tf.Variable`s (what Horovod's ops take): Keras 2's are, Keras 3's hold one."""
    return [v if isinstance(v, tf.Variable) else v.value for v in variables]


def weighted(tensor, weight):
    """`tensor` x `weight` (a float32 scalar) in `tensor`'s own dtype."""
    return tensor * tf.cast(weight, tensor.dtype)


def wire_bytes(tensors, compression=hvd.Compression.none):
    """What `tensors` weigh on the wire (float16 under the fp16 compression)."""
    size = 2 if compression is hvd.Compression.fp16 else None
    return sum(
        int(t.shape.num_elements()) * (size if size and t.dtype.is_floating else t.dtype.size)
        for t in tensors
    )
