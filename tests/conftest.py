"""Shared helpers: run real multi-process jobs under horovodrun (Gloo, MPI) and mpirun."""

import contextlib
import inspect
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

BIN = os.path.dirname(sys.executable)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")
# Generous bounds: a hang fails the test instead of blocking CI.
JOB_TIMEOUT = 240
# Tests that call hvdtrain.init() in this process leave HOROVOD_* settings in os.environ
# (the stall times, the cycle time); jobs must start from the user's environment instead.
_STARTING_ENV = dict(os.environ)


@pytest.fixture(scope="module", autouse=True)
def _environ_per_module():
    """What a module's tests change in os.environ ends with the module. An in-process
    `hvdtrain.init()` sets HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=300, which overrides
    HVDTRAIN_STALL_SHUTDOWN_SECONDS: the namespace-host jobs of a later module (their
    environment is os.environ's) had a 300 s stall time instead of 10 s, and the MPI cut
    test hung in the whole suite only. Within a module, `job_env` leaves them out."""
    saved = dict(os.environ)
    yield
    for name in set(os.environ) - set(saved):  # only what changed: threads may read it
        del os.environ[name]
    for name, value in saved.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


# What starts a process: the helpers here, subprocess, os.system. A test is marked
# `processes` when its function, its fixtures or a function of the tests they call name one.
_STARTS = re.compile(
    r"\b(run_job|start_job|run_until|SharedJob|OneJobAtATime|launch_argv|subprocess|Popen"
    r"|NamespaceHosts|slurm_cluster|os\.system|os\.exec\w*|os\.spawn\w*|hvdtrain\.launch"
    r"|NotebookClient)\b"
)


def _starts_processes(thing, seen):
    """Whether `thing` (a function or class of the tests), or a function or class of the
    tests it names (transitively), names what starts a process: read from the source, so a
    new test is classified as it is written."""
    if not (inspect.isfunction(thing) or inspect.isclass(thing)):
        return False
    thing = inspect.unwrap(thing)
    if thing in seen:
        return False
    seen.add(thing)
    try:
        if not os.path.abspath(inspect.getsourcefile(thing)).startswith(ROOT + os.sep + "tests"):
            return False
        if _STARTS.search(inspect.getsource(thing)):
            return True
    except (OSError, TypeError):
        return False
    functions = [thing] if inspect.isfunction(thing) else [
        f for f in vars(thing).values() if inspect.isfunction(f)
    ]  # fmt: skip
    names, codes = set(), [f.__code__ for f in functions]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes += [c for c in code.co_consts if inspect.iscode(c)]
    module = sys.modules.get(thing.__module__)
    scope = vars(module) if module else {}
    return any(_starts_processes(scope.get(n), seen) for n in names)


