"""Keras 2 (`tf.keras` from tf-keras): what the recipe needs, with the same names as
`hvdtrain.frontends.keras3`. The distributed optimizer is Horovod's own Keras wrapper."""

import tensorflow as tf

from hvdtrain import compat, optim

__all__ = [
    "NAME",
    "PACKAGE",
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
    "optimizer_variables",
    "set_seed",
    "set_policy",
    "float32_outputs",
    "tensorboard",
    "deterministic",
    "checkpoint_extras",
]

ONE_EPOCH_PER_FIT = False  # whole executions only: a fit per epoch ends the last early
NAME = "Keras 2 (tf-keras)"
keras = tf.keras
PACKAGE = keras.Model.__module__.partition(".")[0]  # tf_keras (Keras 2.15: keras itself)
WarmupSchedule = optim.WarmupSchedule
is_distributed = optim.is_distributed
distributed_optimizer = optim.distributed_optimizer


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
    # The loss scale wraps the distributed optimizer, whose allreduce (in `compute_gradients`)
    # then carries the scaled gradients, non-finite ones included, so every rank takes the
    # same skip-or-apply decision (Horovod #3807). The ranks must hold the same scale, so it
    # is broadcast with the rest (`optimizer_variables`).
    return tf.keras.mixed_precision.LossScaleOptimizer(optimizer)


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
