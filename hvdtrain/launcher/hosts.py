"""Hosts and slots: `-H node1:4,node2:4`, hostfiles in every common dialect, localhost.

A slot is one process (one rank, one GPU). The same hosts in each form::

    hvdtrain-run -H node1:4,node2:4 -- python -m hvdtrain.mnist
    hvdtrain-run --hostfile hosts.txt -- python -m hvdtrain.mnist

where `hosts.txt` may mix the dialects of the common launchers (see `launch/hosts.example`)::

    # Open MPI, DeepSpeed, horovodrun          # MPICH, Intel MPI      # one slot
    node1 slots=4                              node3:4                 node5
    node2 slots=4 max_slots=8   # a comment

Every mistake is one `HvdtrainError` naming the file and line (`hosts.txt:3: ...`).
"""

import os
import re
import socket
from typing import NamedTuple

from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.runtime.numbers import decimal

__all__ = [
    "Host",
    "parse_hosts_arg",
    "parse_hostfile_text",
    "read_hostfile",
    "total_slots",
    "format_hosts",
    "local_hosts",
    "is_local",
    "this_host_names",
    "LOCAL_NAMES",
]

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
_HOST = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
_OPENMPI = re.compile(rf"^({_HOST})\s+slots=(\S*)(?:\s+max[_-]slots=(\S*))?$")
_COLON = re.compile(rf"^({_HOST}):(\S*)$")
_BARE = re.compile(rf"^({_HOST})$")
_DIALECTS = "`host slots=N`, `host slots=N max_slots=M`, `host:N` or `host`"
_MAX_HOSTFILE = 1 << 20  # characters: a hostfile of 10,000 hosts is about 200 KiB
# Bounds that catch typos (`-np 100000000000000000000000`) before anything starts: the largest
# Horovod jobs reported ran about 27,000 processes; a host with more than 1,024 processes is
# a mistake too (one per GPU or a few per CPU socket is the rule).
MAX_PROCESSES = 65536
MAX_SLOTS = 1024


class Host(NamedTuple):
    """One host and how many processes (slots) it runs."""

    name: str
    slots: int


def _positive_int(text, most=MAX_SLOTS):
    """The slots `text` writes (`numbers.decimal`: "4", not "+4", "4.0", "²") when from 1
    to `most`, else None."""
    value = decimal(text)
    return value if value is not None and 0 < value <= most else None


def parse_hosts_arg(text, flag="-H"):
    """Parses `node1:4,node2:4` (bare `node3` means 1 slot) into a list of `Host`.

    Raises:
        HvdtrainError: an empty entry, slots that are not a positive integer, or a host
            listed twice, e.g. "Invalid value for `-H`: received 'node1:0'; expected ...".
    """
    example = (
        f"host:slots[,host:slots...] with slots an integer from 1 to {MAX_SLOTS}, "
        f"e.g. {flag} node1:4,node2:4"
    )
    hosts, seen = [], set()
    for item in text.split(","):
        item = item.strip()
        match = _COLON.match(item) or _BARE.match(item)
        slots = _positive_int(match.group(2)) if match and match.re is _COLON else 1
        if not match or slots is None:
            raise invalid_value(flag, text, example)
        name = match.group(1)
        if name in seen:
            raise invalid_value(flag, text, f"each host once (`{name}` is listed twice)")
        seen.add(name)
        hosts.append(Host(name, slots))
    return hosts


def _parse_line(line):
    """`Host` for one hostfile line (comment removed), or raises ValueError with the reason."""
    for pattern in (_OPENMPI, _COLON, _BARE):
        match = pattern.match(line)
        if not match:
            continue
        if pattern is _BARE:
            return Host(match.group(1), 1)
        slots = _positive_int(match.group(2))
        if slots is None:
            raise ValueError(
                f"slots {match.group(2)!r} is not an integer from 1 to {MAX_SLOTS} in {line!r}"
            )
        if pattern is _OPENMPI and match.group(3) is not None:
            if _positive_int(match.group(3)) is None:
                raise ValueError(
                    f"max_slots {match.group(3)!r} is not an integer from 1 to {MAX_SLOTS} "
                    f"in {line!r}"
                )
        return Host(match.group(1), slots)
    raise ValueError(f"cannot read {line!r}; expected {_DIALECTS}")


