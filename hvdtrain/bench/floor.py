"""The floor: what synchronous data parallelism of the MLP costs on this machine, whatever
software exchanges the gradient.

    python -m hvdtrain.bench.floor --out out/floor --rounds 3
    python -m hvdtrain.bench.floor --out out/floor --quick   # the smoke run (a minute)

One training loop (the MNIST MLP, per-rank batch 64 or `--batch-size`, Adam, 16 steps per
`tf.function` call as hvdtrain's `steps_per_execution`, one core per rank), run as these
jobs, interleaved round by round (the order reversed in even rounds):

- `alone`: one process, no exchange: the step's compute;
- `side-by-side`: two such processes at once, unconnected (this machine's ceiling);
- under `mpirun -np 2` (the commands `hvdtrain-run` builds), the gradient as one flat
  buffer handed to NumPy every step (`tf.numpy_function`), and there:
  - `copy`: copied, no exchange (the cost of the detour itself);
  - `sync`: a 4-byte `MPI_Allreduce` (mpi4py) and the copy: the ranks wait for each other
    every step, but no gradient moves;
  - `mpi`: the 1.08 MB `MPI_Allreduce` (sum, then / 2): the least software any
    MPI-based exchange can have;
- `horovod`: Horovod's grouped allreduce (average) inside the same loop, after
  `hvdtrain.init()` (hvdtrain's settings), no NumPy detour.

The differences between consecutive jobs split the step: `sync - copy` is the price of
synchronising every step (the ranks' steps are not equally long: the faster one waits),
`mpi - sync` that of moving and summing the gradient, `horovod - mpi` Horovod's own path
against the bare one. `floor.json` and `floor.md` go to `--out`; the launcher side never
imports TensorFlow (the workers are this module with `--exchange`).
"""

import argparse
import json
import os
import statistics
import sys
import time

from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.errors import main as cli_main

__all__ = ["main", "JOBS", "decompose", "markdown"]

# (job, exchange, processes, backend); backend None: one process, "independent": unconnected.
JOBS = (
    ("alone", "none", 1, None),
    ("side-by-side", "none", 2, "independent"),
    ("copy", "copy", 2, "mpi"),
    ("sync", "sync", 2, "mpi"),
    ("mpi", "mpi", 2, "mpi"),
    ("horovod", "horovod", 2, "mpi"),
)
STEPS_PER_CALL = 16
WINDOWS = 5


def decompose(ms):
    """The step split by job differences (ms), and the efficiencies, from `ms`: {job: ms per
    step}. Pure."""
    alone, pair = ms["alone"], ms["side-by-side"]
    parts = {
        "compute, one core alone": alone,
        "two processes side by side (no exchange)": pair - alone,
        "the NumPy detour (flat buffer, copy)": ms["copy"] - pair,
        "synchronising every step (4-byte allreduce)": ms["sync"] - ms["copy"],
        "moving and summing the gradient (MPI_Allreduce, 1.08 MB)": ms["mpi"] - ms["sync"],
    }
    # The least any synchronous exchange costs: the wait and the transfer, no copies at all.
    floor = pair + parts["synchronising every step (4-byte allreduce)"]
    floor += parts["moving and summing the gradient (MPI_Allreduce, 1.08 MB)"]
    return {
        "parts_ms": parts,
        "horovod_minus_mpi_ms": ms["horovod"] - ms["mpi"],
        "efficiency": {job: alone / step for job, step in ms.items() if job != "alone"},
        "ceiling": alone / pair,
        "floor_step_ms": floor,
        "best_efficiency": alone / floor,
    }


