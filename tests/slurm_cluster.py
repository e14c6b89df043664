"""A real single-node SLURM for tests: munge + slurmctld + slurmd, configured in a temp dir.

    with SlurmCluster(workdir, cpus=2) as slurm:
        job = slurm.sbatch(["launch/hvdtrain.sbatch", "--epochs", "1"], "--ntasks=2")
        slurm.wait(job, timeout=300)

Everything (key, sockets, state, logs) lives in `workdir`; the daemons run in the
foreground as children of the test and are stopped on exit, also after a failure.
"""

import os
import re
import shutil
import socket
import subprocess
import time

SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol")


def cannot_run_slurm():
    """Why SLURM cannot run here, or None if it can."""
    if os.geteuid() != 0:
        return "the test SLURM runs its daemons as root"
    missing = [t for t in SLURM_TOOLS if not shutil.which(t)]
    if missing:
        return (
            f"SLURM/munge not installed (missing {', '.join(missing)}); "
            "run: apt-get install slurm-wlm munge"
        )
    return None


class SlurmCluster:
    def __init__(self, workdir, cpus=2):
        self.dir = str(workdir)
        self.cpus = cpus
        self.node = socket.gethostname()
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self._daemons = []

    def __enter__(self):
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def _start(self):
        d = self.dir
        for sub in ("state", "spool", "munge"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        os.chmod(os.path.join(d, "munge"), 0o700)
        key = os.path.join(d, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = os.path.join(d, "munge", "munge.socket")
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--pid-file={d}/munge/munged.pid",
                f"--log-file={d}/munge/munged.log",
                f"--seed-file={d}/munge/munged.seed",
            ],
        )
        self._wait_for(lambda: os.path.exists(sock), "munged's socket")
        with open(self.conf, "w") as f:
            f.write(f"""\
ClusterName=hvdtest
SlurmctldHost={self.node}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
NodeName={self.node} CPUs={self.cpus} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        self._spawn("slurmd", ["slurmd", "-D", "-f", self.conf])
        self._wait_for(self._node_idle, "the SLURM node to be idle", timeout=60)

    def _spawn(self, name, argv):
        log = open(os.path.join(self.dir, f"{name}.out"), "w")  # noqa: SIM115
        self._daemons.append(
            subprocess.Popen(
                argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )

    def _wait_for(self, ready, what, timeout=30):
        deadline = time.monotonic() + timeout
        while not ready():
            for p in self._daemons:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited {p.returncode}; logs in {self.dir}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}; logs in {self.dir}")
            time.sleep(0.2)  # polling a daemon's state, bounded by the deadline

    def _node_idle(self):
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True, timeout=10
        )
        return out.returncode == 0 and out.stdout.strip() == "idle"

    # -- use ----------------------------------------------------------------------------
    def sbatch(self, script_and_args, *options, cwd):
        out = subprocess.run(
            ["sbatch", "--parsable", *options, *script_and_args],
            env=self.env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return out.stdout.strip().split(";")[0]

    def wait(self, job, timeout):
        """Waits for `job` to end; returns its final state (COMPLETED, FAILED, ...)."""
        state = {}

        def ended():
            out = subprocess.run(
                ["scontrol", "show", "job", job],
                env=self.env,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            m = re.search(r"JobState=(\S+).*?ExitCode=(\S+)", out, re.S)
            if m:
                state["state"], state["exit"] = m.groups()
            return m is not None and m.group(1) not in (
                "PENDING",
                "RUNNING",
                "CONFIGURING",
                "COMPLETING",
            )

        self._wait_for(ended, f"job {job}", timeout=timeout)
        return state

    # -- tear-down ----------------------------------------------------------------------
    def close(self):
        for p in reversed(self._daemons):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=15)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
