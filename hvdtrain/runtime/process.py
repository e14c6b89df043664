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
import threading

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdtrain.errors import HvdtrainError, env_rank, kind_of, note_ending, write_line
from hvdtrain.runtime import compat, logs, orphan, stall, streams, tuning, watchdog
from hvdtrain.runtime.stall import stall_settings, stall_shutdown_seconds
from hvdtrain.runtime.uncaught import horovod_up, report_uncaught

__all__ = [
    "init",
    "stall_settings",
    "stall_shutdown_seconds",
    "gpu_for_local_rank",
    "gloo_hostname_problem",
    "threads_per_rank",
    "is_main_process",
    "agree",
    "weights_digest",
    "rank_report",
    "bound_cores",
]

log = logging.getLogger("hvdtrain")

_pinned = None  # the GPU index `init` pinned (rank_report says it)
_initialised = False  # `init` ran in this process (a second cannot set the threads again)
_bound = None  # the cores `init` bound this rank's threads to (sorted), or None


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


def gloo_hostname_problem(environ, hostname=None):
    """Why Horovod's Gloo would crash on this host, or None.

    Horovod 0.28.1's Gloo looks the host's own name up and dies with SIGSEGV (exit 139, no
    message) when it does not resolve, whatever the network interface; MPI does not. Under
    Gloo (horovodrun --gloo, hvdtrain-run across hosts) `init` checks it first.
    """
    if environ.get("HOROVOD_CONTROLLER") != "gloo":
        return None
    name = hostname or socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
        return None
    except OSError:
        return (
            f"this host's name {name!r} does not resolve, and Horovod's Gloo crashes on it "
            f"(SIGSEGV); add it to /etc/hosts (e.g. `127.0.1.1 {name}`) or DNS, or launch with "
            "MPI (horovodrun --mpi, mpirun)"
        )


