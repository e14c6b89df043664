"""Keras 3 (`import keras`, TensorFlow backend): what the recipe needs, with the same names as
`hvdtrain.frontends.keras2`.

Horovod's Keras wrappers are Keras 2 only, but its TensorFlow ops work inside a Keras 3
model's traced train step: the distributed optimizer is a subclass of the user's optimizer
class whose `apply` first averages the gradients over the ranks with one grouped allreduce
(fused by Horovod), then applies them as the user's optimizer would.
"""

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.frontends import interface
from hvdtrain.optimizers import rates
from hvdtrain.optimizers.hooks import applying, attach_hooks, class_attribute, gated, hooks_of

__all__ = [*interface.NAMES]  # the frontend interface

ONE_EPOCH_PER_FIT = True  # whole executions only: a fit per epoch ends the last early
NAME = "Keras 3"
PACKAGE = "keras"


def owns(model):
    return isinstance(model, keras.Model)


def check(model, backend=None):
    """Keras 3 on the TensorFlow backend only (`backend`: Keras's, by default): Horovod's
    collectives here are TensorFlow ops."""
    backend = backend or keras.backend.backend()
    if backend != "tensorflow":
        raise HvdtrainError(
            f"Invalid value for `KERAS_BACKEND`: received '{backend}'; expected 'tensorflow' "
            "(hvdtrain averages gradients with Horovod's TensorFlow ops, which a Keras 3 model "
            f"on {backend} cannot run). Set KERAS_BACKEND=tensorflow."
        )


def compiled(model):
    """(compile arguments, the user's optimizer) of a compiled model; a one-line error for
    metrics given where Keras 3 takes loss weights (compile's third positional argument: Keras
    2's `compile(opt, loss, ["accuracy"])` fails at the first step on Keras 3)."""
    config = getattr(getattr(model, "_compile_config", None), "config", None)
    weights = (config or {}).get("loss_weights")
    values = list(weights.values()) if isinstance(weights, dict) else weights
    if isinstance(values, list | tuple) and not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in values
    ):
        raise invalid_value(
            "loss_weights",
            weights,
            "numbers (Keras 3's compile takes its third positional argument as loss_weights, "
            "not metrics); pass metrics by keyword: model.compile(optimizer=..., loss=..., "
            "metrics=[...])",
        )
    opt = getattr(model, "optimizer", None)
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        opt = opt.inner_optimizer  # Keras adds one under mixed_float16; fit puts its own around
    return config, opt


# What `hvdtrain.recipe.prepare` takes for an optimizer (the loss-scale one among them).
OPTIMIZER_TYPES = (keras.optimizers.Optimizer,)
LEGACY_OPTIMIZERS = ()  # (Keras 3 has none)


def unwrapped(opt):
    """The optimizer inside a loss-scale one (Keras adds one under mixed_float16), else `opt`."""
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        return opt.inner_optimizer
    return opt


def is_compiled(model):
    return bool(getattr(model, "compiled", False))


def compiled_loss(model):
    """The loss given to `compile` (None without one)."""
    return getattr(model, "loss", None) or None


def has_added_losses(model):
    """Whether a layer adds a loss (Keras 3 collects them as the model is called: a layer
    whose `call` uses `add_loss` counts)."""
    layers = [model, *model._flatten_layers(include_self=False)]
    return bool(model.losses) or any(
        "add_loss" in getattr(type(layer).call, "__code__", None).co_names
        for layer in layers
        if getattr(type(layer).call, "__code__", None) is not None
    )


def jit_compile(model):
    """Whether XLA is asked for, or chosen by Keras 3 itself ("auto" means XLA on a GPU)."""
    return getattr(model, "jit_compile", None) is True


def configure(model, steps_per_execution):
    """What `compile(steps_per_execution=..., jit_compile=False)` sets, on a compiled model
    (Horovod's allreduce cannot be XLA-compiled)."""
    model.jit_compile = False
    model.steps_per_execution = steps_per_execution
    model.train_function = model.test_function = model.predict_function = None


def base_lr(opt):
    lr = getattr(opt, "_learning_rate", None)
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        return lr
    return float(keras.ops.convert_to_numpy(opt.learning_rate))


WarmupSchedule = rates.keras3_schedule()  # of both Keras; registered with both


def is_distributed(opt):
    return hooks_of(opt) is not None


