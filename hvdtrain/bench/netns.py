"""Hosts as Linux network namespaces on one machine, each with its own address, hostname and
sshd, their links shaped or cut at will: what the tests and the benchmarks across hosts run
on (root only).

    with NamespaceHosts(2, workdir) as hosts:
        hosts.shape(100)                     # every host's link at 100 Mbit/s (tbf)
        hosts.run(0, ["horovodrun", "-np", "2", "-H", hosts.hostlist(1), ...])
        hosts.cut(1); hosts.restore(1)       # host 1's network down, then up again

Each host is a network namespace (`ip netns`) joined to a bridge by a veth pair renamed
`eth0` (Horovod needs one interface name on all hosts), a UTS namespace with its own
hostname (Gloo's rendezvous tells hosts apart by name), and an sshd that accepts a key made
for the test. Only the addresses of these namespaces are used. Everything is torn down on
exit, also after a failure.
"""

import os
import shutil
import subprocess
import sys

SUBNET = "10.231.{}.{}"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cannot_make_namespaces():
    """Why this machine cannot host namespace test hosts, or None if it can."""
    if os.geteuid() != 0:
        return "namespace hosts need root (ip netns, veth, sshd)"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"`{tool}` is not installed"
    if not os.path.exists("/usr/sbin/sshd"):
        return "openssh-server (/usr/sbin/sshd) is not installed"
    probe = f"hvdtprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"the machine forbids network namespaces: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _free_tag(first):
    """A tag (20-254) that no `hvdtbr<tag>` bridge and no `hvdt<tag>h<i>` namespace has,
    looking from `first` on."""
    used = set()
    for folder in ("/sys/class/net", "/var/run/netns"):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            digits = name.removeprefix("hvdtbr") if name.startswith("hvdtbr") else ""
            if name.startswith("hvdt") and not digits:
                digits = name[4:].split("h")[0]
            if digits.isdigit():
                used.add(int(digits))
    for k in range(235):
        tag = 20 + (first - 20 + k) % 235
        if tag not in used:
            return tag
    raise RuntimeError("no free subnet tag for namespace hosts (235 sets in use)")


def _sh(*argv, check=True):
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=60)


