"""The faults of `hvdtrain-run chaos` (chaos.py): their kinds, when each strikes, the time
within which the job must end after it, and how each is injected: a signal to a process of
the job (found by the marker in its environment), a damaged checkpoint, a full disk.

    schedule(7, seed=1)              # [Fault(1, "stop-rank", 0.761, 1), ...]
    moment(0.42, checkpoints=5)      # ("after", 1, 0.1): 0.1 of an interval after the 2nd
    promise("stop-rank", stall=20)   # 80: seconds within which every process has ended
    rank_pid(marker, 1)              # rank 1 of the job, a processes.Recorded, or None

Not a failed job's explanation (that is failures.py). No TensorFlow here.
"""

import dataclasses
import os
import random
import subprocess

from hvdtrain.recipe import names
from hvdtrain.runtime import processes
from hvdtrain.runtime.watchdog import OTHER_RANKS, OTHER_RANKS_SETUP

__all__ = [
    "KINDS",
    "HOST_KINDS",
    "LINK_KINDS",
    "MARKER",
    "Fault",
    "schedule",
    "target",
    "moment",
    "anchors",
    "promise",
    "job_processes",
    "rank_pid",
    "complete_checkpoints",
    "checkpoint_order",
    "checkpoint_position",
    "writing_checkpoint",
    "damage_checkpoint",
    "mount_tmpfs",
    "fill_disk",
]

