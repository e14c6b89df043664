"""The benchmark's training workers: one process per rank, started by `hvdtrain.bench`.

    python -m hvdtrain.bench.workers --variant hvdtrain --models mlp --batch-sizes 64

Variants, all on the same synthetic data, models, per-rank batch and cores:

- `hvdtrain`: hvdtrain's own path: `hvdtrain.init`, `train_dataset`, `distributed_optimizer`,
  `broadcast_initial_state`, `compile_options` (its defaults), `fit`.
- `baseline`: a plain Horovod Keras script as Horovod's documentation and its
  `tensorflow2_keras_mnist.py` example write it (hvd.init, `DistributedOptimizer`, the
  broadcast and metric-average callbacks, `fit`), no tuning. The example's
  `LearningRateWarmupCallback` is left out: it sets the learning rate from Python before
  every batch and would only make the baseline slower.
- `mwms`: `tf.distribute.MultiWorkerMirroredStrategy` as in TensorFlow's multi-worker Keras
  tutorial (TF_CONFIG set by the launcher, global batch = per-worker batch x workers).
- `keras`: plain Keras `fit`, no Horovod, one process (the reference for `hvdtrain` at -np 1),
  plain and with hvdtrain's compile options (`--steps-per-execution` overrides theirs).
- `hvdtrain-keras3`: `hvdtrain` with the same models built with Keras 3 (`import keras`):
  hvdtrain's Keras 3 optimizer in place of Horovod's Keras 2 one.
- `hvdtrain-tfrecord`: `hvdtrain` with the same samples read from TFRecord files through
  `hvdtrain.FileData` (written once per host in the system's temporary folder), instead of
  from memory.
- `input-tfrecord`: that TFRecord pipeline alone, no model: its batches per second on every
  rank at once, against which the training step's rate is compared.

Each process first binds itself to its share of the cores (local rank r gets cores
r*c .. r*c+c-1 of those it may use, c = HVDBENCH_CORES_PER_RANK, default 1), before
TensorFlow starts, so every variant runs on the same thread budget; HVDBENCH_BIND=none
leaves the binding to the operating system.

Timing (`hvdtrain.bench.timing`): `fit` runs `1 + repeats` epochs of `steps` steps; the first
is the warm-up (tracing, the shuffle buffer) and is dropped; each later epoch is one timed
window, measured from its first to its last step by rank 0 (the ranks are in lock step
through the allreduce). Rank 0 prints one line per configuration: `@@hvdbench {json}`;
every rank one `@@hvdbench-cpu {json}` line, its CPU seconds per window and by thread.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

from hvdtrain.bench.timing import Windows, thread_cpu_seconds, thread_groups

__all__ = ["main", "bind_to_cores", "local_rank_from_env", "result_key", "thread_cpu_seconds",
           "thread_groups", "synthetic_data", "MARKER", "CPU_MARKER"]  # fmt: skip

MARKER = "@@hvdbench "
CPU_MARKER = "@@hvdbench-cpu "  # every rank: its CPU seconds per window, and by thread
VARIANTS = ("hvdtrain", "hvdtrain-keras3", "baseline", "mwms", "keras", "hvdtrain-tfrecord",
            "input-tfrecord")  # fmt: skip
SAMPLES = 8192  # synthetic samples in all
_HOROVOD_TIDS = set()  # the threads Horovod's init started (its background thread, MPI's)
_RECORDED_ENV = ("HOROVOD_", "OMPI_MCA_", "HVDBENCH_", "OMP_NUM_THREADS", "TF_ENABLE_ONEDNN")
_LOCAL_RANK_VARS = ("HVDBENCH_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")


def local_rank_from_env(environ=None):
    """This process's rank on its host, from the launcher's variables (0 when alone)."""
    environ = os.environ if environ is None else environ
    values = [environ.get(name, "") for name in _LOCAL_RANK_VARS]
    return next((int(v) for v in values if v.isdigit()), 0)


def bind_to_cores(local_rank, cores_per_rank, available):
    """The cores of `local_rank`: its own `cores_per_rank` of the sorted `available` ones
    (wrapping around when there are more ranks than cores)."""
    cores = sorted(available)
    start = (local_rank * cores_per_rank) % len(cores)
    return {cores[(start + i) % len(cores)] for i in range(min(cores_per_rank, len(cores)))}


def bind():
    """Binds this process to its local rank's cores (before TensorFlow starts a thread)."""
    if os.environ.get("HVDBENCH_BIND", "core") == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    per_rank = int(os.environ.get("HVDBENCH_CORES_PER_RANK", "1"))
    cores = bind_to_cores(local_rank_from_env(), per_rank, os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores)
    return sorted(cores)


