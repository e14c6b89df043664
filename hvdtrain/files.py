"""Files that are either complete or absent: metrics JSON and the exported model."""

import json
import os
import shutil

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
    """Saves `model`'s weights in a fresh copy from `build_fn()` that plain Keras loads; on
    rank 0 only (the others return None, writing nothing).

    The copy has no Horovod optimizer, so `tf.keras.models.load_model(path)` works without
    Horovod installed; it is built in float32 when `model` was trained under the mixed
    precision `policy`. The format follows the suffix, as Keras' `save`: `.keras` (Keras'
    zip), `.h5` (HDF5), no suffix (a SavedModel folder). Written beside `path` first, then
    renamed; missing parent folders are made.
    """
    from hvdtrain.errors import env_rank

    try:
        import horovod.tensorflow as hvd

        rank = hvd.rank() if hvd.is_initialized() else env_rank()
    except ImportError:
        rank = env_rank()
    if rank != 0:
        return None
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
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    suffix = next((s for s in (".keras", ".h5", ".hdf5") if name.endswith(s)), "")
    tmp = os.path.join(folder, f".{name}.export-{os.getpid()}{suffix}")
    try:
        plain.save(tmp)
        if not suffix and os.path.isdir(path):  # a SavedModel folder: replace the old one
            old = f"{tmp}.old"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.exists(tmp):
            os.remove(tmp)
    return path
