"""The training loop every entry point shares: the Horovod recipe, from flags to metrics.

An entry point (`hvdtrain.mnist`, `hvdtrain.cifar10`, ...) adds its own flags to the common
ones, and hands `train` a model builder and a data loader::

    parser = trainer.make_parser("hvdtrain.mnist", __doc__, epochs=15, batch_size=32, lr=1e-3)
    args = trainer.parse(parser, argv)
    trainer.train(args, build_model=..., load_data=...)

`train` then does, in order: `hvd.init()` with GPU pinning and threads; data agreed by all
ranks; LR = base x size with a warmup; the distributed optimizer (optionally with fp16
gradient compression, local gradient accumulation, mixed precision); resume on rank 0
from the newest valid checkpoint; broadcast of weights and optimizer state; `fit` with
sample-weighted metrics and evaluation on every rank; rank-0 checkpoints, logs,
TensorBoard, export and metrics JSON; a final check that all ranks hold identical weights.
"""

import argparse
import os
import sys
import time

from hvdtrain.errors import HvdtrainError, invalid_value

__all__ = ["make_parser", "parse", "train", "resume_step", "Data"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump, no traceback
        raise HvdtrainError(f"{message}. See `{self.prog} --help`.")


def make_parser(prog, doc, *, epochs, batch_size, lr, warmup_epochs=1.0):
    """The flags every entry point has, with the entry point's defaults."""
    p = _Parser(
        prog=f"python -m {prog}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=epochs, help=f"epochs in all ({epochs})")
    g.add_argument(
        "--batch-size", type=int, default=batch_size, help=f"per-rank batch ({batch_size})"
    )
    g.add_argument(
        "--lr",
        type=float,
        default=lr,
        help=f"single-worker learning rate, scaled by the number of ranks after the warmup ({lr})",
    )
    g.add_argument(
        "--warmup-epochs",
        type=float,
        default=warmup_epochs,
        help=f"epochs to ramp the LR from --lr to --lr x ranks ({warmup_epochs:g})",
    )
    g.add_argument("--seed", type=int, default=0, help="random seed (0)")
    g.add_argument("--limit-samples", type=int, help="train on the first N samples only")
    g.add_argument("--threads", type=int, help="CPU threads per rank (cores / local ranks)")
    g.add_argument(
        "--mixed-precision",
        nargs="?",
        const="auto",
        choices=["auto", "float16", "bfloat16"],
        help="mixed precision: float16 on GPUs, bfloat16 on CPUs (auto); loss scaling for float16",
    )
    g.add_argument(
        "--fp16-allreduce",
        action="store_true",
        help="compress gradients to float16 for the allreduce (halves the bytes sent)",
    )
    g.add_argument(
        "--accumulate",
        type=int,
        default=1,
        help="average gradients of N local batches before each allreduce (1 = off)",
    )
    f = p.add_argument_group("files")
    f.add_argument("--checkpoint-dir", help="save each epoch here (rank 0) and resume from it")
    f.add_argument("--keep-checkpoints", type=int, default=2, help="checkpoints kept (2)")
    f.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="also checkpoint every N steps mid-epoch; a resume continues at that step (0 = off)",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic ops and per-step random seeds: a killed and resumed run ends with "
        "the same weights as an uninterrupted one (bitwise on CPU)",
    )
    f.add_argument("--metrics-json", help="rank 0 writes the run's figures here")
    f.add_argument("--log-dir", help="TensorBoard logs (rank 0)")
    e = p.add_argument_group("elastic (launch with hvdtrain-run --elastic; see hvdtrain.elastic)")
    e.add_argument(
        "--elastic",
        action="store_true",
        help="train under Horovod Elastic: survive failed workers, take in new ones",
    )
    e.add_argument(
        "--commit-every",
        type=int,
        default=10,
        help="steps between in-memory commits of the state; a failure redoes at most this "
        "many (10)",
    )
    return p


def parse(parser, argv=None):
    """Parses and checks the command line (no TensorFlow needed)."""
    args = parser.parse_args(argv)
    for name in (
        "epochs",
        "batch_size",
        "keep_checkpoints",
        "limit_samples",
        "threads",
        "accumulate",
        "commit_every",
    ):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise invalid_value(f"--{name.replace('_', '-')}", value, "a positive integer")
    if not 0 < args.lr < float("inf"):
        raise invalid_value("--lr", args.lr, "a positive learning rate")
    if not 0 <= args.seed < 2**31:  # numpy refuses seeds outside [0, 2**32) mid-job
        raise invalid_value("--seed", args.seed, "an integer from 0 to 2147483647")
    if args.threads is not None and args.threads > 4096:
        raise invalid_value("--threads", args.threads, "at most 4096 threads per rank")
    if getattr(args, "elastic", False) and args.accumulate > 1:
        raise invalid_value("--accumulate", args.accumulate, "1 with --elastic")
    if args.checkpoint_every < 0:
        raise invalid_value("--checkpoint-every", args.checkpoint_every, "a number of steps >= 0")
    if not 0 <= args.warmup_epochs < float("inf"):
        raise invalid_value("--warmup-epochs", args.warmup_epochs, "a number >= 0")
    if getattr(args, "data_dir", None) and not os.path.isdir(args.data_dir):
        raise invalid_value("--data-dir", args.data_dir, "an existing folder")
    if args.metrics_json and os.path.isdir(args.metrics_json):
        raise invalid_value("--metrics-json", args.metrics_json, "a file path, not a folder")
    return args


class Data:
    """What a loader returns: arrays (or file paths) and how to turn them into batches.

    Args:
        train, test: (x, y) pairs; x may be file paths that `train_map` reads.
        source: a short name of where the data came from (in the metrics JSON).
        notice: one line saying so, printed by rank 0 (default: `source`).
        train_map, eval_map: per-sample `(x, y) -> (x, y)` functions applied after sharding
            (decoding, augmentation, normalisation); None for arrays ready to use.
    """

    def __init__(self, train, test, source, notice=None, train_map=None, eval_map=None):
        self.train, self.test, self.source, self.notice = train, test, source, notice or source
        self.train_map, self.eval_map = train_map, eval_map


def _mixed_precision_policy(choice):
    import tensorflow as tf

    if choice in (None, ""):
        return None
    if choice == "auto":
        choice = "float16" if tf.config.list_physical_devices("GPU") else "bfloat16"
    return f"mixed_{choice}"


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


def train(args, *, prog, build_model, load_data, optimizer="adam"):
    """Trains as `args` says; returns the metrics dict (rank 0 also writes it).

    Args:
        args: from `parse(make_parser(...))`.
        prog: the entry point's name, for messages.
        build_model: `() -> keras.Model` returning logits.
        load_data: `() -> Data`, called on every rank after `hvd.init()` (it may use
            collectives); a `HvdtrainError` on any rank stops every rank.
        optimizer: "adam" or "sgd" (momentum 0.9).
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if getattr(args, "elastic", False):  # the same recipe under Horovod Elastic
        from hvdtrain import elastic

        return elastic.train(
            args, prog=prog, build_model=build_model, load_data=load_data, optimizer=optimizer
        )
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvdtrain
    from hvdtrain import callbacks as callbacks_mod
    from hvdtrain import data, runtime

    start = time.perf_counter()
    hvdtrain.init(threads=args.threads)
    log = hvdtrain.get_logger()
    rank, size = hvd.rank(), hvd.size()
    # Horovod: a seed per rank, so dropout and augmentation differ; weights are broadcast.
    tf.keras.utils.set_random_seed(args.seed + rank)

    d = runtime.agree(load_data)
    (x_train, y_train), (x_test, y_test) = d.train, d.test
    if args.limit_samples:
        x_train, y_train = x_train[: args.limit_samples], y_train[: args.limit_samples]
    log.info("data: %s; %d train, %d test samples", d.notice, len(x_train), len(x_test))

    steps = data.steps_per_epoch(len(x_train), args.batch_size * args.accumulate, size)
    steps *= args.accumulate  # whole accumulation cycles per epoch
    warmup_steps = round(args.warmup_epochs * steps)  # optimizer.iterations counts micro-steps
    if args.deterministic:
        tf.config.experimental.enable_op_determinism()
        tf.keras.backend.experimental.enable_tf_random_generator()  # see DeterministicRandomness
    policy = _mixed_precision_policy(args.mixed_precision)
    if policy:
        tf.keras.mixed_precision.set_global_policy(policy)
    model = build_model()
    if policy:  # logits back to float32 for a stable softmax and loss
        inputs = tf.keras.Input(model.input_shape[1:])
        logits = tf.keras.layers.Activation("linear", dtype="float32")(model(inputs))
        model = tf.keras.Model(inputs, logits, name=model.name)
    # Horovod: the base LR is the single-worker one; the schedule scales it by size after a warmup.
    schedule = hvdtrain.WarmupSchedule(args.lr, size, warmup_steps)
    if optimizer == "sgd":
        base = tf.keras.optimizers.SGD(schedule, momentum=0.9)
    else:
        base = tf.keras.optimizers.Adam(schedule)
    # Horovod: average gradients across ranks before each update.
    opt = hvdtrain.distributed_optimizer(
        base,
        compression=hvdtrain.fp16_compression() if args.fp16_allreduce else None,
        backward_passes_per_step=args.accumulate,
    )
    if policy == "mixed_float16":
        # The loss scale wraps the distributed optimizer, so the allreduce sees unscaled
        # gradients and every rank takes the same skip-or-apply decision (Horovod #3807).
        opt = tf.keras.mixed_precision.LossScaleOptimizer(opt)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    # Several steps per call into TensorFlow (hvdtrain.tuning); one when callbacks must act
    # before or after every single step (mid-epoch checkpoints, per-step random seeds).
    per_step = bool(args.checkpoint_every or args.deterministic)
    fast = hvdtrain.compile_options(steps, steps_per_execution=1 if per_step else None)
    model.compile(optimizer=opt, loss=loss, metrics=["accuracy"], **fast)
    opt.build(model.trainable_variables)

    global_batch = args.batch_size * size
    start_step, manager, resumed = 0, None, None
    if args.checkpoint_dir:
        manager = hvdtrain.CheckpointManager(
            args.checkpoint_dir, model, opt, keep=args.keep_checkpoints
        )

        def resume():
            manager.check_writable()
            found = manager.latest()
            if not found:
                return None
            manager.restore(found[1], found[2])
            return {k: found[2].get(k) for k in ("epoch", "step", "global_batch", "size")}

        # Horovod: rank 0 reads the checkpoint; the broadcast below hands it to every rank.
        saved = runtime.agree(resume, root_only=True)
        saved = hvd.broadcast_object(saved, root_rank=0, name="hvdtrain.resume")
        if saved:
            start_step = resume_step(saved, steps, global_batch, args.accumulate)
            resumed = {"epoch": saved["epoch"], "step": saved["step"] or 0}
            if saved.get("global_batch") not in (None, global_batch):
                log.warning(
                    "the checkpoint was written with %s rank(s) x batch %d; this run has %d x %d:"
                    " resuming at epoch %d step %d (the same samples seen; the LR schedule "
                    "follows the step). The global batch changed: the results will differ.",
                    saved.get("size"),
                    saved["global_batch"] // (saved.get("size") or 1),
                    size,
                    args.batch_size,
                    start_step // steps + 1,
                    start_step % steps,
                )
    # Horovod: start every rank from rank 0's weights and optimizer state.
    hvdtrain.broadcast_initial_state(model, opt)
    if resumed:
        opt.iterations.assign(start_step)  # the LR schedule follows this step
        resumed["optimizer_iterations"] = start_step
        log.info(
            "resuming at epoch %d, step %d of %d (global step %d) from %s",
            start_step // steps + 1,
            start_step % steps,
            steps,
            start_step,
            manager.directory,
        )
    initial_epoch = start_step // steps

    def train_ds(step):
        return data.train_dataset(
            x_train, y_train, args.batch_size, rank, size, seed=args.seed,
            map_fn=d.train_map, start_step=step, steps=steps,
        )  # fmt: skip

    test_ds = data.eval_dataset(x_test, y_test, 256, rank, size, map_fn=d.eval_map)
    throughput = hvdtrain.ThroughputCallback(global_batch)
    callbacks = [
        # A rank that makes no progress for the stall time (300 s) ends the job: no hang.
        hvdtrain.WatchdogCallback(),
        # Horovod: BatchNorm statistics are per rank; average them before anything reads them.
        callbacks_mod.ModelStateAverageCallback(),
        # Horovod: average the epoch's metrics over ranks first, so everything after sees them.
        hvdtrain.MetricAverageCallback(
            steps * args.batch_size, evaluate_fn=lambda: hvdtrain.evaluate(model, test_ds)
        ),
        throughput,
    ]
    if args.deterministic:
        callbacks.insert(0, callbacks_mod.DeterministicRandomness(args.seed, rank, start_step))
    if manager:
        extra = {"size": size, "global_batch": global_batch, "steps_per_epoch": steps, "prog": prog}
        callbacks.append(
            hvdtrain.CheckpointCallback(manager, extra, steps, args.checkpoint_every, start_step)
        )
    callbacks += callbacks_mod.rank0_callbacks(args.log_dir)

    log.info(
        "training on %d rank(s): %d steps/epoch, batch %d/rank (%d global%s), lr %g -> %g over "
        "%d steps%s",
        size,
        steps,
        args.batch_size,
        args.batch_size * size,
        f", {args.accumulate} accumulated" if args.accumulate > 1 else "",
        args.lr,
        hvdtrain.scaled_lr(args.lr, size),
        warmup_steps,
        f", {policy}" if policy else "",
    )
    history = {}

    def fit(first_step, epochs, steps_this_epoch):
        run = model.fit(
            train_ds(first_step),
            epochs=epochs,
            initial_epoch=first_step // steps,
            steps_per_epoch=steps_this_epoch,
            callbacks=callbacks,
            verbose=2 if rank == 0 else 0,  # Horovod: one line per epoch, on rank 0 only
        )
        for k, vs in run.history.items():
            history.setdefault(k, []).extend(float(v) for v in vs)

    if start_step % steps and initial_epoch < args.epochs:  # finish the interrupted epoch
        fit(start_step, initial_epoch + 1, steps - start_step % steps)
        start_step = (initial_epoch + 1) * steps
    if start_step // steps < args.epochs:
        fit(start_step, args.epochs, steps)
    elif not history:
        log.info("already trained %d of %d epochs; evaluating only", initial_epoch, args.epochs)

    result = hvdtrain.evaluate(model, test_ds)
    ranks = runtime.rank_report(model)
    if len({r["weights_sha256"] for r in ranks}) != 1:
        raise HvdtrainError("ranks ended with different weights; this is a bug, please report it")
    metrics = {
        "prog": prog,
        "size": size,
        "epochs": args.epochs,
        "initial_epoch": initial_epoch,
        "resumed_from": resumed,
        "steps_per_epoch": steps,
        "steps_per_execution": fast["steps_per_execution"],
        "batch_size": args.batch_size,
        "global_batch_size": global_batch,
        "deterministic": bool(args.deterministic),
        "accumulate": args.accumulate,
        "mixed_precision": policy,
        "fp16_allreduce": bool(args.fp16_allreduce),
        "lr_base": args.lr,
        "lr_scaled": hvdtrain.scaled_lr(args.lr, size),
        "lr_final": float(schedule(opt.iterations)),
        "warmup_steps": warmup_steps,
        "optimizer_iterations": int(opt.iterations),
        "data_source": d.source,
        "train_samples": len(x_train),
        "test_samples": result["samples"],
        "test_loss": result["loss"],
        "test_accuracy": result["accuracy"],
        "train_samples_per_sec": throughput.samples_per_sec,
        "epoch_samples_per_sec": throughput.epoch_samples_per_sec,
        "wall_seconds": time.perf_counter() - start,
        "history": history,
        "ranks": ranks,
    }
    if rank == 0:
        if manager:
            path = hvdtrain.export_model(
                model, build_model, os.path.join(manager.directory, "model.keras"), policy
            )
            metrics["exported_model"] = path
        if args.metrics_json:
            hvdtrain.write_json(args.metrics_json, metrics)
        rate = throughput.samples_per_sec
        log.info(
            "test accuracy %.4f, loss %.4f on %d samples; %s samples/s; %.1f s",
            result["accuracy"],
            result["loss"],
            result["samples"],
            f"{rate:.0f}" if rate else "n/a",
            metrics["wall_seconds"],
        )
    return metrics


def main(parser, argv, run):
    """The CLI edge of an entry point: user errors print one line and exit 2."""
    prog = parser.prog.removeprefix("python -m ")
    try:
        run(parse(parser, argv))
    except HvdtrainError as e:
        from hvdtrain.errors import exit_with_error

        exit_with_error(prog, e)
    except KeyboardInterrupt:
        sys.exit(130)
