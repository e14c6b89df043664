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
- `keras`: plain Keras `fit`, no Horovod, one process (the reference for `hvdtrain` at -np 1);
  `--steps-per-execution` gives it the same compile settings as hvdtrain.
- `hvdtrain-keras3`: `hvdtrain` with the same models built with Keras 3 (`import keras`):
  hvdtrain's Keras 3 optimizer in place of Horovod's Keras 2 one.
- `hvdtrain-tfrecord`: `hvdtrain` with the same samples read from TFRecord files through
  `hvdtrain.FileData` (written once per host under HVDBENCH_DATA, by default the system's
  temporary folder), instead of from memory.
- `input-tfrecord`: that TFRecord pipeline alone, no model: its batches per second on every
  rank at once, against which the training step's rate is compared.

Each process first binds itself to its share of the cores (local rank r gets cores
r*c .. r*c+c-1 of those it may use, c = HVDBENCH_CORES_PER_RANK, default 1), before
TensorFlow starts, so every variant runs on the same thread budget; HVDBENCH_BIND=none
leaves the binding to the operating system.

Timing: `fit` runs `1 + repeats` epochs of `steps` steps; the first is the warm-up (tracing,
the shuffle buffer) and is dropped; each later epoch is one timed window, measured from
its first to its last step by rank 0 (the ranks are in lock step through the allreduce).
Rank 0 prints one line per configuration: `@@hvdbench {json}`.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

from hvdtrain.launcher.gpu import BENCH_MARKER
from hvdtrain.runtime import processes
from hvdtrain.runtime.tuning import bind_to_cores

__all__ = [
    "main",
    "local_rank_from_env",
    "result_key",
    "thread_cpu_seconds",
    "thread_groups",
    "MARKER",
]

MARKER = BENCH_MARKER  # the line each worker prints its result on (`hvdtrain-run doctor` reads it)
SAMPLES = 8192  # synthetic samples, the same on every rank and variant
CPU_MARKER = "@@hvdbench-cpu "  # every rank: its CPU seconds per window, and by thread
THREAD_GROUPS = ("main", "tensorflow", "horovod", "other")
_HOROVOD_TIDS = set()  # the threads Horovod's init started (its background thread, MPI's)
VARIANTS = (
    "hvdtrain",
    "hvdtrain-keras3",
    "baseline",
    "mwms",
    "keras",
    "hvdtrain-tfrecord",
    "input-tfrecord",
)
_RECORDED_ENV = ("HOROVOD_", "OMPI_MCA_", "HVDBENCH_", "OMP_NUM_THREADS", "TF_ENABLE_ONEDNN")
_LOCAL_RANK_VARS = ("HVDBENCH_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")


def local_rank_from_env(environ=None):
    """This process's rank on its host, from the launcher's variables (0 when alone)."""
    environ = os.environ if environ is None else environ
    for name in _LOCAL_RANK_VARS:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _bind():
    if os.environ.get("HVDBENCH_BIND", "core") == "none" or not hasattr(os, "sched_setaffinity"):
        return None
    cores = bind_to_cores(
        local_rank_from_env(),
        int(os.environ.get("HVDBENCH_CORES_PER_RANK", "1")),
        os.sched_getaffinity(0),
    )
    os.sched_setaffinity(0, cores)
    return sorted(cores)


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


def _steps_for(spec, model):
    table = dict(item.split("=") for item in spec.split(",") if "=" in item)
    return int(table.get(model, next(iter(table.values()), 64)))


