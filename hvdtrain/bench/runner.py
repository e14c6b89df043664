"""The benchmark's launcher side: which runs to make, the command of each, running them.

Pure planning (`plan`, `launch`) and a runner that starts each job, streams its output,
shows progress and collects the `@@hvdbench {json}` lines. Never imports TensorFlow.

Launch per variant (all on localhost, one core per rank by default):

- hvdtrain at -np 1: `python -m hvdtrain.bench.workers ...` (one process);
- hvdtrain at -np N: the command `hvdtrain-run --backend gloo|mpi` builds
  (`hvdtrain.launcher.commands.build_command`: `horovodrun --gloo|--mpi -np N -H localhost:N`),
  so changes to the launcher's defaults show up here;
- baseline: `horovodrun -np N -H localhost:N [--gloo|--mpi] python ...`, as Horovod's docs;
- mwms: N plain processes, each with its TF_CONFIG (free localhost ports);
- the machine's ceiling (backend `independent`): N plain processes of one rank each, side
  by side on their own cores, with nothing to exchange;
- keras: one plain process.
"""

import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from hvdtrain.bench.workers import CPU_MARKER, MARKER, machine_busy_seconds, result_key
from hvdtrain.launcher.commands import LaunchConfig, build_command
from hvdtrain.launcher.hosts import local_hosts

__all__ = [
    "Run",
    "attach_usage",
    "launch",
    "free_ports",
    "tf_config",
    "quiet_wait",
    "cpu_busy",
    "execute",
]

_DECODER = json.JSONDecoder()
# A window counts as quiet when other processes took less than this many cores in it.
QUIET_BELOW = 0.15
INDEPENDENT = "independent"  # the backend of the ceiling runs: no launcher, no communication
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class Run:
    """One job: a worker module on `np` ranks under `backend` with extra settings.

    Args:
        name: unique, for logs and progress.
        variant: hvdtrain, baseline, mwms, keras, allreduce (the sweep) or floor
            (`hvdtrain.bench.floor`).
        np: processes.
        backend: gloo or mpi for np > 1 (Horovod variants); `INDEPENDENT` for np
            unconnected processes side by side; None otherwise.
        args: the worker's own arguments.
        env: variables set for this run only (e.g. a Horovod setting under test).
        group: what the run is for: "main", "ceiling", "tuning", "sweep" or "profile".
        tags: for tuning runs, the (knob, setting) pairs this configuration stands for.
        python: the interpreter of another environment (`--compare-python`: another
            stack) for every process of the job, its launcher beside it; None: this one.
    """

    name: str
    variant: str
    np: int
    backend: str | None
    args: tuple = ()
    env: dict = field(default_factory=dict)
    group: str = "main"
    tags: list = field(default_factory=list)
    python: str | None = None


