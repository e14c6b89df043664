"""Keras 2 (`tf.keras` from tf-keras): what the recipe needs, with the same names as
`hvdtrain.frontends.keras3`. The distributed optimizer is Horovod's own Keras wrapper."""

import horovod.tensorflow.keras as hvd_keras
import tensorflow as tf

from hvdtrain.errors import invalid_value
from hvdtrain.frontends import interface
from hvdtrain.optimizers.hooks import applying, attach_hooks, class_attribute, gated, hooks_of
from hvdtrain.optimizers.rates import WarmupSchedule, single_worker_lr  # noqa: F401 (interface)
from hvdtrain.runtime import compat

__all__ = [*interface.NAMES, "horovod_optimizer"]  # the frontend interface

ONE_EPOCH_PER_FIT = False  # whole executions only: a fit per epoch ends the last early
NAME = "Keras 2 (tf-keras)"
keras = tf.keras
PACKAGE = keras.Model.__module__.partition(".")[0]  # tf_keras (Keras 2.15: keras itself)


def is_distributed(optimizer):
    """True for an optimizer that `hvd.DistributedOptimizer` (or `distributed_optimizer`)
    made, also inside a loss-scale optimizer."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return getattr(inner, "_allreduce_grads", None) is not None


def distributed_optimizer(optimizer, compression=None, backward_passes_per_step=1):
    """`hvdtrain.distributed_optimizer` as `hvdtrain.fit` makes it: an Embedding's sparse
    gradients averaged dense, so that every rank applies them with the same dense update
    (a sparse update on a GPU adds in no fixed order: the ranks' weights would differ in
    their last bits, and the check that they agree would stop the run)."""
    return horovod_optimizer(optimizer, compression, backward_passes_per_step, sparse_as_dense=True)


def horovod_optimizer(optimizer, compression=None, backward_passes_per_step=1, **kwargs):
    """`hvdtrain.distributed_optimizer` for a Keras 2 optimizer: Horovod's own
    `DistributedOptimizer` (`kwargs` passed on to it), averaging the gradients also where a
    `train_step` of the user's own only applies them."""
    compat.require_keras2()  # Horovod's wrapper fails deep inside `fit` on Keras 3
    if is_distributed(optimizer):  # Horovod would wrap it again, and recurse without end
        raise invalid_value(
            "optimizer",
            type(optimizer).__name__ + " (already distributed)",
            "a plain Keras optimizer: wrap it once",
        )
    if compression is not None:
        kwargs["compression"] = compression
    if backward_passes_per_step > 1:
        kwargs["backward_passes_per_step"] = backward_passes_per_step
        kwargs.setdefault("average_aggregated_gradients", True)
        # An Embedding's gradient is IndexedSlices, which Horovod's local sums refuse ("not
        # supported when backward_passes_per_step > 1 and sparse_as_dense is False").
        kwargs.setdefault("sparse_as_dense", True)
    return _averaging_where_applied(hvd_keras.DistributedOptimizer(optimizer, **kwargs))


def _averaging_where_applied(made):
    """Horovod's Keras 2 optimizer `made`, averaging the gradients also where they are only
    applied.

    Horovod's averages them in `compute_gradients`, which Keras's own `train_step` calls
    (`minimize`); a `train_step` of the user's own (`tape.gradient`, then
    `optimizer.apply_gradients`, as the Keras guides write GANs and VAEs) never calls it, and
    each rank applied its own gradients: the ranks drifted apart, silently. Here
    `apply_gradients` averages the gradients it is given unless `compute_gradients` did in
    the same step (its hooks' `reduced`, set while the step is traced or run). Its class is
    Horovod's with those methods and `learning_rate` (`single_worker_lr`) replaced, made from
    the same namespace as Horovod makes it: a subclass would recurse, Horovod's methods
    calling `super(self.__class__, self)`."""
    horovod = type(made)
    namespace = dict(horovod.__dict__)
    reduce, apply = namespace["_allreduce"], namespace["apply_gradients"]

    def _allreduce(self, grads, variables):
        hooks = hooks_of(self)
        hooks.reduced = True
        if hooks.gate is None:
            return reduce(self, grads, variables)
        # `--sync local/diloco`: averaged in the synchronous warmup only (`hvdtrain.exchange`)
        pairs = [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None]
        kept = [v for _, v in pairs]
        return gated(hooks.gate, lambda gs: reduce(self, gs, kept), grads)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        hooks = hooks_of(self)
        try:
            if not hooks.reduced:
                pairs = list(grads_and_vars)
                variables = [v for _, v in pairs]
                grads = self._allreduce([g for g, _ in pairs], variables)
                grads_and_vars = list(zip(grads, variables, strict=True))
            return apply(self, grads_and_vars, *args, **kwargs)
        finally:
            hooks.reduced = False

    namespace.update(_allreduce=_allreduce, apply_gradients=applying(apply_gradients))
    keras_lr = class_attribute(horovod, "learning_rate")
    if isinstance(keras_lr, property):  # (legacy optimizers keep theirs)
        namespace["learning_rate"] = single_worker_lr(keras_lr)
    object.__setattr__(made, "__class__", type(horovod.__name__, horovod.__bases__, namespace))
    return attach_hooks(made)


def owns(model):
    return isinstance(model, tf.keras.Model)


def check(model):
    compat.require_keras2()


def compiled(model):
    """(compile arguments, the user's optimizer) of a compiled model."""
    config = getattr(getattr(model, "_compile_config", None), "config", None)
    opt = getattr(model, "optimizer", None)
    if isinstance(opt, tf.keras.mixed_precision.LossScaleOptimizer):
        opt = opt.inner_optimizer  # Keras adds one under mixed_float16; fit puts its own around
    return config, opt


