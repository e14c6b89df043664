"""Rank 1 stops itself (SIGSTOP) at its exit, after the job's last collective: rank 0 ends
normally, and only hvdtrain-run's grace ends the job.

    hvdtrain-run -np 2 -- python tests/workers/stop_at_exit.py
"""

import atexit
import os
import signal

import horovod.tensorflow as hvd
import tensorflow as tf

import hvdtrain

hvdtrain.init(threads=1)
hvd.allreduce(tf.constant(1.0), name="last")  # the last collective
if hvd.rank() == 1:
    atexit.register(os.kill, os.getpid(), signal.SIGSTOP)  # runs before Horovod's shutdown
print(f"rank {hvd.rank()} done", flush=True)
