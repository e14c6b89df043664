"""`hvdtrain.launch`: a Python function run on every rank of a job, from a notebook cell or a
script, under `hvdtrain-run`'s own supervision; rank 0's return value comes back.

    import hvdtrain

    def train(epochs):
        import tensorflow as tf
        ...
        return hvdtrain.fit(build_model, data, epochs=epochs)   # the metrics

    metrics = hvdtrain.launch(train, 3, np=2)        # in a cell: rank 0's lines stream below it

What happens, in order: the function (by value, with cloudpickle: a function of a notebook
cell, and what it uses of the cells, travels whole), its arguments and the source of the
notebook's cells go to a file in a private temporary folder (mode 0700); `hvdtrain-run`'s
own path builds the job (`cli.parse_args`, `cli.prepare`: the same hosts, hostfile dialects,
backends, checks and warnings as `hvdtrain-run -np N -H ... --backend B -x NAME=VALUE`) and
`supervise` runs it: each rank runs `python -m hvdtrain.launcher.run_fn FOLDER`, which calls
the function and leaves its result in the folder. The folder is removed afterwards.

The caller's streams (`sys.stdout`, `sys.stderr`: in Jupyter, the cell's) get rank 0's
lines as they come, without the launchers' tags; another rank's lines are left out unless
it fails: from its first line of failure on (a traceback, hvdtrain's `rank 1 failed:` line,
an error line) they are shown, after `[rank 1] `; a rank that fails without such a line has
its last lines shown when the job ends.

A failed job raises `hvdtrain.JobFailed` (a `RuntimeError` and an `HvdtrainError`) whose
message is the one line that names the rank, its error and where in your code it was raised
(`Cell In[4], line 7` for a notebook cell). Ctrl-C (the kernel's interrupt) is passed to the
job, whose ranks end within seconds, and `KeyboardInterrupt` is raised. Importing this
module imports no TensorFlow.
"""

import collections
import linecache
import os
import pickle
import re
import shutil
import sys
import tempfile

from hvdtrain.errors import HvdtrainError, JobFailed, invalid_value, kind_of
from hvdtrain.launcher import cli, run_fn
from hvdtrain.launcher.commands import BACKENDS
from hvdtrain.launcher.hosts import is_local
from hvdtrain.launcher.supervise import supervise
from hvdtrain.launcher.tags import split_tag

__all__ = ["launch", "RankOutput"]

# horovodrun's own lines on a failed Gloo job: the exception says it in one line.
_LAUNCHERS = re.compile(
    r"(Process \d+ exit with status code -?\d+|Terminating remaining workers after failure of "
    r"Process \d+)\.\s*"
)
_HELD_LINES = 20  # of a rank that failed without a line saying so, shown at the job's end
# A rank's first line of failure: a traceback, hvdtrain's lines before and after one, an
# error line (`prog [rank 1]: error: ...`), a watchdog's line, Python's fatal errors.
_FAILING = re.compile(
    r"Traceback \(most recent call last\)|hvdtrain: (the error|rank \d+ (failed|stopped|made no)"
    r"|rank \d+ waited)|^\S+( \[rank \d+\])?: error: |Fatal Python error|\[hvdtrain:stall "
)


class RankOutput:
    """Where the job's lines go (`supervise`'s `output`): rank 0's to `out` and `err` as
    they come, without the launchers' tag (`[1,0]<stdout>:`); another rank's held, shown from
    its first line of failure on, prefixed `[rank R] `; the launchers' own lines to `err`.

    Args:
        out, err: text streams, by default `sys.stdout` and `sys.stderr` at each write (a
            notebook cell's).
    """

    def __init__(self, out=None, err=None):
        self._out, self._err = out, err
        self.failing = set()  # ranks whose lines are shown
        self.held = collections.defaultdict(lambda: collections.deque(maxlen=_HELD_LINES))

    def _stream(self, name):
        if name == "stdout":
            return self._out or sys.stdout
        return self._err or sys.stderr

    def write(self, stream, lines):
        """The lines that `supervise` read from the job's `stream` ("stdout", "stderr")."""
        written = set()
        for line in lines:
            rank, tagged, body = split_tag(line)
            name = tagged or stream
            if rank is None and _LAUNCHERS.fullmatch(body):
                continue
            if rank is None or rank == 0:
                self._stream(name).write(body)
            elif rank in self.failing or _FAILING.search(body):
                self.failing.add(rank)
                self._stream("stderr").write(f"[rank {rank}] {body}")
                name = "stderr"
            else:
                if name == "stderr":
                    self.held[rank].append(body)
                continue
            written.add(name)
        for name in written:
            self._stream(name).flush()

    def end(self, failed):
        """At the job's end: where it failed, the last lines of each rank that failed
        without saying so."""
        if not failed:
            return
        for rank in sorted(set(self.held) - self.failing):
            for body in self.held[rank]:
                self._stream("stderr").write(f"[rank {rank}] {body}")
        self._stream("stderr").flush()


