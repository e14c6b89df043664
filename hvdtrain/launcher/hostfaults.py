"""The chaos run's hands on the other hosts of a hostfile: the job's processes on a host
found and signalled through the ssh that the launch uses, by this module run there
(`python -m hvdtrain.launcher.hostfaults MARKER [--rank R] [--send SIGNAL]`, or
`--qdisc NIC SPEC...` and `--cut NIC SECONDS MOST` for its link), so that a
fault strikes a rank wherever it runs and `kill-host` strikes every process of the job on
one host at once.

    hosts = Hosts(["10.0.0.2"], python, ssh_port=None, ssh_identity_file=None)
    hosts.find(marker, rank=1)                 # ("10.0.0.2", [{"pid": ..., "rank": 1}]) or None
    hosts.send(marker, "10.0.0.2", "KILL")     # every process of the job there; what it hit
    hosts.running(marker)                      # {host: count} of the job's processes left
    hosts.qdisc("10.0.0.2", "eth0", ["tbf", "rate", "10mbit", ...])   # its link slowed
    hosts.qdisc("10.0.0.2", "eth0")            # back to the kernel's default
    hosts.cut("10.0.0.2", "eth0", 9, marker, 300)  # its link down until the job's ranks
                                               # there end (at most 300 s), then 9 s more
    hosts.wait_back(marker, "10.0.0.2", deadline)   # it answers again, nothing of the job left
    hosts.hostname("10.0.0.2")                 # its own name ("node2"), or None
    Ranks(hosts).where(marker, 1, proc)        # (host, None) or (None, a process here)

A host's processes are those in the network namespace of the ssh session there: on
separate machines all of that host's; on namespace test hosts (`hvdtrain.bench.netns`),
which share one table of processes, that host's only (`faults.job_processes` keeps to this
one's the same way). No TensorFlow here.
"""

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

from hvdtrain.launcher.doctor import ssh_argv
from hvdtrain.launcher.faults import LINK_KINDS, MARKER, job_processes, rank_pid, ranks_running
from hvdtrain.launcher.hosts import (
    is_local,
    parse_hosts_arg,
    read_hostfile,
    this_host_names,
    total_slots,
)
from hvdtrain.runtime import processes

__all__ = ["Hosts", "HostUnreachable", "Ranks", "cannot", "job_hosts", "main"]

_PREFIX = "@@hostfaults "


class HostUnreachable(RuntimeError):
    """ssh to a host of the job failed, or its answer could not be read."""


class Hosts:
    """The other hosts of the job (names as the hostfile gives them), reached with `python`
    over `ssh -o BatchMode=yes [-p P] [-i F]`."""

    def __init__(self, names, python, ssh_port=None, ssh_identity_file=None, timeout=30):
        self.names = list(names)
        self.python = python
        self.ssh = (ssh_port, ssh_identity_file)
        self.timeout = timeout

    def _ask(self, host, marker="", rank=None, send=None, qdisc=None, cut=None):
        remote = [self.python, "-m", "hvdtrain.launcher.hostfaults", marker]
        if rank is not None:
            remote += ["--rank", str(rank)]
        if send:
            remote += ["--send", send]
        if qdisc:
            remote += ["--qdisc", *qdisc]
        if cut:
            remote += ["--cut", *cut]
        argv = [*ssh_argv(host, *self.ssh), shlex.join(remote)]
        try:
            done = subprocess.run(argv, capture_output=True, text=True,
                                  timeout=self.timeout, stdin=subprocess.DEVNULL)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise HostUnreachable(f"{host}: ssh did not answer within {self.timeout} s") from None
        for line in reversed(done.stdout.splitlines()):
            if line.startswith(_PREFIX):
                return json.loads(line[len(_PREFIX) :])
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        raise HostUnreachable(f"{host}: exit {done.returncode}: {tail}")

    def find(self, marker, rank):
        """(host, [its processes]) of the job's rank `rank`, or None where no host has it."""
        for host in self.names:
            found = self._ask(host, marker, rank=rank)
            if found:
                return host, found
        return None

    def send(self, marker, host, name, rank=None):
        """SIG`name` to the job's processes on `host` (only rank `rank`'s, if given): the
        processes it was sent to."""
        return self._ask(host, marker, rank=rank, send=name)

    def qdisc(self, host, nic, spec=()):
        """`host`'s link `nic` given the root qdisc `spec` (`tc qdisc replace dev NIC root
        SPEC`: where its packets leave), or its own qdisc deleted (the kernel's default
        back) without one: None, or why it could not."""
        return self._ask(host, qdisc=[nic, *spec])

    def cut(self, host, nic, seconds=0.0, marker="", most=0.0):
        """`host`'s link `nic` set down in a second, by a process left there (ssh cannot
        reach a host cut off), until the ranks of the job `marker` there have ended (their
        watchdog ends them) or `most` seconds, then for `seconds` more, then up again;
        without `seconds` only the right to do so tried (`ip link set NIC up`): None, or
        why it could not."""
        return self._ask(host, marker, cut=[nic, f"{seconds:g}", f"{most:g}"])

    def wait_back(self, marker, host, deadline):
        """Waits until `host` answers ssh again with nothing of the job left there (what
        waited for a peer that is gone ends once the network is back), or `deadline`
        (monotonic); then ends what is left: (the processes left, whether it answered)."""
        while time.monotonic() < deadline:
            try:
                if not self._ask(host, marker):
                    return 0, True
            except HostUnreachable:
                pass
            time.sleep(1)
        try:
            return len(self.send(marker, host, "KILL")), True
        except HostUnreachable:
            return 0, False

    def hostname(self, host):
        """`host`'s own name (Open MPI's banners name hosts so), or None."""
        argv = [*ssh_argv(host, *self.ssh), "hostname"]
        try:
            done = subprocess.run(argv, capture_output=True, text=True,
                                  timeout=self.timeout, stdin=subprocess.DEVNULL)  # fmt: skip
        except subprocess.TimeoutExpired:
            return None
        return (done.stdout.strip() or None) if done.returncode == 0 else None

    def running(self, marker, unreachable_ok=True):
        """{host: the count of the job's processes there} for the hosts that have any. A
        host ssh cannot reach counts none where `unreachable_ok` (a host that lost its
        network: its processes are the job's end to time, not this count's)."""
        out = {}
        for host in self.names:
            try:
                count = len(self._ask(host, marker))
            except HostUnreachable:
                if not unreachable_ok:
                    raise
                count = 0
            if count:
                out[host] = count
        return out