def synthetic_data(n=SAMPLES, seed=0):
    """`n` random 28x28x1 float32 images in [0, 1) and int64 labels 0-9 (the same on every
    rank and variant)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.random((n, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, n).astype(np.int64)


def _loss(keras=None):
    import tensorflow as tf

    return (keras or tf.keras).losses.SparseCategoricalCrossentropy(from_logits=True)


def tfrecord_data(x, y):
    """`hvdtrain.FileData` over `x`, `y` written as 8 TFRecord files of uneven sizes (local
    rank 0 of each host writes them once; the others wait)."""
    import tempfile

    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    import hvdtrain

    folder = os.path.join(tempfile.gettempdir(), f"hvdbench-tfrecord-{len(x)}")
    done = os.path.join(folder, "done")
    if hvd.local_rank() == 0 and not os.path.exists(done):
        os.makedirs(folder, exist_ok=True)
        bounds = np.linspace(0, len(x), 9).astype(int) + np.array([0, 3, -5, 7, -2, 4, -6, 1, 0])
        feature = tf.train.Feature
        for i in range(8):
            with tf.io.TFRecordWriter(os.path.join(folder, f"part-{i}.tfrecord")) as w:
                for j in range(bounds[i], bounds[i + 1]):
                    f = {"x": feature(bytes_list=tf.train.BytesList(value=[x[j].tobytes()])),
                         "y": feature(int64_list=tf.train.Int64List(value=[y[j]]))}  # fmt: skip
                    example = tf.train.Example(features=tf.train.Features(feature=f))
                    w.write(example.SerializeToString())
        with open(done, "w") as f:
            f.write("ok")
    hvd.broadcast_object(None, name="hvdbench.tfrecord")  # the files exist everywhere

    def parse(record):
        spec = {"x": tf.io.FixedLenFeature([], tf.string), "y": tf.io.FixedLenFeature([], tf.int64)}
        f = tf.io.parse_single_example(record, spec)
        return tf.reshape(tf.io.decode_raw(f["x"], tf.float32), (28, 28, 1)), f["y"]

    data = hvdtrain.FileData(os.path.join(folder, "part-*.tfrecord"), parse)
    data.prepare(hvdtrain.Placement.current())
    return data


def _hvdtrain_dataset(x, y, batch, steps, epochs, files):
    import horovod.tensorflow as hvd

    import hvdtrain

    if not files:
        return hvdtrain.train_dataset(x, y, batch, hvd.rank(), hvd.size())
    data, p = tfrecord_data(x, y), hvdtrain.Placement.current()
    steps = min(steps, data.steps_per_epoch(batch, p))
    return data.train_dataset(batch, p, seed=0, start_step=0, steps=steps, epochs=epochs)


def _timer(windows):
    """A Keras callback that times each epoch as one of `windows`."""
    import tensorflow as tf

    class WindowTimer(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            windows.begin()

        def on_epoch_end(self, epoch, logs=None):
            windows.end()

    return WindowTimer()


def _train(args, variant, model_name, batch, steps, data, strategy, keras_options):
    """Runs `variant` on one configuration as its recipe writes it: (windows, compile
    options, parameters, extra result fields)."""
    import tensorflow as tf

    from hvdtrain.models import build_model

    x, y = data
    windows, epochs = Windows(), 1 + args.repeats
    if variant == "input-tfrecord":  # the pipeline alone: windows of batches, as fit draws them
        ds = iter(_hvdtrain_dataset(x, y, batch, steps, epochs, files=True))
        return windows.run(lambda: [next(ds) for _ in range(steps)], epochs), {}, 0, {}
    callbacks, options, extra = [_timer(windows)], dict(keras_options or {}), {}
    if variant.startswith("hvdtrain"):
        import horovod.tensorflow as hvd

        import hvdtrain
        from hvdtrain import frontends

        keras = frontends.keras_module("3" if variant == "hvdtrain-keras3" else "2")
        ds = _hvdtrain_dataset(x, y, batch, steps, epochs, variant == "hvdtrain-tfrecord")
        model = build_model(model_name, keras)
        schedule = frontends.for_model(model).WarmupSchedule(1e-3, hvd.size(), warmup_steps=steps)
        opt = hvdtrain.distributed_optimizer(keras.optimizers.Adam(schedule))
        options = hvdtrain.compile_options(steps)
        if args.steps_per_execution:
            options["steps_per_execution"] = args.steps_per_execution
        model.compile(opt, loss=_loss(keras), metrics=["accuracy"], **options)
        hvdtrain.broadcast_initial_state(model, opt)
    elif variant == "baseline":
        import horovod.tensorflow.keras as hvd

        # As Horovod's tensorflow2_keras_mnist.py: every rank reads all the data, repeat,
        # shuffle (10,000), batch; lr x size; DistributedOptimizer; broadcast and
        # metric-average callbacks.
        ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().shuffle(10000).batch(batch)
        model = build_model(model_name)
        opt = hvd.DistributedOptimizer(tf.optimizers.Adam(0.001 * hvd.size()))
        model.compile(loss=_loss(), optimizer=opt, metrics=["accuracy"],
                      experimental_run_tf_function=False)  # fmt: skip
        callbacks += [hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                      hvd.callbacks.MetricAverageCallback()]  # fmt: skip
    elif variant == "mwms":  # as TensorFlow's multi-worker Keras tutorial: a global batch
        workers = strategy.num_replicas_in_sync
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).repeat()
        ds = ds.batch(batch * workers)
        with strategy.scope():
            model = build_model(model_name)
            model.compile(optimizer=tf.keras.optimizers.Adam(0.001 * workers), loss=_loss(),
                          metrics=["accuracy"])  # fmt: skip
    else:  # keras
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).repeat()
        ds = ds.batch(batch).prefetch(tf.data.AUTOTUNE)
        model = build_model(model_name)
        model.compile(tf.keras.optimizers.Adam(1e-3), loss=_loss(), metrics=["accuracy"],
                      **options)  # fmt: skip
    model.fit(ds, steps_per_epoch=steps, epochs=epochs, callbacks=callbacks, verbose=0)
    if variant.startswith("hvdtrain"):
        # The check that the ranks hold the same weights, which hvdtrain.fit runs at each
        # epoch's end (and once after the first steps): its time against an epoch's.
        checks = Windows(usage=False).run(
            lambda: hvdtrain.check_weights_agree(model, "in the benchmark"), 5
        )
        extra["agreement_ms"] = 1000 * statistics.median(checks.walls())
        if variant == "hvdtrain-keras3":
            keras.backend.clear_session()
    return windows, options, model.count_params(), extra


def _init(variants, threads):
    """Starts what the variants need; returns (rank, size, backend, strategy)."""
    import tensorflow as tf

    before = set(thread_cpu_seconds())
    try:
        if "mwms" in variants:
            strategy = tf.distribute.MultiWorkerMirroredStrategy()
            size = strategy.num_replicas_in_sync
            rank = strategy.cluster_resolver.task_id or 0
            return rank, size, "grpc" if size > 1 else None, strategy
        if any(v.startswith(("hvdtrain", "input")) for v in variants):
            import hvdtrain

            hvdtrain.init(threads=threads)
        if "baseline" in variants:
            import horovod.tensorflow.keras as hvd

            hvd.init()  # as Horovod's example; a no-op after hvdtrain.init in the same process
            gpus = tf.config.experimental.list_physical_devices("GPU")
            for gpu in gpus:
                tf.config.experimental.set_memory_growth(gpu, True)
            if gpus:
                tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")
        if any(v.startswith(("hvdtrain", "input", "baseline")) for v in variants):
            import horovod.tensorflow as hvd

            size = hvd.size()
            backend = ("mpi" if hvd.mpi_enabled() else "gloo") if size > 1 else None
            return hvd.rank(), size, backend, None
        return 0, 1, None, None
    finally:
        _HOROVOD_TIDS.update(set(thread_cpu_seconds()) - before)  # TF's pools start later


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m hvdtrain.bench.workers")
    p.add_argument("--variant", required=True, help=f"one of {VARIANTS}, or several at -np 1")
    p.add_argument("--models", default="mlp", help="comma-separated: mlp, convnet")
    p.add_argument("--batch-sizes", default="64", help="comma-separated per-rank batch sizes")
    p.add_argument("--steps", default="mlp=256,convnet=16", help="steps per window, per model")
    p.add_argument("--repeats", type=int, default=5, help="timed windows after the warm-up")
    p.add_argument("--steps-per-execution", type=int, help="override the variant's default")
    p.add_argument("--threads", type=int, help="hvdtrain: intra-op threads (default: its own)")
    return p.parse_args(argv)


def result_key(result):
    """What identifies one measurement across the ranks' lines."""
    return "/".join(str(result[k]) for k in ("variant", "model", "batch_size", "label"))


