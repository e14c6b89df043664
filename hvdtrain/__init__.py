"""hvdtrain: Horovod data-parallel training for TensorFlow/Keras.

A single-device Keras script becomes distributed with one call, its model compiled as for
one device and its data in any form (arrays, a tf.data pipeline, TFRecord or other files)::

    import hvdtrain

    args = hvdtrain.ArgumentParser(epochs=10).parse_args()   # --checkpoint-dir, --elastic, ...
    hvdtrain.fit(build_model, hvdtrain.FileData("data/*.tfrecord", parse), args)

launched with `horovodrun -np 4 python train.py`, `mpirun -np 4 python train.py` or
`hvdtrain-run --hostfile hosts.txt -- python train.py`; from a notebook cell (or any Python),
`hvdtrain.launch(train, np=2)` runs a function on the ranks under the same supervision and
returns rank 0's value. The building blocks of the recipe
(`init`, `train_dataset`, `distributed_optimizer`, `broadcast_initial_state`, ...) are
here too, for loops of your own.

Importing `hvdtrain` defines these names and does nothing else: each loads its module on
first use (so the launcher, `hvdtrain.launcher`, never imports TensorFlow), and what changes
the process happens in the calls you make (`hvdtrain.init`, `hvdtrain.fit`,
`hvdtrain.ArgumentParser`, the entry points, `hvdtrain-run`). The one exception, where
TensorFlow 2.16 or newer is installed: TF_USE_LEGACY_KERAS=1 is set (unless set already), so
that `tf.keras` is Keras 2, which Horovod needs; TensorFlow reads it when `tf.keras` is first
used, so it must be set before then (`hvdtrain.runtime.compat`).
"""

import importlib
import os

from hvdtrain.runtime import compat  # the standard library only: no TensorFlow

__version__ = "0.1.0"

# The module paths before the concept folders (`hvdtrain.records`, `hvdtrain.flags`, ...): each
# resolves to the module it moved to (`hvdtrain/_moved`).
__path__.append(os.path.join(os.path.dirname(__file__), "_moved"))

if compat.legacy_keras_needed(compat.tensorflow_version()):
    os.environ.setdefault(compat.LEGACY_KERAS, "1")
    compat.keras2_submodules()  # `from tensorflow.keras.x import y` after it, too

_EXPORTS = {
    # the recipe
    "fit": "recipe.trainer",
    "launch": "launcher.notebook",
    "ArgumentParser": "recipe.flags",
    "TrainConfig": "recipe.flags",
    # data
    "as_data": "data.forms",
    "Data": "data",
    "ArrayData": "data",
    "DatasetData": "data",
    "FileData": "data.files",
    "BatchData": "data.batches",
    "Placement": "data",
    "shard_indices": "data",
    "steps_per_epoch": "data",
    "train_dataset": "data",
    "eval_dataset": "data",
    "load_mnist": "data.mnist",
    # set-up
    "HvdtrainError": "errors",
    "TrainingDiverged": "errors",
    "OutputsNotWritten": "errors",
    "JobFailed": "errors",
    "init": "runtime.process",
    "is_main_process": "runtime.process",
    "gpu_for_local_rank": "runtime.process",
    "threads_per_rank": "runtime.process",
    "agree": "runtime.process",
    "rank_report": "runtime.process",
    "weights_digest": "runtime.process",
    "get_logger": "runtime.logs",
    "compile_options": "runtime.tuning",
    # optimisation
    "scaled_lr": "optimizers.rates",
    "warmup_lr": "optimizers.rates",
    "WarmupSchedule": "optimizers.rates",
    "distributed_optimizer": "recipe.optim",
    "fp16_compression": "recipe.optim",
    "broadcast_initial_state": "recipe.optim",
    "average_model_state": "recipe.optim",
    # metrics
    "weighted_mean": "recipe.metrics",
    "evaluate": "recipe.metrics",
    "MetricAverageCallback": "recipe.metrics",
    # callbacks
    "ModelStateAverageCallback": "recipe.callbacks",
    "CheckpointCallback": "recipe.callbacks",
    "ProgressCallback": "recipe.callbacks",
    "ThroughputCallback": "recipe.callbacks",
    "Watchdog": "runtime.watchdog",
    "WatchdogCallback": "recipe.callbacks",
    "rank0_only": "recipe.usercallbacks",
    # ranks that drift apart
    "RanksDisagree": "recipe.agreement",
    "check_weights_agree": "recipe.agreement",
    "WeightsAgreeCallback": "recipe.agreement",
    # files
    "CheckpointManager": "recipe.checkpoint",
    "Manifest": "recipe.checkpoint",
    "write_json": "recipe.outputs",
    "export_model": "recipe.outputs",
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
