"""Scenarios that check the shared job itself (tests/test_shared_jobs.py): what comes back,
a failure, a hang."""

import os
import sys
import time


def rank():
    return int(os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)


def echo(word):
    print(f"echo {word} from rank {rank()}", flush=True)
    print(f"echo {word} on stderr", file=sys.stderr, flush=True)
    return [word, rank(), os.getcwd(), os.environ.get("SHARED_CHECK")]


def fail_on(which):
    if rank() == which:
        raise ValueError(f"rank {which} fails on purpose")
    return "fine"


def hang_on(which):
    if rank() == which:
        print(f"rank {which} hangs on purpose", flush=True)
        while True:
            time.sleep(3600)


def exit_with(code):
    sys.exit(code)
