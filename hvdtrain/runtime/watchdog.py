"""A watchdog that ends a rank which stopped making progress, so the job cannot hang.

Horovod's stall shutdown (turned on by `hvdtrain.init`) ends a job when some ranks wait
in a collective for a rank that never submits its tensors. It cannot act when the rank
that stopped also froze Horovod's background thread (a stopped process, an MPI call that
never returns) or when no rank submitted anything. The watchdog covers those: a daemon
thread ends the process when it is told of no progress for too long. During `fit` a Keras
callback tells it of each step (`hvdtrain.WatchdogCallback`, in `hvdtrain.recipe.callbacks`)::

    model.fit(ds, ..., callbacks=[hvdtrain.WatchdogCallback(), ...])

prints, when rank 1 is stuck after its 12th step,

    hvdtrain: rank 1 made no progress for 300 s (last: finished step 12 of epoch 2; ...)

to stderr and exits with status 124; horovodrun, mpirun and `srun --kill-on-bad-exit`
then end the other ranks. What a rank tells its watchdog says what it waits for, and so how
long it may take (`Allowance`): its own work one timeout, the other ranks (a collective, a
training step's gradient allreduce) twice that, so that the stuck rank names itself before
the ranks that wait for it do. Long phases of its own (building the model, loading the
data, the first step of `fit`, which traces and compiles the model) get ten times the
timeout (50 min by default).

The process's watchdog is the one started last: code between the steps tells it what it
does with `doing(what, waits_for)` (or `with doing_in_thread(what):` from a thread of its
own, such as tf.data's running a user's data code), which does nothing when none runs.

The line ends with a marker, `[hvdtrain:stall rank=1 waiting=0]`, from which `hvdtrain-run`
reads the rank and whether it waited for the others (`stalls`), whatever the words say; it
leaves the marker out of what it prints (`without_marker`). Nothing here imports
TensorFlow: the launcher reads the marker.
"""

import contextlib
import os
import re
import threading
import time
from typing import NamedTuple

from hvdtrain.errors import env_rank, invalid_value, note_ending
from hvdtrain.runtime.stall import FIRST_STEP_FACTOR

__all__ = [
    "Watchdog",
    "Allowance",
    "OWN_WORK",
    "OTHER_RANKS",
    "OWN_SETUP",
    "OTHER_RANKS_SETUP",
    "doing",
    "doing_in_thread",
    "last_activity",
    "message",
    "stalls",
    "without_marker",
    "EXIT_CODE",
]

EXIT_CODE = 124  # as timeout(1): the process was ended for taking too long


class Allowance(NamedTuple):
    """How long a rank may be in what it told its watchdog: `timeouts` times the timeout;
    `others`: it waits for the other ranks (its line says so, and `hvdtrain-run` then
    names another rank if one said it was stuck)."""

    timeouts: int
    others: bool


# What a rank waits for:
OWN_WORK = Allowance(1, False)  # its own work: a user's callback or data code, a step's end
OTHER_RANKS = Allowance(2, True)  # the other ranks, in a collective or a training step
OWN_SETUP = Allowance(FIRST_STEP_FACTOR, False)  # its own long phase: the model, the data
OTHER_RANKS_SETUP = Allowance(FIRST_STEP_FACTOR + 2, True)  # the others, still in theirs


def _end_process(line):
    note_ending(line)
    os.write(2, line.encode("utf-8", "replace"))  # no locks: the main thread may hold one
    os._exit(EXIT_CODE)


