"""Performance defaults, each measured by `python -m hvdtrain.bench` (its "Tuning" table);
none of them changes the training math.

- `compile_options`: `steps_per_execution` for `model.compile`. Keras then runs that many
  steps inside one `tf.function` call (a `tf.while_loop`) instead of returning to Python
  after every step; the updates are the same, step for step. It removes Keras' per-step
  Python work (callbacks, the iterator, the function call): on one core the MNIST MLP at
  batch 64 runs 2x faster with 16 steps per call than with 1. Batch callbacks (progress
  bar, TensorBoard's per-batch logs, a watchdog's beat) then run once per call, with the
  index of its last step. 64 steps per call is faster still on the MLP (+15 %), but a
  callback that must see progress (`hvdtrain.WatchdogCallback`, 300 s) would then wait
  64 steps: with slow steps that could be minutes; 16 keeps that short.
- `horovod_settings`: variables `hvdtrain.init` sets before `hvd.init()`, where the user
  has not set them:
  - HOROVOD_CYCLE_TIME=0.1 when a launcher started more than one rank (Horovod: 1 ms).
    Horovod's background thread looks for ready tensors once per cycle, and a step waits
    for the next cycle after its last gradient: a 1 ms cycle costs the MLP about a quarter
    of its throughput at -np 2. A single process keeps Horovod's 1 ms: it has nothing
    to exchange, and polling every 0.1 ms would cost it a quarter of its core.
    Under `--sync local/diloco`, whose ranks meet every H steps only, Horovod's 1 ms.
  - OMPI_MCA_mpi_yield_when_idle=1 (Open MPI: 0 unless oversubscribed): an MPI wait yields
    the core instead of spinning on it. With one core per rank, Horovod's background thread
    waits in MPI for the other ranks at every cycle; spinning took the core from the rank's
    own compute (the MLP at -np 2 runs at half the speed without it).
- `background_policy` and `set_policy`: after `hvd.init()`, on CPU-only hosts, the threads
  Horovod started (its background thread, MPI's and Gloo's helpers) are scheduled
  SCHED_BATCH: they keep their fair share of the core but no longer preempt the rank's
  compute threads each time they wake up (every cycle). Under Gloo the MLP at -np 2 runs
  3x faster with it (about 2.3 against 8 ms per step); under MPI, with the yielding waits,
  it changes little. SCHED_IDLE (run only when the compute waits) measured the same, but
  a SCHED_IDLE thread starves when other processes load the machine, and every allreduce
  would then wait for it. GPU hosts keep normal scheduling (the CPU there feeds the input
  pipeline, which the background thread must not wait behind).
- `cores_for_rank`: after `hvd.init()`, where nothing bound the ranks to cores
  (`horovodrun` and `hvdtrain-run` start them with `--bind-to none`; a process allowed on
  all the host's cores), each rank's threads are bound to its own share of the cores, as
  `mpirun` binds ranks by default. By default only under `--sync local/diloco` on CPU-only
  hosts, whose ranks compute on their own between exchanges: through `hvdtrain.fit`, local
  SGD at H=16 on the MNIST MLP at -np 2 (batch 64) ran at 0.92-0.93 of the ceiling bound
  against 0.68-0.70 unbound under MPI, 0.78-0.90 against 0.65-0.73 under Gloo; the convnet
  (its augmenting input pipeline on the rank's threads) within 3 % either way (2026-11-30,
  two rounds interleaved with the ceiling). HVDTRAIN_CPU_BIND=cores binds in every mode: it pays for
  a small model whose ranks wait on each other every step (the MLP under `--sync step`,
  19,400-23,700 samples/s bound against 15,100-17,200 under Gloo), and costs where a
  rank's own threads share the work while it waits (the main job's convnet ran at 648-749
  samples/s bound against 724-798, 2026-11-29, runs in turn).
  HVDTRAIN_CPU_BIND=none never binds.

The user always wins: variables already set (by hand, `hvdtrain-run --cycle-time-ms`,
`-x`) are kept, HVDTRAIN_HOROVOD_THREAD=idle|batch|normal chooses the scheduling,
HVDTRAIN_CPU_BIND=cores|none the binding, and `compile_options(steps_per_execution=...)`
overrides.
"""

import os

from hvdtrain.errors import invalid_value

