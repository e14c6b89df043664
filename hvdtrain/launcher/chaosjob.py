"""A chaos run's jobs: the user's command as chaos runs it (its own checkpoint folder and
metrics JSON), hvdtrain-run's command line for it, and the running job, whose processes on
every host carry its marker (`faults.MARKER`). `hvdtrain.launcher.chaos` and
`hvdtrain.launcher.chaoselastic` run them. No TensorFlow here."""

import json
import signal
import subprocess
import time
import uuid

from hvdtrain.launcher.faults import MARKER, job_processes
from hvdtrain.launcher.hostfaults import HostUnreachable
from hvdtrain.runtime import processes

__all__ = ["TRACEBACK", "Job", "job_command", "launch_command", "read_metrics", "digest"]

TRACEBACK = "Traceback (most recent call last)"  # in a job's output: a traceback printed


def _flag_value(argv, flag):
    """The index of `flag`'s value in `argv` (`--flag V` or `--flag=V`), or None."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return i + 1
        if arg.startswith(flag + "="):
            return i
    return None


def job_command(command, checkpoint_dir, metrics_json, flags=("--deterministic",)):
    """The user's `command` with this run's `--checkpoint-dir` and `--metrics-json` (in
    place of theirs, if given) and the `flags` where missing (pure)."""
    argv = list(command)
    for flag, value in (("--checkpoint-dir", checkpoint_dir), ("--metrics-json", metrics_json)):
        i = _flag_value(argv, flag)
        if i is None:
            argv += [flag, value]
        elif argv[i].startswith(flag + "="):
            argv[i] = f"{flag}={value}"
        else:
            argv[i] = value
    argv += [flag for flag in flags if flag not in argv]
    return argv


def launch_command(python, np, backend, command, launch=()):
    """hvdtrain-run's command line for `command`, with its options `launch` (the hosts,
    the interface, ssh's) (pure)."""
    argv = [python, "-m", "hvdtrain.launcher.cli", "-q", "-np", str(np), *launch]
    if backend:
        argv += ["--backend", backend]
    return [*argv, "--", *command]


class Job:
    """One run of the command under hvdtrain-run, its output in `log`."""

    instances = []  # every job of this process: ended with chaos itself (`run`)

    def __init__(self, argv, env, log, hosts=None):
        Job.instances.append(self)
        self.marker = uuid.uuid4().hex
        self.log = log
        self.hosts = hosts  # `Hosts`: the job's other hosts, or None
        self.started = time.monotonic()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                argv,
                env={**env, MARKER: self.marker},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def ended(self):
        if self.proc.poll() is None or job_processes(self.marker):
            return False
        return not (self.hosts and self.hosts.running(self.marker))

    def wait_end(self, deadline):
        """Waits until every process of the job, on every host, ended or `deadline`
        (monotonic); returns the processes it then ended with SIGKILL (left behind)."""
        while time.monotonic() < deadline:
            if self.ended():
                return 0
            time.sleep(0.1 if self.hosts is None else 0.5)
        left = job_processes(self.marker)
        processes.send_all(left, signal.SIGKILL)
        left = len(left)
        for host in self.hosts.running(self.marker) if self.hosts else ():
            try:
                left += len(self.hosts.send(self.marker, host, "KILL"))
            except HostUnreachable:
                pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        gone = time.monotonic() + 10  # (a SIGKILL is delivered when the process next runs)
        while job_processes(self.marker) and time.monotonic() < gone:
            time.sleep(0.05)
        return left

    def output(self):
        with open(self.log, errors="replace") as f:
            return f.read()


def read_metrics(metrics_json):
    """The run's metrics JSON (a dict), or None where it is missing or unreadable."""
    try:
        with open(metrics_json) as f:
            out = json.load(f)
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def digest(metrics_json):
    """Rank 0's final weights digest from the run's metrics JSON, or None."""
    try:
        return read_metrics(metrics_json)["ranks"][0]["weights_digest"]
    except (KeyError, IndexError, TypeError):
        return None