def free_ports(n):
    """`n` distinct free TCP ports on localhost (bound, read, released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def tf_config(ports, index):
    """The TF_CONFIG of worker `index` of a localhost cluster on `ports`."""
    workers = [f"localhost:{p}" for p in ports]
    return json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})


_MODULES = {"allreduce": "hvdtrain.bench.allreduce", "floor": "hvdtrain.bench.floor"}


def _module(variant):
    return _MODULES.get(variant, "hvdtrain.bench.workers")


def launch(run, python, environ, uid, ports=None):
    """The processes that make `run`: a list of (argv, env overrides). Pure.

    Args:
        run: a `Run`.
        python: the interpreter for every rank (this one).
        environ: the launching environment (read only).
        uid: the effective user id (root makes mpirun need `--allow-run-as-root`).
        ports: for mwms with np > 1, one free port per worker.
    """
    command = [python, "-m", _module(run.variant)]
    if run.variant not in _MODULES:
        command += ["--variant", run.variant]
    command += list(run.args)
    bindir = os.path.dirname(python)
    if run.np == 1 and run.variant != "mwms":
        return [(command, {"HVDBENCH_LOCAL_RANK": "0"})]
    if run.backend == INDEPENDENT:  # N single-process jobs at once, each on its own core
        return [(command, {"HVDBENCH_LOCAL_RANK": str(i)}) for i in range(run.np)]
    if run.variant == "mwms":
        ports = ports or free_ports(run.np)
        return [
            (command, {"HVDBENCH_LOCAL_RANK": str(i), "TF_CONFIG": tf_config(ports, i)})
            for i in range(run.np)
        ]
    if run.variant in ("hvdtrain", *_MODULES):
        config = LaunchConfig(
            backend=run.backend, np=run.np, hosts=tuple(local_hosts(run.np)), command=command
        )
        horovodrun = os.path.join(bindir, "horovodrun")
        # The job's own variables count as set here (e.g. TF_USE_LEGACY_KERAS on another stack)
        argv, env = build_command(config, {**environ, **run.env}, uid, bindir, horovodrun)
        return [(argv, env)]
    # The baseline: horovodrun exactly as Horovod's documentation writes it.
    horovodrun = os.path.join(bindir, "horovodrun")
    argv = [horovodrun, "-np", str(run.np), "-H", f"localhost:{run.np}", f"--{run.backend}"]
    return [(argv + command, {})]


def cpu_busy(seconds=1.0):
    """The number of cores busy (0 .. cores) over `seconds` (`machine_busy_seconds`); None
    where that cannot be told."""
    start, before = time.monotonic(), machine_busy_seconds()
    time.sleep(seconds)
    after = machine_busy_seconds()
    return (
        None if before is None or after is None else (after - before) / (time.monotonic() - start)
    )


def quiet_wait(limit_seconds, busy_below=0.25, log=None):
    """Waits (at most `limit_seconds`) until other processes use less than `busy_below`
    cores; returns what it saw: load averages, busy cores, seconds waited, quiet or not."""
    start = time.monotonic()
    busy = cpu_busy(0.5)
    while busy is not None and busy >= busy_below and time.monotonic() - start < limit_seconds:
        if log:
            log(f"waiting for a quiet machine: {busy:.2f} cores busy elsewhere")
        time.sleep(2)
        busy = cpu_busy(1.0)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "load_average": [round(v, 2) for v in load] if load else None,
        "busy_cores": round(busy, 2) if busy is not None else None,
        "waited_seconds": round(time.monotonic() - start, 1),
        "quiet": busy is not None and busy < busy_below,
    }


def _parse(line, marker):
    at = line.find(marker)
    if at < 0:
        return None
    try:  # raw_decode: mpirun --tag-output may glue the next line's tag to this one
        return _DECODER.raw_decode(line[at + len(marker) :])[0]
    except ValueError:
        return None


def _stream(proc, log_file, on_result):
    for line in proc.stdout:
        log_file.write(line)
        result = _parse(line, MARKER)
        if result is not None:
            on_result(result, final=False)


def read_log(path):
    """The results in a job's log file, each with its ranks' CPU use (`attach_usage`)."""
    results, lines = [], {}  # lines: key -> rank -> that rank's CPU lines, in order
    with open(path, errors="replace") as f:
        for line in f:
            result = _parse(line, MARKER)
            if result is not None:
                results.append(result)
            usage = _parse(line, CPU_MARKER)
            if usage is not None:
                lines.setdefault(usage.get("key"), {}).setdefault(usage["rank"], []).append(usage)
    seen = {}  # key -> results seen: the n-th result of a key gets the n-th lines
    for result in results:
        if "window_seconds" not in result:  # the allreduce sweep's lines
            continue
        key = result_key(result)
        n = seen.get(key, 0)
        seen[key] = n + 1
        # Unconnected processes (the ceiling) each print a result and one line each: every
        # result of theirs gets all their lines.
        by_rank = lines.get(key, {})
        attach_usage(result, [v[min(n, len(v) - 1)] for v in by_rank.values()])
    return results


def attach_usage(result, cpu_lines, quiet_below=QUIET_BELOW, min_quiet=3):
    """Adds to a worker's `result` how busy the machine was in each window, and bases its
    figure on the quiet windows.

    Per window: every rank's CPU seconds (`cpu_lines`, `@@hvdbench-cpu` lines; all the
    processes of the job) and the machine's busy CPU seconds give the cores other processes
    took (`external_cores`).
    `samples_per_sec` becomes the median over the windows in which they took less than
    `quiet_below` cores, when there are `min_quiet` such windows; otherwise it stays the
    median over all windows and `noisy` is set. Both medians are kept.
    """
    key = result_key(result)
    ranks = {c["rank"]: c["cpu"] for c in cpu_lines if c.get("key") == key}
    walls = result.get("window_seconds") or []
    busy = result.get("machine_busy_seconds") or []
    result["rank_cpu_seconds"] = {str(r): v for r, v in sorted(ranks.items())}
    result["rank_thread_seconds"] = {  # per window, by thread group (workers.thread_groups)
        str(c["rank"]): c["threads"] for c in cpu_lines if c.get("key") == key and "threads" in c
    }
    external = []
    for i, wall in enumerate(walls):
        ours = [v[i] for v in ranks.values() if i < len(v)]
        if i >= len(busy) or busy[i] is None or len(ours) < result["np"] or wall <= 0:
            external.append(None)
        else:
            external.append(round(max(0.0, busy[i] - sum(ours)) / wall, 3))
    result["external_cores"] = external
    quiet = [w for w, e in zip(walls, external, strict=True) if e is not None and e < quiet_below]
    result["samples_per_sec_all_windows"] = result["samples_per_sec"]
    result["quiet_windows"] = len(quiet)
    result["noisy"] = len(quiet) < min(min_quiet, len(walls))
    if not result["noisy"] and quiet:
        seconds = statistics.median(quiet)
        result["samples_per_sec"] = result["batch_size"] * result["np"] * result["steps"] / seconds
        result["step_ms"] = 1000 * seconds / result["steps"]
    return result


def execute(run, log_dir, base_env, timeout, on_result, quiet_seconds=0, log=None):
    """Runs `run` to the end (or `timeout`), returns its record with the results.

    Output of every process goes to `log_dir/<name>.log`; rank 0's result lines are parsed
    as they come (`on_result` shows progress).
    """
    quiet = quiet_wait(quiet_seconds, log=log) if quiet_seconds else quiet_wait(0)
    uid = os.getuid() if hasattr(os, "getuid") else 1
    procs = launch(run, run.python or sys.executable, base_env, uid)
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, f"{run.name}.log")
    started = time.monotonic()
    with open(path, "w") as log_file:
        handles = []
        for argv, env in procs:
            full = {**base_env, **run.env, **env}
            log_file.write("$ " + shlex.join(argv) + "\n")
            log_file.flush()
            handles.append(
                subprocess.Popen(
                    argv,
                    env=full,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    cwd=PACKAGE_ROOT,
                    start_new_session=True,
                )
            )
        readers = [
            threading.Thread(target=_stream, args=(h, log_file, on_result), daemon=True)
            for h in handles
        ]
        for t in readers:
            t.start()
        deadline = started + timeout
        while any(h.poll() is None for h in handles):
            failed = any(h.poll() not in (None, 0) for h in handles)
            if failed or time.monotonic() > deadline:  # a rank failed: the others would hang
                for h in handles:
                    if h.poll() is None:
                        try:
                            os.killpg(h.pid, 9)
                        except OSError:
                            pass
                break
            time.sleep(0.2)
        timed_out = time.monotonic() > deadline
        codes = [h.wait() for h in handles]
        for t in readers:
            t.join(timeout=5)
    # The log file holds every line: read the figures back from it, so that no line a
    # reader thread had not handed over yet is missing.
    results = read_log(path)
    for result in results:
        if "window_seconds" in result:
            on_result(result, final=True)
    return {
        "name": run.name,
        "variant": run.variant,
        "np": run.np,
        "backend": run.backend,
        "group": run.group,
        "tags": [list(t) for t in run.tags],
        "env": dict(run.env),
        "python": run.python,
        "command": [shlex.join(argv) for argv, _ in procs],
        "exit_codes": codes,
        "ok": all(c == 0 for c in codes),
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - started, 1),
        "machine": quiet,
        "log": os.path.relpath(path, os.path.dirname(log_dir)),
        "results": results,
    }
