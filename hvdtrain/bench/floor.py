"""The floor: a lower bound on what synchronous data parallelism costs on this machine,
whatever software exchanges the gradient, and what the barest MPI exchange costs (the
performance issue's question: are its targets within reach?).

    python -m hvdtrain.bench.floor --out out/floor --rounds 3
    python -m hvdtrain.bench.floor --out out/floor128 --rounds 2 --batch-size 128
    python -m hvdtrain.bench.floor --out out/floor --quick   # the smoke run (a minute)
    python -m hvdtrain.bench.floor --out out/sync --sync 1,4,16,64 --backends mpi,gloo

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
  - `mpi`: the whole gradient's `MPI_Allreduce` (sum, then / n) into a buffer allocated
    once: the least software an MPI-based exchange can have; then the same allreduce in
    a tight loop, the ranks arriving together;
- `horovod`: Horovod's grouped allreduce (average) inside the same loop, after
  `hvdtrain.init()` (hvdtrain's settings), no NumPy detour;
- with `--sync H,...` (exchanging less, `hvdtrain.exchange`): `local-H`, the same loop with
  no exchange in the step, and hvdtrain's own exchange of `--sync local` (the weights
  averaged) after every H steps, the calls of min(16, H) steps; the exchange is also timed
  apart, in the loop and with the ranks arriving together; with `--backends mpi,gloo`
  these and `horovod` also under Gloo (`-gloo` after their names).

Each job times its calls inside the exchange on every rank, every step (the wait falls on
the faster rank: the ranks' mean is reported), and after its timed windows the same call
in a tight loop, the ranks arriving together. Two figures follow (`decompose`): a lower
bound, the unconnected step plus the wait (`sync`) plus the gradient's allreduce with the
ranks together (no copy, no averaging, nothing else), and the bare path, the unconnected
step plus the allreduce and the / n as they took inside the step. `floor.json` and
`floor.md` go to `--out`; the launcher side never imports TensorFlow (the workers are
this module with `--exchange`).
"""

import argparse
import json
import os
import statistics
import sys
import time

from hvdtrain.bench.runner import INDEPENDENT, Run, execute
from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.errors import main as cli_main

__all__ = ["main", "JOBS", "decompose", "markdown"]

# (job, exchange, processes, backend); backend None: one process, INDEPENDENT: unconnected.
JOBS = (
    ("alone", "none", 1, None),
    ("side-by-side", "none", 2, INDEPENDENT),
    ("copy", "copy", 2, "mpi"),
    ("sync", "sync", 2, "mpi"),
    ("mpi", "mpi", 2, "mpi"),
    ("horovod", "horovod", 2, "mpi"),
)
STEPS_PER_CALL = 16
CALLS = {"mlp": 60, "convnet": 4}  # per timed window: about 2.5 and 8 seconds on one core
SECONDS_PER_STEP = {"mlp": 0.01, "convnet": 0.5}  # at batch 64: 4x this machine's one core
WINDOWS = 5
TOGETHER = 200  # exchanges timed with the ranks arriving together (`local-H` jobs)
QUIET_WAIT = 20  # seconds, at most, that each job waits for other processes to leave the cores


