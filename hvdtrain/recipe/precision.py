"""Mixed precision in `hvdtrain.fit` (`--mixed-precision`): the policy a choice names, and a
plain model's outputs back to float32 so that its loss is computed stably.

    policy = precision.policy("auto")            # "mixed_bfloat16" on CPU, float16 on a GPU
    model = precision.float32_outputs(model, frontend)
"""

import tensorflow as tf

from hvdtrain.recipe import prepare

__all__ = ["policy", "float32_outputs"]


def policy(choice):
    """The Keras policy of `--mixed-precision` `choice` (None, "auto", "float16" or
    "bfloat16"): None, or "mixed_float16" / "mixed_bfloat16" ("auto": float16 on a GPU)."""
    if not choice:
        return None
    if choice == "auto":
        choice = "float16" if tf.config.list_physical_devices("GPU") else "bfloat16"
    return f"mixed_{choice}"


def float32_outputs(model, frontend):
    """`model` with float32 outputs, compiled as it was, where it is plain (a functional or
    Sequential model trained by Keras's own `train_step` and `compile`); else `model`."""
    if not _plain(model, frontend):
        return model
    config, opt = frontend.compiled(model)
    if not config or opt is None or all(o.dtype == "float32" for o in model.outputs):
        return model
    wrapped = frontend.float32_outputs(model)
    wrapped.compile(
        optimizer=model.optimizer,  # as compiled (under float16, the loss-scale one Keras made)
        loss=config.get("loss"),
        metrics=config.get("metrics"),
        loss_weights=config.get("loss_weights"),
        weighted_metrics=config.get("weighted_metrics"),
        run_eagerly=bool(config.get("run_eagerly")),
    )
    return wrapped


def _plain(model, frontend):
    """A functional or Sequential model trained by Keras's own `train_step` and `compile`."""
    base = frontend.keras.Model
    own = type(model).compile is not base.compile or prepare.trains_itself(model, frontend)
    return not own and bool(getattr(model, "outputs", None))
