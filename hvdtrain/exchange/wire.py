"""The tensors of the ranks moved as one: averaged or broadcast by position, packed into one
buffer per dtype, and what they weigh on the wire. The exchange (`hvdtrain.exchange`) and the
recipe's broadcast and averaging (`hvdtrain.recipe.optim`) go through here.
"""

import horovod.tensorflow as hvd
import tensorflow as tf

__all__ = [
    "average_variables",
    "by_position",
    "packed",
    "pack",
    "unpack",
    "tf_variables",
    "weighted",
    "wire_bytes",
    "slot_variables",
    "learning_rate_of",
]


def average_variables(variables, prefix):
    """Sets `variables` to their mean over the ranks, as they are (full precision), in one
    allreduce per dtype named by `prefix` (see `by_position`)."""
    by_position(variables, prefix, lambda t, name: hvd.allreduce(t, op=hvd.Average, name=name))


def by_position(variables, prefix, collective):
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
    """`collective(buffer, name)` of `tensors` packed by dtype (see `by_position`): the
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


def slot_variables(optimizer):
    """`optimizer`'s float state of its own (Adam's moments, momentum): its variables but its
    step counter and its learning rate (a variable, or a `WarmupSchedule`'s single-worker
    rate), found by what they are, not by their names."""
    held = learning_rate_of(optimizer)
    held = getattr(held, "rate", held)  # a WarmupSchedule: its single-worker rate, or None
    rate = {id(held), id(getattr(held, "value", held))}
    return [
        v for v in tf_variables(optimizer.variables) if v.dtype.is_floating and id(v) not in rate
    ]


def learning_rate_of(optimizer):
    """What `optimizer` holds as its learning rate: a variable, or a schedule."""
    return getattr(getattr(optimizer, "inner_optimizer", optimizer), "_learning_rate", None)
