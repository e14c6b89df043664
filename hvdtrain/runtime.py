"""Process set-up: `hvd.init()`, one GPU per local rank, a fair share of CPU threads.

Every entry point starts with::

    import hvdtrain
    hvdtrain.init()          # hvd.init(), pin the GPU, set threads

and is then launched with, for example::

    horovodrun -np 2 -H localhost:2 python -m hvdtrain.mnist
    mpirun -np 2 python -m hvdtrain.mnist
"""

import hashlib
import logging
import os
import socket

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdtrain.errors import HvdtrainError

__all__ = [
    "init",
    "gpu_for_local_rank",
    "threads_per_rank",
    "is_main_process",
    "agree",
    "weights_digest",
    "rank_report",
]

log = logging.getLogger("hvdtrain")


def gpu_for_local_rank(local_rank, num_gpus, local_size=None):
    """The index of the GPU that `local_rank` should use, or None when there is no GPU.

    Pure, so it tests without GPUs. One GPU per local rank: more ranks on a host than it
    has GPUs is an error, since two ranks sharing one GPU run out of memory or crawl.
    """
    if num_gpus <= 0:
        return None
    if local_rank >= num_gpus:
        have = f"{num_gpus} visible GPU" + ("s" if num_gpus != 1 else "")
        ranks = f" of {local_size}" if local_size else ""
        raise HvdtrainError(
            f"Invalid value for `local_rank`: received {local_rank}{ranks} on "
            f"{socket.gethostname()}; expected < {num_gpus} ({have} on this host). "
            "Start at most one process per GPU (slots = GPUs per host).",
            every_rank=False,
        )
    return local_rank


def threads_per_rank(cpu_count, local_size, affinity_count=None):
    """CPU threads for each rank so that the ranks of one host don't oversubscribe it.

    The host's cores are split evenly across its local ranks (at least 1 each); when the
    launcher bound the rank to fewer cores (`affinity_count`), those are the limit.
    """
    share = max(1, cpu_count // max(1, local_size))
    if affinity_count:
        share = min(share, affinity_count)
    return share


def init(threads=None, pin_gpu=True, comm=None):
    """Initialises Horovod and this process's devices; call once, before building models.

    Args:
        threads: intra-op threads per rank; by default the host's cores / local ranks.
        pin_gpu: pin one GPU per local rank with memory growth on (a no-op without GPUs).
        comm: the ranks that form this Horovod job: an mpi4py communicator (e.g. from
            `MPI.COMM_WORLD.Split`) or a list of ranks of MPI_COMM_WORLD; by default all of
            them. Needs Horovod on MPI (`mpirun`, `horovodrun --mpi`; not Gloo); import
            mpi4py before this call, so that mpi4py initialises MPI and finalises it at exit.

    Returns:
        The GPU index used, or None on a CPU-only host.
    """
    hvd.init(comm=comm)
    if comm is not None and not hvd.mpi_enabled():  # Gloo ignores `comm`: all ranks join
        raise HvdtrainError(
            f"Invalid value for `comm`: received a {type(comm).__name__} while Horovod runs on "
            "Gloo, which ignores it; expected None. Launch with `mpirun` or `horovodrun --mpi` "
            "to train on a communicator."
        )
    cpus = os.cpu_count() or 1
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    n = threads or threads_per_rank(cpus, hvd.local_size(), affinity)
    try:
        tf.config.threading.set_intra_op_parallelism_threads(n)
        tf.config.threading.set_inter_op_parallelism_threads(min(2, n))
    except RuntimeError:  # TensorFlow already started (a second init in one process)
        pass
    if not pin_gpu:
        return None
    gpus = tf.config.list_physical_devices("GPU")
    index = gpu_for_local_rank(hvd.local_rank(), len(gpus), hvd.local_size())
    if index is not None:
        try:
            tf.config.experimental.set_memory_growth(gpus[index], True)
            tf.config.set_visible_devices(gpus[index], "GPU")
        except RuntimeError:
            pass
    return index


def is_main_process():
    """True on rank 0: the one process that logs, prints progress and writes files."""
    return hvd.rank() == 0


def agree(fn, *, root_only=False):
    """Runs `fn` (on every rank, or on rank 0 only) and makes every rank agree on failure.

    If `fn` raises `HvdtrainError` anywhere, every rank raises the same error, so no rank
    goes on into a collective that the failed one never joins (a hang). Returns `fn()`'s
    result on each rank that ran it (None elsewhere).
    """
    result, message = None, None
    if not root_only or hvd.rank() == 0:
        try:
            result = fn()
        except HvdtrainError as e:
            message = str(e)
    if hvd.size() > 1:
        if root_only:
            message = hvd.broadcast_object(message, root_rank=0, name="hvdtrain.agree")
        else:
            messages = hvd.allgather_object(message, name="hvdtrain.agree")
            failed = [(r, m) for r, m in enumerate(messages) if m]
            if failed and len({m for _, m in failed}) == 1 and len(failed) == hvd.size():
                message = failed[0][1]
            elif failed:
                message = "; ".join(f"rank {r}: {m}" for r, m in failed)
    if message:
        raise HvdtrainError(message)
    return result


def weights_digest(model):
    """A SHA-256 of the model's weights, to compare ranks bit for bit."""
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


def rank_report(model=None):
    """One entry per rank (rank, local rank, host, weights digest), gathered on all ranks."""
    mine = {
        "rank": hvd.rank(),
        "local_rank": hvd.local_rank(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
    }
    if model is not None:
        mine["weights_sha256"] = weights_digest(model)
    if hvd.size() == 1:
        return [mine]
    return hvd.allgather_object(mine, name="hvdtrain.rank_report")