def threads_per_rank(cpu_count, local_size, affinity_count=None):
    """CPU threads for each rank so that the ranks of one host don't oversubscribe it.

    The host's cores are split evenly across its local ranks (at least 1 each); when the
    launcher bound the rank to fewer cores (`affinity_count`), those are the limit.
    """
    share = max(1, cpu_count // max(1, local_size))
    if affinity_count:
        share = min(share, affinity_count)
    return share


def init(
    threads=None,
    pin_gpu=True,
    comm=None,
    stall_shutdown_seconds=None,
    exchanges_rarely=False,
    deterministic=False,
):
    """Initialises Horovod and this process's devices; call once, before building models.

    Performance defaults (`hvdtrain.runtime.tuning`, measured by `python -m hvdtrain.bench`):
    before `hvd.init()`, where the environment does not set them, a 0.1 ms Horovod cycle
    (with more than one rank) and MPI waits that yield the core; after it, on CPU-only
    hosts, Horovod's background threads are scheduled SCHED_BATCH, so they do not preempt
    the compute at every wake-up. Where nothing bound the ranks to cores, each rank's threads
    are bound to its share of the host's cores under `exchanges_rarely` on CPU-only hosts,
    or in every case with HVDTRAIN_CPU_BIND=cores (HVDTRAIN_CPU_BIND=none: never).

    Args:
        threads: intra-op threads per rank; by default the host's cores / local ranks.
        pin_gpu: pin one GPU per local rank with memory growth on (a no-op without GPUs).
        comm: the ranks that form this Horovod job: an mpi4py communicator (e.g. from
            `MPI.COMM_WORLD.Split`) or a list of ranks of MPI_COMM_WORLD; by default all of
            them. Needs Horovod on MPI (`mpirun`, `horovodrun --mpi`; not Gloo); import
            mpi4py before this call, so that mpi4py initialises MPI and finalises it at exit.
        stall_shutdown_seconds: end the job when ranks wait this long for a rank that
            stopped submitting tensors (Horovod's stall shutdown; see `stall_settings`) and
            time `hvdtrain.WatchdogCallback` by it; by default
            HVDTRAIN_STALL_SHUTDOWN_SECONDS, else 300; 0 turns both off. The HOROVOD_STALL_*
            variables, when set, win. Also prints `hvdtrain: rank R failed: ...` after an
            uncaught exception's traceback.
        exchanges_rarely: the ranks meet every few steps only (`hvdtrain.fit`'s `--sync
            local` and `diloco`: its exchange strategy says so), and Horovod's cycle is
            longer (`hvdtrain.runtime.tuning.EXCHANGE_CYCLE_TIME_MS`); on a CPU-only host each rank
            is then bound to its share of the cores (`hvdtrain.runtime.tuning.cores_for_rank`).
        deterministic: the same sums in every run (`--deterministic`): Horovod's tensor
            fusion off (`hvdtrain.runtime.tuning.horovod_settings`).

    Returns:
        The GPU index used, or None on a CPU-only host.
    """
    report_uncaught()  # a user mistake prints one line, not a traceback
    streams.whole_lines()  # mpirun tags pieces of lines: see there
    orphan.watch()  # a rank whose launcher was killed ends within a second: see there
    compat.require_keras2()  # Horovod needs Keras 2: a clear error before anything starts
    compat.horovod_as_graph_code()  # a faster first step: see there
    problem = gloo_hostname_problem(os.environ)
    if problem:  # before hvd.init(), where Gloo would crash without a word
        raise HvdtrainError(problem)
    os.environ.update(stall_settings(os.environ, stall_shutdown_seconds))  # before hvd.init()
    settings = tuning.horovod_settings(os.environ, exchanges_rarely, deterministic)
    os.environ.update(settings)  # cycle time, MPI waits; see there
    before = tuning.thread_ids()
    waiting = _waiting_for_the_others(10 * stall.stall_shutdown_seconds(os.environ))
    try:
        hvd.init(comm=comm)
    finally:
        if waiting:
            waiting.cancel()
    horovod_threads = tuning.thread_ids() - before  # its background thread (and MPI's/Gloo's)
    horovod_up(hvd.rank(), watchdog.last_activity)  # the hook of uncaught errors names the rank
    logs.keras_set_up_on_rank0(hvd.rank())
    if comm is not None and not hvd.mpi_enabled():  # Gloo ignores `comm`: all ranks join
        raise HvdtrainError(
            f"Invalid value for `comm`: received {kind_of(comm)} while Horovod runs on "
            "Gloo, which ignores it; expected None. Launch with `mpirun` or `horovodrun --mpi` "
            "to train on a communicator."
        )
    cpus = os.cpu_count() or 1
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    gpus = tf.config.list_physical_devices("GPU")  # does not start TensorFlow's runtime
    global _bound  # kept from an earlier `init` of this process, which bound it
    if allowed is not None:
        cores = tuning.cores_for_rank(
            os.environ, allowed, cpus, hvd.local_rank(), hvd.local_size(),
            default=exchanges_rarely and not gpus,
        )  # fmt: skip
        if cores and tuning.bind(tuning.thread_ids(), cores):  # see hvdtrain.runtime.tuning
            allowed, _bound = cores, sorted(cores)
    n = threads or threads_per_rank(cpus, hvd.local_size(), len(allowed) if allowed else None)
    global _initialised
    try:
        tf.config.threading.set_intra_op_parallelism_threads(n)
        tf.config.threading.set_inter_op_parallelism_threads(min(2, n))
    except RuntimeError:  # TensorFlow already started: a second init in one process, or
        if not _initialised:  # something made before the first (local SGD ran 1.5x slower)
            logs.get_logger(hvd.rank()).warning(  # rank 0 alone: every rank would say it
                "TensorFlow started before hvdtrain.init() (a model, a variable or a tensor "
                "made first): its threads stay at its defaults (every core, on every rank) "
                "instead of %d per rank, which slows training on CPUs; call hvdtrain.init() "
                "before anything of TensorFlow's",
                n,
            )
    _initialised = True
    policy = tuning.background_policy(os.environ, bool(gpus))
    if policy != "normal":
        tuning.set_policy(horovod_threads, policy)  # see hvdtrain.runtime.tuning
    global _pinned
    _pinned = None
    if not pin_gpu:
        return None
    index = gpu_for_local_rank(hvd.local_rank(), len(gpus), hvd.local_size())
    if index is not None:
        try:
            tf.config.experimental.set_memory_growth(gpus[index], True)
            tf.config.set_visible_devices(gpus[index], "GPU")
        except RuntimeError:
            pass
    _pinned = index
    return index


def _waiting_for_the_others(seconds):
    """A started timer that ends this rank (one line, exit 124) if `hvd.init()` has not
    returned after `seconds` (10 stall times, as the watchdog's long phases), or None for
    0: a rank that never reaches it (stopped, or stuck before it, importing TensorFlow
    from a hung file system) kept the others waiting in it forever under MPI."""
    if not seconds:
        return None

    def end():
        line = (
            f"hvdtrain: rank {env_rank()} waited {seconds:g} s in hvd.init() for the other "
            "ranks (one never reached it: stopped, or stuck before it); ending"
        )
        note_ending(line + "\n")
        write_line(line)
        os._exit(124)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()
    return timer


def is_main_process():
    """True on rank 0: the one process that logs, prints progress and writes files."""
    if not hvd.is_initialized():
        raise HvdtrainError(
            "is_main_process() needs the job's ranks: call hvdtrain.init() first (it calls "
            "hvd.init() and pins the GPU)"
        )
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
        watchdog.doing(
            "done with a set-up step, waiting for the other ranks to finish it",
            watchdog.OTHER_RANKS_SETUP,
        )
        if root_only:
            message = hvd.broadcast_object(message, root_rank=0, name="hvdtrain.agree")
        else:
            messages = hvd.allgather_object(message, name="hvdtrain.agree")
            failed = [(r, m) for r, m in enumerate(messages) if m]
            if failed and len({m for _, m in failed}) == 1 and len(failed) == hvd.size():
                message = failed[0][1]
            elif failed:
                message = "; ".join(f"rank {r}: {m.rstrip('.')}" for r, m in failed) + "."
    if message:
        raise HvdtrainError(message)
    return result


def weights_digest(model):
    """A SHA-256 of the model's weights, to compare ranks bit for bit."""
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


def bound_cores():
    """The cores `init` bound this rank's threads to (sorted), or None where it left them."""
    return _bound


def rank_report(model=None, **figures):
    """One entry per rank (rank, local rank, host, pid, the GPU `init` pinned or None, the
    cores it bound the rank to or None, weights digest, and this rank's own `figures`),
    gathered on all ranks."""
    mine = {
        "rank": hvd.rank(),
        "local_rank": hvd.local_rank(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "gpu": _pinned,
        "cores": _bound,
        **figures,
    }
    if model is not None:
        mine["weights_digest"] = weights_digest(model)
    if hvd.size() == 1:
        return [mine]
    return hvd.allgather_object(mine, name="hvdtrain.rank_report")
