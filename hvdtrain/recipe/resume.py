"""Where a run resumes: the step from a checkpoint's manifest (`resume_step`, pure), and what
rank 0 reads from the newest valid checkpoint for every rank (`from_newest`).

    step = resume_step({"epoch": 3, "step": 8, "global_batch": 128}, steps=16, global_batch=64)

The rule: keep the completed epochs and the samples seen in the interrupted one. With
another global batch (another number of ranks), the step in the epoch is the number of whole
new batches those samples fill; the optimizer's step (and so the learning-rate schedule)
is set to the result. The metrics of the epochs before, a callback's stop and the
single-worker rates the callbacks set come back with it.
"""

import dataclasses
import os

import horovod.tensorflow as hvd
import numpy as np

from hvdtrain.errors import HvdtrainError
from hvdtrain.recipe import names
from hvdtrain.runtime import process

__all__ = ["Resumed", "from_newest", "resume_step", "steering"]


def resume_step(saved, steps, global_batch, accumulate=1):
    """The global step to resume at from a checkpoint's manifest (`epoch`, `step`,
    `global_batch`), for a run with `steps` per epoch and `global_batch` samples per step.

    Pure. The rule: keep the completed epochs and the samples seen in the interrupted one;
    with another global batch (another number of ranks), the step in the epoch is the
    number of whole new batches those samples fill, rounded down to a whole accumulation
    cycle. The optimizer's step (and so the LR schedule) is set to the result.
    """
    epoch, step = int(saved.get("epoch") or 0), int(saved.get("step") or 0)
    old_batch = saved.get("global_batch") or global_batch
    step = min(step * old_batch // global_batch, steps - 1) if step else 0
    step -= step % accumulate
    return epoch * steps + step


def steering(schedules, model, epochs):
    """What a checkpoint records of the callbacks' steering (its manifest's `extra`, which
    `from_newest` reads back): a stop (at this epoch's end, of a run that asked for
    `epochs`), and the single-worker rates they set, by optimizer name."""
    changed = {
        name: float(s.rate.numpy())
        for name, s in schedules.items()
        if s.rate is not None and s.rate.numpy() != np.float32(s.base_lr)
    }
    out = {"single_worker_lr": changed} if changed else {}
    if getattr(model, "stop_training", False):
        out["stopped"] = epochs
    return out


@dataclasses.dataclass(frozen=True)
class Resumed:
    """What a run starts from: the global step, the metrics of the epochs before it, the
    epoch after which a callback stopped training (0-based, or None) and where the
    checkpoint put the run (the metrics JSON's `resumed_from`: its `epoch` and `step`
    counted from 1 as its folder's name and hvdtrain's lines count them (`names`), the
    folder's name `checkpoint`, and the `optimizer_iterations` this run starts at; None: a
    start from scratch)."""

    start_step: int = 0
    history: dict = dataclasses.field(default_factory=dict)
    stopped: int | None = None
    where: dict | None = None


def from_newest(manager, cfg, place, steps, batch_size, schedules, log):
    """Every rank's `Resumed`, from the newest valid checkpoint in `manager`'s folder (read on
    rank 0, broadcast), or from scratch (a collective: every rank calls it).

    Args:
        manager: the run's `CheckpointManager`, or None (no --checkpoint-dir).
        cfg: the run's `TrainConfig` (`epochs`, `accumulate`, `require_resume`).
        place: this rank's `Placement`.
        steps: steps per epoch of this run.
        batch_size: this run's batch per rank and step (the data's own, or --batch-size).
        schedules: {name: WarmupSchedule} of the run's optimizers: the single-worker rates
            the callbacks set before are set again.
        log: this rank's logger.
    """
    if not manager:
        return Resumed()
    global_batch = batch_size * place.size

    # Horovod: rank 0 reads the checkpoint; the broadcast hands it to every rank.
    def latest():
        found = manager.latest()  # the folder was checked before
        if found is None and cfg.require_resume:
            raise HvdtrainError(
                f"nothing to resume from in --checkpoint-dir {manager.directory}: "
                f"{manager.found()}; --require-resume refuses to start over. Point "
                "--checkpoint-dir at the run's checkpoints, or drop --require-resume to "
                "start from scratch."
            )
        if found is None and manager.skipped:
            log.warning(
                "no usable checkpoint in %s: %s; starting from scratch and leaving them as "
                "they are (--require-resume refuses to start over)",
                manager.directory,
                manager.found(),
            )
        if found is None:
            return None
        return {**manager.restore(found).to_dict(), "folder": os.path.basename(found.path)}

    saved = process.agree(latest, root_only=True)
    saved = hvd.broadcast_object(saved, root_rank=0, name="hvdtrain.recipe.resume")
    if not saved:
        return Resumed()
    step = resume_step(saved, steps, global_batch, cfg.accumulate)
    # The metrics of the epochs done before, so the metrics JSON covers the whole job.
    done = step // steps
    history = {k: list(v)[:done] for k, v in (saved.get("history") or {}).items() if list(v)[:done]}
    extra = saved.get("extra") or {}
    stopped = None
    # A callback's stop holds for the same command; asking for more epochs trains on.
    if extra.get("stopped") and step % steps == 0 and cfg.epochs <= extra["stopped"]:
        stopped = step // steps - 1
    for name, rate in (extra.get("single_worker_lr") or {}).items():
        schedule = schedules.get(name)
        if schedule is not None and schedule.rate is not None:
            schedule.set_single_worker(rate)  # what a callback set before the resume
    # Where the checkpoint was, as its folder's name and the lines say it (`names`).
    written = saved.get("steps_per_epoch") or steps
    epoch, in_epoch = names.human(saved["epoch"] * written + saved["step"], written)
    where = {
        "epoch": epoch,
        "step": in_epoch,
        "checkpoint": saved.get("folder") or names.folder_name(saved["epoch"], saved["step"]),
        "optimizer_iterations": step,
    }
    if saved.get("global_batch") not in (None, global_batch):
        log.warning(
            "the checkpoint was written with %s rank(s) x batch %d; this run has %d x %d: "
            "resuming after %s (the same samples seen; the LR schedule follows the step). "
            "The global batch changed: the results will differ.",
            saved.get("size"),
            saved["global_batch"] // (saved.get("size") or 1),
            place.size,
            batch_size,
            names.describe(step, steps),
        )
    if step >= cfg.epochs * steps:  # nothing left to train: no epoch to resume at
        log.info(
            "the checkpoint in %s is after epoch %d: all %d epoch(s) trained",
            manager.directory,
            step // steps,
            cfg.epochs,
        )
    else:
        log.info(
            "resuming %s (global step %d) from %s",
            f"after {names.describe(step, steps)}" if step else "at the start",
            step,
            os.path.join(manager.directory, where["checkpoint"]),
        )
    return Resumed(step, history, stopped, where)