def launch(
    fn,
    *args,
    np=2,
    hosts=None,
    hostfile=None,
    backend=None,
    env=None,
    all_ranks=False,
    workdir=None,
    **kwargs,
):
    """Runs `fn(*args, **kwargs)` on `np` ranks, as `hvdtrain-run` runs a script, and returns
    rank 0's return value.

    Args:
        fn: the function every rank calls: a function of a notebook cell or of a module,
            sent by value with cloudpickle (a function of an installed module by its name).
            It imports TensorFlow and calls `hvdtrain.fit` or `hvdtrain.init` itself.
        *args: its positional arguments (they must pickle).
        np: ranks, 2 by default.
        hosts: hosts and slots, as `hvdtrain-run -H`: "a:4,b:4" or ["a:4", "b:4"]; by
            default this host with `np` slots.
        hostfile: a hostfile, as `hvdtrain-run --hostfile` (every dialect it reads).
        backend: "gloo", "mpi", "mpirun" or "srun"; by default `hvdtrain-run`'s choice (mpi
            on one host where mpirun is installed, gloo across hosts, srun in SLURM).
        env: {name: value} set on every rank (`hvdtrain-run -x NAME=VALUE`).
        all_ranks: return every rank's value, a list in rank order.
        workdir: the folder for the function's file and the results; by default the
            temporary folder. Ranks on other hosts need one they all see at the same path
            (a shared file system).
        **kwargs: its keyword arguments (they must pickle; the names above are launch's).

    Returns:
        rank 0's return value (it must pickle), or with `all_ranks` every rank's.

    Raises:
        JobFailed: a rank failed; its message names the rank, the error and the line of
            your code (and the error, where it pickles, is its `rank_error`).
        KeyboardInterrupt: interrupted (Ctrl-C, the kernel's interrupt); the job is ended.
        HvdtrainError: a mistake in the arguments, before anything starts.
    """
    if not callable(fn):
        raise invalid_value("fn", kind_of(fn), "a function to run on every rank")
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise invalid_value("np", np, "a number of ranks >= 1, e.g. np=2")
    if backend is not None and backend not in BACKENDS:
        raise invalid_value("backend", backend, f"one of {', '.join(BACKENDS)}, or None")
    if env is not None and not isinstance(env, dict):
        raise invalid_value("env", kind_of(env), "a dict {name: value}")
    argv = ["-np", str(np), "-q"]
    if hosts is not None:
        argv += ["-H", hosts if isinstance(hosts, str) else ",".join(map(str, hosts))]
    if hostfile is not None:
        argv += ["--hostfile", os.fspath(hostfile)]
    if backend is not None:
        argv += ["--backend", str(backend)]
    for name, value in (env or {}).items():
        argv += ["-x", f"{name}={value}"]
    folder = tempfile.mkdtemp(prefix="hvdtrain-launch-", dir=workdir)
    try:
        _write_payload(folder, fn, args, kwargs, all_ranks)
        command = [sys.executable, "-m", "hvdtrain.launcher.run_fn", folder]
        parsed = cli.parse_args([*argv, "--", *command])
        found, _, _ = cli.resolve_hosts(parsed, os.environ)
        if workdir is None and any(not is_local(h.name, cli.this_host_names()) for h in found):
            raise invalid_value(
                "workdir", None, "a folder that every host sees at the same path (a shared "
                "file system) when ranks run on other hosts"
            )  # fmt: skip
        job = cli.prepare(parsed, dict(os.environ))
        for warning in job.warnings:
            print(f"hvdtrain.launch: warning: {warning}", file=sys.stderr, flush=True)
        output = RankOutput()
        outcome = supervise(
            job.argv, job.env, job.hosts, job.grace, job.probe, job.elastic, output=output
        )
        output.end(outcome.code != 0)
        if outcome.received == "SIGINT":
            raise KeyboardInterrupt
        results = _results(folder, np)
        if outcome.code != 0:
            raise _failure(outcome, results, job.hosts) from None
        if all_ranks:
            return [_value(results.get(rank), rank) for rank in range(np)]
        return _value(results.get(0), 0)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _write_payload(folder, fn, args, kwargs, all_ranks):
    payload = {
        "fn": fn,
        "args": args,
        "kwargs": kwargs,
        "all_ranks": bool(all_ranks),
        "prog": getattr(fn, "__name__", None) or "launch",
        "sources": _cell_sources(),
    }
    try:
        data = _dumps(payload)
    except Exception as e:  # noqa: BLE001 (anything an object's pickling may raise)
        raise invalid_value(
            "fn", getattr(fn, "__name__", kind_of(fn)),
            f"a function and arguments that cloudpickle can send to the ranks ({e}); make "
            "what does not pickle (an open file, a lock, a model) inside the function",
        ) from None  # fmt: skip
    with open(os.path.join(folder, run_fn.PAYLOAD), "wb") as f:
        f.write(data)