__all__ = [
    "STEPS_PER_EXECUTION",
    "CYCLE_TIME_MS",
    "compile_options",
    "launcher_size",
    "horovod_settings",
    "thread_ids",
    "background_policy",
    "set_policy",
    "cores_for_rank",
    "bind_to_cores",
    "bind",
]

STEPS_PER_EXECUTION = 16
CYCLE_TIME_MS = 0.1
# Under `--sync local/diloco` the ranks meet at exchanges only, every H steps: with Horovod's
# thread polling every 0.1 ms in between, local SGD on the MNIST MLP at H=64 ran at 0.75 of
# the ceiling; at 1 ms 0.92 (MPI) and 0.91 (Gloo), at 2 ms 0.87 and 0.88, one round each
# (python -m hvdtrain.bench.floor --sync 16,64 --backends mpi,gloo, 2026-11-28).
EXCHANGE_CYCLE_TIME_MS = 1.0
# The launchers' variables that give the number of ranks before `hvd.init()`.
_SIZE_VARS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS")
_THREAD_ENV = "HVDTRAIN_HOROVOD_THREAD"  # "batch" (default on CPU-only hosts), "idle", "normal"
_POLICIES = {"idle": "SCHED_IDLE", "batch": "SCHED_BATCH", "normal": "SCHED_OTHER"}
_BIND_ENV = "HVDTRAIN_CPU_BIND"  # "cores" or "none"; unset: `cores_for_rank`'s default


def compile_options(steps_per_epoch=None, steps_per_execution=None):
    """Keyword arguments for `model.compile` that make `fit` faster without changing the math.

    Args:
        steps_per_epoch: when given, `steps_per_execution` is at most this (Keras would
            otherwise shorten every execution to the epoch's end anyway).
        steps_per_execution: overrides `STEPS_PER_EXECUTION`; 1 gives Keras' default
            (batch callbacks after every step).

    Example::

        model.compile(opt, loss=..., metrics=[...], **hvdtrain.compile_options(steps))
    """
    spe = STEPS_PER_EXECUTION if steps_per_execution is None else int(steps_per_execution)
    if steps_per_epoch:
        spe = min(spe, int(steps_per_epoch))
    return {"steps_per_execution": max(1, spe)}


def launcher_size(environ):
    """The number of ranks the launcher started (horovodrun, mpirun, srun), or None."""
    for name in _SIZE_VARS:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def horovod_settings(environ, exchanges_rarely=False):
    """The variables `hvdtrain.init` sets before `hvd.init()`, of those missing from
    `environ` (pure; `environ` is only read): the short cycle only when a launcher started
    more than one rank (a single process has nothing to wait for, and the polling would
    cost it up to a quarter of its core), the yielding MPI waits always; under Horovod
    Elastic (HOROVOD_ELASTIC=1) no response cache: Horovod 0.28.1 keeps a worker's cache
    across a reset (`set_capacity` clears it only when the capacity changes), so a worker
    that trained at 2 ranks, then alone, aborts when a worker joins again (gloo
    `pair.cc:510 op.preamble.length <= op.nbytes`). With `exchanges_rarely` (`--sync
    local/diloco`) the cycle is `EXCHANGE_CYCLE_TIME_MS`.

    And Open MPI's `ofi` BTL left out (`OMPI_MCA_btl`: `^ofi`, or `ofi` added to the
    exclusion list the launcher gave, `-mca btl ^openib` from `horovodrun` and
    `hvdtrain-run`; a list that names the BTLs to use is kept). Debian's Open MPI 4.1.4
    can deadlock in `MPI_Init` there: `opal_common_ofi_export_memory_monitor` returns
    without releasing its lock when called a second time, and the next call waits on it
    forever (a 2-rank job under `horovodrun --mpi` hung 26 minutes in `MPI_Init`,
    2026-11-28, the thread waiting on a lock it held). The BTL serves OFI fabrics under
    `pml ob1`; TCP and shared memory, what the launchers' `pml ob1` uses, are kept."""
    out = {}
    if environ.get("HOROVOD_ELASTIC") == "1" and "HOROVOD_CACHE_CAPACITY" not in environ:
        out["HOROVOD_CACHE_CAPACITY"] = "0"
    size = launcher_size(environ)
    if size and size > 1 and "HOROVOD_CYCLE_TIME" not in environ:
        cycle = EXCHANGE_CYCLE_TIME_MS if exchanges_rarely else CYCLE_TIME_MS
        out["HOROVOD_CYCLE_TIME"] = f"{cycle:g}"
    if "OMPI_MCA_mpi_yield_when_idle" not in environ:
        out["OMPI_MCA_mpi_yield_when_idle"] = "1"
    btl = environ.get("OMPI_MCA_btl")
    if btl is None or (btl.startswith("^") and "ofi" not in btl[1:].split(",")):
        out["OMPI_MCA_btl"] = "^ofi" if btl is None else f"{btl},ofi"
    return out


