"""What hvdtrain tells a distributed optimizer, and reads back, declared in one place.

A distributed optimizer of either Keras (`hvdtrain.frontends.keras2` and `keras3` make them)
holds one `Hooks` (`hooks_of(optimizer)`; None for an optimizer hvdtrain did not make):

- `gate`: under `--sync local/diloco` (`hvdtrain.exchange`), a `Gate` whose variable says
  whether the step averages its gradients over the ranks (the synchronous warmup) or applies
  this rank's own; None: always averaged. `gated` is how the step asks it.
- `single_worker`: its `learning_rate` property shows and takes the single-worker rate of
  its `WarmupSchedule` (what `hvdtrain.fit` does, so that Keras's callbacks steer it as on
  one device: `hvdtrain.optimizers.rates.single_worker_lr`); `applying` is set inside the
  optimizer's own update, where `learning_rate` is the rate applied (`applying`).
- `reduced` (Keras 2): the gradients of the step being traced were averaged already.

The recipe sets them through `set_gate` and `show_single_worker_lr`; nothing else sets
attributes on an optimizer.
"""

import dataclasses
import weakref

import tensorflow as tf

__all__ = [
    "Gate",
    "Hooks",
    "attach_hooks",
    "hooks_of",
    "gated",
    "set_gate",
    "applying",
    "class_attribute",
]


@dataclasses.dataclass
class Hooks:
    """One distributed optimizer's hooks (see the module)."""

    gate: object = None  # a `Gate`, or None: gradients always averaged
    single_worker: bool = False  # `learning_rate` is the single-worker rate
    applying: bool = False  # inside the optimizer's own update
    reduced: bool = False  # Keras 2: this step's gradients are averaged already


_HOOKS = weakref.WeakKeyDictionary()  # optimizer -> its `Hooks`, for as long as it lives


def _inner(optimizer):
    """The optimizer a loss-scale optimizer wraps, or `optimizer` itself."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def attach_hooks(optimizer):
    """Gives `optimizer` (a distributed optimizer hvdtrain just made) its `Hooks`."""
    _HOOKS[optimizer] = Hooks()
    return optimizer


def hooks_of(optimizer):
    """The `Hooks` of `optimizer` (or of the one it wraps, under loss scaling), or None for
    an optimizer hvdtrain did not make."""
    try:
        return _HOOKS.get(_inner(optimizer))
    except TypeError:  # not weakly referable: not ours
        return None


def set_gate(optimizer, gate):
    """Makes `optimizer` average its gradients only while `gate` is on (None: always); an
    optimizer that hvdtrain did not make averages nothing, and is left as it is."""
    hooks = hooks_of(optimizer)
    if hooks is not None:
        hooks.gate = gate


class Gate:
    """A boolean variable in a plain holder: Keras would track (checkpoint) a variable set as
    an attribute of the optimizer."""

    def __init__(self):
        self.on = tf.Variable(True, trainable=False, name="hvdtrain_exchange_gradients")


def gated(gate, reduce, grads):
    """`reduce(grads)` (the allreduce of a distributed optimizer) while `gate` (a `Gate`, or
    None) is on, else `grads` as they are: a `tf.cond`, so one traced train step does both.
    None gradients stay None; sparse ones are made dense."""
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


def applying(apply):
    """`apply` (an optimizer method that updates the variables) marked as the optimizer's own
    update, where `learning_rate` is the rate applied (`single_worker_lr`)."""

    def method(self, *args, **kwargs):
        hooks = hooks_of(self)
        if hooks is None:
            return apply(self, *args, **kwargs)
        hooks.applying = True
        try:
            return apply(self, *args, **kwargs)
        finally:
            hooks.applying = False

    method.__name__ = getattr(apply, "__name__", "apply")
    return method


def class_attribute(cls, name):
    """`name` as `cls` defines it or inherits it (a property itself, not its value)."""
    return next((k.__dict__[name] for k in cls.__mro__ if name in k.__dict__), None)