def distributed_optimizer(optimizer, compression=None, backward_passes_per_step=1):
    """A copy of the Keras 3 `optimizer` whose `apply` averages the gradients over the ranks
    first (one grouped allreduce), in float16 on the wire with `compression`.

    With `backward_passes_per_step` N > 1 each rank sums N steps' gradients locally and the
    N-th step averages the sum over the ranks and applies it, as Horovod's Keras 2 optimizer
    does: `iterations` counts every step (the LR schedule, resume and checkpoints count
    steps), and a step resumes at a whole cycle with empty sums (they are not checkpointed).
    """
    if is_distributed(optimizer):
        raise invalid_value(
            "optimizer",
            type(optimizer).__name__ + " (already distributed)",
            "a plain Keras optimizer: wrap it once",
        )
    cls = type(optimizer)
    compression = compression or hvd.Compression.none
    passes = int(backward_passes_per_step)

    def average(grads):
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        if hvd.size() > 1 and present:
            reduced = hvd.grouped_allreduce(
                [tf.convert_to_tensor(grads[i]) for i in present],
                op=hvd.Average,
                compression=compression,
                name="hvdtrain.gradients",
            )
            for i, g in zip(present, reduced, strict=True):
                grads[i] = g
        return grads

    def build(self, variables):
        cls.build(self, variables)
        if passes > 1:  # in a plain holder: Keras would track (checkpoint) a list
            self._gradient_sums = _Sums(variables)

    def apply(self, grads, trainable_variables=None):
        if passes == 1:  # (--sync local/diloco: averaged in their warmup only)
            grads = gated(hooks_of(self).gate, average, grads)
            return cls.apply(self, grads, trainable_variables)
        variables = trainable_variables or self._trainable_variables
        if not self.built:
            self.build(variables)
        sums = [self._gradient_sums.of(v) for v in variables]
        grads = [
            tf.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g)
            for g, v in zip(grads, variables, strict=True)
        ]

        def update():
            mean = [(s + g) / passes for s, g in zip(sums, grads, strict=True)]
            cls.apply(self, average(mean), trainable_variables)  # counts the step
            for s in sums:
                s.assign(tf.zeros_like(s))
            return tf.constant(True)

        def add():
            for s, g in zip(sums, grads, strict=True):
                s.assign_add(g)
            self.iterations.assign_add(1)
            return tf.constant(False)

        last = tf.equal((self.iterations + 1) % passes, 0)
        return tf.cond(last, update, add)

    keras_lr = class_attribute(cls, "learning_rate")
    distributed = type(
        f"Distributed{cls.__name__}",
        (cls,),
        {
            "apply": applying(apply),
            "build": build,
            "learning_rate": rates.single_worker_lr(keras_lr),
            "__module__": __name__,
        },
    )
    return attach_hooks(distributed.from_config(optimizer.get_config()))


class _Sums:
    """One rank's gradient sums of an accumulation cycle, one per variable (the object: two
    variables of nested models may share a path)."""

    def __init__(self, variables):
        self.by_id = {
            id(v): tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in variables
        }

    def of(self, variable):
        return self.by_id[id(variable)]


class _AgreedLossScale(keras.optimizers.LossScaleOptimizer):
    """Keras 3's dynamic loss scaling, where the ranks agree whether a step's gradients are
    finite (one small allreduce): a rank that skipped the step alone would leave the others
    waiting in the gradients' allreduce (Keras 2 gets the same from wrapping the
    distributed optimizer, whose allreduce comes before the check). A skipped step counts in
    `iterations`, as on Keras 2."""

    _loss_scaled = False  # scale_loss was called for the gradients `apply` gets

    def build(self, var_list):
        if not self.built:  # Keras's makes new scale variables at every call: a scale
            super().build(var_list)  # restored from a checkpoint was replaced by the initial

    def scale_loss(self, loss):
        self._loss_scaled = True  # (while the step is traced, or run eagerly)
        return super().scale_loss(loss)

    def apply(self, grads, trainable_variables=None):
        # A train_step of the user's own that did not scale its loss (the Keras guides'
        # GANs never call scale_loss) gives gradients as they are, which Keras would divide
        # by the scale (2**15): the model would barely train, silently. Scaled here, so
        # that they are applied as given; the finite check still skips overflowing steps.
        if not self._loss_scaled:
            if not self.built:
                self.build(trainable_variables or self._trainable_variables)
            grads = [None if g is None else g * tf.cast(self.dynamic_scale, g.dtype) for g in grads]
        self._loss_scaled = False
        return super().apply(grads, trainable_variables)

    def _stateful_handle_non_finite_grads(self):
        # A skipped step still counts, as in Keras 2: `iterations` is the step that the LR
        # schedule, resume and --accumulate's cycles follow.
        super()._stateful_handle_non_finite_grads()
        self.inner_optimizer.iterations.assign_add(1)

    def check_finite(self, grads):
        finite = super().check_finite(grads)
        if hvd.size() == 1:
            return finite
        bad = hvd.allreduce(
            tf.cast(tf.logical_not(finite), tf.int32), op=hvd.Sum, name="hvdtrain.nonfinite"
        )
        return tf.equal(bad, 0)


def loss_scale(optimizer):
    return _AgreedLossScale(optimizer)


def current_loss_scale(opt):
    """The dynamic loss scale of a loss-scale optimizer, else None."""
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        return float(keras.ops.convert_to_numpy(opt.dynamic_scale))
    return None


def optimizer_variables(opt):
    """`opt`'s variables (a loss-scale optimizer's scale and counter among them)."""
    return list(opt.variables)


def set_seed(seed):
    keras.utils.set_random_seed(seed)


def set_policy(policy):
    keras.mixed_precision.set_global_policy(policy or "float32")


def float32_outputs(model):
    outputs = [
        keras.layers.Activation("linear", dtype="float32")(o) if o.dtype != "float32" else o
        for o in tf.nest.flatten(model.outputs)
    ]
    return keras.Model(model.inputs, outputs[0] if len(outputs) == 1 else outputs, name=model.name)


def tensorboard(log_dir):
    return keras.callbacks.TensorBoard(log_dir)


def deterministic():
    tf.config.experimental.enable_op_determinism()  # Keras 3's seed states are variables


def checkpoint_extras(model):
    """Every model variable, by position: a `tf.train.Checkpoint` of a Keras 3 model misses
    its random seed states (dropout, augmentation), which a bitwise resume needs."""
    return {"variables": [v.value for v in model.variables]}
