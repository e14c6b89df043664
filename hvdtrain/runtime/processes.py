"""The process table, read one way (psutil): what the launcher, a rank and chaos ask of it.

A process that ends frees its id, and the kernel gives it to a later process. So a process
seen once and acted on later is kept as `Recorded(pid, started)`: its id and when it
started (seconds after the machine's boot, to the kernel's clock tick; stable when the
clock is set). `alive` and `send` compare the start with the recorded one, and a process
that now holds the id but started at another time is neither alive nor signalled::

    job = processes.marked("HVDTRAIN_CHAOS_JOB", marker)   # {Recorded: its environment}
    processes.send_all(job, signal.SIGKILL)                # those, and only those

    processes.alive(pid, started)        # False: gone, a zombie, or the id taken since

Every reader answers "none" for a process that is gone, or not this user's to read
(`command_line` [], `environment` {}, `started` None), never an exception: the table
changes while it is read. Nothing here imports TensorFlow (the launcher imports it).
"""

import os
import signal
from typing import NamedTuple

import psutil

__all__ = [
    "Recorded",
    "STOPPED",
    "started",
    "record",
    "alive",
    "state",
    "parent",
    "session",
    "command_line",
    "environment",
    "ancestors",
    "descendants",
    "session_processes",
    "marked",
    "send",
    "send_all",
    "busy_cpu_seconds",
]

STOPPED = psutil.STATUS_STOPPED  # `state` of a process stopped by SIGSTOP or SIGTSTP
_ENDED = frozenset({psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD})
_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


class Recorded(NamedTuple):
    """A process as seen once: its id, and when it started (`started`)."""

    pid: int
    started: float


def _since_boot(proc):
    """When psutil's `proc` started, in seconds after boot (to 1 ms: the kernel counts in
    clock ticks). The boot time is read on both sides, so that a clock set meanwhile (which
    moves it) gives another try rather than a wrong start."""
    for _ in range(3):
        boot = psutil.boot_time()
        created = proc.create_time()
        if psutil.boot_time() == boot:
            break
    return round(created - boot, 3)


def started(pid=None):
    """When process `pid` (default: this one) started, in seconds after boot; None when
    there is no such process."""
    try:
        return _since_boot(psutil.Process(pid))
    except _GONE:
        return None


def record(pid=None):
    """`Recorded` of process `pid` (default: this one), or None when there is none."""
    pid = os.getpid() if pid is None else pid
    start = started(pid)
    return None if start is None else Recorded(pid, start)


def state(pid):
    """psutil's status of process `pid` ("running", "sleeping", `STOPPED`, "zombie" ...),
    or None when there is none."""
    try:
        return psutil.Process(pid).status()
    except _GONE:
        return None


def alive(pid, start=None):
    """True when process `pid` exists and has not ended (a zombie has), and, with `start`,
    started then: the same id held by a process started at another time is another
    process."""
    try:
        proc = psutil.Process(pid)
        if proc.status() in _ENDED:
            return False
        return start is None or _since_boot(proc) == start
    except _GONE:
        return False


def parent(pid):
    """The id of process `pid`'s parent, or None (no such process)."""
    try:
        return psutil.Process(pid).ppid()
    except _GONE:
        return None


def session(pid):
    """The session id of process `pid`, or None (no such process)."""
    try:
        return os.getsid(pid)
    except OSError:
        return None


def command_line(pid):
    """Process `pid`'s command line (a list of str), or [] (gone, a zombie, not readable)."""
    try:
        return psutil.Process(pid).cmdline()
    except _GONE:
        return []


def environment(pid):
    """Process `pid`'s environment as it started (a dict of str), or {} (gone, a zombie,
    another user's)."""
    try:
        return psutil.Process(pid).environ()
    except _GONE:
        return {}


def ancestors(pid=None):
    """[(pid, started, command line)] of the ancestors of `pid` (default: this process),
    parent first, up to (not including) process 1; at most 64."""
    out = []
    try:
        proc = psutil.Process(pid)
        while len(out) < 64:
            proc = proc.parent()  # (None where the parent's id was taken by a later one)
            if proc is None or proc.pid <= 1:
                break
            out.append((proc.pid, _since_boot(proc), command_line(proc.pid)))
    except _GONE:
        pass  # gone meanwhile: the ancestors read so far
    return out


def _every_process():
    """psutil's Process of every process now (its own list: no cache shared by threads)."""
    for pid in psutil.pids():
        try:
            yield psutil.Process(pid)
        except _GONE:
            pass  # gone meanwhile


def _recorded(procs):
    out = []
    for proc in procs:
        try:
            out.append(Recorded(proc.pid, _since_boot(proc)))
        except _GONE:
            pass  # gone meanwhile
    return out


def descendants(pid):
    """[`Recorded`] of the descendants of process `pid` (children, theirs, ...); [] when
    there is no such process."""
    try:
        return _recorded(psutil.Process(pid).children(recursive=True))
    except _GONE:
        return []


def session_processes(sid):
    """[`Recorded`] of the processes of session `sid`."""
    return _recorded(p for p in _every_process() if session(p.pid) == sid)


def marked(name, value):
    """{`Recorded`: environment} of the living processes (not zombies), other than this
    one, whose environment sets `name` to `value` (a job's marker). Processes of other
    users, whose environment cannot be read, are not among them."""
    found = {}
    for proc in _every_process():
        if proc.pid == os.getpid():
            continue
        try:
            env = proc.environ()
            if env.get(name) == value and proc.status() not in _ENDED:
                found[Recorded(proc.pid, _since_boot(proc))] = env
        except _GONE:
            pass
    return found


def in_this_network(pid):
    """Whether process `pid` is in this process's network namespace (namespace test hosts
    share one table of processes). psutil does not read namespaces: the one link read
    here. A process gone, or a system without the links, counts as here."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net") == os.readlink("/proc/self/ns/net")
    except OSError:
        return True


def send(process, signum):
    """Sends `signum` to `process` (a `Recorded`) if it is still that process; True when
    sent. Where the kernel has pidfds, the process is held while its start is compared, so
    that its id cannot pass to another process between the check and the signal."""
    pid, start = process
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):  # no pidfd here (an old kernel, a sandbox): os.kill
        fd = None
    try:
        if started(pid) != start:
            return False  # gone, or its id taken by a later process
        if fd is None:
            os.kill(pid, signum)
        else:
            signal.pidfd_send_signal(fd, signum)
        return True
    except OSError:  # ended meanwhile, or not ours to signal
        return False
    finally:
        if fd is not None:
            os.close(fd)


def send_all(processes, signum):
    """Sends `signum` to each of `processes` (`Recorded`s) that is still that process;
    returns the ids signalled."""
    return [p.pid for p in processes if send(p, signum)]


def busy_cpu_seconds():
    """CPU seconds all cores of this machine spent busy since boot (user, nice, system,
    interrupts and the hypervisor's steal: all but idle and I/O wait), or None where
    psutil cannot tell. The steal counts as busy: a core another virtual machine took was
    not this job's."""
    try:
        t = psutil.cpu_times()
    except (OSError, RuntimeError):
        return None
    idle = t.idle + getattr(t, "iowait", 0.0)
    return sum(t) - idle - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