def _result(how, windows, size, backend):
    """The figure of one configuration (`how`: variant, label, model, batch, steps)."""
    import tensorflow as tf

    timed = windows.walls()[1:]
    seconds, steps = statistics.median(timed), how["steps"]
    return {
        "variant": how["variant"], "label": how["label"], "np": size, "backend": backend,
        "model": how["model"], "batch_size": how["batch_size"], "steps": steps,
        "repeats": len(timed), "window_seconds": [round(t, 6) for t in timed],
        "warmup_seconds": round(windows[0]["wall"], 3),
        "machine_busy_seconds": [None if w["busy"] is None else round(w["busy"], 3)
                                 for w in windows[1:]],
        "step_ms": 1000 * seconds / steps,
        "samples_per_sec": how["batch_size"] * size * steps / seconds,
        "threads": {"intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
                    "inter_op": tf.config.threading.get_inter_op_parallelism_threads()},
        "env": {k: v for k, v in os.environ.items() if k.startswith(_RECORDED_ENV)},
        "stack": {"python": platform.python_version(), "tensorflow": tf.__version__},
    }  # fmt: skip


def main(argv=None):
    cores = bind()  # before TensorFlow creates a thread
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = _parse(argv)
    variants = args.variant.split(",")
    if "mwms" in variants and "TF_CONFIG" in os.environ:  # one GPU per worker, if any
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(local_rank_from_env()))
    import tensorflow as tf

    from hvdtrain.tuning import compile_options

    rank, size, backend, strategy = _init(variants, args.threads)
    if len(variants) > 1 and (size > 1 or strategy is not None):
        raise SystemExit("several variants share a process only at -np 1, without mwms")
    data = synthetic_data()
    batches = [int(b) for b in args.batch_sizes.split(",")]
    steps_for = dict(item.split("=") for item in args.steps.split(",") if "=" in item)
    for variant, model, batch in ((v, m, b) for v in variants
                                  for m in args.models.split(",") for b in batches):  # fmt: skip
        steps = int(steps_for.get(model, next(iter(steps_for.values()), 64)))
        runs = [("", None)]
        if variant == "keras":  # plain, then with hvdtrain's compile options
            same = compile_options(steps)
            if args.steps_per_execution:
                same["steps_per_execution"] = args.steps_per_execution
            runs = [("plain", {}), ("same compile options", same)]
        for label, keras_options in runs:
            start = time.perf_counter()
            out = _train(args, variant, model, batch, steps, data, strategy, keras_options)
            windows, options, params, extra = out
            tf.keras.backend.clear_session()
            how = {"variant": variant, "label": label, "model": model, "batch_size": batch,
                   "steps": steps}  # fmt: skip
            result = _result(how, windows, size, backend)
            if extra:  # the weights check: its share of an epoch
                result.update(extra)
                share = extra["agreement_ms"] / (result["step_ms"] * steps)
                result["agreement_share_of_epoch"] = share
            result.update(
                compile_options={k: v for k, v in options.items() if isinstance(v, int)},
                params=params, cores=cores, seconds=round(time.perf_counter() - start, 2),
            )  # fmt: skip
            if rank == 0:
                print(MARKER + json.dumps(result), flush=True)
            # Single processes started side by side (the ceiling) tell apart by core.
            who = rank if size > 1 else local_rank_from_env()
            main_tid = os.getpid()
            line = {"rank": who, "key": result_key(result),
                    "cpu": [round(w["cpu"], 3) for w in windows[1:]],
                    "threads": [thread_groups(*w["threads"], _HOROVOD_TIDS, main_tid)
                                for w in windows[1:]]}  # fmt: skip
            print(CPU_MARKER + json.dumps(line), flush=True)
    if strategy is not None and size > 1:
        # Every figure is out; MultiWorkerMirrored's gRPC teardown takes 10 s or more.
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
