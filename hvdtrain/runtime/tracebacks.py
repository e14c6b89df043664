"""A traceback that the ranks of one job raise alike, printed once per host.

When every rank hits the same bug (a typo in `train_step`, a parse function that fails on
every file), each would print the same traceback, and a launcher interleaves them line by
line. hvdtrain's hook of uncaught errors (`hvdtrain.errors`) asks `first_to_raise` first:
the first rank of the job on this host publishes its traceback in a small file (in
`hvdtrain-<uid>` of the temp folder, mode 0700) and prints it; a later rank whose
traceback is the same (`same_text`) prints one line naming that rank instead. A different
traceback is printed in full. `hvdtrain-run` then shows one of the hosts' alike
tracebacks (`hvdtrain.launcher.failures`).

Standard library only: the launcher imports `same_text`.
"""

import contextlib
import glob
import hashlib
import os
import re
import stat
import sysconfig
import tempfile
import time
import traceback

__all__ = ["first_to_raise", "job_key", "printed_by", "same_text", "traced_frame", "your_frame"]

# What differs from process to process for the same code: the names of the files that
# TensorFlow's autograph writes, object addresses.
_PER_PROCESS = re.compile(r"__autograph_generated_file\w+|0x[0-9a-f]{6,}")
# Variables that name one job on every one of its ranks, by launcher; the first found wins.
_JOB_NAMES = (
    ("PMIX_NAMESPACE",),  # mpirun (Open MPI), srun --mpi=pmix
    ("OMPI_MCA_ess_base_jobid",),
    ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT"),  # horovodrun --gloo
    ("SLURM_JOB_ID", "SLURM_STEP_ID"),
)
STALE_SECONDS = 86400  # older files of failed jobs are removed by the next one
# A launcher's name for a job comes back: Open MPI's job family is 16 bits of a hash, a Gloo
# rendezvous a free port. A file of the same name written this long before this process
# imported hvdtrain is an earlier job's: replaced, never compared.
EARLIER_JOB_SECONDS = 60
_STARTED = time.time()


def same_text(text):
    """`text` (a traceback) without what differs between processes running the same code
    (pure)."""
    return _PER_PROCESS.sub("~", text)


def job_key(environ):
    """What names this job on every rank of it, from the launcher's variables in `environ`,
    or None outside a launcher (pure)."""
    for names in _JOB_NAMES:
        values = [environ.get(name, "") for name in names]
        if all(values):
            return "/".join(values)
    return None


def printed_by(kind, value, tb, rank, environ=None):
    """The rank of this job on this host that printed the same traceback as this uncaught
    exception's, if one did (this rank then prints one line instead), else None."""
    key = job_key(os.environ if environ is None else environ)
    if key is None:
        return None
    return first_to_raise(key, rank, "".join(traceback.format_exception(kind, value, tb)))


def first_to_raise(key, rank, text, folder=None, started=None):
    """Publishes traceback `text` of `rank` for job `key` on this host unless another rank
    did. Returns None when this rank's traceback is to be printed (the first, a different
    one, or no file could be written), else the rank that printed the same one. The file
    goes to `folder`, by default this user's own folder of the temp folder (mode 0700); one
    written `EARLIER_JOB_SECONDS` before `started` (this process's import of hvdtrain) is an
    earlier job's of the same name, and replaced."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    mine = same_text(text)
    earlier = (_STARTED if started is None else started) - EARLIER_JOB_SECONDS
    try:
        folder = folder or _own_folder()
        name = os.path.join(folder, f"{digest}.traceback")
        with contextlib.suppress(FileNotFoundError):
            if os.stat(name).st_mtime < earlier:
                os.unlink(name)
        part = f"{name}.{os.getpid()}"
        with open(part, "w") as f:
            f.write(f"{rank}\n{mine}")
        try:
            os.link(part, name)  # whole or not at all: the first rank's, for all to read
        except FileExistsError:
            with open(name) as f:
                first, _, theirs = f.read().partition("\n")
            return int(first) if theirs == mine and first != str(rank) else None
        finally:
            os.unlink(part)
    except (OSError, ValueError):
        return None
    _remove_stale(folder, name)
    return None


def _own_folder():
    """This user's folder in the temp folder, made 0700; OSError if another user owns it."""
    folder = os.path.join(tempfile.gettempdir(), f"hvdtrain-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    info = os.lstat(folder)
    if info.st_uid != os.getuid() or not stat.S_ISDIR(info.st_mode) or info.st_mode & 0o077:
        raise OSError(f"{folder} is not this user's own")
    return folder


def _remove_stale(folder, keep):
    now = time.time()
    for path in glob.glob(os.path.join(folder, "*.traceback")):
        try:
            if path != keep and now - os.path.getmtime(path) > STALE_SECONDS:
                os.unlink(path)
        except OSError:
            pass


_LIBRARIES = None
# A frame that TensorFlow's error while tracing lists in its message.
_TRACED = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _library(path):
    """Whether `path` (real) is the standard library's, an installed package's, hvdtrain's
    or code TensorFlow generated."""
    global _LIBRARIES
    if _LIBRARIES is None:
        paths = sysconfig.get_paths()
        roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
        _LIBRARIES = tuple(os.path.realpath(r) + os.sep for r in roots)
    ours = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep  # hvdtrain/
    return path.startswith((*_LIBRARIES, ours)) or "__autograph_generated_file" in path


def your_frame(tb):
    """The innermost frame of traceback `tb` in the user's code (a `FrameSummary`), if the
    error came from there: a function of the user's (not the standard library's, an
    installed package's, hvdtrain's or code TensorFlow generated) that raised it or called
    the library that did, but not one that called hvdtrain (`hvdtrain.fit` from `main`), nor
    a script's top level."""
    ours = os.path.dirname(os.path.dirname(os.path.realpath(__file__))) + os.sep  # hvdtrain/
    deeper = None
    for frame in reversed(traceback.extract_tb(tb)):
        if frame.filename.startswith("<"):  # code made at run time (a dataclass's __init__)
            continue
        path = os.path.realpath(frame.filename)
        if not _library(path):
            called_us = deeper is not None and deeper.startswith(ours)
            return None if called_us or frame.name == "<module>" else frame
        deeper = path
    return None


def traced_frame(message):
    """The innermost frame of the user's code that TensorFlow's error while tracing lists
    in its `message` ("in user code:", the frames, then the error: a parse function that
    tf.data maps, a `train_map`, a `train_step`), or None. Its traceback holds only the code
    TensorFlow generated from the user's."""
    if not message.startswith("in user code:"):
        return None
    for path, line, name in reversed(_TRACED.findall(message)):
        if not _library(os.path.realpath(path)):
            return traceback.FrameSummary(path, int(line), name, lookup_line=False)
    return None
