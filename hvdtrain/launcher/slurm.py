"""SLURM allocations: which hosts and how many tasks per host, from the environment alone.

Inside `sbatch` or `salloc`, `hvdtrain-run` needs no host list::

    sbatch launch/hvdtrain.sbatch                   # runs: hvdtrain-run -- python -m hvdtrain.mnist
    salloc -N 2 --ntasks-per-node=4 hvdtrain-run -- python -m hvdtrain.mnist
    hvdtrain-run --backend mpirun -- python -m hvdtrain.mnist   # mpirun over the same hosts

and launches `srun --mpi=pmix -n N ...` (or `mpirun`/`horovodrun` over the allocation's
hosts when asked). The variables read are SLURM_JOB_ID, SLURM_JOB_NODELIST (or the older
SLURM_NODELIST), SLURM_TASKS_PER_NODE (`2(x3),1`), SLURM_NTASKS_PER_NODE and SLURM_NTASKS.
Compressed node lists (`node[01-03,7],gpu5`) are expanded here, without `scontrol`.
"""

import collections
import itertools
import re
from typing import NamedTuple

from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.launcher.hosts import Host
from hvdtrain.runtime.numbers import decimal, whole_number

__all__ = ["Allocation", "detect_allocation", "expand_nodelist", "expand_tasks_per_node"]

MAX_HOSTS = 100_000  # a node list longer than this is a mistake (`n[0-99999999]`), not a job


class Allocation(NamedTuple):
    """A SLURM job's hosts (with their task slots) and its task count."""

    job_id: str
    hosts: list
    ntasks: int


def _split_top_level(text):
    """Splits on the commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested brackets")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("a `]` without its `[`")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("a `[` without its `]`")
    parts.append(text[start:])
    return parts


def _expand_range(item):
    """`01-03` -> ['01', '02', '03'] (keeping the zero padding); `7` -> ['7']."""
    match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", item)
    if not match:
        raise ValueError(f"{item!r} is not a number or a range like 01-03")
    first, last = match.group(1), match.group(2) or match.group(1)
    if int(last) < int(first):
        raise ValueError(f"the range {item!r} runs backwards")
    if int(last) - int(first) >= MAX_HOSTS:
        raise ValueError(f"the range {item!r} names more than {MAX_HOSTS:,} hosts")
    width = len(first) if first.startswith("0") else 0
    return [str(n).zfill(width) for n in range(int(first), int(last) + 1)]


def _expand_one(name):
    """`rack[1-2]-n[01-02]` -> every combination, in order."""
    match = re.search(r"\[([^\]]*)\]", name)
    if not match:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
            raise ValueError(f"{name!r} is not a host name")
        return [name]
    prefix, suffix = name[: match.start()], name[match.end() :]
    numbers = [n for item in match.group(1).split(",") for n in _expand_range(item)]
    return (host for n in numbers for host in _expand_one(prefix + n + suffix))  # lazy


def expand_nodelist(text, name="SLURM_JOB_NODELIST"):
    """Expands a SLURM node list: `node[01-03,7],gpu5` -> node01 node02 node03 node7 gpu5.

    Raises:
        HvdtrainError: unbalanced brackets, bad ranges, empty entries.
    """
    try:
        parts = _split_top_level(text.strip())
        every = (host for part in parts for host in _expand_one(part))
        hosts = list(itertools.islice(every, MAX_HOSTS + 1))
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"more than {MAX_HOSTS:,} hosts")
        twice = next((h for h, n in collections.Counter(hosts).items() if n > 1), None)
        if twice:
            raise ValueError(f"{twice!r} is listed twice")
    except ValueError as e:
        raise invalid_value(
            name, text, f"a SLURM node list such as node[01-03,7],gpu5 ({e})"
        ) from None
    return hosts


def expand_tasks_per_node(text, name="SLURM_TASKS_PER_NODE"):
    """Expands SLURM's task counts: `2(x3),1` -> [2, 2, 2, 1].

    Raises:
        HvdtrainError: anything but `N` and `N(xK)` items separated by commas.
    """
    counts = []
    for item in text.strip().split(","):
        match = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", item.strip())
        repeat = int(match.group(2) or 1) if match else 0
        if not match or int(match.group(1)) < 1 or not 1 <= repeat <= MAX_HOSTS - len(counts):
            raise invalid_value(name, text, "task counts such as 2(x3),1")
        counts += [int(match.group(1))] * repeat
    return counts


def detect_allocation(environ):
    """The SLURM allocation described by `environ` (a mapping), or None outside SLURM.

    Slots per host come from SLURM_TASKS_PER_NODE; failing that, SLURM_NTASKS_PER_NODE on
    every host; failing that, SLURM_NTASKS spread evenly (one per host if it does not divide).
    `ntasks` is SLURM_NTASKS when set, else the sum of the slots.

    Raises:
        HvdtrainError: the variables are present but contradict each other or are malformed.
    """
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job_id or not nodelist:
        return None
    names = expand_nodelist(nodelist)
    ntasks_text = environ.get("SLURM_NTASKS") or environ.get("SLURM_NPROCS")
    ntasks = None if ntasks_text is None else whole_number(ntasks_text, "SLURM_NTASKS")

    if environ.get("SLURM_TASKS_PER_NODE"):
        slots = expand_tasks_per_node(environ["SLURM_TASKS_PER_NODE"])
    elif decimal(environ.get("SLURM_NTASKS_PER_NODE")) is not None:
        slots = [decimal(environ["SLURM_NTASKS_PER_NODE"])] * len(names)
    elif ntasks and ntasks % len(names) == 0:
        slots = [ntasks // len(names)] * len(names)
    else:
        slots = [1] * len(names)
    if len(slots) != len(names):
        raise HvdtrainError(
            f"SLURM_TASKS_PER_NODE={environ['SLURM_TASKS_PER_NODE']!r} gives {len(slots)} task "
            f"counts for the {len(names)} hosts in {nodelist!r}; expected one per host"
        )
    hosts = [Host(name, count) for name, count in zip(names, slots, strict=True)]
    return Allocation(job_id, hosts, ntasks or sum(slots))
