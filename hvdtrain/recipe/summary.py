"""The metrics JSON: the one owner of its format (`VERSION`), what a run writes to
`--metrics-json` on rank 0 and what `hvdtrain.fit` returns on every rank.

    {"metrics_version": 2, "prog": "train.py", "status": "finished", "size": 2,
     "epochs": 15, ..., "test_accuracy": 0.9933, "ranks": [{"rank": 0, ...}, ...]}

`running` (the figures so far: what a run that stopped on an error writes, with its
`status` and `error`) and `finished` (with the test results and every rank's digest) make
it from a `hvdtrain.recipe.trainer.Run`; `write` puts it on disk on rank 0.
"""

import time

from hvdtrain.recipe import names, outputs
from hvdtrain.runtime import process

__all__ = [
    "VERSION",
    "failed",
    "finished",
    "first_line",
    "last_line",
    "rank_report",
    "running",
    "write",
]

# Raised when a key changes meaning or goes away (a new key keeps it). 2 (2026-12):
# `resumed_from`'s `epoch` is the epoch the checkpoint was in, from 1, as its folder's name
# says (`hvdtrain.recipe.names`); 1 gave the epochs done before it. `initial_epoch` is still
# the epochs done before this run (Keras's `initial_epoch`).
VERSION = 2


def rank_report(run):
    """Every rank's entry of the metrics JSON's `ranks` (a collective): its host, pid, weights
    digest and its own figures (its exchange's)."""
    return process.rank_report(run.built.model, **run.built.exchange.rank_figures())


def running(run):
    """The run's figures so far (what the metrics JSON holds before the test results)."""
    cfg, b, plan = run.cfg, run.built, run.plan
    rates = run.throughput
    steps = plan.steps or 1
    reported = b.reported
    return {
        "metrics_version": VERSION,
        "prog": run.prog,
        "status": "running",
        "size": plan.place.size,
        "keras": b.keras.NAME,
        "epochs": cfg.epochs,
        "initial_epoch": (run.resumed or {}).get("optimizer_iterations", 0) // steps,
        "resumed_from": run.resumed,
        "steps_per_epoch": plan.steps,
        "steps_per_execution": min(b.steps_per_execution, steps),
        "batch_size": plan.batch_size,
        "global_batch_size": plan.global_batch,
        "samples_per_epoch": plan.steps * plan.global_batch,
        "deterministic": cfg.deterministic,
        "accumulate": cfg.accumulate,
        "mixed_precision": b.policy,
        "fp16_allreduce": cfg.fp16_allreduce,
        "sync": b.exchange.summary(),
        "lr_base": b.lr_base(),
        "lr_scaled": b.lr_scaled(),
        "lr_final": float(b.schedule(reported.iterations)),
        "warmup_steps": plan.warmup_steps,
        "optimizer_iterations": int(reported.iterations),
        "optimizers": {
            name: {
                "class": b.optimizers.classes[name],
                "iterations": int(opt.iterations),
                "lr_single_worker": float(
                    b.optimizers.schedules[name].single_worker(opt.iterations)
                ),
                "lr_final": float(b.optimizers.schedules[name](opt.iterations)),
                "loss_scale": b.keras.current_loss_scale(opt),
            }
            for name, opt in b.optimizers.by_name.items()
        },
        "stopped_early": None if run.stopped is None else run.stopped + 1,
        "data_source": plan.data.source,
        "train_samples": plan.data.num_samples,
        "train_samples_per_sec": rates.samples_per_sec if rates else None,
        "epoch_samples_per_sec": rates.epoch_samples_per_sec if rates else [],
        "wall_seconds": time.perf_counter() - run.wall,
        "history": run.history,
    }


def failed(run, error):
    """The metrics JSON of a run that stopped on `error` (with a `status`: it diverged, its
    ranks disagreed): the figures so far, the status and the error's words."""
    return {**running(run), "status": error.status, "error": str(error)}


def finished(run, result, ranks, **more):
    """The whole metrics JSON of a run that trained and evaluated: `result` the test
    metrics, `ranks` every rank's host, pid and weights digest, `more` keys over them."""
    return {
        **running(run),
        "status": "finished",
        "test": result,
        "test_samples": result.get("samples", 0),
        "test_loss": result.get("loss"),
        "test_accuracy": result.get("accuracy"),
        "ranks": ranks,
        **more,
    }


def write(path, out, rank):
    """Rank 0 writes `out` to `path` (if given); returns the path or None."""
    if rank == 0 and path:
        return outputs.write_json(path, out)
    return None


def first_line(run):
    """The run's first line on rank 0, once it has started (`Run.start`): `training on 2
    rank(s): 16 steps/epoch, batch 64/rank (128 global), lr 0.001 -> 0.002 over 16 steps, 16
    step(s) per execution`, then what else the run does (its exchange, a precision policy)."""
    cfg, b, plan = run.cfg, run.built, run.plan
    steps, start, size = plan.steps, plan.start_step, plan.place.size
    where = ""
    if cfg.elastic:  # where this (re)start begins
        after = f"after {names.describe(start, steps)}" if start else "at the start"
        where = f" {after} (global step {start})"
    accumulated = f", {cfg.accumulate} accumulated" if cfg.accumulate > 1 else ""
    base, scaled = b.lr_base(), b.lr_scaled()
    base = f"{base:g}" if isinstance(base, float) else base  # or the schedule's name
    scaled = f"{scaled:g}" if scaled else f"x{size}"
    more = f", {b.policy}" if b.policy else ""
    if exchange := b.exchange.describe():
        more += f"; {exchange}"
    if run.bound:  # hvdtrain.runtime.tuning.cores_for_rank
        more += f"; each rank bound to {len(run.bound)} core(s) (HVDTRAIN_CPU_BIND=none: unbound)"
    return (
        f"{'elastic: ' if cfg.elastic else ''}training on {size} rank(s){where}: {steps} "
        f"steps/epoch, batch {plan.batch_size}/rank ({plan.global_batch} global{accumulated}), "
        f"lr {base} -> {scaled} over {plan.warmup_steps} steps, "
        f"{min(b.steps_per_execution, steps)} step(s) per execution{more}"
    )


def last_line(out):
    """The run's last line on rank 0, from its finished metrics JSON `out`: `test: loss
    0.0312, accuracy 0.9933 on 10000 samples; 5120 samples/s; 95.1 s`."""
    result = out["test"]
    shown = ", ".join(
        f"{k} {v:.4f}" for k, v in result.items() if k != "samples" and isinstance(v, float)
    )
    rate = out["train_samples_per_sec"]
    samples = f" on {result['samples']} samples" if result.get("samples") else ""
    return "{}; {} samples/s; {:.1f} s".format(
        f"test: {shown}{samples}" if shown else "done (no test set)",
        f"{rate:.0f}" if rate else "n/a",
        out["wall_seconds"],
    )
