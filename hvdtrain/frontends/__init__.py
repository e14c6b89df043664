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
import re
import traceback

from hvdtrain.errors import HvdtrainError, invalid_value, one_line
from hvdtrain.runtime import compat

__all__ = ["for_model", "owner", "loaded", "mixed_keras", "add_keras_flag", "keras_module"]


def loaded():
    """The frontends of the Keras this process has imported (Keras 2 always)."""
    from hvdtrain.frontends import keras2

    found = [keras2]
    if compat.keras3_imported():
        from hvdtrain.frontends import keras3

        found.append(keras3)
    return found


def for_model(model):
    """The frontend of `model`'s Keras; a one-line error for anything else, a model holding
    layers or variables of the other Keras among them."""
    found = loaded()
    for frontend in found:
        if frontend.owns(model):
            frontend.check(model)
            for other in found:
                if other is not frontend and other.PACKAGE != frontend.PACKAGE:
                    stranger = _first_of(model, other.PACKAGE)
                    if stranger is not None:
                        raise _mixing(f"a {frontend.NAME} model holds {stranger} of {other.NAME}")
            return frontend
    raise invalid_value(
        "build_model",
        f"a function returning {type(model).__name__}",
        "a function returning a compiled Keras model: tf.keras (Keras 2) or `import keras` "
        "(Keras 3, TensorFlow backend)",
    )


def owner(model):
    """The frontend of `model`'s Keras, without `for_model`'s checks (cheap: for what runs
    often, such as an elastic commit), or None."""
    return next((f for f in loaded() if f.owns(model)), None)


def _package(obj):
    """The top-level package of `obj`'s class ('keras', 'tf_keras', ...)."""
    return type(obj).__module__.partition(".")[0]


def _first_of(model, package):
    """A layer of `model`, or an argument a layer was called with (a Keras 3 layer called on
    tf.keras tensors leaves only its variables there), whose class is from `package`."""
    import tensorflow as tf

    layers = [model, *model._flatten_layers(include_self=False)]
    for layer in layers:
        if _package(layer) == package:
            return f"the layer {layer.name!r} ({type(layer).__name__})"
        for node in getattr(layer, "_inbound_nodes", ()):
            args = (getattr(node, "call_args", ()), getattr(node, "call_kwargs", {}))
            for arg in tf.nest.flatten(args):
                if _package(arg) == package:
                    name = getattr(arg, "path", None) or getattr(arg, "name", "")
                    return f"{type(arg).__name__} {name!r} (in the layer {layer.name!r})"
    return None


def _mixing(what):
    return HvdtrainError(
        f"Invalid value for `build_model`: received a model mixing the two Keras ({what}); "
        "expected one Keras throughout: build the model, its layers and its optimizer with "
        "tf.keras (Keras 2) or with `import keras` (Keras 3), never both"
    )


# A class of either Keras named in an error message: tf_keras.src.… or keras.src.….
_NAMED = re.compile(r"(?<![\w.])(tf_keras|keras)\.src\.")


def mixed_keras(error):
    """The one-line error for `error`, raised by one Keras while building or compiling a model
    because it was given an object of the other (a tf.keras optimizer in a Keras 3 `compile`,
    a Keras 3 layer in a tf.keras `Sequential`, a tf.keras layer called on a `keras.Input`),
    else None: the other Keras named in the message, or an object of it in the raising
    frame's variables (`'tuple' object has no attribute 'rank'` names nothing)."""
    frames = traceback.extract_tb(error.__traceback__)
    raiser = frames[-1].filename.replace(os.sep, "/") if frames else ""
    raised_by = "tf_keras" if "/tf_keras/" in raiser else "keras" if "/keras/" in raiser else ""
    named = {m.group(1) for m in _NAMED.finditer(str(error))} | _held(error)
    if not raised_by or not named - {raised_by} or len(loaded()) < 2:
        return None
    names = {"tf_keras": "Keras 2 (tf.keras)", "keras": "Keras 3 (`import keras`)"}
    other = names[(named - {raised_by}).pop()]
    return _mixing(
        f"{names[raised_by]} refused an object of {other}: {one_line(error, whole=True)}"
    )


def _held(error):
    """The Keras packages of the objects in the variables of the frame that raised `error`
    (one level into lists and tuples)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    found = set()
    for value in tb.tb_frame.f_locals.values() if tb is not None else ():
        for v in value if isinstance(value, list | tuple) else (value,):
            if _package(v) in ("keras", "tf_keras"):
                found.add(_package(v))
    return found


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
