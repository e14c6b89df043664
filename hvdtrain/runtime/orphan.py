"""The launcher's death ends the job: a rank whose launcher is gone stops within a second.

A launcher killed with SIGKILL (an out-of-memory killer, a scheduler's hard kill) cannot
end its ranks, and neither `horovodrun` nor `mpirun` tells them: under `horovodrun` the
ranks hang below `sh -c` middlemen and a forked copy of it, under `horovodrun --mpi` its
process became `sh -c mpirun ...`, and orphaned ranks trained to the end, writing
checkpoints into a folder that "run the same command again" then shares with a second job.

`hvdtrain.init()` calls `watch()`: it walks this process's ancestors (read through
`hvdtrain.runtime.processes`) up to the outermost launcher among them (`is_launcher`:
mpirun, mpiexec, orterun, prterun, prted, orted, horovodrun, hvdtrain-run, srun, slurmstepd,
or `sh -c` running one of them) and records each one's process id and start time. A daemon
thread looks every `INTERVAL` seconds; when one of them has ended (gone, a zombie, or its id
reused: another start time), the rank prints one line and exits at once with `EXIT_CODE`
(`os._exit`: no `finally`, no checkpoint)::

    hvdtrain: rank 1: the launcher (mpirun, pid 4242) is gone; ending

`hvdtrain-run` also names itself in `LAUNCHER_ENV` (host, pid, start time): a rank that
reaches `hvdtrain.init()` after hvdtrain-run was killed (during the ranks' start-up, while
the `horovodrun` or `mpirun` below it lives on) ends there.

`CheckpointManager.save` calls `check()` before it puts a checkpoint in place, so no
checkpoint appears after the launcher's death, even within the thread's interval. A
process with no launcher among its ancestors (a script run by hand) watches nothing.
Linux only (elsewhere, nothing is watched). Nothing here imports TensorFlow or Horovod.
"""

import os
import socket
import sys
import threading

from hvdtrain.errors import env_rank, write_line
from hvdtrain.runtime import processes

__all__ = [
    "watch",
    "check",
    "is_launcher",
    "launcher_chain",
    "identity",
    "LAUNCHER_ENV",
    "INTERVAL",
    "EXIT_CODE",
]

INTERVAL = 0.5  # seconds between looks
EXIT_CODE = 1
LAUNCHERS = frozenset(
    {
        "mpirun",
        "mpiexec",
        "orterun",
        "prterun",
        "prted",
        "orted",
        "horovodrun",
        "hvdtrain-run",
        "srun",
        "slurmstepd",
    }
)
# Set by hvdtrain-run for its ranks: "host:pid:start time" of itself, so that a rank that
# reaches `watch` after hvdtrain-run died (killed during the ranks' start-up) still sees it.
LAUNCHER_ENV = "HVDTRAIN_LAUNCHER"
_SHELLS = frozenset({"sh", "bash", "dash", "zsh"})
_chain = []  # [(pid, start time, name)] of the ancestors watched, this one's parent first
_lock = threading.Lock()
_ending = []


def is_launcher(argv):
    """The launcher's name if the command line `argv` (a list) runs one, else None (pure).

    `mpirun ...`, `/usr/bin/orted ...`, `python /venv/bin/horovodrun ...` (a script run by
    its interpreter), `python -m hvdtrain.launcher.cli ...`, `sh -c "mpirun ..."`."""
    if not argv:
        return None
    name = os.path.basename(argv[0])
    if name in LAUNCHERS:
        return name
    if name.startswith("python") and len(argv) > 1:
        if argv[1] == "-m" and len(argv) > 2 and argv[2] == "hvdtrain.launcher.cli":
            return "hvdtrain-run"
        script = os.path.basename(argv[1])
        return script if script in LAUNCHERS else None
    if name in _SHELLS and len(argv) > 2 and argv[1] == "-c":
        words = argv[2].split()
        for word in words:  # past variable assignments (`A=1 mpirun ...`) and `exec`
            if "=" in word and not word.startswith("-"):
                continue
            if word == "exec":
                continue
            found = is_launcher([word, *words[1:]])
            return found and f"sh -c {found}"
    return None


def launcher_chain(lineage):
    """The part of `lineage` (the ancestors' [(pid, start, argv)], parent first) to watch:
    up to and including the outermost launcher, as [(pid, start, name)]; [] when none of
    them is a launcher (pure)."""
    last = None
    for i, (_, _, argv) in enumerate(lineage):
        if is_launcher(argv):
            last = i
    if last is None:
        return []
    chain = []
    for pid, start, argv in lineage[: last + 1]:
        name = is_launcher(argv) or (os.path.basename(argv[0]) if argv else "?")
        chain.append((pid, start, name))
    return chain


def _gone():
    """The first watched ancestor that has ended, as (pid, start, name), or None."""
    for pid, start, name in _chain:
        if not processes.alive(pid, start):
            return pid, start, name
    return None


def check():
    """Ends this process (one line, `EXIT_CODE`) if a watched launcher has ended."""
    gone = _gone() if _chain else None
    if gone is None:
        return
    with _lock:  # the thread and a checkpoint's save may see it at once: one line
        if not _ending:
            _ending.append(gone)
            pid, _, name = gone
            try:
                write_line(
                    f"hvdtrain: rank {_rank()}: the launcher ({name}, pid {pid}) is gone; ending"
                )
            except (OSError, ValueError):
                pass  # the launcher took the pipe with it
        os._exit(EXIT_CODE)


def _rank():
    try:
        import horovod.tensorflow as hvd

        return hvd.rank() if hvd.is_initialized() else env_rank()
    except (ImportError, ValueError):
        return env_rank()


def identity(pid=None):
    """`LAUNCHER_ENV`'s value for process `pid` (default: this one): host, pid, start time."""
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{pid}:{processes.started(pid) or 0}"


def _named_launcher(environ):
    """(pid, start, "hvdtrain-run") from `LAUNCHER_ENV` when it names a process of this host,
    else None (pure but for the host's name)."""
    parts = environ.get(LAUNCHER_ENV, "").rsplit(":", 2)
    if len(parts) != 3 or parts[0] != socket.gethostname():
        return None
    try:
        return int(parts[1]), float(parts[2]), "hvdtrain-run"
    except ValueError:
        return None


def watch(environ=None):
    """Records the launcher's chain (and the hvdtrain-run that `LAUNCHER_ENV` names) and
    starts the watching thread, once per process; ends this process at once when one of
    them is gone already. Returns the chain [(pid, start, name)] ([] when none)."""
    global _chain
    if _chain or not sys.platform.startswith("linux"):
        return list(_chain)
    chain = launcher_chain(processes.ancestors())
    named = _named_launcher(os.environ if environ is None else environ)
    if named and named[0] not in {pid for pid, _, _ in chain}:
        chain.append(named)
    _chain = chain
    if _chain:
        check()
        threading.Thread(target=_loop, name="hvdtrain-launcher-watch", daemon=True).start()
    return list(_chain)


def _loop():
    stop = threading.Event()
    while not stop.wait(INTERVAL):
        check()
