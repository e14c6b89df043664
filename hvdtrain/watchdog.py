"""A watchdog that ends a rank which stopped making progress, so the job cannot hang.

Horovod's stall shutdown (turned on by `hvdtrain.init`) ends a job when some ranks wait
in a collective for a rank that never submits its tensors. It cannot act when the rank
that stopped also froze Horovod's background thread (a stopped process, an MPI call that
never returns) or when no rank submitted anything. The watchdog covers those: a Keras
callback records each step, and a daemon thread ends the process when no step begins or
ends for too long::

    model.fit(ds, ..., callbacks=[hvdtrain.WatchdogCallback(), ...])

prints, when rank 1 is stuck after its 12th step,

    hvdtrain: rank 1 made no progress for 300 s (last: finished step 12 of epoch 2; ...)

to stderr and exits with status 124; horovodrun, mpirun and `srun --kill-on-bad-exit`
then end the other ranks. A rank inside a training step is usually waiting in the
gradient allreduce for the rank that stopped, so it gets twice the time: the stuck rank
names itself first. The first step of `fit` traces and compiles the model (minutes for a
large one) and gets ten times the timeout (50 min by default).
"""

import os
import threading
import time

import tensorflow as tf

from hvdtrain.errors import env_rank, invalid_value, note_ending
from hvdtrain.stall import (
    FIRST_STEP_FACTOR,
    WAITED,
    follow,
    holding,
    last_activity,
    stall_shutdown_seconds,
    waiting,
)

__all__ = [
    "Watchdog",
    "WatchdogCallback",
    "EXIT_CODE",
    "last_activity",
    "waiting",
    "holding",
]

EXIT_CODE = 124  # as timeout(1): the process was ended for taking too long


def _end_process(message):
    note_ending(message)
    os.write(2, message.encode("utf-8", "replace"))  # no locks: the main thread may hold one
    os._exit(EXIT_CODE)


class Watchdog:
    """Ends this process when `beat` is not called for `timeout` seconds.

    Args:
        timeout: seconds without a beat before the process ends (> 0).
        rank: named in the message; by default Horovod's rank, else the launcher's.
        on_timeout: called with the one-line message instead of ending the process
            (for tests); by default the message goes to stderr and the process exits
            with `EXIT_CODE` through `os._exit` (no clean-up that could hang too).
    """

    def __init__(self, timeout, rank=None, on_timeout=None):
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise invalid_value("timeout", timeout, "a number of seconds > 0")
        self.timeout = float(timeout)
        self.rank = rank
        self.on_timeout = on_timeout or _end_process
        self._last = (time.monotonic(), "started", self.timeout, False)  # + waiting
        self._busy = {}  # what other threads do on their own (`enter`): {key: (since, what)}
        self._stop = threading.Event()
        self._thread = None

    def beat(self, what, waiting=False):
        """Records progress: `what` this rank is doing now. `waiting` marks work that
        waits for the other ranks (a training step), which gets twice the timeout."""
        self._last = (time.monotonic(), what, self.timeout * (2 if waiting else 1), waiting)

    def hold(self, what, factor=FIRST_STEP_FACTOR, waiting=False):
        """Records `what` this rank is doing, with `factor` times the timeout (by default
        for the first step of `fit`, which traces and compiles the model: minutes for a
        large one); `waiting`: for the other ranks."""
        self._last = (time.monotonic(), what, self.timeout * factor, waiting)

    def enter(self, what):
        """Records that the calling thread began `what` on its own (one timeout), beside the
        training thread's beats, until `leave(key)`; returns the key."""
        key = object()
        self._busy[key] = (time.monotonic(), what)
        return key

    def leave(self, key):
        self._busy.pop(key, None)

    def start(self, what="started", timed=True):
        """Starts (or restarts) watching from now; `timed=False` starts with `hold`."""
        if timed:
            self.beat(what)
        else:
            self.hold(what)
        if self._thread is None or not self._thread.is_alive():
            if self.rank is None:
                self.rank = _rank()
            self._stop.clear()
            follow(self)
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

    def _run(self):
        # Fine enough that a rank stuck outside a step names itself well before Horovod's
        # stall check, one check (at least 1 s) after the stall time (`stall_settings`).
        poll = min(0.25, self.timeout / 20)
        while not self._stop.wait(poll):
            now = time.monotonic()
            since, what, limit, waited = self._last
            for began, doing in list(self._busy.values()):
                if now - began - self.timeout > now - since - limit:
                    since, what, limit, waited = began, doing, self.timeout, False
            idle = now - since
            if idle > limit:
                self.on_timeout(_message(self.rank, idle, what, waited))
                return


