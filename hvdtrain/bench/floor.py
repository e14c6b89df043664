"""The floor: the least that synchronous data parallelism costs on this machine, whatever
software exchanges the gradient (the performance issue's question: are its targets within
reach?).

    python -m hvdtrain.bench.floor --out out/floor --rounds 3
    python -m hvdtrain.bench.floor --out out/floor128 --rounds 2 --batch-size 128
    python -m hvdtrain.bench.floor --out out/floor --quick   # the smoke run (a minute)

One training loop (the MNIST MLP or `--model convnet`, per-rank batch 64 or `--batch-size`,
Adam, 16 steps per `tf.function` call as hvdtrain's `steps_per_execution`, one core per
rank), run as these jobs, interleaved round by round (the order reversed in even rounds):

- `alone`: one process, no exchange: the step's compute;
- `side-by-side`: two such processes at once, unconnected (this machine's ceiling);
- under `mpirun -np 2` (the commands `hvdtrain-run` builds), the gradient as one flat
  buffer handed to NumPy every step (`tf.numpy_function`), and there:
  - `copy`: copied, no exchange (the detour itself);
  - `sync`: a 4-byte `MPI_Allreduce` (mpi4py) and the copy: the ranks wait for each other
    every step, but no gradient moves; then the same 4 bytes in a tight loop, the ranks
    arriving together (the bare latency);
  - `mpi`: the whole gradient's `MPI_Allreduce` (sum, then / 2): the least software any
    MPI-based exchange can have;
- `horovod`: Horovod's grouped allreduce (average) inside the same loop, after
  `hvdtrain.init()` (hvdtrain's settings), no NumPy detour.

The time inside the NumPy exchange is measured in each job, every step. The bare call's
time (`mpi`) added to the step of two unconnected processes is the floor: the shortest
step any exchange of the whole gradient every step can give, with no copy at all.
`floor.json` and `floor.md` go to `--out`; the launcher side never imports TensorFlow (the
workers are this module with `--exchange`).
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
CALLS = {"mlp": 60, "convnet": 4}  # per timed window: about 2.5 and 8 seconds on one core
WINDOWS = 5


def decompose(ms, inside):
    """The floor, from `ms` ({job: ms per step}, medians over rounds) and `inside` (medians of
    what was timed inside the NumPy exchange: "copy", "sync" and "mpi" in ms, "together" in
    µs). Pure.

    The bare `MPI_Allreduce` call timed inside the step (the `mpi` job: the wait for the
    slower rank, the transfer, the sum and the / 2) added to the step of two unconnected
    processes is the shortest step any exchange of the whole gradient can give: it leaves out
    every copy."""
    alone, pair = ms["alone"], ms["side-by-side"]
    floor = pair + inside["mpi"]
    return {
        "efficiency": {job: alone / step for job, step in ms.items() if job != "alone"},
        "ceiling": alone / pair,
        "bare_allreduce_ms": inside["mpi"],
        "waiting_ms": inside["sync"] - inside["copy"],  # the 4-byte allreduce, less the copy
        "latency_together_us": inside["together"],
        "floor_step_ms": floor,
        "best_efficiency": alone / floor,
        "horovod_added_ms": ms["horovod"] - pair,
    }


def markdown(ms, parts):
    """The report's two tables. Pure."""
    lines = ["| job | ms per step | efficiency (alone / step) |", "| --- | --- | --- |"]
    lines += [f"| {job} | {step:.2f} | {parts['efficiency'].get(job, 1.0):.2f} |"
              for job, step in ms.items()]  # fmt: skip
    rows = [
        ("two processes side by side, no exchange: the step", f"{ms['side-by-side']:.2f}"),
        ("the bare `MPI_Allreduce` of the gradient, timed inside the step (mpi)",
         f"{parts['bare_allreduce_ms']:.2f}"),
        ("of which waiting for the slower rank (sync's 4 bytes, less copy's copy)",
         f"{parts['waiting_ms']:.2f}"),
        ("the same 4 bytes with the ranks arriving together",
         f"{parts['latency_together_us'] / 1000:.3f}"),
        ("the floor: side by side + the bare call (no copies at all)",
         f"{parts['floor_step_ms']:.2f}"),
        ("Horovod's job over side by side (everything it adds)",
         f"{parts['horovod_added_ms']:.2f}"),
    ]  # fmt: skip
    lines += ["", "| -np 2 | ms |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    lines += [
        "",
        f"Ceiling (alone / side by side): {parts['ceiling']:.2f}. Efficiency at the floor: "
        f"{parts['best_efficiency']:.2f} at best; Horovod's job: "
        f"{parts['efficiency']['horovod']:.2f}.",
    ]
    return "\n".join(lines) + "\n"


