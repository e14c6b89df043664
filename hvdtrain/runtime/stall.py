"""How long a rank may make no progress: the leaf of stall settings that `runtime`
(Horovod's stall shutdown, set by `hvdtrain.init`) and `watchdog` (hvdtrain's own, for what
Horovod's cannot see) both read. Nothing here imports TensorFlow or Horovod.
"""

import os
import re

from hvdtrain.errors import invalid_value
from hvdtrain.runtime.numbers import decimal

# A rank that makes no progress for this long ends the job (Horovod's stall shutdown and
# `hvdtrain.WatchdogCallback`). Long enough for a rank-0-only checkpoint, export or first-step
# compile of a large model; short enough that a hung job does not hold its hosts for hours.
STALL_SHUTDOWN_SECONDS = 300
STALL_WARNING_SECONDS = 60  # Horovod's own default for the stall warning
_STALL_CHECK = "HOROVOD_STALL_CHECK_TIME_SECONDS"
_STALL_SHUTDOWN = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
_STALL_ENV = "HVDTRAIN_STALL_SHUTDOWN_SECONDS"
FIRST_STEP_FACTOR = 10  # the first step traces and compiles the model


def _seconds(value, name):
    """A whole number of seconds >= 0 from an int or its digits (`numbers.decimal`), else
    the error."""
    number = value if isinstance(value, int) and not isinstance(value, bool) else decimal(value)
    if number is None or number < 0:
        raise invalid_value(name, value, "a whole number of seconds >= 0 (0 turns it off)")
    return number


def _env_int(text, default):
    """Horovod's reading of a number variable (strtol: the leading digits, else 0)."""
    digits = re.match(r"\s*\d*", text or "").group().strip()
    return int(digits) if digits else (default if text is None else 0)


def stall_settings(environ, shutdown_seconds=None):
    """The stall variables that `init` sets: those missing from `environ` (pure).

    Horovod (see horovod/common/stall_inspector.cc) lets rank 0 check, every
    HOROVOD_STALL_CHECK_TIME_SECONDS, for tensors that some ranks submitted and others did
    not; after HOROVOD_STALL_SHUTDOWN_TIME_SECONDS it logs the missing ranks (marked `!`)
    and shuts Horovod down on every rank, so the waiting ranks fail instead of hanging. Its
    shutdown is off by default; hvdtrain turns it on.

    Args:
        environ: the process environment (read, never changed). Variables the user set
            (e.g. by `horovodrun --stall-check-shutdown-time-seconds`) are kept.
        shutdown_seconds: the stall time; by default HVDTRAIN_STALL_SHUTDOWN_SECONDS, else
            `STALL_SHUTDOWN_SECONDS` (300). 0 turns the shutdown off.

    Returns:
        {name: value} to set. The warning time (also how often rank 0 checks) is min(60,
        stall time / 5), at least 1. Horovod's shutdown comes one check after the stall time,
        which HVDTRAIN_STALL_SHUTDOWN_SECONDS records for the watchdogs: a rank stuck outside
        a step (one stall time on its watchdog) names itself before Horovod's check can end
        the job, which it would do naming the ranks that miss the stuck rank's first
        collective. A stalled tensor that Horovod had cached waits up to two checks before
        it is timed, then the shutdown time and one check more: at most 1.8 times the stall
        time, before the watchdog of a rank that waits inside a step (twice the time), so
        that Horovod's check, which knows the missing rank, ends the job and names it.
    """
    shutdown = _stall_time(environ, shutdown_seconds)
    out = {}
    if _STALL_CHECK in environ:
        warning = _env_int(environ[_STALL_CHECK], STALL_WARNING_SECONDS)
    else:
        warning = STALL_WARNING_SECONDS
        if shutdown:
            warning = max(1, min(warning, shutdown // 5))
        out[_STALL_CHECK] = str(warning)
    if _STALL_SHUTDOWN not in environ:
        out[_STALL_SHUTDOWN] = str(max(shutdown, warning) + warning if shutdown else 0)
        out[_STALL_ENV] = str(shutdown)
    return out


def stall_shutdown_seconds(environ=None):
    """The stall time in effect (0: off), which the watchdogs follow: as `init` set it, or
    would set it when it has not run yet, or Horovod's shutdown time where the user set
    HOROVOD_STALL_SHUTDOWN_TIME_SECONDS alone."""
    environ = os.environ if environ is None else environ
    if _env_int(environ.get("HOROVOD_STALL_CHECK_DISABLE"), 0) > 0:
        return 0
    if _STALL_SHUTDOWN in environ and not environ.get(_STALL_ENV, "").strip():
        return _env_int(environ.get(_STALL_SHUTDOWN), 0)
    return _stall_time(environ)


def _stall_time(environ, shutdown_seconds=None):
    if shutdown_seconds is not None:
        return _seconds(shutdown_seconds, "stall_shutdown_seconds")
    text = environ.get(_STALL_ENV, "").strip()
    return _seconds(text, _STALL_ENV) if text else STALL_SHUTDOWN_SECONDS