def decompose(ms, inside):
    """The step's parts and the floor. Pure.

    Args:
        ms: {job: ms per step} (medians over rounds).
        inside: medians, in ms, of what the jobs timed inside the exchange, averaged over the
            ranks: "copy" (the copy), "sync" (the 4-byte `MPI_Allreduce` in the step: the
            wait for the slower rank), "mpi" (the gradient's `MPI_Allreduce` in the step),
            "scale" (the / n after it); and with the ranks arriving together, after the
            timed windows: "sync_together" (4 bytes: the latency) and "mpi_together" (the
            gradient: the transfer and the sum alone).

        and for each `local-H` job (`--sync`), {"local-H": {"exchange": ..., "together":
        ..., "together_cpu": ..., "overlap_cpu": ...}}: its exchange as it took in the loop
        (every H steps: the wait for the slower rank in it), in a tight loop with the ranks
        arriving together, the rank's CPU time in that exchange (all its threads: the work a
        core must do, which no overlap hides on a rank of one core), and the same for a
        round of `--sync-overlap` (its work at the exchange point, its thread's averaging,
        the landing: the eager update's own arithmetic on top of the exchange).

    The lower bound: the unconnected step, the wait and the transfer with the ranks
    together; no copy, no averaging, nothing else. The bare path: the unconnected step and
    the calls as they took inside the step (the `MPI_Allreduce` and the / n). A `local-H`
    job's parts: its local steps (its step less its exchange / H), its bound (the
    unconnected step and the exchange with the ranks together / H: no wait), and the bound
    of an overlap on one core (the unconnected step and the exchange's CPU time / H).
    """
    alone, pair = ms["alone"], ms["side-by-side"]
    bound = pair + inside["sync"] + inside["mpi_together"]
    bare = pair + inside["mpi"] + inside["scale"]
    return {
        "efficiency": {job: alone / step for job, step in ms.items() if job != "alone"},
        "of_ceiling": {job: pair / step for job, step in ms.items() if job != "alone"},
        "ceiling": alone / pair,
        "inside_ms": dict(inside),
        "bound_step_ms": bound,
        "bound_efficiency": alone / bound,
        "bare_step_ms": bare,
        "bare_efficiency": alone / bare,
        "horovod_added_ms": ms["horovod"] - pair,
        "local": {
            job: {
                **parts,
                "local_step": ms[job] - parts["exchange"] / _every(job),
                "bound_of_ceiling": pair / (pair + parts["together"] / _every(job)),
                "overlap_bound_of_ceiling": pair / (pair + parts["together_cpu"] / _every(job)),
                "overlapped_bound_of_ceiling": pair / (pair + parts["overlap_cpu"] / _every(job)),
            }
            for job, parts in inside.items()
            if job.startswith("local-")
        },
    }


def _overlapped_cpu(model, opt, every, step):
    """The process's mean CPU seconds (every thread) in a round of `--sync-overlap`'s
    exchange, the ranks arriving together: its work at the exchange point (which lands the
    round before), then its thread's averaging, waited for."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from hvdtrain.data.shares import EqualShares
    from hvdtrain.exchange import for_config
    from hvdtrain.recipe.flags import make_config

    cfg = make_config(sync="local", sync_every=every, sync_warmup_steps=0, sync_overlap=True)
    rounds = for_config(cfg)
    rounds.configure(None, every, EqualShares())
    rounds.attach(model, [opt])
    rounds.begin(step, 0)
    cpu = []
    for k in range(TOGETHER + 5):  # the first 5: tracing
        hvd.allreduce(tf.constant(0.0), name="floor.barrier").numpy()
        used = time.process_time()
        rounds.replica.step += 1
        rounds.now()
        rounds.averager.wait()
        if k >= 5:
            cpu.append(time.process_time() - used)
    rounds.now(whole=True)
    return statistics.mean(cpu)


def _every(job):
    """`local-16-gloo` -> 16."""
    return int(job.split("-")[1])


def markdown(ms, parts):
    """The report's two tables. Pure."""
    inside = parts["inside_ms"]
    lines = ["| job | ms per step | efficiency (alone / step) | of the ceiling |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    lines += [f"| {job} | {step:.2f} | {parts['efficiency'].get(job, 1.0):.2f} | "
              f"{parts['of_ceiling'].get(job, 1.0):.2f} |" for job, step in ms.items()]  # fmt: skip
    rows = [
        ("two processes side by side, no exchange: the step", ms["side-by-side"]),
        ("waiting for the slower rank: the 4-byte allreduce in the step (sync)", inside["sync"]),
        ("the same 4 bytes, the ranks arriving together", inside["sync_together"]),
        ("the gradient's allreduce in the step (mpi)", inside["mpi"]),
        ("the same, the ranks arriving together", inside["mpi_together"]),
        ("the / n after it (mpi)", inside["scale"]),
        ("lower bound: side by side + the wait + the allreduce together", parts["bound_step_ms"]),
        ("the bare path: side by side + the allreduce and / n in the step", parts["bare_step_ms"]),
        ("Horovod's job over side by side (everything it adds)", parts["horovod_added_ms"]),
    ]
    lines += ["", "| -np 2 | ms |", "| --- | --- |"]
    lines += [f"| {name} | {value:.3f} |" for name, value in rows]
    lines += [
        "",
        f"Efficiency: at the lower bound {parts['bound_efficiency']:.2f}, on the bare path "
        f"{parts['bare_efficiency']:.2f}, Horovod's job {parts['efficiency']['horovod']:.2f}; "
        f"ceiling (alone / side by side) {parts['ceiling']:.2f}.",
    ]
    if parts["local"]:
        lines += ["", "| job | the exchange in the loop, ms | the ranks together, ms | "
                  "its CPU, ms | local steps, ms per step | of the ceiling | its bound | "
                  "overlapped on one core, its bound | --sync-overlap's CPU, ms | its bound |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        lines += [f"| {job} | {p['exchange']:.2f} | {p['together']:.2f} | "
                  f"{p['together_cpu']:.2f} | {p['local_step']:.3f} | "
                  f"{parts['of_ceiling'][job]:.2f} | {p['bound_of_ceiling']:.2f} | "
                  f"{p['overlap_bound_of_ceiling']:.2f} | {p['overlap_cpu']:.2f} | "
                  f"{p['overlapped_bound_of_ceiling']:.2f} |"
                  for job, p in parts["local"].items()]  # fmt: skip
    return "\n".join(lines) + "\n"


