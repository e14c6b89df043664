"""Performance defaults of a rank's process; none of them changes the training math. Each is
measured by `python -m hvdtrain.bench`, its figures on docs/performance.md ("Tuning").

- `compile_options`: `steps_per_execution` for `model.compile` (16): Keras runs that many
  steps inside one `tf.function` call instead of returning to Python after every step (the
  same updates). Batch callbacks then run once per call; 16 keeps a watchdog's beat frequent.
- `horovod_settings`: variables `hvdtrain.init` sets before `hvd.init()`, where the user has
  not: HOROVOD_CYCLE_TIME=0.1 ms when a launcher started more than one rank (a step waits for
  Horovod's next cycle after its last gradient), 1 ms under `--sync local/diloco`, whose
  ranks meet every H steps only, and for a single process; OMPI_MCA_mpi_yield_when_idle=1
  (an MPI wait yields the core instead of spinning on it); Open MPI's `ofi` BTL left out
  (its deadlock in `MPI_Init`: see `horovod_settings`).
- `background_policy` and `set_policy`: on CPU-only hosts the threads Horovod started are
  scheduled SCHED_BATCH, so they no longer preempt the rank's compute at every wake-up (not
  SCHED_IDLE, which starves under load; GPU hosts keep normal scheduling).
- `cores_for_rank`: where nothing bound the ranks to cores, each rank's threads are bound to
  its own share of the host's cores, as `mpirun` binds ranks; by default under `--sync
  local/diloco` on CPU-only hosts, whose ranks compute on their own between exchanges.

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
# Under `--sync local/diloco` the ranks meet every H steps only: a polling thread between
# exchanges costs the steps (docs/performance.md, "Exchanging less": its table by cycle).
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


def horovod_settings(environ, exchanges_rarely=False, deterministic=False):
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
    `pml ob1`; TCP and shared memory, what the launchers' `pml ob1` uses, are kept.

    With `deterministic` (`--deterministic`), no tensor fusion (HOROVOD_FUSION_THRESHOLD=0):
    which tensors one fused allreduce holds depends on when each was ready, so the ring's
    chunks, and with three ranks or more the order of each sum, moved from run to run (3
    namespace hosts under Gloo, 2026-12-06: two uninterrupted runs, two digests; without
    fusion, one, and a resume gave it too). Not in an elastic job: Horovod 0.28.1 crashes
    there (SIGSEGV in `hvd.init`) when it re-forms the job after a lost worker with fusion
    off (2 namespace hosts, 2026-12-06: every try, with HOROVOD_FUSION_THRESHOLD 0 or 1;
    none with fusion on), and a re-formed job does not repeat bit for bit anyway."""
    out = {}
    elastic = environ.get("HOROVOD_ELASTIC") == "1"
    if deterministic and not elastic and "HOROVOD_FUSION_THRESHOLD" not in environ:
        out["HOROVOD_FUSION_THRESHOLD"] = "0"
    if elastic and "HOROVOD_CACHE_CAPACITY" not in environ:
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
