"""Rank 1 never reaches `hvdtrain.init()` (it sleeps before it, as a rank stopped or stuck
importing TensorFlow would): rank 0's wait in `hvd.init()` ends after 10 stall times.

    HVDTRAIN_STALL_SHUTDOWN_SECONDS=1 mpirun -np 2 python tests/workers/never_init.py
"""

import time

from hvdtrain.errors import env_rank

if env_rank() == 1:
    time.sleep(600)

import hvdtrain  # noqa: E402

hvdtrain.init(threads=1)
print("init returned", flush=True)