def sync_jobs(every, backends):
    """The jobs `--sync` and `--backends` add. Pure."""
    out = []
    for backend in backends:
        suffix = "" if backend == "mpi" else f"-{backend}"
        if backend != "mpi":
            out.append((f"horovod{suffix}", "horovod", 2, backend))
        out += [(f"local-{h}{suffix}", f"local-{h}", 2, backend) for h in every]
    return tuple(out)


def _worker(exchange, model_name, batch, calls):
    from hvdtrain.bench.allreduce import _raw_mpi
    from hvdtrain.bench.workers import MARKER, _bind, _loss, synthetic_data

    _bind()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np

    comm = None
    local = int(exchange.partition("-")[2]) if exchange.startswith("local-") else 0
    per_call = STEPS_PER_CALL
    if local:  # hvdtrain's rule: a call's steps divide H; as many steps per window
        from hvdtrain.exchange import fitting_steps_per_execution

        per_call = fitting_steps_per_execution(STEPS_PER_CALL, local)
        calls = calls * STEPS_PER_CALL // per_call
    if exchange == "horovod" or local:
        import horovod.tensorflow as hvd

        import hvdtrain

        hvdtrain.init(threads=1, exchanges_rarely=bool(local))
        rank, size = hvd.rank(), hvd.size()
        import tensorflow as tf
    else:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        rank, size = 0, 1
        if exchange != "none":
            from hvdtrain.runtime import tuning

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
    loss_fn = _loss()
    x_np, y_np = synthetic_data(batch * 64, seed=rank)
    xs, ys = tf.constant(x_np), tf.constant(y_np)
    # Two result buffers, allocated once, used in turn: no allocation inside the timed calls.
    outs = [np.empty(sum(sizes), np.float32) for _ in range(2)]
    # Seconds, summed over the timed steps; local SGD's exchanges apart
    spent = {"call": 0.0, "scale": 0.0, "steps": 0, "exchange": 0.0, "exchanges": 0}

    def numpy_exchange(flat):
        out = outs[spent["steps"] % 2]
        start = time.perf_counter()
        if exchange == "mpi":
            comm.Allreduce(flat, out, op=MPI.SUM)
            mid = time.perf_counter()
            out *= 1.0 / size
            spent["scale"] += time.perf_counter() - mid
            spent["call"] += mid - start
        else:
            if exchange == "sync":
                comm.Allreduce(flat[:1], out[:1], op=MPI.SUM)
                spent["call"] += time.perf_counter() - start
            out[:] = flat
            if exchange == "copy":
                spent["call"] += time.perf_counter() - start
        spent["steps"] += 1
        return out

    def exchange_gradients(grads):
        if exchange == "none" or local:
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

    exchanges = None
    if exchange == "horovod" or local:
        hvd.broadcast_variables(variables, 0)
    if local:
        from hvdtrain.data.shares import EqualShares
        from hvdtrain.exchange import for_config
        from hvdtrain.recipe.flags import make_config

        opt.build(variables)
        exchanges = for_config(make_config(sync="local", sync_every=local, sync_warmup_steps=0))
        exchanges.configure(None, per_call, EqualShares())
        exchanges.attach(model, [opt])
        exchanges.begin(0, 0)
    done = 0

    def call(k):
        nonlocal done
        loss = steps(tf.constant(k * per_call), tf.constant(per_call))
        done += per_call
        if exchanges is not None and done % local == 0:
            exchanges.replica.step = done
            loss.numpy()  # the steps done: the exchange's own time, apart
            start = time.perf_counter()
            exchanges.now()
            spent["exchange"] += time.perf_counter() - start
            spent["exchanges"] += 1
        return loss

    for k in range(max(3, calls // 3)):  # warm-up: tracing, caches
        call(k)
    spent.update(call=0.0, scale=0.0, steps=0, exchange=0.0, exchanges=0)
    windows = []
    for _ in range(WINDOWS):
        start = time.perf_counter()
        for k in range(calls):
            call(k).numpy()
        windows.append(1e3 * (time.perf_counter() - start) / (calls * per_call))
    inside = {}
    if local:  # the exchange's ms as in the loop, then with the ranks arriving together
        mine = 1e3 * spent["exchange"] / max(spent["exchanges"], 1)
        together, cpu = [], []  # wall, and the process's CPU (every thread of it)
        for _ in range(TOGETHER):
            hvd.allreduce(tf.constant(0.0), name="floor.barrier").numpy()
            start, used = time.perf_counter(), time.process_time()
            exchanges.replica.step += 1
            exchanges.now()
            together.append(time.perf_counter() - start)
            cpu.append(time.process_time() - used)
        mine = (mine, 1e3 * statistics.median(together), 1e3 * statistics.mean(cpu),
                1e3 * _overlapped_cpu(model, opt, local, exchanges.replica.step))  # fmt: skip
        both = hvd.allgather_object(mine)
        inside = {"exchange": statistics.mean(m[0] for m in both),
                  "together": statistics.mean(m[1] for m in both),
                  "together_cpu": statistics.mean(m[2] for m in both),
                  "overlap_cpu": statistics.mean(m[3] for m in both),
                  "exchange_by_rank": [m[0] for m in both]}  # fmt: skip
    if comm is not None:  # every rank's mean per step (the wait falls on the faster one)
        n = max(spent["steps"], 1)
        mine = {"call": 1e3 * spent["call"] / n, "scale": 1e3 * spent["scale"] / n}
        if exchange in ("sync", "mpi"):  # the same call in a tight loop, the ranks together
            nbytes = 4 if exchange == "sync" else 4 * sum(sizes)
            mine["together"] = 1e3 * _raw_mpi(comm, [nbytes])[nbytes]
        ranks = comm.gather(mine, root=0)
        if rank == 0:
            inside = {key: statistics.mean(r[key] for r in ranks) for key in mine}
            inside["call_by_rank"] = [r["call"] for r in ranks]
    if rank == 0:
        result = {
            "kind": "floor",
            "exchange": exchange,
            "np": size,
            "batch_size": batch,
            "gradient_bytes": 4 * sum(sizes),
            "ms_per_step": statistics.median(windows),
            "windows_ms": windows,
            "inside_ms": inside,
        }
        print(MARKER + json.dumps(result), flush=True)
    return 0


def _inside(by_job):
    """{job: [inside_ms per round]} -> `decompose`'s `inside` (medians over rounds)."""
    med = {job: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]
                 if not key.endswith("_by_rank")} for job, rounds in by_job.items()}  # fmt: skip
    return {
        **{job: parts for job, parts in med.items() if job.startswith("local-")},
        "copy": med["copy"]["call"],
        "sync": med["sync"]["call"],
        "sync_together": med["sync"]["together"],
        "mpi": med["mpi"]["call"],
        "mpi_together": med["mpi"]["together"],
        "scale": med["mpi"]["scale"],
    }


