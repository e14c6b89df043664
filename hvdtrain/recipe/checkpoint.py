"""Checkpoints that a crash cannot break, written by rank 0 alone.

Layout of a checkpoint directory::

    ckpt/epoch-0003/manifest.json   # a `Manifest`: format, epoch, step, model, files' SHA-256
    ckpt/epoch-0003/state.index     # model weights + optimizer state (tf.train.Checkpoint)
    ckpt/epoch-0003/state.data-00000-of-00001
    ckpt/epoch-0004-step-000050/    # mid-epoch (--checkpoint-every): epoch 4, step 50

Folder names number epochs and steps from 1, as hvdtrain's lines do (`hvdtrain.recipe.names`:
`epoch-0003` is the end of epoch 3, `epoch-0004-step-000050` is after step 50 of epoch 4);
checkpoints whose manifest is of format 1 or 2 named a mid-epoch folder by the epochs done,
and are still found, ordered and resumed by their manifest.

Resuming in a loop of your own (`hvdtrain.fit` does all of this)::

    manager = hvdtrain.CheckpointManager("ckpt", model, optimizer)
    found = manager.restore_latest() if hvd.rank() == 0 else None    # rank 0 reads
    found = hvd.broadcast_object(found, root_rank=0)                 # every rank learns where
    hvdtrain.broadcast_initial_state(model, optimizer)               # and gets rank 0's state
    start_epoch, start_step = (found.epoch, found.step) if found else (0, 0)
    ...
    if hvd.rank() == 0:
        manager.save(epoch + 1)                                      # after each epoch

One job at a time: the rank that writes holds the folder (an `fcntl.flock` on it, which
the kernel releases when the process ends, however it ends), and a second job on the same
folder is refused in one line while the first one lives.

A checkpoint is written into a hidden temporary folder and renamed into place only when
complete, so a process killed mid-write leaves no `epoch-*` folder behind; the manifest is
checked on load, so a damaged one is skipped. Older checkpoints are deleted only after
the new one is in place.
"""

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import time

import tensorflow as tf

from hvdtrain.errors import HvdtrainError, one_line
from hvdtrain.recipe import names, outputs
from hvdtrain.runtime import orphan

__all__ = ["CheckpointManager", "Manifest", "FORMAT", "model_fingerprint"]

log = logging.getLogger("hvdtrain")
# Written: 3 names a mid-epoch folder by the epoch it is in (`names`). Read too: 2 (the same
# fields; a mid-epoch folder named by the epochs done) and 1 (hvdtrain 0.1's, less `data`).
FORMAT = names.NAMED_BY_ITS_EPOCH
_READABLE = (1, 2, 3)
_MAX_MANIFEST = 16 << 20  # bytes; a real manifest is about 1 KB
_held = {}  # {folder: its open descriptor, locked}: the folders this process holds


@dataclasses.dataclass
class Manifest:
    """What a checkpoint holds: `manifest.json`, written last and checked on load.

    Args:
        epoch: epochs completed before it; step: steps into the next one (0 at epoch ends).
        files: {file name: [size, SHA-256]} of the state files.
        fingerprint: the model's layers and weight shapes (`model_fingerprint`).
        format: `FORMAT` when written; a checkpoint of another format is refused.
        time: when it was written.
        written_by: by which host and process.
        size: the ranks of the run that wrote it (for a resume on another number of ranks).
        global_batch: that run's global batch.
        steps_per_epoch: that run's steps per epoch.
        prog: the program.
        logs: the epoch's metrics.
        data: what the data was.
        history: the metrics of every epoch so far, the resumed runs' included.
        keras: the model's Keras ("Keras 2 (tf-keras)", "Keras 3"); the other refuses it.
        extra: anything else the writer recorded.
    """

    epoch: int
    files: dict
    fingerprint: list
    step: int = 0
    format: int = FORMAT
    time: float = 0.0
    written_by: dict = dataclasses.field(default_factory=dict)
    size: int | None = None
    global_batch: int | None = None
    steps_per_epoch: int | None = None
    prog: str | None = None
    logs: dict = dataclasses.field(default_factory=dict)
    data: dict | None = None
    history: dict = dataclasses.field(default_factory=dict)
    keras: str | None = None
    extra: dict = dataclasses.field(default_factory=dict)
    path: str | None = dataclasses.field(default=None, compare=False)  # where it was read

    @property
    def global_step(self):
        """Steps completed in all (needs `steps_per_epoch`)."""
        return self.epoch * (self.steps_per_epoch or 0) + self.step

    def to_dict(self):
        d = dataclasses.asdict(self)
        d.pop("path")
        return d

    @classmethod
    def from_dict(cls, d, path=None):
        """The manifest in `d` (parsed JSON); None when it is not one (damaged); raises
        `HvdtrainError` for a format this hvdtrain does not read."""
        if not isinstance(d, dict):
            return None
        version = d.get("format", 1)
        if type(version) is not int or version not in _READABLE:
            raise HvdtrainError(
                f"Invalid checkpoint {path}: it has format {version!r}; this hvdtrain reads "
                f"formats {', '.join(map(str, _READABLE))} (writes {FORMAT}). Use the hvdtrain "
                "that wrote it, or a new --checkpoint-dir."
            )
        names = {f.name for f in dataclasses.fields(cls)} - {"path", "extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {
            **(d.get("extra") or {}),
            **{k: v for k, v in d.items() if k not in names | {"extra"}},
        }
        try:
            m = cls(**known, extra=extra, path=path)
        except TypeError:  # a required field missing
            return None
        types = {"epoch": int, "step": int, "files": dict, "fingerprint": list}
        if any(type(getattr(m, k)) is not t for k, t in types.items()) or not m.files:
            return None
        if m.epoch < 0 or m.step < 0:
            return None
        if not isinstance(m.history, dict):
            m.history = {}
        return m