def _dumps(obj):
    """cloudpickle's pickle of `obj`, its functions' code keeping the file it came from
    (cloudpickle 3.1 names it `<dynamic-code>`): a rank's traceback then names the cell or
    file and line, and shows the line."""
    import io
    import types

    import cloudpickle

    reduce = getattr(cloudpickle.cloudpickle, "_code_reduce", None)

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if reduce is not None and isinstance(obj, types.CodeType):
                make, args = reduce(obj)
                return make, tuple(obj.co_filename if a == "<dynamic-code>" else a for a in args)
            return super().reducer_override(obj)

    f = io.BytesIO()
    Pickler(f).dump(obj)
    return f.getvalue()


def _ipython():
    """The running IPython shell, or None (none in this process, or not imported)."""
    module = sys.modules.get("IPython")
    shell = module.get_ipython() if module else None
    return shell if hasattr(shell, "compile") else None


def _cell_sources():
    """{file name: lines} of the notebook's cells, for the ranks' tracebacks ({} outside a
    notebook)."""
    shell = _ipython()
    names = getattr(shell.compile, "_filename_map", {}) if shell else {}
    return {name: linecache.getlines(name) for name in names if linecache.getlines(name)}


def _place(where):
    """`function, Cell In[4], line 7` or `function, train.py:7` for (file, line, function)."""
    filename, line, function = where
    shell = _ipython()
    if shell is not None:
        try:
            label, name = shell.compile.format_code_name(filename) or (None, None)
        except (AttributeError, TypeError, KeyError):
            label = None
        if label:
            return f"{function}, {label} {name}, line {line}"
    return f"{function}, {os.path.basename(filename)}:{line}"


def _results(folder, np):
    """{rank: its result record} of the ranks that left one."""
    out = {}
    for rank in range(np):
        try:
            with open(run_fn.result_path(folder, rank), "rb") as f:
                out[rank] = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            continue
    return out


def _value(record, rank):
    if record is None:  # the function ended the process itself (sys.exit(0))
        return None
    try:
        return pickle.loads(record["value"])
    except Exception as e:  # noqa: BLE001 (a class this process cannot import, ...)
        raise HvdtrainError(
            f"rank {rank}'s return value cannot be read here: {type(e).__name__}: {e}; return "
            "numbers, strings, lists and dicts of them, NumPy arrays or a path"
        ) from None


def _failure(outcome, results, hosts):
    """The `JobFailed` of a failed job: the rank that failed first, in one line."""
    failed = {r: rec for r, rec in results.items() if not rec["ok"]}
    named = outcome.failure.rank if outcome.failure else None
    if named not in failed:  # the rank whose error started it, not one that followed it
        first = [r for r, rec in sorted(failed.items()) if not rec["consequence"]]
        named = first[0] if first else named
    record = failed.get(named)
    if record is None:
        line = outcome.line or f"the job failed: exit status {outcome.code}"
        return JobFailed(line, outcome.code, named)
    who = f"rank {named}"
    if len(set(hosts)) > 1 and named < len(hosts):
        who += f" on host {hosts[named]}"
    if outcome.failure and outcome.failure.alike:
        who = "every rank"
    where = f" (raised in {_place(record['where'])})" if record["where"] else ""
    error = None
    if record["exception"] is not None:
        try:
            error = pickle.loads(record["exception"])
        except Exception:  # noqa: BLE001 (its class is not importable here)
            error = None
    line = f"{who} failed: {record['error'].rstrip('.')}{where}; exit status {outcome.code}"
    return JobFailed(line, outcome.code, named, error)
