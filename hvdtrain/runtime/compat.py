"""Which Keras `tf.keras` is: hvdtrain and Horovod need Keras 2.

From TensorFlow 2.16 on, `tf.keras` is Keras 3 unless the environment variable
`TF_USE_LEGACY_KERAS=1` is set when `tf.keras` is first used; then it is Keras 2 from the
`tf-keras` package. Horovod has no Keras 3 path (its callbacks and optimizer wrapper fail
inside `fit`), so hvdtrain sets the variable when it is imported (`hvdtrain/__init__.py`),
and the launcher passes it to every rank, both only where the installed TensorFlow is 2.16
or newer (`legacy_keras_needed`: on TensorFlow 2.15 the variable asks for a tf_keras that
is not there and breaks tf.keras). This module checks the outcome and turns a wrong Keras
into one clear error instead of a Horovod traceback::

    import tensorflow as tf
    tf.keras.layers.Dense(1)   # Keras 3 is now fixed for this process
    import hvdtrain
    hvdtrain.init()            # HvdtrainError: tf.keras is Keras 3 ... set TF_USE_LEGACY_KERAS=1
"""

import importlib.metadata
import importlib.util
import os
import sys

from hvdtrain.errors import HvdtrainError

__all__ = [
    "LEGACY_KERAS",
    "tensorflow_version",
    "legacy_keras_needed",
    "keras_problem",
    "require_keras2",
    "keras3_imported",
    "horovod_as_graph_code",
]

LEGACY_KERAS = "TF_USE_LEGACY_KERAS"
_TF_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "intel-tensorflow")


def _minor(version):
    """(2, 21) from '2.21.0'; () for text that is not a version."""
    parts = []
    for p in str(version).split(".")[:2]:
        if not p.isdigit():
            break
        parts.append(int(p))
    return tuple(parts)


def tensorflow_version():
    """The installed TensorFlow's version, read from package metadata (TensorFlow is not
    imported), or None when there is none."""
    for name in _TF_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def legacy_keras_needed(tf_version):
    """Whether TF_USE_LEGACY_KERAS=1 is needed (TensorFlow >= 2.16) and safe (pure). An
    unknown version (no TensorFlow here, e.g. a launch host) counts as new."""
    return tf_version is None or _minor(tf_version) >= (2, 16)


_FIX = (
    "Set TF_USE_LEGACY_KERAS=1 in the environment before Python starts (or import hvdtrain "
    "before tensorflow)"
)


def keras_problem(tf_version, has_tf_keras, keras_module, keras_version, legacy_env):
    """What is wrong with this TensorFlow/Keras pairing for Horovod, or None (pure).

    Args:
        tf_version: `tf.__version__`.
        has_tf_keras: whether the `tf_keras` package is installed.
        keras_module: the top-level package `tf.keras` resolved to ("tf_keras", "keras"),
            or None when it was not looked at (it needs `has_tf_keras` first).
        keras_version: that package's `__version__`.
        legacy_env: the value of TF_USE_LEGACY_KERAS (None when unset).
    """
    if not legacy_keras_needed(tf_version):
        return None  # tf.keras is Keras 2 itself
    pin = f"tf-keras=={'.'.join(map(str, _minor(tf_version)))}.*"
    if not has_tf_keras:
        return (
            f"TensorFlow {tf_version} needs Keras 2 from the tf-keras package for Horovod, and "
            f"it is not installed: pip install --no-deps '{pin}' (--no-deps: it requires "
            "`tensorflow`, which would install the full wheel beside tensorflow-cpu)"
        )
    if keras_module == "keras" and str(keras_version).startswith("3"):
        if legacy_env in ("1", "true", "True"):
            why = "tf.keras was used before TF_USE_LEGACY_KERAS=1 was set"
        else:
            why = f"TF_USE_LEGACY_KERAS={'unset' if legacy_env is None else legacy_env}"
        return (
            f"tf.keras is Keras {keras_version} in this process ({why}); Horovod and hvdtrain "
            f"need Keras 2 (tf_keras). {_FIX}, and use tf.keras throughout."
        )
    return None


def keras2_submodules():
    """Points `from tensorflow.keras.x import y` at Keras 2 where TensorFlow was imported
    before `import hvdtrain` set TF_USE_LEGACY_KERAS (the README's order: `import tensorflow
    as tf`, then `import hvdtrain`). TensorFlow finds its `keras` submodules on the path it
    chose at its import: Keras 3's then, so `from tensorflow.keras.preprocessing.image import
    ImageDataGenerator` made `tf.keras` Keras 3's for the rest of the process. Changes
    nothing where TensorFlow is not imported yet, or already reads Keras 2."""
    tf = sys.modules.get("tensorflow")
    path = getattr(tf, "__path__", None)
    if path is None or os.environ.get(LEGACY_KERAS) != "1" or "tensorflow.keras" in sys.modules:
        return False
    spec = importlib.util.find_spec("tf_keras")
    if spec is None or spec.origin is None:
        return False
    keras2 = os.path.join(os.path.dirname(spec.origin), "api", "_v2")
    keras3 = [p for p in path if p.replace(os.sep, "/").endswith("/keras/api/_v2")]
    if keras2 in path or not keras3:
        return False
    path[:] = [keras2 if p in keras3 else p for p in path]
    return True


def require_keras2():
    """Raises `HvdtrainError` unless `tf.keras` is Keras 2 (a no-op once it passed)."""
    if getattr(require_keras2, "passed", False):
        return
    import tensorflow as tf

    has_tf_keras = importlib.util.find_spec("tf_keras") is not None
    module = version = None
    if has_tf_keras:  # else tf.keras would fail to load (TF >= 2.16) or is Keras 2 (older)
        module = tf.keras.layers.Layer.__module__.split(".")[0]
        version = getattr(sys.modules.get(module), "__version__", None)
    problem = keras_problem(
        tf.__version__, has_tf_keras, module, version, os.environ.get(LEGACY_KERAS)
    )
    if problem:
        raise HvdtrainError(problem)
    require_keras2.passed = True


def keras3_imported():
    """The Keras 3 module (`import keras`) where this process has imported it, else None (also
    on TensorFlow 2.15, whose `keras` is Keras 2). Importing it costs a second: hvdtrain
    follows the script's imports rather than importing it itself."""
    keras = sys.modules.get("keras")
    return keras if str(getattr(keras, "__version__", "")).startswith("3.") else None


def horovod_as_graph_code():
    """Has autograph call Horovod's TensorFlow functions as they are, as it calls Keras's.

    Horovod's ops are graph code already: written for TensorFlow 1's graphs, they branch on
    tensors with `tf.cond`, never with Python's `if`. Converted, they cost each process
    about 1 s of autograph work (of 2 s) when it traces its train step, with the same
    graph in the end (`hvdtrain.mnist` on one rank: the same loss to the last digit).
    Returns False, changing nothing, where TensorFlow's internal rule list is not there.
    """
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:
        return False
    rules = getattr(config, "CONVERSION_RULES", None)
    if rules is None or not hasattr(config, "DoNotConvert"):
        return False
    if not any(getattr(r, "_prefix", None) == "horovod" for r in rules):
        config.CONVERSION_RULES = (config.DoNotConvert("horovod"), *rules)
    return True