KINDS = (
    "kill-rank",
    "kill-launcher",
    "term-launcher",
    "stop-rank",
    "kill-in-checkpoint",
    "damage-checkpoint",
    "full-disk",
    "kill-host",
    "cut-host",
    "slow-link",
    "lossy-link",
)
# another host's: -H or --hostfile
HOST_KINDS = ("kill-host", "cut-host", "slow-link", "lossy-link")
LINK_KINDS = {  # the root qdisc each gives a host's link, for a drawn time (`LINK_SECONDS`)
    # 10 Mbit/s where its packets leave: a queue of 50 ms, a burst of 64 kB
    "slow-link": ["tbf", "rate", "10mbit", "burst", "64kb", "latency", "50ms"],
    # 2 % of its packets lost, the rest 20 ms late (netem: a kernel may lack it)
    "lossy-link": ["netem", "loss", "2%", "delay", "20ms"],
}
LINK_SECONDS = (5.0, 20.0)  # and a cut's time after the host's ranks ended
BACK_SECONDS = 120  # a cut host back: what waited there for a gone peer ends (TCP's backoff)
MARKER = "HVDTRAIN_CHAOS_JOB"  # in the environment of every process of a job
STALL_SECONDS = 20
GRACE_SECONDS = 10  # HVDTRAIN_LAUNCHER_GRACE_SECONDS for the job (hvdtrain-run's default: 30)
# A cut takes effect seconds after its moment (ssh to the host, the holder's start there and
# its second): it strikes at least this long before the run's last checkpoint (`anchors`).
CUT_LEAD_SECONDS = 6.0
TMPFS_MB = 64  # full-disk: the size of the tmpfs mounted over the checkpoint folder


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault of the schedule: its `kind`, the `fraction` of the attempt's expected
    duration after which it strikes, the `rank` it hits (kinds on a rank) and the `host`
    (kinds on another host: an index into the other hosts of the job) and, for the
    `LINK_KINDS`, the `seconds` they last."""

    index: int
    kind: str
    fraction: float
    rank: int
    host: int = 0
    seconds: float = 0.0


def schedule(faults, seed, kinds=KINDS, np=2, hosts=1):
    """The `faults` faults drawn from `seed` (pure): the `kinds` in turn, in an order,
    moments and ranks (and for a host's kind one of `hosts` other hosts) drawn from the
    seed, so that every kind comes once in each len(kinds) faults drawn; the kinds that a
    run may survive by finishing last: `cut-host`, then the link kinds."""
    rng = random.Random(seed)
    order = []
    while len(order) < faults:
        block = list(kinds)
        rng.shuffle(block)
        order.extend(block)
    # A run survives a slowed link by finishing, and often a cut too (the job ends once its
    # ranks there are gone, or finishes first): those kinds go last, after every fault that
    # the run must resume from, so that a run that finished leaves none of those undone.
    order = sorted(order[:faults], key=lambda kind: (kind in LINK_KINDS, kind == "cut-host"))
    out = []
    for i, kind in enumerate(order):
        fraction = round(rng.random(), 3)
        rank = 0 if kind == "kill-in-checkpoint" else rng.randrange(np)
        host = rng.randrange(max(1, hosts)) if kind in HOST_KINDS else 0
        timed = kind in LINK_KINDS or kind == "cut-host"
        seconds = round(rng.uniform(*LINK_SECONDS), 1) if timed else 0.0
        out.append(Fault(i + 1, kind, fraction, rank, host, seconds))
    return out


def moment(fraction, checkpoints, in_a_write=False):
    """Where a fault of `fraction` strikes in an attempt that has `checkpoints` checkpoints
    of the uninterrupted run still to write (pure): ("start-up", share of the start-up) for
    the first fifth of fractions, else ("after", k, share of an interval): that share of the
    interval between checkpoints after the k-th of them appears, never after the last one
    (the run must have something left to redo). With no such anchor: in the start-up.
    `in_a_write`: the fault waits for a write after its moment, so the anchor is one
    earlier still."""
    anchors = checkpoints - 1 - (1 if in_a_write else 0)
    if fraction < 0.2:
        return "start-up", round(fraction / 0.2, 3)
    if anchors <= 0:
        return "start-up", round((fraction - 0.2) / 0.8, 3)
    position = (fraction - 0.2) / 0.8 * anchors
    k = min(int(position), anchors - 1)
    return "after", k, round(position - k, 3)


def anchors(timeline, resumed_from=None, lead=0.0):
    """The checkpoints of the uninterrupted run (`timeline`: {name: seconds after its start})
    still to write after `resumed_from`, in order, that a fault's moment may follow (pure):
    with `lead`, only those at least `lead` seconds before the last, so that a fault that
    takes effect late still finds the run going (`CUT_LEAD_SECONDS`)."""
    after = checkpoint_order(resumed_from) if resumed_from is not None else None
    out = [n for n in sorted(timeline, key=checkpoint_order)
           if after is None or checkpoint_order(n) > after]  # fmt: skip
    if out and lead:
        last = timeline[out[-1]]
        out = [n for n in out if last - timeline[n] >= lead]
    return out


def promise(
    kind, stall=STALL_SECONDS, grace=GRACE_SECONDS, expected=60.0, phase="training", slow=0.0
):
    """The seconds within which every process of the job has ended after a fault of `kind`
    (pure): a rank's death gives the launcher `grace` (hvdtrain-run then ends it, SIGKILL
    10 s later); a launcher killed outright leaves ranks that end within a second
    (`hvdtrain.runtime.orphan`); a stopped rank or a host cut off leaves the others to their
    watchdog, which ends a rank that waits for the others after twice the `stall` time in
    training, 12 times in the start-up and after training (the others may still be in a
    long phase of their own: `watchdog.OTHER_RANKS_SETUP`), then the launcher's grace (and
    for a cut its 5 s ssh probe); a full disk ends the run at its next checkpoint
    (`expected`: the attempt's expected duration); a link slowed for `slow` seconds lets
    the run finish within its expected time and those seconds. 20 s on top of each for
    start-up and a loaded host."""
    slack = 20
    waits = OTHER_RANKS_SETUP if phase in ("start-up", "after training") else OTHER_RANKS
    waits = waits.timeouts * stall
    return {
        "kill-rank": grace + 10 + slack,
        "kill-launcher": 5 + slack,
        "term-launcher": grace + 10 + slack,
        "stop-rank": waits + grace + 10 + slack,
        "kill-in-checkpoint": grace + 10 + slack,
        "damage-checkpoint": grace + 10 + slack,
        "full-disk": expected + grace + 10 + slack,
        "kill-host": grace + 10 + slack,
        "cut-host": waits + grace + 10 + 5 + slack,
        "slow-link": expected + slow + grace + 10 + slack,
        "lossy-link": expected + slow + grace + 10 + slack,
    }[kind]


# -- processes and folders -----------------------------------------------------------------


def job_processes(marker):
    """{`processes.Recorded`: environment (a dict)} of the living processes of the job
    `marker` (`MARKER` in their environment) on this host: in this process's network
    namespace (namespace test hosts share one table of processes; another host's are
    reached over ssh, `hostfaults`)."""
    found = processes.marked(MARKER, marker).items()
    return {p: env for p, env in found if processes.in_this_network(p.pid)}


_RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def rank_pid(marker, rank):
    """The rank `rank` of the job `marker` (a `processes.Recorded`), or None (not started
    yet)."""
    for process, env in job_processes(marker).items():
        if any(env.get(var) == str(rank) for var in _RANK_VARIABLES) and _is_python(process):
            return process
    return None


def ranks_running(marker):
    """The ranks of the job `marker` whose Python process runs on this host."""
    out = set()
    for process, env in job_processes(marker).items():
        for var in _RANK_VARIABLES:
            if str(env.get(var, "")).isdigit() and _is_python(process):
                out.add(int(env[var]))
    return out


def _is_python(process):
    argv = processes.command_line(process.pid)
    return bool(argv) and os.path.basename(argv[0]).startswith("python")


def complete_checkpoints(folder):
    """The names of the checkpoints in `folder` with a manifest, oldest first."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    done = [n for n in names if n.startswith("epoch-") and "." not in n]
    done = [n for n in done if os.path.isfile(os.path.join(folder, n, "manifest.json"))]
    return sorted(done, key=checkpoint_order)


def checkpoint_order(name):
    """Where checkpoint `name` is in its run, to compare and sort by: not its text, which puts
    `epoch-0002` (the end of epoch 2) before `epoch-0002-step-000004` (`names`)."""
    return (names.position_of(name) if name else None) or (-1, -1)


def checkpoint_position(name):
    """(epoch, step) of a checkpoint's name, (0, 0) for None."""
    if not name:
        return 0, 0
    parts = name.split("-")
    return int(parts[1]), int(parts[3]) if len(parts) > 3 else 0


def writing_checkpoint(folder):
    try:
        return any(n.startswith(".epoch-") and ".tmp" in n for n in os.listdir(folder))
    except OSError:
        return False


def damage_checkpoint(folder, name):
    """Changes one byte in the middle of the biggest state file of checkpoint `name`."""
    path = os.path.join(folder, name)
    files = [os.path.join(path, f) for f in os.listdir(path) if f.startswith("state")]
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as f:
        f.seek(os.path.getsize(target) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([(byte[0] if byte else 0) ^ 0xFF]))


def mount_tmpfs(path, mb):
    """Mounts a tmpfs of `mb` MB at `path`; None when done, else why not (one phrase)."""
    if os.geteuid() != 0:
        return "it needs root to mount a small tmpfs"
    os.makedirs(path, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", path],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"mount failed ({e})"
    if done.returncode:
        return f"mount failed ({(done.stderr or '').strip().splitlines()[-1:] or done.returncode})"
    return None


def fill_disk(folder):
    """Fills the disk of `folder` with a file; returns its path."""
    path = os.path.join(folder, ".chaos-filler")
    block = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError:
            pass
        try:  # the last bytes
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return path


def target(record):
    """What a fault hit: `rank 1` (`rank 1 on HOST` where the job has other hosts), `host
    HOST`, `launcher`, or `-` (a checkpoint, the disk) (pure)."""
    kind = record["kind"]
    if "launcher" in kind:
        return "launcher"
    if kind in HOST_KINDS:
        return f"host {record.get('host')}"
    if "rank" in kind or "stop" in kind:
        on = f" on {record['host']}" if record.get("host") else ""
        return f"rank {record['rank']}{on}"
    return "-"
