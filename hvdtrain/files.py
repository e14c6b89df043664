"""Files that are either complete or absent: metrics JSON and the exported model."""

import json
import os

__all__ = ["write_json", "export_model"]


def write_json(path, obj):
    """Writes `obj` as JSON to `path` through a temporary file and a rename."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def export_model(model, build_fn, path, policy=None):
    """Saves `model`'s weights in a fresh copy from `build_fn()` that plain Keras loads.

    The copy has no Horovod optimizer, so `tf.keras.models.load_model(path)` works without
    Horovod installed; it is built in float32 when `model` was trained under the mixed
    precision `policy`. Written to a temporary file first, then renamed.
    """
    if policy:
        import tensorflow as tf

        tf.keras.mixed_precision.set_global_policy("float32")
        try:
            plain = build_fn()
        finally:
            tf.keras.mixed_precision.set_global_policy(policy)
    else:
        plain = build_fn()
    plain.set_weights(model.get_weights())
    path = os.path.abspath(path)
    tmp = os.path.join(os.path.dirname(path), f".export-{os.getpid()}.keras")
    plain.save(tmp)
    os.replace(tmp, path)
    return path
