"""hvdtrain: Horovod data-parallel training for TensorFlow/Keras.

A single-device Keras script becomes distributed with a few calls::

    import hvdtrain
    hvdtrain.init()                                       # hvd.init, GPU pinning, threads
    ds = hvdtrain.train_dataset(x, y, batch, hvd.rank(), hvd.size())  # shard first
    opt = hvdtrain.distributed_optimizer(
        tf.keras.optimizers.Adam(hvdtrain.WarmupSchedule(lr, hvd.size(), warmup_steps)))
    model.compile(opt, ...)
    hvdtrain.broadcast_initial_state(model, opt)          # identical start on every rank

and is launched with `horovodrun -np 4 python train.py` or `mpirun -np 4 python train.py`.

Importing `hvdtrain` does not import TensorFlow: the names below load their module on
first use, so the launcher (`hvdtrain.launcher`) starts fast and never touches a GPU.
"""

import importlib
import os

__version__ = "0.1.0"

from hvdtrain import compat  # noqa: E402  (standard library only; no TensorFlow)
from hvdtrain.errors import report_uncaught  # noqa: E402

# Keras 2 (tf_keras) for tf.keras from TensorFlow 2.16 on: Horovod has no Keras 3 path. It must
# be set before TensorFlow is imported, so here, before any module of ours imports it (it also
# reaches every process the launcher starts). `hvdtrain.compat` explains a wrong Keras.
if compat.legacy_keras_needed(compat.tensorflow_version()):
    os.environ.setdefault(compat.LEGACY_KERAS, "1")
report_uncaught()  # a user mistake in a script prints one line, not a traceback

_EXPORTS = {
    "HvdtrainError": "errors",
    "init": "runtime",
    "is_main_process": "runtime",
    "gpu_for_local_rank": "runtime",
    "threads_per_rank": "runtime",
    "agree": "runtime",
    "rank_report": "runtime",
    "weights_digest": "runtime",
    "shard_indices": "data",
    "steps_per_epoch": "data",
    "train_dataset": "data",
    "eval_dataset": "data",
    "scaled_lr": "optim",
    "warmup_lr": "optim",
    "WarmupSchedule": "optim",
    "distributed_optimizer": "optim",
    "fp16_compression": "optim",
    "broadcast_initial_state": "optim",
    "average_model_state": "optim",
    "ModelStateAverageCallback": "callbacks",
    "weighted_mean": "metrics",
    "evaluate": "metrics",
    "MetricAverageCallback": "metrics",
    "CheckpointManager": "checkpoint",
    "CheckpointCallback": "callbacks",
    "ThroughputCallback": "callbacks",
    "Watchdog": "watchdog",
    "WatchdogCallback": "watchdog",
    "compile_options": "tuning",
    "load_mnist": "datasets",
    "get_logger": "logs",
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