class Ranks:
    """Where each rank of a job runs, on this host or on one of `hosts` (a `Hosts`, or
    None), and a signal sent to it there. `proc`: the job's launcher (a `subprocess.Popen`),
    whose end ends every wait."""

    def __init__(self, hosts):
        self.hosts = hosts
        self.placed = None  # {rank: the other host that runs it}: `place`

    def place(self, marker, np):
        """Learns which of the other hosts runs each of the `np` ranks of a running job
        (hvdtrain-run places the ranks on the hosts in the same order each time): a fault
        on a rank there then costs one ssh at its moment, not one a host."""
        self.placed = {}
        for rank in range(np):
            found = None if rank_pid(marker, rank) else self.hosts.find(marker, rank)
            if found:
                self.placed[rank] = found[0]

    def where(self, marker, rank, proc):
        """Where the rank's process runs, waiting for it to start (up to the end of the
        job): (None, its `processes.Recorded`) on this host, (host, None) on another of the
        job's, or None."""
        if rank in (self.placed or ()):
            return self.placed[rank], None
        while proc.poll() is None:
            process = rank_pid(marker, rank)
            if process:
                return None, process
            found = self.hosts.find(marker, rank) if self.hosts else None
            if found:
                return found[0], None
            time.sleep(0.1)
        return None

    def strike(self, marker, target, rank, name, proc):
        """SIG`name` to the rank at `target` (`where`'s), or to every process of the job on
        its host where `rank` is None; True when sent."""
        host, process = target
        if host is None:
            return processes.send(process, getattr(signal, "SIG" + name))
        while proc.poll() is None:  # (in the start-up: once the rank has started)
            if self.hosts.send(marker, host, name, rank=rank):
                return True
            time.sleep(0.1)
        return False


def _here(marker, rank=None, send=None):
    """What this host has of the job `marker` (rank `rank`'s Python process only, if
    given), signalled with SIG`send` if given: [{"pid", "rank"}] of those found (sent)."""
    if rank is not None:
        found = [p for p in [rank_pid(marker, rank)] if p]
    else:
        found = list(job_processes(marker))
    if send:
        signum = getattr(signal, "SIG" + send)
        found = [p for p in found if processes.send(p, signum)]
    return [{"pid": p.pid, "rank": rank} for p in found]


def cannot(kind, hosts, nic):
    """Why a fault of `kind` (of `HOST_KINDS`) cannot be injected, or None."""
    if hosts is None:
        return "the job has no host other than this one (give -H or --hostfile)"
    if (kind in LINK_KINDS or kind == "cut-host") and not nic:
        return "it needs --network-interface (the hosts' link to slow or cut)"
    if kind == "cut-host":
        try:
            why = hosts.cut(hosts.names[0], nic)
        except HostUnreachable as e:
            return str(e)
        return f"on {hosts.names[0]}: {why} (it needs root there)" if why else None
    if kind in LINK_KINDS:  # tried: the qdisc given, then deleted at once
        try:
            why = hosts.qdisc(hosts.names[0], nic, LINK_KINDS[kind])
            hosts.qdisc(hosts.names[0], nic)
        except HostUnreachable as e:
            return str(e)
        if why and kind == "lossy-link" and "unknown" in why:
            return f"on {hosts.names[0]}: {why} (the kernel there has no netem)"
        return f"on {hosts.names[0]}: {why} (it needs root there)" if why else None
    return None


