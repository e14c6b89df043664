"""Files that are either complete or absent: metrics JSON and the exported model."""

import json
import math
import os
import shutil

__all__ = ["write_json", "export_model", "check_writable"]


def write_json(path, obj):
    """Writes `obj` as JSON to `path` through a temporary file and a rename. NaN and
    infinities become null, so the file is valid JSON for every reader."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(_finite(obj), f, indent=2, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def check_writable(path, flag, folder=False):
    """Proves that `path` (a file, or with `folder` a folder) can be written, making the
    missing folders; raises the one-line `HvdtrainError` naming `flag` otherwise. Run
    before training, so that a bad path costs nothing."""
    from hvdtrain.errors import invalid_value

    path = os.path.abspath(path)
    where = path if folder else os.path.dirname(path)
    try:
        if not folder and os.path.isdir(path):
            raise IsADirectoryError(21, "it is a folder")
        os.makedirs(where, exist_ok=True)
        probe = os.path.join(where, f".hvdtrain-write-test-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        what = "a writable directory" if folder else "a file hvdtrain can write"
        raise invalid_value(
            flag, path, f"{what} ({e.strerror or e}); choose another path or fix its permissions"
        ) from None


def export_model(model, build_fn, path, policy=None):
    """Saves the trained `model` so that plain Keras loads it; on rank 0 only (the others
    return None, writing nothing).

    The model itself is saved, with a fresh optimizer of the class and settings it was
    compiled with in place of the distributed one: plain Keras loads it without Horovod
    installed (a Keras 2 model's: `tf_keras.models.load_model(path)`, or `tf.keras` under
    TF_USE_LEGACY_KERAS=1), compiled as you compiled it. `build_fn` is called (once, on
    rank 0) only where the model cannot be saved as it trained: under a mixed precision
    `policy` (a copy built in float32 takes the weights), and for a model compiled without
    an optimizer Keras can read back. A model of a class of your own (one that customizes
    `fit`: a GAN, a VAE) is saved as its weights, `<path without suffix>.weights.h5`, which
    `build_model().load_weights(path)` loads (the path written is returned). The format
    follows the suffix, as Keras' `save`: `.keras` (Keras' zip), `.h5` (HDF5), no suffix (a
    SavedModel folder). Written beside `path` first, then renamed; missing parent folders
    are made.
    """
    from hvdtrain.errors import env_rank

    try:
        import horovod.tensorflow as hvd

        rank = hvd.rank() if hvd.is_initialized() else env_rank()
    except ImportError:
        rank = env_rank()
    if rank != 0:
        return None
    fresh = None
    if type(model).__module__.partition(".")[0] not in ("keras", "tf_keras"):
        # A model class of the user's own (a GAN, a VAE): Keras loads it whole only with its
        # class and a get_config; its weights load into build_model() with load_weights.
        path, save = os.path.splitext(path)[0] + ".weights.h5", model.save_weights
        if model.weights and not model.built:  # its layers are: a model that trains itself
            model.built = True  # is never called whole, and Keras 3 saves only a built one
    elif not policy and (fresh := _fresh_optimizer(model)) is not None:
        save = model.save
    else:
        save = _plain_copy(model, build_fn, policy).save
    path = os.path.abspath(path)
    folder, name = os.path.split(path)
    os.makedirs(folder, exist_ok=True)
    suffix = next((s for s in (".weights.h5", ".keras", ".h5", ".hdf5") if name.endswith(s)), "")
    tmp = os.path.join(folder, f".{name}.export-{os.getpid()}{suffix}")
    held = model.optimizer if fresh is not None else None
    try:
        if fresh is not None:  # saved with the model; the distributed one back afterwards
            model.optimizer = fresh
        save(tmp)
        if not suffix and os.path.isdir(path):  # a SavedModel folder: replace the old one
            old = f"{tmp}.old"
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        if fresh is not None:
            model.optimizer = held
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.exists(tmp):
            os.remove(tmp)
    return path


def _fresh_optimizer(model):
    """A new optimizer as `model` was compiled with (its compile config: the class and
    settings you gave, not the distributed one), its slots made; None where the model keeps
    no such config."""
    from hvdtrain.frontends import for_model

    try:
        spec = (model.get_compile_config() or {}).get("optimizer")
        if spec is None:
            return None
        optimizer = for_model(model).keras.optimizers.deserialize(spec)
        optimizer.build(model.trainable_variables)  # so that it loads as saved
    except (AttributeError, TypeError, ValueError, KeyError):
        return None
    return optimizer


def _plain_copy(model, build_fn, policy):
    """`build_fn()` (in float32 under a mixed precision `policy`) with `model`'s weights."""
    if policy:
        from hvdtrain.frontends import for_model

        keras = for_model(model)
        keras.set_policy("float32")
        try:
            plain = build_fn()
        finally:
            keras.set_policy(policy)
    else:
        plain = build_fn()
    plain.set_weights(model.get_weights())
    if getattr(plain, "optimizer", None) is not None:  # its slots, so that it loads as saved
        plain.optimizer.build(plain.trainable_variables)  # (no "Skipping variable loading")
    return plain