def synthetic_data(n, seed=0):
    """`n` random 28x28x1 float32 images in [0, 1) and int64 labels 0-9 (the same on every
    rank and variant)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.random((n, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)
    return x, y


def machine_busy_seconds():
    """CPU seconds all cores of this machine spent busy since boot, or None
    (`processes.busy_cpu_seconds`: the hypervisor's steal counts as busy, as in the
    runner's quiet wait)."""
    return processes.busy_cpu_seconds()


def thread_cpu_seconds():
    """{thread id: (name, CPU seconds)} of this process's threads: Linux's schedstat, in
    nanoseconds (the tick counts of /proc/.../stat are 10 ms coarse); {} elsewhere."""
    out = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                seconds = int(f.read().split()[0]) / 1e9
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
        out[int(tid)] = (name, seconds)
    return out


def thread_groups(before, after, horovod_tids, main_tid):
    """The CPU seconds spent between two `thread_cpu_seconds` snapshots, by group (pure):
    `main` (the Python thread: Keras's loop, and the ops TensorFlow runs inline on it),
    `tensorflow` (its tf_* pools), `horovod` (the threads `hvd.init` started: its
    background thread, MPI's or Gloo's), `other`."""
    groups = dict.fromkeys(THREAD_GROUPS, 0.0)
    for tid, (name, seconds) in after.items():
        spent = seconds - before.get(tid, (name, 0.0))[1]
        if tid == main_tid:
            group = "main"
        elif name.startswith("tf_"):
            group = "tensorflow"
        elif tid in horovod_tids:
            group = "horovod"
        else:
            group = "other"
        groups[group] += spent
    return {k: round(v, 4) for k, v in groups.items()}


def _usage():
    t = os.times()
    return time.perf_counter(), t.user + t.system, machine_busy_seconds(), thread_cpu_seconds()


def _window(start, end):
    """(wall seconds, this process's CPU seconds, the machine's busy CPU seconds, this
    process's CPU seconds by thread group) between two `_usage()`."""
    busy = None if end[2] is None else end[2] - start[2]
    groups = thread_groups(start[3], end[3], _HOROVOD_TIDS, os.getpid())
    return end[0] - start[0], end[1] - start[1], busy, groups


def _timer(windows):
    """A callback that appends `_window(...)` of each epoch to `windows`: this process's and
    the machine's CPU seconds tell how much of the machine other processes took, the thread
    groups where this process's went."""
    import tensorflow as tf

    class WindowTimer(tf.keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self._start = _usage()

        def on_epoch_end(self, epoch, logs=None):
            windows.append(_window(self._start, _usage()))

    return WindowTimer()


def _loss():
    import tensorflow as tf

    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def tfrecord_data(x, y):
    """`hvdtrain.FileData` over `x`, `y` written as 8 TFRecord files of uneven sizes (local
    rank 0 of each host writes them once; the others wait)."""
    import tempfile

    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    import hvdtrain

    root = os.environ.get("HVDBENCH_DATA") or tempfile.gettempdir()
    folder = os.path.join(root, f"hvdbench-tfrecord-{len(x)}")
    done = os.path.join(folder, "done")
    if hvd.local_rank() == 0 and not os.path.exists(done):
        os.makedirs(folder, exist_ok=True)
        bounds = np.linspace(0, len(x), 9).astype(int) + np.array([0, 3, -5, 7, -2, 4, -6, 1, 0])
        for i in range(8):
            path = os.path.join(folder, f"part-{i}.tfrecord")
            with tf.io.TFRecordWriter(path) as w:
                for j in range(bounds[i], bounds[i + 1]):
                    f = {
                        "x": tf.train.Feature(
                            bytes_list=tf.train.BytesList(value=[x[j].tobytes()])
                        ),
                        "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[j]])),
                    }
                    w.write(
                        tf.train.Example(features=tf.train.Features(feature=f)).SerializeToString()
                    )
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


def _input_dataset(x, y, batch, steps, epochs, files):
    import horovod.tensorflow as hvd

    import hvdtrain

    if not files:
        return hvdtrain.train_dataset(x, y, batch, hvd.rank(), hvd.size())
    data = tfrecord_data(x, y)
    p = hvdtrain.Placement.current()
    steps = min(steps, data.steps_per_epoch(batch, p))
    return data.train_dataset(batch, p, seed=0, start_step=0, steps=steps, epochs=epochs)


def _run_input(args, batch, steps, x, y):
    """The TFRecord pipeline alone: windows of `steps` batches, as `fit` would draw them."""
    windows = []
    ds = iter(_input_dataset(x, y, batch, steps, 1 + args.repeats, files=True))
    for _ in range(1 + args.repeats):
        start = _usage()
        for _ in range(steps):
            next(ds)
        windows.append(_window(start, _usage()))
    return windows, {}, 0


def _run_hvdtrain(args, model_name, batch, steps, x, y, files=False, keras_version="2"):
    import horovod.tensorflow as hvd

    import hvdtrain
    from hvdtrain import frontends
    from hvdtrain.models import build_model

    keras = frontends.keras_module(keras_version)
    size = hvd.size()
    ds = _input_dataset(x, y, batch, steps, 1 + args.repeats, files)
    model = build_model(model_name, keras)
    schedule = frontends.for_model(model).WarmupSchedule(1e-3, size, warmup_steps=steps)
    opt = hvdtrain.distributed_optimizer(keras.optimizers.Adam(schedule))
    options = hvdtrain.compile_options(steps)
    if args.steps_per_execution:
        options["steps_per_execution"] = args.steps_per_execution
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(opt, loss=loss, metrics=["accuracy"], **options)
    hvdtrain.broadcast_initial_state(model, opt)
    windows = []
    model.fit(
        ds, steps_per_epoch=steps, epochs=1 + args.repeats, callbacks=[_timer(windows)], verbose=0
    )
    # The check that the ranks hold the same weights, which hvdtrain.fit runs at each epoch's
    # end (and once after the first steps): its time against an epoch's.
    checks = []
    for _ in range(5):
        start = time.perf_counter()
        hvdtrain.check_weights_agree(model, "in the benchmark")
        checks.append(time.perf_counter() - start)
    if keras_version == "3":
        keras.backend.clear_session()
    return (
        windows,
        options,
        model.count_params(),
        {"agreement_ms": 1000 * statistics.median(checks)},
    )


def _run_baseline(args, model_name, batch, steps, x, y):
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf

    from hvdtrain.models import build_model

    # As Horovod's tensorflow2_keras_mnist.py: every rank reads all the data, repeat, shuffle
    # (10,000), batch; lr x size; DistributedOptimizer; broadcast and metric-average callbacks.
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().shuffle(10000).batch(batch)
    model = build_model(model_name)
    opt = hvd.DistributedOptimizer(tf.optimizers.Adam(0.001 * hvd.size()))
    model.compile(
        loss=_loss(), optimizer=opt, metrics=["accuracy"], experimental_run_tf_function=False
    )
    windows = []
    callbacks = [
        _timer(windows),
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
    ]
    model.fit(ds, steps_per_epoch=steps, epochs=1 + args.repeats, callbacks=callbacks, verbose=0)
    return windows, {}, model.count_params()


def _run_mwms(args, model_name, batch, steps, x, y, strategy):
    import tensorflow as tf

    from hvdtrain.models import build_model

    # As TensorFlow's multi-worker Keras tutorial: a global batch split over the workers.
    workers = strategy.num_replicas_in_sync
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).repeat()
    ds = ds.batch(batch * workers)
    with strategy.scope():
        model = build_model(model_name)
        model.compile(
            optimizer=tf.keras.optimizers.Adam(0.001 * workers), loss=_loss(), metrics=["accuracy"]
        )
    windows = []
    model.fit(
        ds, steps_per_epoch=steps, epochs=1 + args.repeats, callbacks=[_timer(windows)], verbose=0
    )
    return windows, {}, model.count_params()


def _run_keras(args, model_name, batch, steps, x, y, options):
    import tensorflow as tf

    from hvdtrain.models import build_model

    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x)).repeat()
    ds = ds.batch(batch).prefetch(tf.data.AUTOTUNE)
    model = build_model(model_name)
    model.compile(tf.keras.optimizers.Adam(1e-3), loss=_loss(), metrics=["accuracy"], **options)
    windows = []
    model.fit(
        ds, steps_per_epoch=steps, epochs=1 + args.repeats, callbacks=[_timer(windows)], verbose=0
    )
    return windows, options, model.count_params()


