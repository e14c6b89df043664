"""How an uncaught error ends a rank: a user mistake (`HvdtrainError`) as one line, any other
error's traceback once per host, and a line naming the rank once Horovod runs.
`report_uncaught` installs it (`hvdtrain.init`, `hvdtrain.fit`, `hvdtrain.ArgumentParser` and
the entry points call it: importing hvdtrain installs nothing).
"""

import atexit
import os
import re
import sys

from hvdtrain.errors import (
    HvdtrainError,
    env_rank,
    exit_with_error,
    note_ending,
    one_line,
    write_line,
)
from hvdtrain.runtime import tracebacks

__all__ = ["report_uncaught", "horovod_up", "because_of_another_rank"]


# Horovod in this process (`horovod_up`): the rank, and what tells the rank's last activity.
_horovod = {}


def horovod_up(rank, last_activity=None):
    """Tells the hook of uncaught errors (`report_uncaught`) that Horovod runs in this
    process as `rank` (`hvdtrain.init` calls it): from then on an uncaught error also ends
    with a line naming the rank, and `last_activity()` (what the rank was doing, or None)."""
    _horovod.update(rank=rank, last_activity=last_activity or (lambda: None))


# An error that says another rank (or its host) went away: Horovod's own shutdown, or the
# transport's connection to a peer breaking (Gloo's TCP pair, Open MPI's TCP transport).
_PEER_LOST = re.compile(
    r"Connection (?:reset|closed) by peer|Broken pipe|pair\.cc:\d+\] (?:Read|Write) error"
)
_PEER_SILENT = re.compile(r"Timed out waiting \d+ms for (?:recv|send) op|Application timeout")


def because_of_another_rank(text):
    """What an error's `text` says happened if this rank only failed because another rank
    did (a phrase for the one line it prints), else None (pure)."""
    if "Horovod has been shut down" in text:
        return "Horovod was shut down"
    if _PEER_LOST.search(text):
        return "the connection to another rank broke"
    if _PEER_SILENT.search(text):
        return "nothing came from another rank within HOROVOD_GLOO_TIMEOUT_SECONDS"
    return None


def report_uncaught():
    """Installs hvdtrain's hook of uncaught errors, once per process (`import hvdtrain` does;
    a second call changes nothing). It knows whether Horovod runs here (`horovod_up`):

    - an `HvdtrainError` ends the script like the entry points' errors: `train.py: error:
      ...` printed once (see `HvdtrainError.every_rank`), no traceback, its exit status
      (after the exit handlers: Horovod shuts down cleanly);
    - another error prints its traceback once per host (`hvdtrain.runtime.tracebacks`): a rank whose
      traceback another rank printed alike prints one line naming that rank instead;
    - once Horovod runs, a line before the traceback names the user's function that raised
      it (`tracebacks.your_frame`), and a line after it names the rank (and, with a
      `WatchdogCallback`, what it was doing): not every launcher tags output with ranks. A
      rank that only failed because another one did (Horovod was shut down) prints that
      line alone: the traceback that matters is the other rank's.
    """
    if getattr(sys.excepthook, "hvdtrain_errors", False):
        return
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, HvdtrainError):
            _exit_now(value)
        elif _horovod:
            _report_rank(kind, value, tb, previous)
        else:  # before `hvd.init()` (a typo in the script's own data code)
            same = None
            if not issubclass(kind, KeyboardInterrupt):
                same = tracebacks.printed_by(kind, value, tb, env_rank())
            if same is None:
                return previous(kind, value, tb)
            write_line(
                f"hvdtrain: rank {env_rank()} failed: {one_line(value, named=True, most=300)}"
                f"; its traceback is the same as rank {same}'s"
            )
        return None

    hook.hvdtrain_errors = True
    sys.excepthook = hook


def _exit_now(error):
    """`exit_with_error` from inside an excepthook, where Python would ignore SystemExit."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "hvdtrain"
    try:
        exit_with_error(prog, error)
    except SystemExit as done:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        atexit._run_exitfuncs()
        os._exit(done.code)


def _report_rank(kind, value, tb, previous):
    """An uncaught error other than an `HvdtrainError` once Horovod runs (`report_uncaught`)."""
    rank = _horovod["rank"]
    consequence = because_of_another_rank(str(value))
    plain = issubclass(kind, KeyboardInterrupt)  # no traceback of yours
    yours = None if consequence or plain else _where(value, tb)
    same = None if consequence or plain else tracebacks.printed_by(kind, value, tb, rank)
    printed = f"; its traceback is the same as rank {same}'s" if same is not None else ""
    if yours:
        below = "" if printed else " below"
        write_line(f"hvdtrain: the error{below} was raised in your code: {yours}{printed}")
    elif printed:
        write_line(f"hvdtrain: rank {rank}{printed}")
    if not consequence and same is None:
        previous(kind, value, tb)
    if plain:
        return
    last = _horovod["last_activity"]()
    where = f" (last: {last})" if last else ""
    if consequence:
        text = (
            f"stopped: {consequence} because another rank failed, exited or stalled, "
            "or its host was lost (see its error)"
        )
    else:
        error, what = one_line(value, named=True, most=300), getattr(value, "hvdtrain_what", "")
        text = f"failed: {what} raised {error} in {yours}" if what else f"failed: {error}"
    line = f"hvdtrain: rank {rank} {text}{where}"
    note_ending(line + "\n")
    write_line(line)


def _where(error, tb):
    """`function (file.py:line)`: where in the user's code `error` was raised, or None."""
    marked = getattr(error, "hvdtrain_where", None)
    if marked:
        return marked
    frame = tracebacks.your_frame(tb) or tracebacks.traced_frame(str(error))
    return f"{frame.name} ({os.path.basename(frame.filename)}:{frame.lineno})" if frame else None