class NamespaceHosts:
    """`count` hosts in `workdir` (keys, sshd logs). With `pin`, host i's processes run on
    core i (of this process's cores, in turn): each host has a core of its own, as separate
    machines have, rather than every rank believing it has the whole machine."""

    def __init__(self, count, workdir, pin=False):
        # One subnet per set of hosts: a tag no bridge or namespace of this machine uses yet
        # (another test process's hosts, or a benchmark's beside them).
        tag = _free_tag(20 + (os.getpid() % 50) * 4)
        self.count = count
        self.workdir = str(workdir)
        self.bridge = f"hvdtbr{tag}"
        self.names = [f"hvdt{tag}h{i}" for i in range(count)]
        self.hostnames = [f"hvd-host{i}" for i in range(count)]
        self.addresses = [SUBNET.format(tag, i + 1) for i in range(count)]
        self.bin = os.path.join(self.workdir, "bin")
        cores = sorted(os.sched_getaffinity(0))
        self.cores = [cores[i % len(cores)] for i in range(count)] if pin else None
        self._sshd = []

    # -- set-up -------------------------------------------------------------------------
    def __enter__(self):
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _up(self):
        w = self.workdir
        os.makedirs(self.bin, exist_ok=True)
        os.makedirs("/run/sshd", exist_ok=True)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{w}/host_key")
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{w}/id")
        shutil.copy(f"{w}/id.pub", f"{w}/authorized_keys")
        subnet = self.addresses[0].rsplit(".", 1)[0] + ".*"
        with open(f"{w}/ssh_config", "w") as f:
            f.write(
                f"Host {subnet}\n  IdentityFile {w}/id\n  StrictHostKeyChecking no\n"
                "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n"
                "  ConnectTimeout 10\n"
            )
        # horovodrun and mpirun call `ssh` from PATH: this one reads the test's config.
        with open(f"{self.bin}/ssh", "w") as f:
            f.write(f'#!/bin/sh\nexec /usr/bin/ssh -F {w}/ssh_config "$@"\n')
        os.chmod(f"{self.bin}/ssh", 0o755)

        # Each host resolves every host's name (`ip netns exec` mounts /etc/netns/NS/hosts on
        # /etc/hosts): Horovod's Gloo process sets look up the host's own name and crash
        # (SIGSEGV in gloo::transport::tcp::CreateDevice) when it does not resolve.
        names = "".join(f"{a} {n}\n" for a, n in zip(self.addresses, self.hostnames, strict=True))
        for ns in self.names:
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n" + names)
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "link", "set", self.bridge, "up")
        for i, ns in enumerate(self.names):
            veth = f"{ns}v"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{ns}b")
            _sh("ip", "link", "set", f"{ns}b", "master", self.bridge)
            _sh("ip", "link", "set", f"{ns}b", "up")
            _sh("ip", "link", "set", veth, "netns", ns)
            ip = ["ip", "netns", "exec", ns, "ip"]
            _sh(*ip, "link", "set", veth, "name", "eth0")
            _sh(*ip, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _sh(*ip, "link", "set", "eth0", "up")
            _sh(*ip, "link", "set", "lo", "up")
            self._sshd.append(None)
            self.start_sshd(i)
        for i in range(self.count):  # every host reaches every host over ssh
            for j in range(self.count):
                self.run(i, ["ssh", self.addresses[j], "true"], timeout=30, retries=20)

    def start_sshd(self, i, prefix=()):
        """Starts host i's sshd (again, after a test killed the host's processes; the one
        running ended first), its command after `prefix`: `setpriv --bounding-set
        -net_admin --` makes a host whose sessions may not touch its network, as a user
        without root there."""
        if self._sshd[i] is not None and self._sshd[i].poll() is None:
            self._sshd[i].kill()
            self._sshd[i].wait(timeout=30)
        w = self.workdir
        sshd = [
            "/usr/sbin/sshd",
            "-D",
            "-e",
            "-f",
            "/dev/null",
            "-o",
            f"HostKey={w}/host_key",
            "-o",
            f"PidFile={w}/sshd{i}.pid",
            "-o",
            f"AuthorizedKeysFile={w}/authorized_keys",
            "-o",
            "PermitRootLogin=yes",
            "-o",
            "StrictModes=no",
            "-o",
            "UsePAM=no",
            "-o",
            f"ListenAddress={self.addresses[i]}",
            "-o",
            "MaxStartups=100",
            "-o",
            "MaxSessions=100",
            "-o",
            "SetEnv=PATH=" + os.path.dirname(sys.executable) + ":/usr/local/bin:/usr/bin:/bin",
        ]
        log = open(f"{w}/sshd{i}.log", "a")  # noqa: SIM115 (closed with the process)
        self._sshd[i] = subprocess.Popen(
            self.inside(i, [*prefix, *sshd]),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def inside(self, i, argv):
        """argv run inside host i: its network namespace and a UTS namespace of its own name."""
        script = f'hostname {self.hostnames[i]} && exec "$@"'
        if self.cores is not None:  # the host's own core: its sshd's children inherit it
            script = f"taskset -pc {self.cores[i]} $$ >/dev/null && {script}"
        return [
            "ip",
            "netns",
            "exec",
            self.names[i],
            "unshare",
            "--uts",
            "sh",
            "-c",
            script,
            "sh",
            *argv,
        ]

    # -- use ----------------------------------------------------------------------------
    def env(self, **extra):
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([self.bin, os.path.dirname(sys.executable), env["PATH"]])
        env.update(extra)
        return env

    def hostlist(self, slots):
        return ",".join(f"{a}:{slots}" for a in self.addresses)

    def run(self, i, argv, timeout, retries=0, **env):
        """Runs argv on host i (from its namespace); returns the CompletedProcess."""
        for attempt in range(retries + 1):
            proc = subprocess.run(
                self.inside(i, argv),
                env=self.env(**env),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if proc.returncode == 0 or attempt == retries:
                return proc
            # sshd may not listen yet: wait for it to answer, bounded by `retries`.
            subprocess.run(["sleep", "0.2"])
        return proc

    def shape(self, mbit=None, hosts=None):
        """Each host's link (of `hosts`, default all) rate-limited to `mbit` Mbit/s where it
        leaves the host (Linux's `tbf` qdisc on its eth0; so both directions between two
        shaped hosts), or back to full speed with None. The burst and queue are sized to
        the rate: a queue of 50 ms, a burst of at least 64 kB."""
        for i in range(self.count) if hosts is None else hosts:
            ns = ["ip", "netns", "exec", self.names[i], "tc", "qdisc"]
            if mbit is None:
                _sh(*ns, "del", "dev", "eth0", "root", check=False)
                continue
            burst = max(64, int(mbit * 1000 / 8 * 0.004))  # kB: 4 ms at the rate
            _sh(*ns, "replace", "dev", "eth0", "root", "tbf", "rate", f"{mbit}mbit",
                "burst", f"{burst}kb", "latency", "50ms")  # fmt: skip

    def cut(self, i):
        """Host i's network down: its processes live on, their connections go silent."""
        _sh("ip", "netns", "exec", self.names[i], "ip", "link", "set", "eth0", "down")

    def restore(self, i):
        """Host i's network up again (after `cut`)."""
        _sh("ip", "netns", "exec", self.names[i], "ip", "link", "set", "eth0", "up")

    def pids(self, i):
        """The pids of every process in host i's network namespace."""
        out = _sh("ip", "netns", "pids", self.names[i], check=False).stdout
        return [int(pid) for pid in out.split()]

    # -- tear-down ----------------------------------------------------------------------
    def close(self):
        for p in filter(None, self._sshd):
            p.kill()
            p.wait(timeout=30)
        for i, ns in enumerate(self.names):
            for pid in self.pids(i):
                try:
                    os.kill(pid, 9)
                except (ProcessLookupError, ValueError):
                    pass
            # The veth pair goes now: the namespace itself may outlive `del` for minutes
            # (the kernel frees it after its last TCP socket, e.g. one retransmitting to a
            # host whose network a test cut), and the next hosts reuse the names.
            _sh("ip", "link", "del", f"{ns}b", check=False)
            _sh("ip", "netns", "del", ns, check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        _sh("ip", "link", "del", self.bridge, check=False)