# The files of the longest scenarios (the 26 kills, the Docker image), collected first: the
# workers of `make test-slow` (`--dist loadgroup`) take tests in this order, and end together
# when the longest start first.
_FIRST = ("test_resume.py", "test_docker_image.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in _FIRST)  # stable: the rest as collected
    verdicts = {}  # each function read once, not once per parametrized test
    for item in items:
        functions = [getattr(item, "function", None)] + [
            d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs
        ]
        for f in functions:
            if f is not None and f not in verdicts:
                verdicts[f] = _starts_processes(f, set())
        if any(verdicts.get(f) for f in functions):
            item.add_marker(pytest.mark.processes)


_LEFT_OUT = {}  # marker -> how many tests with it this run deselected


def pytest_deselected(items):
    for marker in ("slow", "gpu_image", "alone"):
        found = sum(1 for i in items if i.get_closest_marker(marker))
        _LEFT_OUT[marker] = _LEFT_OUT.get(marker, 0) + found


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: tell the controller
        session.config.workeroutput["left_out"] = _LEFT_OUT


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller of `pytest -n`: every worker collects (and deselects) every test."""
    for marker, count in getattr(node, "workeroutput", {}).get("left_out", {}).items():
        _LEFT_OUT[marker] = max(_LEFT_OUT.get(marker, 0), count)


_STARTED = time.monotonic()  # the session's start (the controller's, under pytest-xdist)


def _time_by_file(terminalreporter):
    """{test file: seconds of its tests (set-up, call, tear-down)} of this run."""
    seconds = {}
    for reports in terminalreporter.stats.values():
        for r in reports:
            if isinstance(r, pytest.TestReport):
                name = r.nodeid.split("::")[0]
                seconds[name] = seconds.get(name, 0.0) + r.duration
    return seconds


def _where_the_time_went(terminalreporter, config):
    """The run's time, its three slowest files (all of them in out/test-times.json), and a
    warning past the budget `make` gives it (HVDTRAIN_TEST_BUDGET_SECONDS)."""
    wall = time.monotonic() - _STARTED
    by_file = sorted(_time_by_file(terminalreporter).items(), key=lambda kv: -kv[1])
    if not by_file:
        return
    shown = ", ".join(f"{name.removeprefix('tests/')} {s:.0f} s" for name, s in by_file[:3])
    terminalreporter.write_line(
        f"took {wall / 60:.1f} min ({sum(s for _, s in by_file):.0f} s of tests); the slowest "
        f"files: {shown}; all of them: out/test-times.json"
    )
    os.makedirs(os.path.join(ROOT, "out"), exist_ok=True)
    with open(os.path.join(ROOT, "out", "test-times.json"), "w") as f:
        json.dump({"wall_seconds": round(wall, 1), "files": dict(by_file)}, f, indent=1)
    budget = os.environ.get("HVDTRAIN_TEST_BUDGET_SECONDS", "")
    if budget.isdigit() and wall > int(budget):
        terminalreporter.write_line(
            f"warning: this run took {wall / 60:.1f} min, past its budget of "
            f'{int(budget) / 60:.0f} min (docs/development.md, "Where the time goes"): '
            "CI's limit comes next",
            yellow=True,
            bold=True,
        )


@pytest.hookimpl(trylast=True)  # after the durations: the run's last words
def pytest_terminal_summary(terminalreporter, config):
    """`make test` leaves the slow scenarios and the GPU image out, `make test-slow` the
    machine's measurements for later: say so, and how to run them; then where the time went."""
    if not hasattr(config, "workerinput"):
        _where_the_time_went(terminalreporter, config)
    for marker, how in (
        ("slow", "`make test-slow` runs them, and CI runs both (.ci/run)"),
        ("gpu_image", "`make test-gpu-image` runs them (a cold build: about 21 min; not in CI)"),
        ("alone", "`make test-slow` runs them next, with nothing beside them"),
    ):
        if f"not {marker}" in config.option.markexpr and _LEFT_OUT.get(marker):
            terminalreporter.write_line(
                f"left out: {_LEFT_OUT[marker]} {marker} test(s); {how}", yellow=True, bold=True
            )


_SHARED = []  # the module's pool of shared jobs, while it has one


@pytest.fixture(scope="module")
def shared_jobs():
    """Long-lived jobs that a module's scenarios share (tests/helpers/shared.py), one alive at
    a time: `shared_jobs.get(2, "gloo").run_script([script, *args])` where a test would
    `run_job` a script that keeps every rank alive and needs no environment of its own.
    Idle ranks are not free (Horovod's cycle and MPI's waits spin: about 0.2-0.5 of a core
    each), so the job ends with the module and before any other job starts."""
    from helpers.shared import OneJobAtATime

    pool = OneJobAtATime()
    _SHARED.append(pool)
    yield pool
    _SHARED.remove(pool)
    pool.close()


def _end_shared_jobs():
    for pool in _SHARED:
        pool.close()


def tf_version():
    """The installed TensorFlow's (major, minor), read without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("tensorflow-cpu", "tensorflow"):
        try:
            return tuple(int(p) for p in version(name).split(".")[:2])
        except PackageNotFoundError:
            continue
    return (0, 0)


# Keras 2 is tf.keras up to TensorFlow 2.15; from 2.16 on it is tf-keras, chosen by this.
LEGACY_KERAS = {"TF_USE_LEGACY_KERAS": "1"} if tf_version() >= (2, 16) else {}


# Horovod's background thread coordinates the ranks every cycle, idle or not: at hvdtrain's
# 0.1 ms a rank's thread took a quarter of a core here, MPI's coordinator more. The tests'
# jobs run at 1 ms, hvdtrain's own cycle under `--sync local/diloco`, as a user's variable
# (the user's wins); `job_env(HOROVOD_CYCLE_TIME=None)` leaves it to hvdtrain.init.
TEST_CYCLE_TIME_MS = "1"


def job_env(**extra):
    """The environment of a test's job: the user's, less what an in-process hvdtrain.init()
    set, plus `extra` (a None value removes the variable)."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_") or k in _STARTING_ENV
    }
    env.setdefault("HOROVOD_CYCLE_TIME", TEST_CYCLE_TIME_MS)
    env.update(
        HVDTRAIN_OFFLINE="1",  # never try to download MNIST in tests
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONUNBUFFERED="1",
        PATH=BIN + os.pathsep + env.get("PATH", ""),
        PYTHONPATH=ROOT,
    )
    if env.get("HVDTRAIN_PROBE_LOG"):  # measured by tests/helpers/durations.py
        env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "tests", "helpers", "probe"), ROOT])
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