def _init(variants, threads):
    """Starts what the variants need; returns (rank, size, backend, strategy)."""
    import tensorflow as tf

    before = set(thread_cpu_seconds())
    try:
        return _init_variants(variants, threads, tf)
    finally:
        _HOROVOD_TIDS.update(set(thread_cpu_seconds()) - before)  # TF's pools start later


def _init_variants(variants, threads, tf):
    if "mwms" in variants:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        size = strategy.num_replicas_in_sync
        return strategy.cluster_resolver.task_id or 0, size, "grpc" if size > 1 else None, strategy
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


def main(argv=None):
    cores = _bind()  # before TensorFlow creates a thread
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    args = _parse(argv)
    variants = args.variant.split(",")
    if "mwms" in variants and "TF_CONFIG" in os.environ:  # one GPU per worker, if any
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(local_rank_from_env()))
    import tensorflow as tf

    rank, size, backend, strategy = _init(variants, args.threads)
    if len(variants) > 1 and (size > 1 or strategy is not None):
        raise SystemExit("several variants share a process only at -np 1, without mwms")
    x, y = synthetic_data(SAMPLES)
    for variant in variants:
        for model_name in args.models.split(","):
            for batch in [int(b) for b in args.batch_sizes.split(",")]:
                steps = _steps_for(args.steps, model_name)
                runs = [("", None)]
                if variant == "keras":  # plain, then with hvdtrain's compile options
                    from hvdtrain.runtime.tuning import compile_options

                    same = compile_options(steps)
                    if args.steps_per_execution:
                        same["steps_per_execution"] = args.steps_per_execution
                    runs = [("plain", {}), ("same compile options", same)]
                for label, keras_options in runs:
                    start = time.perf_counter()
                    if variant in ("hvdtrain", "hvdtrain-tfrecord"):
                        files = variant == "hvdtrain-tfrecord"
                        out = _run_hvdtrain(args, model_name, batch, steps, x, y, files)
                    elif variant == "hvdtrain-keras3":
                        out = _run_hvdtrain(args, model_name, batch, steps, x, y, False, "3")
                    elif variant == "input-tfrecord":
                        out = _run_input(args, batch, steps, x, y)
                    elif variant == "baseline":
                        out = _run_baseline(args, model_name, batch, steps, x, y)
                    elif variant == "mwms":
                        out = _run_mwms(args, model_name, batch, steps, x, y, strategy)
                    else:
                        out = _run_keras(args, model_name, batch, steps, x, y, keras_options)
                    windows, options, params, *extra = out
                    tf.keras.backend.clear_session()
                    result = _result(
                        variant, label, size, backend, model_name, batch, steps, windows
                    )
                    for more in extra:  # the weights check: its share of an epoch
                        result.update(more)
                        result["agreement_share_of_epoch"] = more["agreement_ms"] / (
                            result["step_ms"] * steps
                        )
                    result.update(
                        compile_options={k: v for k, v in options.items() if isinstance(v, int)},
                        params=params,
                        cores=cores,
                        seconds=round(time.perf_counter() - start, 2),
                    )
                    if rank == 0:
                        print(MARKER + json.dumps(result), flush=True)
                    cpu = [round(w[1], 3) for w in windows[1:]]
                    # Single processes started side by side (the ceiling) tell apart by core.
                    who = rank if size > 1 else local_rank_from_env()
                    line = {"rank": who, "key": result_key(result), "cpu": cpu,
                            "threads": [w[3] for w in windows[1:]]}  # fmt: skip
                    print(CPU_MARKER + json.dumps(line), flush=True)
    if strategy is not None and size > 1:
        # Every figure is out; MultiWorkerMirrored's gRPC teardown takes 10 s or more.
        sys.stdout.flush()
        os._exit(0)
    return 0


def result_key(result):
    """What identifies one measurement across the ranks' lines."""
    return "/".join(str(result[k]) for k in ("variant", "model", "batch_size", "label"))


def _result(variant, label, size, backend, model_name, batch, steps, windows):
    import tensorflow as tf

    timed = [w[0] for w in windows[1:]]
    seconds = statistics.median(timed)
    return {
        "variant": variant,
        "label": label,
        "np": size,
        "backend": backend,
        "model": model_name,
        "batch_size": batch,
        "steps": steps,
        "repeats": len(timed),
        "window_seconds": [round(t, 6) for t in timed],
        "warmup_seconds": round(windows[0][0], 3),
        "machine_busy_seconds": [None if w[2] is None else round(w[2], 3) for w in windows[1:]],
        "step_ms": 1000 * seconds / steps,
        "samples_per_sec": batch * size * steps / seconds,
        "threads": {
            "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
            "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
        },
        "env": {k: v for k, v in os.environ.items() if k.startswith(_RECORDED_ENV)},
        "stack": {"python": platform.python_version(), "tensorflow": tf.__version__},
    }


if __name__ == "__main__":
    sys.exit(main())
