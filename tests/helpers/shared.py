"""Scenarios that share their rank processes: one long-lived job of N ranks runs them one
after the other (tests/helpers/scenario_runner.py on every rank), each its own pytest test
with its own name, result and output, as Horovod's own suite runs whole test files under
one `horovodrun`. A scenario is a script's file, run as `__main__` with the command line
given, or a function `module:function` (a module of tests/workers) that every rank calls with
the same arguments; what it returns (JSON) comes back per rank.

    @pytest.fixture(scope="module")
    def job():
        with SharedJob(2, "gloo") as shared:
            yield shared

    def test_something(job, tmp_path):
        rank0, rank1 = job.run("recipe:main", ["--epochs", "1"], cwd=tmp_path)

A scenario that fails on a rank fails its test with that rank's traceback and the job's
output while it ran; the job goes on for the next. One that does not answer within its
timeout fails its test, and the job is ended and started again for the next scenario.
Only scenarios that keep every rank alive belong here: kills, stalls, lost hosts and
elastic runs keep their own jobs.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import JOB_TIMEOUT, ROOT, Lines, job_env, launch_argv

RUNNER = os.path.join(ROOT, "tests", "helpers", "scenario_runner.py")
START_TIMEOUT = 120  # the ranks' start-up: interpreter, launcher, connection


class SharedJob:
    """A job of `np` ranks under `backend` ("gloo", "mpi", "none" for one process) that runs
    scenarios; `hosts` as `launch_argv` takes them, `env` over the job's environment."""

    def __init__(self, np, backend, hosts=None, env=None):
        self.np, self.backend, self.hosts, self.env = np, backend, hosts, dict(env or {})
        self.proc = self.out = None
        self.streams = {}
        self.count = 0
        self.starts = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the job --------------------------------------------------------------------------
    def _start(self):
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(self.np)
        server.settimeout(START_TIMEOUT)
        address = f"127.0.0.1:{server.getsockname()[1]}"
        argv = [*launch_argv(self.np, self.backend, self.hosts), sys.executable, RUNNER, address]
        self.proc = subprocess.Popen(
            argv, env=job_env(**self.env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, cwd=ROOT, start_new_session=True,
        )  # fmt: skip
        self.out = Lines(self.proc, on_fail=self.kill)
        self.starts += 1
        self.streams = {}
        try:
            while len(self.streams) < self.np:
                conn, _ = server.accept()
                stream = conn.makefile("rw", encoding="utf-8")
                hello = json.loads(stream.readline())
                self.streams[hello["rank"]] = (conn, stream)
        except (TimeoutError, OSError, ValueError):
            self.kill()
            pytest.fail("the shared job did not start:\n" + self._tail())
        finally:
            server.close()

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        for conn, _ in self.streams.values():
            conn.close()
        self.streams = {}

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            for _, stream in self.streams.values():
                try:
                    stream.write(json.dumps({"exit": True}) + "\n")
                    stream.flush()
                except OSError:
                    pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def _tail(self, lines=80):
        return "".join(self.out.drain()[-lines:]) if self.out else ""

    # -- scenarios --------------------------------------------------------------------------
    def run(self, scenario, args=(), argv=None, cwd=None, env=None, timeout=JOB_TIMEOUT,
            check=True):  # fmt: skip
        """`scenario` on every rank: a script's file ("path.py") run with the command line
        `argv`; or "module:function": `function(*args)`, or with `argv` a script's `main()`
        with that command line. Returns each rank's reply ({"ok", "result",
        "error", "traceback", "exit"}) by rank; the scenario's output lines are in
        `self.output`. With `check`, a rank that failed fails the test."""
        if self.proc is None or self.proc.poll() is not None or not self.streams:
            self._start()
        self.count += 1
        request = {"id": self.count, "scenario": scenario, "args": list(args),
                   "argv": None if argv is None else [str(a) for a in argv],
                   "cwd": str(cwd) if cwd else None, "env": env or {}}  # fmt: skip
        first = len(self.out.lines)
        for _, stream in self.streams.values():
            stream.write(json.dumps(request) + "\n")
            stream.flush()
        replies, deadline = {}, time.monotonic() + timeout
        name = " ".join([f"{scenario}{list(args) or ''}", *(request["argv"] or [])])
        for rank, (conn, stream) in sorted(self.streams.items()):
            conn.settimeout(max(1.0, deadline - time.monotonic()))
            try:
                line = stream.readline()
            except (TimeoutError, OSError):
                line = ""
            if not line:
                output = "".join(self.out.drain()[first:][-80:])
                self.kill()  # the next scenario starts a new job
                why = f"rank {rank} did not answer within {timeout} s (or its process ended)"
                pytest.fail(f"{name}: {why}; the next scenario starts a new job:\n{output}")
            replies[rank] = json.loads(line)
        end = rf"@@scenario end {self.count}\b"
        for _ in range(2 * self.np):  # on stdout and stderr of every rank
            self.out.wait_for(end, timeout=60)
        self.output = self._scenario_lines(first)
        failed = [r for r, reply in replies.items() if not reply["ok"]]
        if check and failed:
            rank = failed[0]
            pytest.fail(f"{name} failed on rank {rank}:\n{replies[rank].get('traceback')}"
                        f"\n--- its output\n{''.join(self.output[-80:])}")  # fmt: skip
        return [replies[r] for r in sorted(replies)]

    def run_script(self, argv, timeout=JOB_TIMEOUT, check=True, cwd=None):
        """`python argv...` as `run_job` runs it, in this job: a CompletedProcess whose
        `returncode` is the first non-zero exit status of a rank (1 for an exception, as
        Python's), and whose `stdout` and `stderr` both hold the scenario's output."""
        script, *rest = [str(a) for a in argv]
        if script == "-m":  # python -m module ...
            script, *rest = f"-m {rest[0]}", *rest[1:]
        replies = self.run(script, argv=rest, timeout=timeout, check=check, cwd=cwd)
        codes = [0 if r["ok"] else (r.get("exit") if "exit" in r else 1) for r in replies]
        code = next((c for c in codes if c), 0)
        code = code if isinstance(code, int) else 1  # sys.exit("message") exits 1
        text = "".join(self.output)
        return subprocess.CompletedProcess([sys.executable, *argv], code, text, text)

    def _scenario_lines(self, first):
        """The lines between the scenario's first begin marker and its last end marker."""
        lines = self.out.lines[first:]
        begin, end = f"@@scenario begin {self.count}", f"@@scenario end {self.count}"
        starts = [i for i, line in enumerate(lines) if begin in line]
        ends = [i for i, line in enumerate(lines) if end in line]
        inside = lines[starts[0] + 1 : ends[-1]] if starts and ends else lines
        return [line for line in inside if "@@scenario " not in line]


class OneJobAtATime:
    """The shared jobs of a module whose scenarios need different jobs (ranks, backend,
    hosts): one alive at a time, started when a scenario needs it and ended when the next
    needs another (order the scenarios by job so that each starts once)."""

    def __init__(self):
        self.key, self.job = None, None

    def get(self, np, backend, hosts=None):
        if backend in ("gloo", "mpi"):
            hosts = hosts or f"localhost:{np}"  # as launch_argv reads None
        if self.key != (np, backend, hosts):
            self.close()
            self.key, self.job = (np, backend, hosts), SharedJob(np, backend, hosts)
        return self.job

    def close(self):
        if self.job is not None:
            self.job.close()
        self.key, self.job = None, None