def launch_argv(np, backend, hosts=None):
    """The launcher prefix for `np` local ranks: gloo, mpi (both horovodrun) or mpirun."""
    if backend in ("gloo", "mpi"):
        hosts = hosts or f"localhost:{np}"
        return [f"{BIN}/horovodrun", "-np", str(np), "-H", hosts, f"--{backend}"]
    if backend == "mpirun":
        root = ["--allow-run-as-root"] if os.getuid() == 0 else []
        return [
            "mpirun",
            *root,
            "-np",
            str(np),
            "--oversubscribe",
            "--bind-to",
            "none",
            "--tag-output",
        ]
    if backend == "none":
        return []
    raise ValueError(backend)


def run_job(np, backend, args, timeout=JOB_TIMEOUT, check=True, hosts=None, **env):
    """Runs `python args...` on `np` ranks and returns the CompletedProcess (text output)."""
    _end_shared_jobs()
    argv = launch_argv(np, backend, hosts) + [sys.executable, *args]
    proc = subprocess.run(
        argv, env=job_env(**env), capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(argv)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def ours(text):
    """`text`'s lines but TensorFlow's start-up noise (`hvdtrain.launcher.noise`), which a script
    that imports TensorFlow before hvdtrain prints on CPUs where oneDNN is on."""
    from hvdtrain.launcher.noise import is_startup_noise

    return [line for line in text.splitlines() if not is_startup_noise(line)]


def worker(name):
    return os.path.join(WORKERS, name)


class Lines:
    """A process's output (stdout), read line by line in a thread; `on_fail()` runs before a
    wait fails (e.g. to kill the job)."""

    def __init__(self, proc, on_fail=None):
        self.proc, self.on_fail, self.lines, self._queue = proc, on_fail, [], queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern, timeout=JOB_TIMEOUT, seen=False):
        """The first new line matching `pattern` (the event, not a time), or with `seen` an
        earlier one; fails after `timeout` s or when the output ends."""
        for line in self.lines if seen else ():
            if re.search(pattern, line):
                return line
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=1)
            except queue.Empty:
                continue
            if line is None:
                break
            self.lines.append(line)
            if re.search(pattern, line):
                return line
        if self.on_fail:
            self.on_fail()
        pytest.fail(f"no line matching {pattern!r}:\n" + "".join(self.lines[-60:]))

    def drain(self):
        """The lines that have come so far, without waiting for more."""
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return self.lines
            if line is None:  # the end stays for `rest`
                self._queue.put(None)
                return self.lines
            self.lines.append(line)

    def rest(self, timeout=JOB_TIMEOUT):
        """The exit code, once the process and its output have ended."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            if self.on_fail:
                self.on_fail()
            pytest.fail("the job did not end:\n" + "".join(self.lines[-60:]))
        while (line := self._queue.get(timeout=60)) is not None:
            self.lines.append(line)
        return code


def start_job(argv, env=None, cwd=ROOT):
    """Starts `argv` in a session of its own, its output (stdout and stderr) read as `Lines`
    that kill the job when a wait fails; returns (process, lines)."""
    _end_shared_jobs()
    proc = subprocess.Popen(
        argv, env=env or job_env(), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    return proc, Lines(proc, on_fail=lambda: kill_job(proc))


def kill_job(proc, marker=None):
    """SIGKILLs the job's session and every process whose argv holds `marker` (a unique
    path: the ranks that mpirun starts outside the session), then reaps them."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    victims = []
    if marker:
        victims = [p for p in psutil.process_iter(["cmdline"])
                   if any(marker in a for a in (p.info["cmdline"] or []))]  # fmt: skip
    for p in victims:
        with contextlib.suppress(psutil.NoSuchProcess):  # ended meanwhile (killpg above)
            p.kill()
    psutil.wait_procs(victims, timeout=30)
    proc.wait(timeout=30)


def run_until(argv, pattern, marker=None, timeout=JOB_TIMEOUT, env=None):
    """Starts `argv`, waits for a line matching `pattern` (the event, not a time), then kills
    the whole job (`kill_job`); returns the lines it printed. Fails if the job ends first or
    the line does not come within `timeout` s."""
    proc, out = start_job(argv, env)
    try:
        out.wait_for(pattern, timeout)
    finally:
        kill_job(proc, marker)
    return out.lines
