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

from hvdtrain import optim
from hvdtrain.errors import HvdtrainError, invalid_value

__all__ = [
    "NAME",
    "ELASTIC",
    "ONE_EPOCH_PER_FIT",
    "keras",
    "owns",
    "check",
    "compiled",
    "base_lr",
    "WarmupSchedule",
    "is_distributed",
    "distributed_optimizer",
    "loss_scale",
    "set_seed",
    "set_policy",
    "float32_outputs",
    "tensorboard",
    "deterministic",
    "checkpoint_extras",
]

ELASTIC = False  # Horovod Elastic (hvdtrain.elastic) supports it
ONE_EPOCH_PER_FIT = True  # whole executions only: a fit per epoch ends the last early
NAME = "Keras 3"


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
    """(compile arguments, the user's optimizer) of a compiled model."""
    config = getattr(getattr(model, "_compile_config", None), "config", None)
    opt = getattr(model, "optimizer", None)
    if isinstance(opt, keras.optimizers.LossScaleOptimizer):
        opt = opt.inner_optimizer  # Keras adds one under mixed_float16; fit puts its own around
    return config, opt


def base_lr(opt):
    lr = getattr(opt, "_learning_rate", None)
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        return lr
    return float(keras.ops.convert_to_numpy(opt.learning_rate))


@keras.saving.register_keras_serializable(package="hvdtrain")
class WarmupSchedule(optim.WarmupMath, keras.optimizers.schedules.LearningRateSchedule):
    """`hvdtrain.WarmupSchedule` for Keras 3 optimizers."""

    schedules = keras.optimizers.schedules


def is_distributed(opt):
    return getattr(opt, "_hvdtrain_distributed", False)


def distributed_optimizer(optimizer, compression=None, backward_passes_per_step=1):
    """A copy of the Keras 3 `optimizer` whose `apply` averages the gradients over the ranks
    first (one grouped allreduce), in float16 on the wire with `compression`."""
    if is_distributed(optimizer):
        raise invalid_value(
            "optimizer",
            type(optimizer).__name__ + " (already distributed)",
            "a plain Keras optimizer: wrap it once",
        )
    cls = type(optimizer)
    compression = compression or hvd.Compression.none

    def apply(self, grads, trainable_variables=None):
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
        return cls.apply(self, grads, trainable_variables)

    distributed = type(
        f"Distributed{cls.__name__}",
        (cls,),
        {"apply": apply, "_hvdtrain_distributed": True, "__module__": __name__},
    )
    if backward_passes_per_step > 1:
        # Keras 3 accumulates itself, but its `iterations` then counts updates, not the
        # steps that hvdtrain's resume, warmup and checkpoints count.
        raise invalid_value(
            "--accumulate",
            f"{backward_passes_per_step} with a Keras 3 model",
            "1 for Keras 3 for now; gradient accumulation is Keras 2 only",
        )
    return distributed.from_config(optimizer.get_config())


class _AgreedLossScale(keras.optimizers.LossScaleOptimizer):
    """Keras 3's dynamic loss scaling, where the ranks agree whether a step's gradients are
    finite (one small allreduce): a rank that skipped the step alone would leave the others
    waiting in the gradients' allreduce (Keras 2 gets the same from wrapping the
    distributed optimizer, whose allreduce comes before the check)."""

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