def _timeout(model, batch, calls):
    """Seconds a job may take: a generous bound (4x this machine's step, one core) on its
    warm-up and timed windows, and 5 minutes for starting up."""
    step = SECONDS_PER_STEP[model] * batch / 64
    return 300 + (WINDOWS + 1) * calls * STEPS_PER_CALL * step


def _run(argv):
    p = argparse.ArgumentParser(prog="python -m hvdtrain.bench.floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--out", default="out/floor", help="folder for floor.json and floor.md")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", choices=("mlp", "convnet"), default="mlp")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--quick", action="store_true", help="short windows, one round: a smoke run")
    p.add_argument("--sync", default="", help="H,H,...: also local SGD exchanging every H steps")
    p.add_argument("--backends", default="mpi", help="mpi,gloo: --sync's jobs under these")
    p.add_argument("--exchange", help="worker mode: one rank of one job (what the ranks run)")
    p.add_argument("--calls", type=int, help="calls of 16 steps per timed window (of 5): "
                   "by default 60 for the MLP, 4 for the convnet (seconds each)")  # fmt: skip
    args = p.parse_args(argv)
    for name in ("rounds", "batch_size", "calls"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise invalid_value(f"--{name.replace('_', '-')}", value, "a whole number >= 1")
    if args.calls is None:
        args.calls = max(1, CALLS[args.model] // 15) if args.quick else CALLS[args.model]
    if args.exchange:
        return _worker(args.exchange, args.model, args.batch_size, args.calls)
    try:
        every = [int(h) for h in args.sync.split(",") if h.strip()]
    except ValueError:
        every = [0]
    if any(h < 1 for h in every):
        raise invalid_value("--sync", args.sync, "steps between exchanges, e.g. 1,4,16,64")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or set(backends) - {"mpi", "gloo"}:
        raise invalid_value("--backends", args.backends, "mpi, gloo or mpi,gloo")
    all_jobs = JOBS + sync_jobs(every, backends)
    quiet_wait = 0 if args.quick else QUIET_WAIT
    if args.quick:
        args.rounds = 1
    jobs, inside = {}, {}  # per job, round by round: ms per step; what was timed inside
    logs = os.path.join(os.path.abspath(args.out), "logs")
    for r in range(args.rounds):
        order = all_jobs if r % 2 == 0 else all_jobs[::-1]
        for job, exchange, np_, backend in order:
            worker_args = ("--exchange", exchange, "--model", args.model, "--batch-size",
                           str(args.batch_size), "--calls", str(args.calls))  # fmt: skip
            run = Run(f"floor-{job}-r{r}", "floor", np_, backend, worker_args)
            timeout = _timeout(args.model, args.batch_size, args.calls)
            record = execute(run, logs, dict(os.environ), timeout, lambda *_, **__: None,
                             quiet_seconds=quiet_wait)  # fmt: skip
            results = [x for x in record["results"] if x.get("kind") == "floor"]
            if not record["ok"] or len(results) != (2 if backend == INDEPENDENT else 1):
                why = f"timed out after {timeout:.0f} s" if record["timed_out"] else "failed"
                raise HvdtrainError(
                    f"the floor's job {run.name} {why}: see {os.path.join(logs, run.name)}.log"
                )
            jobs.setdefault(job, []).append(statistics.mean(x["ms_per_step"] for x in results))
            if results[0]["inside_ms"]:
                inside.setdefault(job, []).append(results[0]["inside_ms"])
            print(f"round {r + 1}: {job} {jobs[job][-1]:.2f} ms per step", file=sys.stderr)
    ms = {job: statistics.median(jobs[job]) for job, *_ in all_jobs}
    parts = decompose(ms, _inside(inside))
    report = markdown(ms, parts) + "\nRound by round, ms per step:\n\n"
    report += "".join(f"- {job}: {', '.join(f'{v:.3g}' for v in values)}\n"
                      for job, values in jobs.items())  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "floor.json"), "w") as f:
        json.dump({"model": args.model, "batch_size": args.batch_size, "rounds": jobs,
                   "inside_rounds": inside, "ms_per_step": ms, **parts},
                  f, indent=1)  # fmt: skip
    with open(os.path.join(args.out, "floor.md"), "w") as f:
        f.write(report)
    print(report)
    return 0


def main(argv=None):
    return cli_main(_run, argv, prog="python -m hvdtrain.bench.floor")


if __name__ == "__main__":
    sys.exit(main())