def thread_ids():
    """The ids of this process's threads (Linux; an empty set elsewhere)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def background_policy(environ, has_gpu):
    """ "idle", "batch" or "normal": how Horovod's background threads are scheduled (pure).

    "batch" (Linux SCHED_BATCH) on CPU-only hosts, where those threads share the rank's
    cores with the compute: they then no longer preempt it at every wake-up. "normal" on
    GPU hosts, where the CPU work is the input pipeline and the background thread must
    not wait behind it.
    HVDTRAIN_HOROVOD_THREAD=idle|batch|normal overrides.
    """
    choice = environ.get(_THREAD_ENV, "").strip().lower()
    if not choice:
        return "normal" if has_gpu else "batch"
    if choice not in _POLICIES:
        raise invalid_value(_THREAD_ENV, environ[_THREAD_ENV], "idle, batch or normal")
    return choice


def set_policy(tids, policy):
    """Schedules the threads `tids` with `policy` ("idle": SCHED_IDLE, "batch": SCHED_BATCH,
    "normal": SCHED_OTHER) on Linux; returns those it changed."""
    value = getattr(os, _POLICIES.get(policy, ""), None)
    if value is None or not hasattr(os, "sched_setscheduler"):
        return []
    return _per_thread(tids, lambda tid: os.sched_setscheduler(tid, value, os.sched_param(0)))


def _per_thread(tids, call):
    """`call(tid)` for each of `tids` in order; the tids it succeeded for (a thread that
    ended, or a platform that refuses, is left out)."""
    done = []
    for tid in sorted(tids):
        try:
            call(tid)
            done.append(tid)
        except OSError:
            pass
    return done


def cores_for_rank(environ, allowed, cpu_count, local_rank, local_size, default=False):
    """The cores this rank's threads are bound to, or None to leave them as they are (pure).

    Args:
        environ: read for HVDTRAIN_CPU_BIND ("cores": bind; "none": never; unset: `default`).
        allowed: the cores the process may run on now (`os.sched_getaffinity(0)`).
        cpu_count: the host's cores (`os.cpu_count()`).
        local_rank, local_size: this rank among the host's ranks.
        default: bind where HVDTRAIN_CPU_BIND is unset (`hvdtrain.init` passes True under
            `--sync local/diloco` on a CPU-only host).

    Only where nothing bound the ranks (`allowed` is every core of the host: a launcher or
    a scheduler that binds gives each rank fewer) and each local rank gets at least one
    core: rank r gets the r-th of `local_size` equal runs of `allowed`, in order.
    """
    choice = environ.get(_BIND_ENV, "").strip().lower()
    if choice not in ("", "cores", "none"):
        raise invalid_value(_BIND_ENV, environ[_BIND_ENV], "cores or none")
    if choice == "none" or (choice == "" and not default):
        return None
    share = len(allowed) // max(1, local_size)
    if local_size < 2 or share < 1 or len(allowed) != cpu_count:
        return None
    return bind_to_cores(local_rank, share, allowed)


def bind_to_cores(local_rank, cores_per_rank, available):
    """The cores of `local_rank`: its own `cores_per_rank` of the sorted `available` ones
    (wrapping around when there are more ranks than cores). Pure."""
    cores = sorted(available)
    start = (local_rank * cores_per_rank) % len(cores)
    return {cores[(start + i) % len(cores)] for i in range(min(cores_per_rank, len(cores)))}


def bind(tids, cores):
    """Binds the threads `tids` to `cores` (Linux); returns those it bound. Threads they
    start later inherit the binding."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return []
    return _per_thread(tids, lambda tid: os.sched_setaffinity(tid, cores))
