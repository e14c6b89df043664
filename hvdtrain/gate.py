"""The gate of a distributed optimizer's gradient exchange, for `--sync local/diloco`
(`hvdtrain.exchange`): on, the gradients are averaged over the ranks; off, each rank applies
its own. Both Keras' distributed optimizers (`hvdtrain.frontends`) ask it in their step.
"""

import tensorflow as tf

__all__ = ["Gate", "gated"]


def gated(gate, reduce, grads):
    """`reduce(grads)` (the allreduce of a distributed optimizer) while `gate` (a holder of a
    boolean variable, or None) is on, else `grads` as they are: a `tf.cond`, so one traced
    train step does both. None gradients stay None; sparse ones are made dense."""
    if gate is None:
        return reduce(grads)
    grads = list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    dense = [tf.convert_to_tensor(grads[i]) for i in present]
    if not dense:
        return grads
    out = tf.cond(gate.on, lambda: list(reduce(dense)), lambda: list(dense))
    for i, g in zip(present, out, strict=True):
        grads[i] = g
    return grads


class Gate:
    """A boolean variable in a plain holder: Keras would track (checkpoint) a variable set as an
    attribute of the optimizer."""

    def __init__(self):
        self.on = tf.Variable(True, trainable=False, name="hvdtrain_exchange_gradients")