def model_fingerprint(model):
    """The model's structure: each layer's class and weight shapes, in order."""
    return [
        [layer.__class__.__name__, [list(map(int, w.shape)) for w in layer.weights]]
        for layer in model.layers
        if layer.weights
    ]


def _keras_of(model):
    from hvdtrain.frontends import for_model

    return for_model(model).NAME


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Saves and restores the model, its optimizer and the epoch.

    Args:
        directory: where checkpoints live (created if missing).
        model: the Keras model.
        optimizer: its optimizer (slots must exist before `restore`; see
            `hvdtrain.broadcast_initial_state`), or a dict of its optimizers by name (a
            GAN's `{"optimizer": ..., "d_optimizer": ..., "g_optimizer": ...}`: the first is
            saved as `optimizer`, the others under their names).
        keep: how many complete checkpoints to keep.
        optional: {name: trackable} saved beside them, and restored where a checkpoint holds
            them (DiLoCo's outer momentum: a checkpoint of another `--sync` has none).
    """

    def __init__(self, directory, model, optimizer, keep=2, optional=None):
        if keep < 1:
            raise HvdtrainError(f"Invalid value for `keep`: received {keep!r}; expected >= 1.")
        self.directory = os.path.abspath(directory)
        self.model = model
        self.optimizer = optimizer
        self.keep = keep
        self.optional = dict(optional or {})
        self.skipped = []  # the damaged checkpoint folders the last `latest()` passed over

    # -- checks -------------------------------------------------------------------------
    def check_writable(self, lock=True):
        """Creates the directory and proves it is writable, or raises a clear error; with
        `lock`, takes the folder for this process (`lock`)."""
        d = self.directory
        outputs.check_writable(d, "--checkpoint-dir", folder=True)
        if lock:
            self.lock()
        for name in os.listdir(d):  # leftovers of writes that a crash interrupted
            if name.startswith(".epoch-") and ".tmp" in name:
                shutil.rmtree(os.path.join(d, name), ignore_errors=True)

    def lock(self):
        """Holds the folder (an `fcntl.flock` on the folder itself: no file is added) until
        `unlock()` or the process's end (the kernel lets go of it however the process ends);
        raises `HvdtrainError` while another process holds it: two jobs writing one folder
        would resume from each other's checkpoints. A file system that cannot lock a folder
        (some network file systems) is not locked."""
        d = os.path.realpath(self.directory)
        if d in _held:
            return
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return  # check_writable said what is wrong with the folder
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            who = f" (pid {holder} on this host)" if holder else ""
            raise HvdtrainError(
                f"--checkpoint-dir {d} is in use by another job{who}; two jobs in one folder "
                "would resume from each other's checkpoints. Wait for it to end (or end it), "
                "or choose another --checkpoint-dir."
            ) from None
        except OSError:  # no locks on this file system
            os.close(fd)
            return
        _held[d] = fd

    def unlock(self):
        """Lets go of the folder's lock (`lock`), if this process holds it."""
        fd = _held.pop(os.path.realpath(self.directory), None)
        if fd is not None:
            os.close(fd)

    # -- reading ------------------------------------------------------------------------
    def _epochs(self):
        """[((epochs done, steps into the next), path)], newest first. A mid-epoch folder's
        name means one thing or another by its manifest's format (`names.position_of`)."""
        if not os.path.isdir(self.directory):
            return []
        found = []
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            key = names.position_of(name)
            if key is not None and key[1]:  # mid-epoch: the format says how it is named
                key = names.position_of(name, _format_of(path))
            if key is not None:
                found.append((key, path))
        return sorted(found, reverse=True)

    def _manifest(self, path, epoch, step):
        """The `Manifest` of a complete, undamaged checkpoint of (`epoch`, `step`), or None.

        Hostile contents are refused, not followed: only regular files (a FIFO would block
        forever, /dev/zero never ends), only names inside the checkpoint, a small manifest.
        A manifest of a format this hvdtrain does not read raises `HvdtrainError`.
        """
        try:
            file = os.path.join(path, "manifest.json")
            if not _regular(file) or os.path.getsize(file) > _MAX_MANIFEST:
                return None
            with open(file, encoding="utf-8") as f:
                manifest = Manifest.from_dict(json.load(f), path)
            if manifest is None or (manifest.epoch, manifest.step) != (epoch, step):
                return None
            for name, (size, digest) in manifest.files.items():
                file = os.path.join(path, name)
                if name in (".", "..") or os.path.basename(name) != name or not _regular(file):
                    return None
                if os.path.getsize(file) != size or _sha256(file) != digest:
                    return None
            return manifest
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return None

    def latest(self):
        """The `Manifest` of the newest valid checkpoint (its `path` set), or None.

        A damaged newer checkpoint is skipped with a warning. When there are checkpoint
        folders but none is usable, nothing is logged: `skipped` names them and `found()`
        says it in words, for the caller to say what it does about it (start over, refuse).
        """
        self.skipped = []
        for (epoch, step), path in self._epochs():
            manifest = self._manifest(path, epoch, step)
            if manifest is not None:
                for name in self.skipped:
                    log.warning(
                        "skipping damaged checkpoint %s", os.path.join(self.directory, name)
                    )
                return manifest
            self.skipped.append(os.path.basename(path))
        return None

    def found(self):
        """What the last `latest()` found, in words."""
        names = self.skipped
        if not names:
            return "no checkpoint folder (epoch-NNNN) there"
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        return f"{len(names)} checkpoint folder(s), each damaged or not hvdtrain's ({shown})"

    def restore(self, manifest):
        """Loads the weights and optimizer state of the checkpoint `manifest` describes (from
        `latest()`); returns it (epoch, step, global_step, ...)."""
        path = manifest.path
        keras = _keras_of(self.model)
        if manifest.keras not in (None, keras):
            raise HvdtrainError(
                f"Invalid checkpoint in `--checkpoint-dir`: {path} was written by a "
                f"{manifest.keras} model; this run builds a {keras} one, whose state it cannot "
                "hold. Use a new --checkpoint-dir, or build the model with the Keras that "
                "wrote it."
            )
        expected = model_fingerprint(self.model)
        if manifest.fingerprint != expected:
            raise HvdtrainError(
                f"Invalid checkpoint in `--checkpoint-dir`: {path} was written by a different "
                f"model ({_describe(manifest.fingerprint)}; this run builds "
                f"{_describe(expected)}). Use a new --checkpoint-dir, or the flags that "
                "wrote it."
            )
        try:
            held = {name.split("/")[0] for name, _ in tf.train.list_variables(
                os.path.join(path, "state"))}  # fmt: skip
            state = self._state(held)
            state.read(os.path.join(path, "state")).assert_existing_objects_matched()
        # A damaged state file makes TensorFlow's reader raise IndexError, KeyError, ...
        except (AssertionError, LookupError, ValueError, TypeError, tf.errors.OpError) as e:
            reason = one_line(e)
            raise HvdtrainError(
                f"Invalid checkpoint in `--checkpoint-dir`: {path} does not match this model "
                f"and optimizer ({reason}). Use a new --checkpoint-dir."
            ) from None
        return manifest

    def restore_latest(self):
        """`restore(latest())`: the restored checkpoint's `Manifest`, or None if none (one
        warning when there were checkpoint folders, none of them usable)."""
        found = self.latest()
        if found is None and self.skipped:
            log.warning(
                "no usable checkpoint in %s: %s; starting from scratch",
                self.directory,
                self.found(),
            )
        return self.restore(found) if found is not None else None

    def _state(self, held=None):
        """What a checkpoint holds: the model and the optimizer, and whatever else the model's
        Keras keeps outside them (Keras 3's random seed states), and the `optional` ones (of
        those, the names in `held` only, when given)."""
        from hvdtrain.frontends import for_model

        extras = for_model(self.model).checkpoint_extras(self.model)
        optimizers = self.optimizer
        if isinstance(optimizers, dict):
            first, *others = optimizers.items()
            extras.update({"optimizer_" + re.sub(r"\W+", "_", k): v for k, v in others})
            optimizers = first[1]
        extras.update({k: v for k, v in self.optional.items() if held is None or k in held})
        return tf.train.Checkpoint(model=self.model, optimizer=optimizers, **extras)

    # -- writing ------------------------------------------------------------------------
    def save(self, epoch, extra=None, step=0, replace=False, **fields):
        """Writes a checkpoint atomically and returns its path: after `epoch` completed
        epochs and `step` steps into the next one. `fields` fill the `Manifest` (size,
        global_batch, steps_per_epoch, prog, logs, data, history); `extra` goes to its
        `extra`. With `replace`, a complete checkpoint of the same epoch and step is
        replaced (set aside until the new one is in place, then deleted)."""
        name = names.folder_name(epoch, step)
        final = os.path.join(self.directory, name)
        tmp = os.path.join(self.directory, f".{name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            self._state().write(os.path.join(tmp, "state"))
            files = {}
            for name in sorted(os.listdir(tmp)):
                file = os.path.join(tmp, name)
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
                files[name] = [os.path.getsize(file), _sha256(file)]
            manifest = Manifest(
                epoch=int(epoch),
                step=int(step),
                files=files,
                fingerprint=model_fingerprint(self.model),
                time=time.time(),
                written_by={"host": socket.gethostname(), "pid": os.getpid()},
                keras=_keras_of(self.model),
                extra=dict(extra or {}),
                **fields,
            ).to_dict()
            with open(os.path.join(tmp, "manifest.json"), "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp)
            orphan.check()  # no checkpoint appears after the launcher's death
            aside = None
            if os.path.exists(final):  # a damaged checkpoint of this epoch: keep it aside
                aside = f"{final}.{'replaced' if replace else 'damaged'}-{int(time.time())}"
                os.replace(final, aside)
            os.replace(tmp, final)
            _fsync_dir(self.directory)
            if replace and aside:
                shutil.rmtree(aside, ignore_errors=True)
            elif aside:  # nothing lost, and the user is told where it went
                log.warning(
                    "a damaged checkpoint was where this one goes: %s is now %s (kept as it was)",
                    final,
                    aside,
                )
        except (OSError, tf.errors.OpError) as e:  # a full disk, a lost mount, permissions
            shutil.rmtree(tmp, ignore_errors=True)
            reason = one_line(e).split("; ")[-1]  # TensorFlow's: "...: path; the reason"
            # Rank 0's alone: the others are already in the next step's collectives, so it
            # leaves at once (no meeting in a last collective) and the launcher ends them.
            raise HvdtrainError(
                f"Could not write checkpoint {final}: {reason}. The previous "
                "checkpoints are kept; free space or choose another --checkpoint-dir.",
                every_rank=False,
            ) from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in self._recognized()[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _recognized(self):
        """Paths of the checkpoints whose manifest names them (newest first): the only ones
        that count toward `keep` and may be deleted. A damaged folder, or one renamed or put
        there by hand (`epoch-9999`), is left alone."""
        out = []
        for (epoch, step), path in self._epochs():
            try:
                file = os.path.join(path, "manifest.json")
                if not _regular(file) or os.path.getsize(file) > _MAX_MANIFEST:
                    continue
                with open(file, encoding="utf-8") as f:
                    m = Manifest.from_dict(json.load(f), path)
            except (OSError, ValueError, RecursionError, HvdtrainError):
                continue
            if m is not None and (m.epoch, m.step) == (epoch, step):
                out.append(path)
        return out


def _describe(fingerprint):
    if not fingerprint:
        return "unknown layers"
    try:  # a manifest's fingerprint may be anything
        layers = ", ".join(str(layer) for layer, _ in fingerprint)
        params = sum(_product(shape) for _, shapes in fingerprint for shape in shapes)
    except (TypeError, ValueError):
        return "an unreadable model description"
    return f"{layers[:300]}; {params:,} parameters"


def _product(shape):
    n = 1
    for d in shape:
        if type(d) is not int:
            raise TypeError(f"a dimension {d!r}")
        n *= d
    return n


def _lock_holder(fd):
    """The process id holding the flock on the open folder `fd`, from /proc/locks (Linux;
    this host only), or None."""
    st = os.fstat(fd)
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if "FLOCK" in parts and key in parts:
                    return int(parts[parts.index(key) - 1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _format_of(path):
    """The `format` of checkpoint folder `path`'s manifest; `FORMAT` where it cannot be read
    (the folder is then skipped as damaged, wherever it sorts)."""
    try:
        file = os.path.join(path, "manifest.json")
        if _regular(file) and os.path.getsize(file) <= _MAX_MANIFEST:
            with open(file, encoding="utf-8") as f:
                found = json.load(f).get("format", 1)
            if type(found) is int:
                return found
    except (OSError, ValueError, AttributeError, RecursionError):
        pass
    return FORMAT


def _regular(path):
    """True for a regular file that is not a symbolic link (which could lead anywhere)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False