def markdown(ms, parts):
    """The report's two tables. Pure."""
    lines = ["| job | ms per step | efficiency (alone / step) |", "| --- | --- | --- |"]
    lines += [f"| {job} | {step:.2f} | {parts['efficiency'].get(job, 1.0):.2f} |"
              for job, step in ms.items()]  # fmt: skip
    lines += ["", "| part of the -np 2 step | ms |", "| --- | --- |"]
    lines += [f"| {name} | {value:+.2f} |" for name, value in parts["parts_ms"].items()]
    lines += [
        f"| Horovod's path against the bare MPI one (horovod - mpi) | "
        f"{parts['horovod_minus_mpi_ms']:+.2f} |",
        "",
        f"Ceiling (alone / side by side): {parts['ceiling']:.2f}. With no copies at all, a step "
        f"is at least {parts['floor_step_ms']:.2f} ms: efficiency {parts['best_efficiency']:.2f} "
        "at best.",
    ]
    return "\n".join(lines) + "\n"


def _worker(exchange, batch, calls):
    from hvdtrain.bench.workers import MARKER, _bind

    _bind()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np

    if exchange == "horovod":
        import horovod.tensorflow as hvd

        import hvdtrain

        hvdtrain.init(threads=1)
        rank, size = hvd.rank(), hvd.size()
        import tensorflow as tf
    else:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        rank, size = 0, 1
        if exchange != "none":
            from hvdtrain import tuning

            os.environ.update(tuning.horovod_settings(os.environ))  # MPI waits yield, as hvdtrain's
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
            rank, size = comm.Get_rank(), comm.Get_size()
    from hvdtrain.models import build_model

    model = build_model("mlp", tf.keras)
    variables = model.trainable_variables
    shapes = [v.shape for v in variables]
    sizes = [int(np.prod(s)) for s in shapes]
    opt = tf.keras.optimizers.Adam(1e-3)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(rank)
    n = batch * 64
    xs = tf.constant(rng.random((n, 28, 28, 1), dtype=np.float32))
    ys = tf.constant(rng.integers(0, 10, n).astype(np.int64))
    spent = [0.0, 0]  # seconds inside the NumPy exchange, calls

    def numpy_exchange(flat):
        start = time.perf_counter()
        out = np.empty_like(flat)
        if exchange == "mpi":
            comm.Allreduce(flat, out, op=MPI.SUM)
            out *= 1.0 / size
        else:
            if exchange == "sync":
                comm.Allreduce(flat[:1], out[:1], op=MPI.SUM)
            out[:] = flat
        spent[0] += time.perf_counter() - start
        spent[1] += 1
        return out

    def exchange_gradients(grads):
        if exchange == "none":
            return grads
        if exchange == "horovod":
            return hvd.grouped_allreduce(grads, op=hvd.Average)
        flat = tf.concat([tf.reshape(g, [-1]) for g in grads], 0)
        out = tf.numpy_function(numpy_exchange, [flat], tf.float32, stateful=True)
        out.set_shape(flat.shape)
        return [tf.reshape(p, s) for p, s in zip(tf.split(out, sizes), shapes, strict=True)]

    @tf.function
    def steps(start, count):
        for i in tf.range(count):
            j = (start + i) % 64
            x, y = xs[j * batch : (j + 1) * batch], ys[j * batch : (j + 1) * batch]
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = exchange_gradients(tape.gradient(loss, variables))
            opt.apply_gradients(zip(grads, variables, strict=True))
        return loss

    if exchange == "horovod":
        hvd.broadcast_variables(variables, 0)
    for k in range(max(3, calls // 3)):  # warm-up: tracing, caches
        steps(tf.constant(k * STEPS_PER_CALL), tf.constant(STEPS_PER_CALL))
    spent[:] = [0.0, 0]
    windows = []
    for _ in range(WINDOWS):
        start = time.perf_counter()
        for k in range(calls):
            steps(tf.constant(k * STEPS_PER_CALL), tf.constant(STEPS_PER_CALL)).numpy()
        windows.append(1e3 * (time.perf_counter() - start) / (calls * STEPS_PER_CALL))
    together = None
    if exchange == "sync":  # the same 4 bytes with the ranks arriving together: the latency
        one, out = np.ones(1, np.float32), np.empty(1, np.float32)
        comm.Barrier()
        times = []
        for _ in range(2000):
            start = time.perf_counter()
            comm.Allreduce(one, out, op=MPI.SUM)
            times.append(time.perf_counter() - start)
        together = 1e6 * statistics.median(times)
    if rank == 0:
        result = {
            "kind": "floor",
            "exchange": exchange,
            "np": size,
            "batch_size": batch,
            "ms_per_step": statistics.median(windows),
            "windows_ms": windows,
            "numpy_exchange_ms": 1e3 * spent[0] / spent[1] if spent[1] else None,
            "allreduce_4_bytes_together_us": together,
        }
        print(MARKER + json.dumps(result), flush=True)
    return 0


def _run(argv):
    p = argparse.ArgumentParser(prog="python -m hvdtrain.bench.floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", default="out/floor", help="folder for floor.json and floor.md")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--quick", action="store_true", help="short windows, one round: a smoke run")
    p.add_argument("--quiet-wait", type=float, default=20, help="seconds, at most, per job")
    p.add_argument("--exchange", help=argparse.SUPPRESS)  # worker mode (the launched ranks)
    p.add_argument("--calls", type=int, default=60, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.exchange:
        return _worker(args.exchange, args.batch_size, args.calls)
    for name, value in (("--rounds", args.rounds), ("--batch-size", args.batch_size)):
        if value < 1:
            raise HvdtrainError(invalid_value(name, value, "a whole number >= 1"))
    if args.quick:
        args.rounds, args.calls, args.quiet_wait = 1, 4, 0
    from hvdtrain.bench.runner import Run, execute

    jobs, inside = {}, {}  # inside: figures timed inside the NumPy exchange, per round
    for r in range(args.rounds):
        order = JOBS if r % 2 == 0 else JOBS[::-1]
        for job, exchange, np_, backend in order:
            worker_args = ("--exchange", exchange, "--batch-size", str(args.batch_size),
                           "--calls", str(args.calls))  # fmt: skip
            run = Run(f"floor-{job}-r{r}", "floor", np_, backend, worker_args)
            record = execute(run, os.path.join(args.out, "logs"), dict(os.environ), 600,
                             lambda *_, **__: None, quiet_seconds=args.quiet_wait)  # fmt: skip
            figures = [x["ms_per_step"] for x in record["results"] if x.get("kind") == "floor"]
            if not record["ok"] or len(figures) != (2 if backend == "independent" else 1):
                raise HvdtrainError(f"the floor's job {run.name} failed: see {record['log']}")
            jobs.setdefault(job, []).append(statistics.mean(figures))
            for x in record["results"]:
                for key in ("numpy_exchange_ms", "allreduce_4_bytes_together_us"):
                    if x.get(key) is not None:
                        inside.setdefault(f"{job}: {key}", []).append(x[key])
            print(f"round {r + 1}: {job} {jobs[job][-1]:.2f} ms per step", file=sys.stderr)
    ms = {job: statistics.median(values) for job, values in jobs.items()}
    ms = {job: ms[job] for job, *_ in JOBS}
    parts = decompose(ms)
    report = markdown(ms, parts)
    report += "\nTimed inside the exchange, round by round:\n\n" + "".join(
        f"- {key}: {', '.join(f'{v:.3g}' for v in values)}\n" for key, values in inside.items()
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "floor.json"), "w") as f:
        json.dump({"batch_size": args.batch_size, "rounds": jobs, "inside": inside,
                   "ms_per_step": ms, **parts},
                  f, indent=1)  # fmt: skip
    with open(os.path.join(args.out, "floor.md"), "w") as f:
        f.write(report)
    print(report)
    return 0


def main(argv=None):
    return cli_main(_run, argv, prog="python -m hvdtrain.bench.floor")


if __name__ == "__main__":
    sys.exit(main())