def _worker(exchange, model_name, batch, calls):
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

    model = build_model(model_name, tf.keras)
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
    p.add_argument("--model", choices=("mlp", "convnet"), default="mlp")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--quick", action="store_true", help="short windows, one round: a smoke run")
    p.add_argument("--quiet-wait", type=float, default=20, help="seconds, at most, per job")
    p.add_argument("--exchange", choices=("none", "copy", "sync", "mpi", "horovod"),
                   help="worker mode: one rank of one job (what the ranks run)")  # fmt: skip
    p.add_argument("--calls", type=int, help="calls of 16 steps per timed window (of 5): "
                   "by default 60 for the MLP, 4 for the convnet (seconds each)")  # fmt: skip
    args = p.parse_args(argv)
    if args.calls is None:
        args.calls = CALLS[args.model]
    if args.exchange:
        return _worker(args.exchange, args.model, args.batch_size, args.calls)
    for name, value in (("--rounds", args.rounds), ("--batch-size", args.batch_size),
                        ("--calls", args.calls)):  # fmt: skip
        if value < 1:
            raise HvdtrainError(invalid_value(name, value, "a whole number >= 1"))
    if args.quick:
        args.rounds, args.calls, args.quiet_wait = 1, max(1, args.calls // 15), 0
    from hvdtrain.bench.runner import Run, execute

    jobs, inside = {}, {}  # inside: figures timed inside the NumPy exchange, per round
    for r in range(args.rounds):
        order = JOBS if r % 2 == 0 else JOBS[::-1]
        for job, exchange, np_, backend in order:
            worker_args = ("--exchange", exchange, "--model", args.model, "--batch-size",
                           str(args.batch_size), "--calls", str(args.calls))  # fmt: skip
            run = Run(f"floor-{job}-r{r}", "floor", np_, backend, worker_args)
            record = execute(run, os.path.join(args.out, "logs"), dict(os.environ), 600,
                             lambda *_, **__: None, quiet_seconds=args.quiet_wait)  # fmt: skip
            figures = [x["ms_per_step"] for x in record["results"] if x.get("kind") == "floor"]
            if not record["ok"] or len(figures) != (2 if backend == "independent" else 1):
                raise HvdtrainError(f"the floor's job {run.name} failed: see {record['log']}")
            jobs.setdefault(job, []).append(statistics.mean(figures))
            for x in record["results"]:
                if x.get("numpy_exchange_ms") is not None:
                    inside.setdefault(job, []).append(x["numpy_exchange_ms"])
                if x.get("allreduce_4_bytes_together_us") is not None:
                    inside.setdefault("together", []).append(x["allreduce_4_bytes_together_us"])
            print(f"round {r + 1}: {job} {jobs[job][-1]:.2f} ms per step", file=sys.stderr)
    ms = {job: statistics.median(values) for job, values in jobs.items()}
    ms = {job: ms[job] for job, *_ in JOBS}
    parts = decompose(ms, {key: statistics.median(values) for key, values in inside.items()})
    report = markdown(ms, parts)
    report += "\nRound by round (ms per step; inside: ms in the exchange, together: µs):\n\n"
    listed = [*jobs.items(), *((f"inside {key}", values) for key, values in inside.items())]
    report += "".join(
        f"- {key}: {', '.join(f'{v:.3g}' for v in values)}\n" for key, values in listed
    )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "floor.json"), "w") as f:
        json.dump({"model": args.model, "batch_size": args.batch_size, "rounds": jobs,
                   "inside": inside, "ms_per_step": ms, **parts},
                  f, indent=1)  # fmt: skip
    with open(os.path.join(args.out, "floor.md"), "w") as f:
        f.write(report)
    print(report)
    return 0


def main(argv=None):
    return cli_main(_run, argv, prog="python -m hvdtrain.bench.floor")


if __name__ == "__main__":
    sys.exit(main())
