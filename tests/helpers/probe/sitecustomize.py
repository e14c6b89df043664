"""Loaded by every Python process a measured test run starts (tests/helpers/durations.py puts
this folder on PYTHONPATH): one JSON line per process in $HVDTRAIN_PROBE_LOG with the test that
started it (PYTEST_CURRENT_TEST, which pytest sets and the job's environment carries), its
command, and when it started and ended. Nothing else; no import of TensorFlow or hvdtrain."""

import atexit
import json
import os
import sys
import time

_LOG = os.environ.get("HVDTRAIN_PROBE_LOG")
if _LOG:
    _started = time.time()

    def _write():
        line = {
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
            "pid": os.getpid(),
            "argv": sys.argv[:3],
            "rank": os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK"),
            "start": _started,
            "end": time.time(),
        }
        with open(_LOG, "a") as f:
            f.write(json.dumps(line) + "\n")

    atexit.register(_write)