class Watchdog:
    """Ends this process when `beat` is not called within its allowance.

    Args:
        timeout: seconds without a beat before the process ends (> 0), for `OWN_WORK`.
        rank: named in the message; by default Horovod's rank, else the launcher's.
        on_timeout: called with the one-line message instead of ending the process
            (for tests); by default the message goes to stderr and the process exits
            with `EXIT_CODE` through `os._exit` (no clean-up that could hang too).
    """

    _latest = []  # the watchdog started last in this process (`doing` tells it)

    def __init__(self, timeout, rank=None, on_timeout=None):
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise invalid_value("timeout", timeout, "a number of seconds > 0")
        self.timeout = float(timeout)
        self.rank = rank
        self.on_timeout = on_timeout or _end_process
        self._last = (time.monotonic(), "started", OWN_WORK)
        self._busy = {}  # what other threads do on their own (`enter`): {key: (since, what)}
        self._stop = threading.Event()
        self._thread = None

    @property
    def running(self):
        return self._thread is not None

    @property
    def last(self):
        """What this rank was last doing, as told by `beat`."""
        return self._last[1]

    def beat(self, what, waits_for=OWN_WORK):
        """Records progress: `what` this rank is doing now, and what it waits for there
        (an `Allowance`: by default its own work, one timeout)."""
        self._last = (time.monotonic(), what, waits_for)

    def enter(self, what):
        """Records that the calling thread began `what` on its own (one timeout), beside the
        training thread's beats, until `leave(key)`; returns the key."""
        key = object()
        self._busy[key] = (time.monotonic(), what)
        return key

    def leave(self, key):
        self._busy.pop(key, None)

    def start(self, what="started", waits_for=OWN_WORK):
        """Starts (or restarts) watching from now, as `beat(what, waits_for)`; it becomes the
        one that `doing` tells."""
        self.beat(what, waits_for)
        if self._thread is None or not self._thread.is_alive():
            if self.rank is None:
                self.rank = _rank()
            self._stop.clear()
            Watchdog._latest[:] = [self]
            self._thread = threading.Thread(target=self._run, name="hvdtrain-watchdog")
            self._thread.daemon = True
            self._thread.start()

    def stop(self):
        """Stops watching (e.g. when training ends)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        self._busy.clear()

    @classmethod
    def latest(cls):
        """The watchdog started last in this process, running or not; None before any."""
        return cls._latest[0] if cls._latest else None

    def _run(self):
        # Fine enough that a rank stuck outside a step names itself well before Horovod's
        # stall check, one check (at least 1 s) after the stall time (`stall_settings`).
        poll = min(0.25, self.timeout / 20)
        while not self._stop.wait(poll):
            now = time.monotonic()
            since, what, allowance = self._last
            limit, waited = self.timeout * allowance.timeouts, allowance.others
            for began, doing_ in list(self._busy.values()):
                if now - began - self.timeout > now - since - limit:
                    since, what, limit, waited = began, doing_, self.timeout, False
            idle = now - since
            if idle > limit:
                self.on_timeout(message(self.rank, idle, what, waited))
                return


def _running():
    dog = Watchdog.latest()
    return dog if dog is not None and dog.running else None


def doing(what, waits_for=OWN_WORK):
    """Tells this process's watchdog (the one started last, if running) that this rank is
    doing `what`, waiting there for `waits_for` (an `Allowance`): `OWN_WORK` (a user's
    callback: one timeout, so that a rank stuck in one names itself before the ranks that
    wait for it do), `OTHER_RANKS` (a collective between steps: twice that), `OWN_SETUP`
    (a long phase of its own: building the model, loading the data) or `OTHER_RANKS_SETUP`
    (done with it, waiting for the other ranks to finish theirs: 2 timeouts more, so that a
    rank stuck in its phase ends first and names itself)."""
    dog = _running()
    if dog is not None:
        dog.beat(what, waits_for)


@contextlib.contextmanager
def doing_in_thread(what):
    """Tells this process's watchdog (if running) that this thread is in `what` on its own
    (one timeout) until the block ends, beside whatever the training thread tells it: for a
    user's data code, which runs in tf.data's or a loader's thread while the training
    thread waits inside a step (twice the time), so that a rank stuck loading its data is
    the one named, and named for that."""
    dog = _running()
    if dog is None:
        yield
        return
    key = dog.enter(what)
    try:
        yield
    finally:
        dog.leave(key)


def last_activity():
    """What this rank was last doing, as its most recently started watchdog knows it."""
    dog = Watchdog.latest()
    return dog.last if dog is not None else None


# The marker at the end of a watchdog's line, which `hvdtrain-run` reads (`stalls`).
_MARKER = " [hvdtrain:stall rank={} waiting={}]"
_MARKER_RE = re.compile(r" ?\[hvdtrain:stall rank=(\d+) waiting=([01])\]")


def message(rank, idle, what, waited):
    """The line a watchdog ends its process with, its marker at the end (pure)."""
    marker = _MARKER.format(rank, int(waited))
    if not waited:
        return (
            f"hvdtrain: rank {rank} made no progress for {idle:.0f} s (last: {what}); "
            f"ending it so that the launcher ends the job{marker}\n"
        )
    # A rank stuck on its own names itself first (it gets half this time), and Horovod's
    # stall check names one stuck before submitting its tensors; neither can when the rank
    # froze whole.
    return (
        f"hvdtrain: rank {rank} made no progress for {idle:.0f} s, waiting for the other "
        f"ranks (last: {what}); unless another rank's line says it was stuck, one of them "
        "froze whole (a stopped process, a host that stopped answering); ending it so that "
        f"the launcher ends the job{marker}\n"
    )


def stalls(text):
    """The watchdogs' lines in `text` (a launcher's output), in order: [(rank, waited)],
    `waited` when that rank waited for the other ranks (pure)."""
    return [(int(rank), waited == "1") for rank, waited in _MARKER_RE.findall(text)]


def without_marker(line):
    """`line` as the user reads it: a watchdog's line without its marker (pure)."""
    return _MARKER_RE.sub("", line)


def _rank():
    try:
        import horovod.tensorflow as hvd

        if hvd.is_initialized():
            return hvd.rank()
    except (ImportError, ValueError):
        pass
    return env_rank()
