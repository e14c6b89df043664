"""The two Keras that hvdtrain trains, told apart by the model object:

- Keras 2: `tf.keras` (tf-keras, under TF_USE_LEGACY_KERAS=1, which `import hvdtrain` sets);
  Horovod's Keras wrappers (`hvdtrain.frontends.keras2`).
- Keras 3: `import keras` on the TensorFlow backend; gradients averaged with Horovod's
  TensorFlow ops inside the optimizer's `apply` (`hvdtrain.frontends.keras3`).

What differs between them (the model and optimizer classes, the distributed optimizer, the
learning-rate schedule's base class, mixed precision, seeds, TensorBoard) lives in one module
per Keras with the same names; the recipe asks `for_model(model)` which one a model is.
Keras 3 is imported only where a script imported it (`import keras` costs a second).
"""

import os
import sys

from hvdtrain.errors import HvdtrainError, invalid_value

__all__ = ["for_model", "loaded", "add_keras_flag", "keras_module"]


def loaded():
    """The frontends of the Keras this process has imported (Keras 2 always)."""
    from hvdtrain.frontends import keras2

    found = [keras2]
    if "keras" in sys.modules:
        from hvdtrain.frontends import keras3

        found.append(keras3)
    return found


def for_model(model):
    """The frontend of `model`'s Keras; a one-line error for anything else."""
    for frontend in loaded():
        if frontend.owns(model):
            frontend.check(model)
            return frontend
    raise invalid_value(
        "build_model",
        f"a function returning {type(model).__name__}",
        "a function returning a compiled Keras model: tf.keras (Keras 2) or `import keras` "
        "(Keras 3, TensorFlow backend)",
    )


def add_keras_flag(parser):
    """The entry points' `--keras 2|3`: which Keras builds their model (2 by default)."""
    parser.add_argument(
        "--keras",
        choices=["2", "3"],
        default="2",
        help="build the model with Keras 2 (tf.keras) or Keras 3 (`import keras`) (2)",
    )


def keras_module(version):
    """`tf.keras` for "2", the `keras` module for "3" (imported before `hvdtrain.fit`, which
    then sets Keras 3's seed and precision policy too)."""
    if str(version) == "3":
        try:
            import keras
        except ImportError as e:  # e.g. KERAS_BACKEND=jax without JAX installed
            backend = os.environ.get("KERAS_BACKEND", "tensorflow")
            if backend != "tensorflow":
                raise invalid_value(
                    "KERAS_BACKEND",
                    backend,
                    f"'tensorflow' (Keras 3 failed to load: {e}; hvdtrain averages gradients "
                    "with Horovod's TensorFlow ops). Set KERAS_BACKEND=tensorflow",
                ) from None
            raise HvdtrainError(
                f"Keras 3 failed to load: {e}. Reinstall it: pip install -c constraints.txt keras"
            ) from None
        return keras
    import tensorflow as tf

    return tf.keras