def job_hosts(args):
    """The job's hosts other than this one as `Hosts` (None where there are none), from
    `-H` or `--hostfile`; sets `args.launch` (hvdtrain-run's options for the hosts), `args.np`
    (default: the hosts' slots, else 2) and `args.here` (this host's name in the records)."""
    listed = None
    if args.hosts:
        listed = parse_hosts_arg(args.hosts)
    elif args.hostfile:
        listed = read_hostfile(args.hostfile)
    args.launch = []
    for flag, value in (("-H", args.hosts), ("--hostfile", args.hostfile),
                        ("--network-interface", args.network_interface),
                        ("--ssh-port", args.ssh_port),
                        ("--ssh-identity-file", args.ssh_identity_file)):  # fmt: skip
        if value is not None:
            args.launch += [flag, str(value)]
    args.np = args.np or (total_slots(listed) if listed else 2)
    own = this_host_names(addresses=True)
    args.here = next((h.name for h in listed or () if is_local(h.name, own)), own[0])
    others = [h.name for h in listed or () if not is_local(h.name, own)]
    if not others:
        return None
    return Hosts(others, sys.executable, args.ssh_port, args.ssh_identity_file)


def _sbin(program):
    # (an ssh session's PATH often leaves out the sbin folders where ip and tc live)
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    return shutil.which(program, path=path) or program


def _cut(marker, nic, seconds, most):
    """This host's link `nic` cut (`_hold`) by a process of its own, since the ssh that
    asked is cut too; with no `seconds`, `ip link set NIC up` only tried (a no-op that
    needs the same right): None, or why it could not."""
    try:
        done = subprocess.run([_sbin("ip"), "link", "set", nic, "up"], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
    except OSError as e:
        return f"cannot run ip: {e.strerror or e}"
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return f"`ip link set {nic} up` failed: {tail}"
    if seconds > 0:
        argv = [sys.executable, "-m", "hvdtrain.launcher.hostfaults", marker,
                "--hold", nic, f"{seconds:g}", f"{most:g}"]  # fmt: skip
        subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return None


def _hold(marker, nic, seconds, most):
    """The link `nic` down a second from now (the ssh that asked has ended by then) until
    no rank of the job `marker` runs here or `most` seconds, then `seconds` more; then up,
    whatever happened."""
    ip = _sbin("ip")
    time.sleep(1)
    subprocess.run([ip, "link", "set", nic, "down"], capture_output=True, timeout=30)
    try:
        end = time.monotonic() + most
        while time.monotonic() < end and ranks_running(marker):
            time.sleep(0.5)
        time.sleep(seconds)
    finally:
        subprocess.run([ip, "link", "set", nic, "up"], capture_output=True, timeout=30)


def _qdisc(nic, spec):
    """This host's link `nic` given the root qdisc `spec`, or its own deleted without one:
    None, or why it could not."""
    tc = _sbin("tc")
    if spec:
        argv = [tc, "qdisc", "replace", "dev", nic, "root", *spec]
    else:
        argv = [tc, "qdisc", "del", "dev", nic, "root"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except OSError as e:
        return f"cannot run tc: {e.strerror or e}"
    if done.returncode and spec:  # (`del` where none was given fails too: nothing to undo)
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return f"`tc qdisc replace dev {nic} root {spec[0]} ...` failed: {tail}"
    return None


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m hvdtrain.launcher.hostfaults")
    p.add_argument("marker", help=f"the job's {MARKER}")
    p.add_argument("--rank", type=int)
    p.add_argument("--send", choices=("KILL", "TERM", "STOP", "CONT"))
    p.add_argument("--qdisc", nargs=argparse.REMAINDER, metavar="NIC [SPEC]")
    p.add_argument("--cut", nargs=3, metavar=("NIC", "SECONDS", "MOST"))
    p.add_argument("--hold", nargs=3, metavar=("NIC", "SECONDS", "MOST"))
    args = p.parse_args(argv)
    if args.hold:
        return _hold(args.marker, args.hold[0], float(args.hold[1]), float(args.hold[2]))
    if args.cut:
        answer = _cut(args.marker, args.cut[0], float(args.cut[1]), float(args.cut[2]))
    elif args.qdisc:
        answer = _qdisc(args.qdisc[0], args.qdisc[1:])
    else:
        answer = _here(args.marker, args.rank, args.send)
    print(_PREFIX + json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