# What `hvdtrain.recipe.prepare` takes for an optimizer (the loss-scale one among them), and what
# it refuses of them (the legacy ones have no `build`: their slots cannot exist before the
# first step, for the broadcast and the restore).
OPTIMIZER_TYPES = (tf.keras.optimizers.Optimizer, tf.keras.optimizers.legacy.Optimizer)
LEGACY_OPTIMIZERS = (tf.keras.optimizers.legacy.Optimizer,)


def unwrapped(opt):
    """The optimizer inside a loss-scale one (Keras adds one under mixed_float16), else `opt`."""
    if isinstance(opt, tf.keras.mixed_precision.LossScaleOptimizer):
        return opt.inner_optimizer
    return opt


def is_compiled(model):
    return bool(getattr(model, "_is_compiled", False))


def compiled_loss(model):
    """The loss given to `compile` (None without one)."""
    config = getattr(getattr(model, "_compile_config", None), "config", None) or {}
    return config.get("loss") or None


def has_added_losses(model):
    return bool(model.losses)


def jit_compile(model):
    """Whether the user asked for XLA."""
    return getattr(model, "_jit_compile", None) is True


def configure(model, steps_per_execution):
    """What `compile(steps_per_execution=..., jit_compile=False)` sets, on a compiled model
    (Horovod's allreduce cannot be XLA-compiled)."""
    model._jit_compile = False
    model._autotune_steps_per_execution = False
    if getattr(model, "_steps_per_execution", None) is None:
        model._configure_steps_per_execution(steps_per_execution)
    else:
        model._steps_per_execution.assign(steps_per_execution)
    model._reset_compile_cache()


def base_lr(opt):
    schedules = tf.keras.optimizers.schedules
    lr = getattr(opt, "_learning_rate", None)
    if isinstance(lr, schedules.LearningRateSchedule):
        return lr
    lr = opt.learning_rate
    if isinstance(lr, schedules.LearningRateSchedule):
        return lr
    return float(tf.keras.backend.get_value(lr))


def loss_scale(optimizer):
    """Keras 2's dynamic loss scaling around the distributed `optimizer`, whose allreduce then
    carries the scaled gradients, non-finite ones included, so every rank takes the same
    skip-or-apply decision (Horovod #3807): in `compute_gradients` under Keras's own
    `train_step`, and before the decision where a `train_step` of the user's own applies
    its gradients (`_AgreedLossScale`). The ranks must hold the same scale, so it is
    broadcast with the rest (`optimizer_variables`)."""
    scaled = tf.keras.mixed_precision.LossScaleOptimizer(optimizer)
    keras_class = type(scaled)
    if keras_class not in _AGREED:
        _AGREED[keras_class] = type(
            "LossScaleOptimizer",
            (keras_class,),
            {
                "apply_gradients": _agreed_apply_gradients,
                "_keras_class": keras_class,
                "__module__": __name__,
            },
        )
    agreed = _AGREED[keras_class]
    object.__setattr__(scaled, "__class__", agreed)
    return scaled


_AGREED = {}  # Keras's loss-scale class -> the subclass that averages before deciding


def _agreed_apply_gradients(self, grads_and_vars, *args, **kwargs):
    inner = self.inner_optimizer
    hooks = hooks_of(inner)
    try:
        if hooks is not None and not hooks.reduced:  # not averaged yet
            pairs = list(grads_and_vars)
            variables = [v for _, v in pairs]
            grads = inner._allreduce([g for g, _ in pairs], variables)
            grads_and_vars = list(zip(grads, variables, strict=True))
        return self._keras_class.apply_gradients(self, grads_and_vars, *args, **kwargs)
    finally:
        if hooks is not None:
            hooks.reduced = False


def current_loss_scale(opt):
    """The dynamic loss scale of a loss-scale optimizer, else None."""
    if isinstance(opt, tf.keras.mixed_precision.LossScaleOptimizer):
        return float(opt.loss_scale)
    return None


def optimizer_variables(opt):
    """`opt`'s variables, and a loss-scale optimizer's dynamic scale and its counter: saved
    in its checkpoints (as its trackable children) but not among its `variables`, so a
    resumed rank 0 held the restored scale and the others the initial one, and their
    updates differed (the scaled gradients are averaged, then each rank unscales them)."""
    out = list(opt.variables)
    if isinstance(opt, tf.keras.mixed_precision.LossScaleOptimizer):
        state = getattr(opt, "_loss_scale", None)  # a float for a fixed scale
        if isinstance(state, tf.__internal__.tracking.Trackable):
            out += [v for _, v in sorted(state._trackable_children().items())]
    return out


def set_seed(seed):
    tf.keras.utils.set_random_seed(seed)


def set_policy(policy):
    tf.keras.mixed_precision.set_global_policy(policy)


def float32_outputs(model):
    outputs = [
        tf.keras.layers.Activation("linear", dtype="float32")(o) if o.dtype != tf.float32 else o
        for o in tf.nest.flatten(model.outputs)
    ]
    return tf.keras.Model(
        model.inputs, outputs[0] if len(outputs) == 1 else outputs, name=model.name
    )


def tensorboard(log_dir):
    return tf.keras.callbacks.TensorBoard(log_dir)


def deterministic():
    tf.config.experimental.enable_op_determinism()
    tf.keras.backend.experimental.enable_tf_random_generator()  # DeterministicRandomness


def checkpoint_extras(model):
    """What a checkpoint must hold beside the model and the optimizer: nothing."""
    return {}