def _message(rank, idle, what, waited):
    """The line a watchdog ends its process with (pure)."""
    if not waited:
        return (
            f"hvdtrain: rank {rank} made no progress for {idle:.0f} s (last: {what}); "
            "ending it so that the launcher ends the job\n"
        )
    # A rank stuck on its own names itself first (it gets half this time), and Horovod's
    # stall check names one stuck before submitting its tensors; neither can when the rank
    # froze whole.
    return (
        f"hvdtrain: rank {rank} made no progress for {idle:.0f} s, {WAITED} (last: "
        f"{what}); unless another rank's line says it was stuck, one of them froze whole (a "
        "stopped process, a host that stopped answering); ending it so that the launcher "
        "ends the job\n"
    )


def _rank():
    try:
        import horovod.tensorflow as hvd

        if hvd.is_initialized():
            return hvd.rank()
    except (ImportError, ValueError):
        pass
    return env_rank()


class WatchdogCallback(tf.keras.callbacks.Callback):
    """Runs a `Watchdog` during `fit`, fed by every step and epoch (see the module doc).

    Args:
        timeout: seconds without progress; by default the stall shutdown time in effect
            when training begins (`hvdtrain.init(stall_shutdown_seconds=...)`,
            HVDTRAIN_STALL_SHUTDOWN_SECONDS, 300 s); 0 there turns the watchdog off.
        rank: named in the message (default: Horovod's rank).
        on_timeout: see `Watchdog`.
        watchdog: a running `Watchdog` to feed instead of one of its own (`hvdtrain.fit`
            starts one at set-up, so the whole run is watched); it is left running when
            training ends.

    If `fit` raises, the watchdog keeps watching until the process ends, so a hang while
    exiting is ended too; call `callback.watchdog.stop()` to catch the error and go on.
    """

    def __init__(self, timeout=None, rank=None, on_timeout=None, watchdog=None):
        super().__init__()
        self.rank, self.on_timeout = rank, on_timeout
        self.watchdog = None if timeout is None else Watchdog(timeout, rank, on_timeout)
        self._owned = watchdog is None
        if watchdog is not None:
            self.watchdog = watchdog
        self._follow_stall_time = timeout is None and self._owned
        self._epoch = 0
        self._armed = False

    def _beat(self, what, waiting=False):
        if self.watchdog is not None and self._armed:
            self.watchdog.beat(what, waiting)

    def on_train_begin(self, logs=None):
        self._armed = False  # the first step traces and compiles: `hold`, a longer limit
        if self._follow_stall_time:  # read now: hvdtrain.init() has run
            if self.watchdog is not None:
                self.watchdog.stop()
            timeout = stall_shutdown_seconds()
            self.watchdog = Watchdog(timeout, self.rank, self.on_timeout) if timeout else None
        if self.watchdog is not None:
            self.watchdog.start("the first training step (tracing and compiling)", timed=False)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1
        self._beat(f"epoch {self._epoch} began")

    def on_train_batch_begin(self, batch, logs=None):
        if not self._armed and self.watchdog is not None:  # the collectives before it beat
            self.watchdog.hold("the first training step (tracing and compiling)")
        self._beat(
            f"in step {batch + 1} of epoch {self._epoch} (input, forward, backward, "
            "gradient allreduce with the other ranks)",
            waiting=True,
        )

    def on_train_batch_end(self, batch, logs=None):
        self._armed = True
        self._beat(
            f"finished step {batch + 1} of epoch {self._epoch}; then in batch-end callbacks "
            "or the next step's input"
        )

    def on_epoch_end(self, epoch, logs=None):
        self._beat(
            f"finished epoch {epoch + 1}; then in epoch-end callbacks (metric averaging, "
            "evaluation, checkpoint)"
        )

    def on_test_batch_end(self, batch, logs=None):
        self._beat(f"validation batch {batch + 1} after epoch {self._epoch}")

    def on_train_end(self, logs=None):
        if self.watchdog is not None and self._owned:
            self.watchdog.stop()
