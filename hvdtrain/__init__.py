"""hvdtrain: Horovod data-parallel training for TensorFlow/Keras.

A single-device Keras script becomes distributed with one call, its model compiled as for
one device and its data in any form (arrays, a tf.data pipeline, TFRecord or other files)::

    import hvdtrain

    args = hvdtrain.ArgumentParser(epochs=10).parse_args()   # --checkpoint-dir, --elastic, ...
    hvdtrain.fit(build_model, hvdtrain.FileData("data/*.tfrecord", parse), args)

launched with `horovodrun -np 4 python train.py`, `mpirun -np 4 python train.py` or
`hvdtrain-run --hostfile hosts.txt -- python train.py`. The building blocks of the recipe
(`init`, `train_dataset`, `distributed_optimizer`, `broadcast_initial_state`, ...) are
here too, for loops of your own.

Importing `hvdtrain` does not import TensorFlow: the names below load their module on
first use, so the launcher (`hvdtrain.launcher`) starts fast and never touches a GPU. It
sets TF_USE_LEGACY_KERAS=1 (Keras 2 for tf.keras; see `hvdtrain.compat`), turns
TensorFlow's start-up log noise off (TF_CPP_MIN_LOG_LEVEL=2 unless set), and makes an
uncaught `HvdtrainError` print one line and exit 2, like the entry points.
"""

import importlib
import os

__version__ = "0.1.0"

from hvdtrain import compat, startup  # noqa: E402  (standard library only; no TensorFlow)
from hvdtrain.errors import report_uncaught  # noqa: E402

# Keras 2 (tf_keras) for tf.keras from TensorFlow 2.16 on: Horovod has no Keras 3 path. It must
# be set before TensorFlow is imported, so here, before any module of ours imports it (it also
# reaches every process the launcher starts). `hvdtrain.compat` explains a wrong Keras.
if compat.legacy_keras_needed(compat.tensorflow_version()):
    os.environ.setdefault(compat.LEGACY_KERAS, "1")
    compat.keras2_submodules()  # `from tensorflow.keras.x import y` after it, too
# TensorFlow's start-up noise (oneDNN, CPU features, absl) off unless asked for: set
# TF_CPP_MIN_LOG_LEVEL=0 to see it again. Errors still show. What TensorFlow 2.21 logs while
# it loads, whatever the level, is left out of its import (`hvdtrain.startup`).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
startup.quiet_tensorflow_import()
report_uncaught()  # a user mistake in a script prints one line, not a traceback

_EXPORTS = {
    # the recipe
    "fit": "trainer",
    "ArgumentParser": "flags",
    "TrainConfig": "flags",
    # data
    "as_data": "forms",
    "Data": "data",
    "ArrayData": "data",
    "DatasetData": "data",
    "FileData": "records",
    "BatchData": "batches",
    "Placement": "data",
    "shard_indices": "data",
    "steps_per_epoch": "data",
    "train_dataset": "data",
    "eval_dataset": "data",
    "load_mnist": "mnist_data",
    # set-up
    "HvdtrainError": "errors",
    "TrainingDiverged": "errors",
    "OutputsNotWritten": "errors",
    "init": "runtime",
    "is_main_process": "runtime",
    "gpu_for_local_rank": "runtime",
    "threads_per_rank": "runtime",
    "agree": "runtime",
    "rank_report": "runtime",
    "weights_digest": "runtime",
    "get_logger": "logs",
    "compile_options": "tuning",
    # optimisation
    "scaled_lr": "rates",
    "warmup_lr": "rates",
    "WarmupSchedule": "rates",
    "distributed_optimizer": "optim",
    "fp16_compression": "optim",
    "broadcast_initial_state": "optim",
    "average_model_state": "optim",
    # metrics
    "weighted_mean": "metrics",
    "evaluate": "metrics",
    "MetricAverageCallback": "metrics",
    # callbacks
    "ModelStateAverageCallback": "callbacks",
    "CheckpointCallback": "callbacks",
    "ProgressCallback": "callbacks",
    "ThroughputCallback": "callbacks",
    "Watchdog": "watchdog",
    "WatchdogCallback": "callbacks",
    "rank0_only": "usercallbacks",
    # ranks that drift apart
    "RanksDisagree": "agreement",
    "check_weights_agree": "agreement",
    "WeightsAgreeCallback": "agreement",
    # files
    "CheckpointManager": "checkpoint",
    "Manifest": "checkpoint",
    "write_json": "files",
    "export_model": "files",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"hvdtrain.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hvdtrain' has no attribute {name!r}")


def __dir__():
    return __all__