def parse_hostfile_text(text, filename="hostfile"):
    """Parses a hostfile's text into a list of `Host` (pure; `filename` is for messages).

    Lines are `host slots=N` (optionally `max_slots=M` after it; Open MPI, DeepSpeed,
    horovodrun), `host:N` (MPICH, Intel MPI) or a bare `host` (one slot); `#` starts a
    comment, whole-line or trailing; blank lines are skipped.

    Raises:
        HvdtrainError: "hosts.txt:3: ..." for a line that no dialect reads, slots that are
            not a positive integer, or a host listed twice; "hosts.txt: no hosts ..." when
            the file lists none.
    """
    hosts, first_line = [], {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            host = _parse_line(line)
        except ValueError as e:
            raise HvdtrainError(f"{filename}:{number}: {e}") from None
        if host.name in first_line:
            raise HvdtrainError(
                f"{filename}:{number}: host {host.name!r} is listed twice (first on line "
                f"{first_line[host.name]}); list each host once with all its slots"
            )
        first_line[host.name] = number
        hosts.append(host)
    if not hosts:
        what = "the file is empty" if not text.strip() else "only comments and blank lines"
        raise HvdtrainError(
            f"{filename}: no hosts ({what}); expected lines such as `node1 slots=4` or `node1:4`"
        )
    return hosts


def read_hostfile(path):
    """Reads and parses the hostfile at `path` (see `parse_hostfile_text`).

    Raises:
        HvdtrainError: the file is missing, not a regular file (a FIFO would block, a
            device never end), larger than 1 MiB, not UTF-8 text, or badly written.
    """
    try:
        if not os.path.isfile(path):
            what = "a folder" if os.path.isdir(path) else "missing or not a regular file"
            raise invalid_value("--hostfile", str(path), f"a readable hostfile ({what})")
        with open(path, encoding="utf-8") as f:
            text = f.read(_MAX_HOSTFILE + 1)
        if len(text) > _MAX_HOSTFILE:
            raise HvdtrainError(f"{path}: larger than 1 MiB; expected a hostfile")
    except UnicodeDecodeError:
        raise HvdtrainError(f"{path}: not a text file; expected a hostfile") from None
    except OSError as e:
        raise invalid_value(
            "--hostfile", str(path), f"a readable hostfile ({e.strerror or type(e).__name__})"
        ) from None
    return parse_hostfile_text(text, str(path))


def total_slots(hosts):
    """The number of processes `hosts` can run."""
    return sum(host.slots for host in hosts)


def format_hosts(hosts):
    """`node1:4,node2:4`, the form `horovodrun -H` and `mpirun -H` take."""
    return ",".join(f"{host.name}:{host.slots}" for host in hosts)


def local_hosts(slots):
    """This host alone, with `slots` slots: what runs when no hosts are given."""
    return [Host("localhost", slots)]


def this_host_names(addresses=False):
    """This host's names: its hostname, and its short name; with `addresses`, the addresses
    its hostname resolves to as well (a hostfile may name this host so)."""
    name = socket.gethostname()
    names = [name, name.split(".")[0]]
    if addresses:
        try:
            names += [info[4][0] for info in socket.getaddrinfo(name, None)]
        except OSError:
            pass
    return tuple(dict.fromkeys(names))


def is_local(name, own_names=()):
    """True when `name` is this host: localhost, a loopback address, or one of `own_names`
    (pass `socket.gethostname()` and friends; pure so it tests anywhere)."""
    return name in LOCAL_NAMES or name.startswith("127.") or name in own_names
