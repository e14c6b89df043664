"""The benchmark's command line: options -> the runs -> results -> JSON, Markdown, PNG.

`main(argv=None)` parses, plans (`plan_runs`, pure), runs every job in turn (progress on
stderr), summarises (`hvdtrain.bench.report.summarize`) and writes the files. It never
imports TensorFlow.
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time

from hvdtrain.bench import project as project_mod
from hvdtrain.bench import render, report
from hvdtrain.bench.runner import INDEPENDENT, PACKAGE_ROOT, Run, execute, quiet_wait
from hvdtrain.errors import HvdtrainError, exit_with_error, invalid_value
from hvdtrain.recipe.flags import ArgumentParser
from hvdtrain.runtime import tuning
from hvdtrain.runtime.compat import LEGACY_KERAS, legacy_keras_needed

__all__ = ["main", "parse_args", "plan_runs", "TUNING", "SWEEP_SIZES", "QUICK_SWEEP_SIZES"]

PROG = "python -m hvdtrain.bench"
# The backend `hvdtrain-run` picks on one host: the one the targets are checked on.
DEFAULT_BACKEND = "mpi"
MLP_GRADIENT_BYTES = 269_322 * 4  # 784-256-256-10, float32: the MLP's allreduce per step
SWEEP_SIZES = tuple(sorted({4096 * 4**i for i in range(8)} | {MLP_GRADIENT_BYTES}))  # 4 KB-64 MB
QUICK_SWEEP_SIZES = (4096, MLP_GRADIENT_BYTES)
MODELS = ("mlp", "convnet")
VARIANTS = ("keras", "hvdtrain", "hvdtrain-keras3", "baseline", "mwms")
STACK_VARIANTS = ("keras", "hvdtrain")  # what `--compare-python` runs on the other stack
# Steps per timed window: about half a second to two seconds on one core.
STEPS = "mlp=256,convnet=16"
QUICK_STEPS = "mlp=32,convnet=4"
JOB_TIMEOUT = 900  # seconds a job may take

# The tuning experiments behind hvdtrain's defaults (`hvdtrain.runtime.tuning`): each runs the
# hvdtrain variant with one knob set and every other at hvdtrain's default, on the MLP at
# batch 64 (the communication-bound case) unless it says otherwise. Fields: knob, setting,
# np (0 = N), backend, env, worker args, model.
_SPE, _CYCLE = tuning.STEPS_PER_EXECUTION, f"{tuning.CYCLE_TIME_MS:g}"
_THREAD = tuning.background_policy({}, has_gpu=False)  # this benchmark runs on CPU cores
_THREAD_DEFAULT = {"HVDTRAIN_HOROVOD_THREAD": _THREAD}
TUNING = (
    *[
        ("steps_per_execution", str(k), np, backend, {}, ("--steps-per-execution", str(k)), "mlp")
        for np, backend in ((1, None), (0, "mpi"))
        for k in sorted({1, 4, _SPE, 64})
    ],
    *[
        ("HOROVOD_CYCLE_TIME (ms)", ms, 0, "mpi", {"HOROVOD_CYCLE_TIME": ms}, (), model)
        for model, values in (
            ("mlp", {"1", "0.5", "0.2", _CYCLE, "0.05"}),
            ("convnet", {"1", _CYCLE, "0.05"}),
        )
        for ms in sorted(values, key=float, reverse=True)
    ],
    *[
        ("HOROVOD_CYCLE_TIME (ms)", ms, 0, "gloo", {"HOROVOD_CYCLE_TIME": ms}, (), "mlp")
        for ms in sorted({"1", _CYCLE}, key=float, reverse=True)
    ],
    *[
        ("HOROVOD_CYCLE_TIME at -np 1 (ms)", ms, 1, None, env, (), model)
        for model in ("mlp", "convnet")
        for ms, env in (("1 (Horovod's)", {}), (_CYCLE, {"HOROVOD_CYCLE_TIME": _CYCLE}))
    ],
    *[
        ("Horovod background threads", p, 0, backend, {"HVDTRAIN_HOROVOD_THREAD": p}, (), m)
        for backend in ("gloo", "mpi")
        for m in ("mlp", "convnet")
        for p in ("normal", "batch", "idle")
    ],
    *[
        ("OMPI_MCA_mpi_yield_when_idle", v, 0, "mpi", {"OMPI_MCA_mpi_yield_when_idle": v}, (), m)
        for m in ("mlp", "convnet")
        for v in ("0", "1")
    ],
    ("process binding", "none (OS scheduler)", 0, "mpi", {"HVDBENCH_BIND": "none"}, (), "mlp"),
    ("process binding", "one core per rank", 0, "mpi", {}, (), "mlp"),
    ("intra-op threads per rank", "2 (TF: all cores)", 0, "mpi", {}, ("--threads", "2"), "mlp"),
    ("intra-op threads per rank", "1 (cores / ranks)", 0, "mpi", {}, (), "mlp"),
)
TUNING_DEFAULTS = {
    "steps_per_execution": str(_SPE),
    "HOROVOD_CYCLE_TIME (ms)": _CYCLE,
    "HOROVOD_CYCLE_TIME at -np 1 (ms)": "1 (Horovod's)",
    "Horovod background threads": _THREAD,
    "OMPI_MCA_mpi_yield_when_idle": "1",
    # hvdtrain binds nothing (mpirun's -bind-to none); the benchmark's main jobs bind one
    # core per rank to hold every variant to the same thread budget.
    "process binding": "none (OS scheduler)",
    "intra-op threads per rank": "1 (cores / ranks)",
}


def _Parser(**kwargs):
    kwargs.pop("formatter_class", None)
    return ArgumentParser(training=False, **kwargs)


def _parser():
    p = _Parser(
        prog=PROG,
        description=(__import__("hvdtrain.bench").bench.__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--out", default="out/bench", help="folder for bench.json/.md/.png (out/bench)")
    p.add_argument("--quick", action="store_true", help="smallest configuration (smoke test)")
    p.add_argument("--project", action="store_true", help="print the GPU projection and exit")
    p.add_argument("-np", "--np", dest="np", type=int, help="ranks for the scaled runs (cores)")
    p.add_argument("--models", help=f"comma-separated, of {','.join(MODELS)} (all)")
    p.add_argument("--batch-sizes", help="per-rank batch sizes (32,64,128)")
    p.add_argument("--backends", default="gloo,mpi", help="Horovod backends (gloo,mpi)")
    p.add_argument("--variants", help=f"comma-separated, of {','.join(VARIANTS)} (all)")
    p.add_argument("--repeats", type=int, help="timed windows per figure (5; quick 3)")
    p.add_argument("--steps", help=f"steps per window per model ({STEPS})")
    p.add_argument("--rounds", type=int, default=1, help="run the main jobs N times (1)")
    p.add_argument("--no-tuning", action="store_true", help="skip the tuning experiments")
    p.add_argument("--no-sweep", action="store_true", help="skip the allreduce sweep")
    p.add_argument("--no-profile", action="store_true", help="skip the Horovod timelines")
    p.add_argument(
        "--no-input", action="store_true", help="skip the input pipeline (TFRecord) comparison"
    )
    p.add_argument("--cores-per-rank", type=int, default=1, help="cores bound to each rank (1)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        help="seconds to wait before each job for other processes to leave the cores (60)",
    )
    p.add_argument(
        "--compare-python",
        metavar="PYTHON",
        help="another environment's python (e.g. .venv-tf2.15.1/bin/python): Keras and "
        "hvdtrain also run on that stack, interleaved with this one's jobs",
    )
    return p


def _csv(text, allowed=None, flag=""):
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or (allowed and any(t not in allowed for t in items)):
        raise invalid_value(flag, text, f"a comma-separated list of {', '.join(allowed or [])}")
    return items


def parse_args(argv=None):
    """Parses and checks the options; fills in the defaults of --quick."""
    args = _parser().parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if args.cores_per_rank < 1:
        raise invalid_value("--cores-per-rank", args.cores_per_rank, "a positive integer")
    args.np = args.np or max(2, (cores or 1) // args.cores_per_rank)
    if args.np < 2:
        raise invalid_value("-np", args.np, "2 or more (the scaled runs)")
    args.models = _csv(
        args.models or ("mlp" if args.quick else ",".join(MODELS)), MODELS, "--models"
    )
    sizes = args.batch_sizes or ("64" if args.quick else "32,64,128")
    try:
        args.batch_sizes = [int(b) for b in _csv(sizes, flag="--batch-sizes")]
    except ValueError:
        raise invalid_value("--batch-sizes", sizes, "positive integers, e.g. 32,64") from None
    if any(b < 1 for b in args.batch_sizes):
        raise invalid_value("--batch-sizes", sizes, "positive integers, e.g. 32,64")
    args.backends = _csv(args.backends, ("gloo", "mpi"), "--backends")
    args.variants = _csv(args.variants or ",".join(VARIANTS), VARIANTS, "--variants")
    args.repeats = args.repeats or (3 if args.quick else 5)
    if args.repeats < 1 or args.rounds < 1:
        raise invalid_value("--repeats/--rounds", args.repeats, "positive integers")
    args.steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    args.tuning = not (args.no_tuning or args.quick)
    args.sweep = not args.no_sweep
    args.profile = not (args.no_profile or args.quick)
    args.input = not args.no_input
    args.sweep_sizes = QUICK_SWEEP_SIZES if args.quick else SWEEP_SIZES
    if args.quiet_wait is None:
        args.quiet_wait = 0 if args.quick else 60
    args.compare_tensorflow = None
    if args.compare_python:
        args.compare_python, args.compare_tensorflow = _other_python(args.compare_python)
    return args


def _other_python(path):
    """(the absolute path, the TensorFlow version) of another environment's interpreter, its
    symbolic links kept (a virtual environment's python is one); its horovodrun must sit
    beside it. Reads the version from package metadata, without importing TensorFlow."""
    expected = (
        "another environment's python with TensorFlow and horovodrun beside it, "
        "e.g. .venv-tf2.15.1/bin/python"
    )
    found = shutil.which(path) if os.sep not in path else path
    if not found or not os.access(found, os.X_OK) or os.path.isdir(found):
        raise invalid_value("--compare-python", path, expected)
    found = os.path.abspath(found)
    if not os.path.isfile(os.path.join(os.path.dirname(found), "horovodrun")):
        raise invalid_value("--compare-python", path, expected)
    code = "from hvdtrain.runtime.compat import tensorflow_version as v; print(v())"
    env = {**os.environ, "PYTHONPATH": PACKAGE_ROOT}
    try:
        proc = subprocess.run(
            [found, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        version = proc.stdout.strip() if proc.returncode == 0 else "None"
    except (OSError, subprocess.TimeoutExpired):
        version = "None"
    if version == "None":
        raise invalid_value("--compare-python", path, expected)
    return found, version


def _worker_args(args, models=None, batch_sizes=None, extra=()):
    return (
        "--models",
        ",".join(models or args.models),
        "--batch-sizes",
        ",".join(str(b) for b in (batch_sizes or args.batch_sizes)),
        "--steps",
        args.steps,
        "--repeats",
        str(args.repeats),
        *extra,
    )


def plan_runs(args):
    """Every job of the run, in order (pure): the main comparison (`--rounds` times), the
    tuning experiments, the allreduce sweep."""
    runs = []
    for r in range(args.rounds):
        suffix = f"-r{r + 1}" if args.rounds > 1 else ""
        common = _worker_args(args)
        # At -np 1 Keras, hvdtrain and the baseline share one process (one start-up): there
        # is nothing to communicate, so what one of them sets cannot favour another.
        single = [v for v in args.variants if v != "mwms"]
        if r % 2:  # every other round in reverse order: no variant always goes first
            single.reverse()
        this = []
        if single:
            this.append(Run(f"np1-{'-'.join(single)}{suffix}", ",".join(single), 1, None, common))
        for variant in args.variants:
            if variant == "keras":
                continue
            if variant == "mwms":
                this.append(Run(f"mwms-np1{suffix}", "mwms", 1, None, common))
            backends = ["tfconfig"] if variant == "mwms" else args.backends
            for backend in backends:
                name = f"{variant}-np{args.np}-{backend}{suffix}"
                backend = None if variant == "mwms" else backend
                this.append(Run(name, variant, args.np, backend, common))
            if variant == "hvdtrain":  # the same N cores busy with no communication at all
                name = f"ceiling-np{args.np}{suffix}"
                this.append(Run(name, variant, args.np, INDEPENDENT, common, group="ceiling"))
        other = _other_stack(args, common, suffix) if args.compare_python else []
        runs += other + this if r % 2 else this + other  # neither stack always first
    if args.input:
        # The convnet from memory and from TFRecord files, and the file pipeline alone, side
        # by side in each round (the order turned round every other one), on the default
        # backend of one host.
        backend = "mpi" if "mpi" in args.backends else args.backends[0]
        order = ["hvdtrain", "hvdtrain-tfrecord", "input-tfrecord"]
        for r in range(args.rounds):
            suffix = f"-r{r + 1}" if args.rounds > 1 else ""
            for variant in order[:: -1 if r % 2 else 1]:
                runs.append(
                    Run(
                        f"input-{variant}-np{args.np}-{backend}{suffix}",
                        variant,
                        args.np,
                        backend,
                        _worker_args(args, ["convnet"], [64]),
                        group="input",
                    )
                )
    if args.tuning:
        planned = {}  # one job per distinct configuration; knobs that share it are tagged
        for knob, setting, np, backend, env, extra, model in TUNING:
            if backend and backend not in args.backends:
                continue
            n = np or args.np
            # Setting a knob to hvdtrain's default is the default configuration: one job.
            defaults = {**tuning.horovod_settings({"HOROVOD_SIZE": str(n)}), **_THREAD_DEFAULT}
            env = {k: v for k, v in env.items() if defaults.get(k) != v}
            if extra == ("--steps-per-execution", str(_SPE)):
                extra = ()
            key = (n, backend, tuple(sorted(env.items())), extra, model)
            if key not in planned:
                planned[key] = Run(
                    f"tune{len(planned) + 1:02d}-{model}-np{n}"
                    + (f"-{backend}" if backend else ""),
                    "hvdtrain",
                    n,
                    backend,
                    _worker_args(args, [model], [64], extra),
                    dict(env),
                    group="tuning",
                )
                runs.append(planned[key])
            planned[key].tags.append((knob, setting))
    if args.sweep:
        sizes = ",".join(str(s) for s in args.sweep_sizes)
        for backend in args.backends:
            extra = ("--sizes", sizes) + (("--raw-mpi",) if backend == "mpi" else ())
            runs.append(
                Run(
                    f"allreduce-np{args.np}-{backend}",
                    "allreduce",
                    args.np,
                    backend,
                    extra,
                    group="sweep",
                )
            )
    if args.profile:
        # Horovod timelines of the MLP at batch 64: hvdtrain's defaults, and Horovod's own
        # (1 ms cycle, spinning MPI waits, normal threads) on the same path.
        horovod = {
            "HOROVOD_CYCLE_TIME": "1",
            "OMPI_MCA_mpi_yield_when_idle": "0",
            "HVDTRAIN_HOROVOD_THREAD": "normal",
        }
        for backend in args.backends:
            for what, env in (("hvdtrain", {}), ("horovod-defaults", horovod)):
                name = f"profile-{what}-np{args.np}-{backend}"
                path = os.path.join(os.path.abspath(args.out), "timelines", f"{name}.json")
                runs.append(
                    Run(
                        name,
                        "hvdtrain",
                        args.np,
                        backend,
                        _worker_args(args, ["mlp"], [64]),
                        {**env, "HOROVOD_TIMELINE": path},
                        group="profile",
                        tags=[("settings", what)],
                    )
                )
    return runs


def _other_stack(args, common, suffix):
    """Keras and hvdtrain (at -np 1 and N) under `--compare-python`: the jobs of this stack's
    main comparison that the other stack can run, group "stack"."""
    single = [v for v in args.variants if v in STACK_VARIANTS]
    runs = []
    if single:
        name = f"stack-np1-{'-'.join(single)}{suffix}"
        runs.append(Run(name, ",".join(single), 1, None, common, group="stack"))
    if "hvdtrain" in args.variants:
        for backend in args.backends:
            name = f"stack-hvdtrain-np{args.np}-{backend}{suffix}"
            runs.append(Run(name, "hvdtrain", args.np, backend, common, group="stack"))
    # This process set TF_USE_LEGACY_KERAS=1 when it imported hvdtrain; TensorFlow 2.15's
    # tf.keras is Keras 2 and the variable would ask it for a tf_keras it does not have.
    keras2 = "1" if legacy_keras_needed(args.compare_tensorflow) else "0"
    for run in runs:
        run.python = args.compare_python
        run.env[LEGACY_KERAS] = keras2
    return runs


def _base_env(args):
    env = dict(os.environ)
    env["PYTHONPATH"] = PACKAGE_ROOT + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    env.update(
        TF_CPP_MIN_LOG_LEVEL=env.get("TF_CPP_MIN_LOG_LEVEL", "2"),
        PYTHONUNBUFFERED="1",
        HVDBENCH_CORES_PER_RANK=str(args.cores_per_rank),
        OMP_NUM_THREADS=str(args.cores_per_rank),
    )
    return env


def _progress(text):
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp}] {text}", file=sys.stderr, flush=True)


def _show(run):
    def on_result(r, final):
        if r.get("kind") == "allreduce":
            _progress(
                f"  {run.name}: {r['bytes']:>9} B  {r['seconds'] * 1e6:9.1f} us  "
                f"busbw {r['busbw'] / 1e9:6.2f} GB/s"
            )
            return
        label = f" [{r['label']}]" if r.get("label") else ""
        what = f"  {run.name}: {r['model']} b{r['batch_size']}{label}: "
        if not final:
            _progress(f"{what}{r['samples_per_sec']:,.0f} samples/s (median of all windows)")
            return
        ext = [e for e in r["external_cores"] if e is not None]
        noise = f"other processes took up to {max(ext):.2f} cores" if ext else "load unknown"
        _progress(
            f"{what}{r['samples_per_sec']:,.0f} samples/s ({r['step_ms']:.2f} ms/step) over "
            f"{r['quiet_windows']} quiet of {len(r['window_seconds'])} windows; {noise}"
            + (" [NOISY]" if r["noisy"] else "")
        )

    return on_result


def _environment():
    info = {
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu_model": None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from importlib import metadata

    for dist in ("tensorflow", "tensorflow-cpu", "horovod", "mpi4py"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return info


def _project_only():
    rows = project_mod.project(project_mod.default_workloads())
    print(project_mod.markdown(rows, project_mod.paper_check()))
    faster = [w for w in project_mod.default_workloads(0.0429, 1_199_882) if "P100" not in w["name"]
              and "CPU" not in w["name"]]  # fmt: skip
    print("\nExchanging less, a projection (--sync local every H steps: the weights; "
          "accuracy not modelled):\n")  # fmt: skip
    print(project_mod.exchange_markdown(project_mod.exchange_less(faster)))
    return 0


def main(argv=None):
    try:
        args = parse_args(argv)
        if args.project:
            return _project_only()
        return run_benchmark(args)
    except HvdtrainError as e:
        exit_with_error(PROG, e)
    except KeyboardInterrupt:
        return 130


def run_benchmark(args):
    """Runs every planned job and writes bench.json, bench.md and bench.png to args.out."""
    out = os.path.abspath(args.out)
    try:
        os.makedirs(os.path.join(out, "timelines"), exist_ok=True)
    except OSError as e:
        raise invalid_value(
            "--out", args.out, f"a folder that can be created ({e.strerror})"
        ) from None
    runs = plan_runs(args)
    base = _base_env(args)
    started = time.time()
    _progress(f"{len(runs)} jobs; -np {args.np}, one job at a time; output in {out}")
    first = quiet_wait(300 if args.quiet_wait else 0, log=_progress)
    _progress(f"machine: load average {first['load_average']}, {first['busy_cores']} cores busy")
    records = []
    for i, run in enumerate(runs, 1):
        _progress(f"[{i}/{len(runs)}] {run.name}")
        record = execute(
            run,
            os.path.join(out, "logs"),
            base,
            JOB_TIMEOUT,
            _show(run),
            quiet_seconds=args.quiet_wait,
            log=_progress,
        )
        if not record["ok"]:
            _progress(f"  {run.name} FAILED (exit {record['exit_codes']}); see {record['log']}")
        records.append(record)
    data = {
        "schema": 1,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([PROG, *(sys.argv[1:] if argv_is_cli() else [])]),
        "environment": _environment(),
        "config": {
            "np": args.np,
            "quick": args.quick,
            "models": args.models,
            "batch_sizes": args.batch_sizes,
            "backends": args.backends,
            "variants": args.variants,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "steps_per_window": args.steps,
            "cores_per_rank": args.cores_per_rank,
            "quiet_wait_seconds": args.quiet_wait,
            "compare_python": args.compare_python,
            "compare_tensorflow": args.compare_tensorflow,
        },
        "machine_at_start": first,
        "wall_seconds": round(time.time() - started, 1),
        "runs": records,
    }
    data.update(
        report.summarize(records, args.np, DEFAULT_BACKEND, TUNING_DEFAULTS, MLP_GRADIENT_BYTES)
    )
    data["projection"] = report.projection(data)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(render.markdown(data))
    render.plot(data, os.path.join(out, "bench.png"))
    _progress(f"done in {data['wall_seconds']:.0f} s: {out}/bench.json, bench.md, bench.png")
    failed = [r["name"] for r in records if not r["ok"]]
    if failed:
        _progress(f"{len(failed)} job(s) failed: {', '.join(failed)}")
        return 1
    return 0


def argv_is_cli():
    return bool(sys.argv and sys.argv[0].endswith(("__main__.py", "bench")))
