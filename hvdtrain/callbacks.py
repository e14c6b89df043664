"""Keras callbacks that know about ranks: checkpoints on rank 0, throughput, logs."""

import logging
import time

import horovod.tensorflow as hvd
import tensorflow as tf

__all__ = [
    "CheckpointCallback",
    "ThroughputCallback",
    "ModelStateAverageCallback",
    "rank0_callbacks",
]

log = logging.getLogger("hvdtrain")


class CheckpointCallback(tf.keras.callbacks.Callback):
    """Saves a checkpoint at the end of every epoch, on rank 0 only.

    Args:
        manager: a `hvdtrain.CheckpointManager`.
        extra: fields to record in each checkpoint's manifest (e.g. size, batch).
    """

    def __init__(self, manager, extra=None):
        super().__init__()
        self.manager = manager
        self.extra = extra or {}

    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() != 0:
            return
        path = self.manager.save(epoch + 1, {**self.extra, "logs": _floats(logs)})
        log.info("saved checkpoint %s (epoch %d)", path, epoch + 1)


class ModelStateAverageCallback(tf.keras.callbacks.Callback):
    """At the end of each epoch, averages non-trainable state (BatchNorm statistics) over
    ranks (see `hvdtrain.average_model_state`); put it before evaluation and checkpoints."""

    def on_epoch_end(self, epoch, logs=None):
        from hvdtrain.optim import average_model_state

        average_model_state(self.model)


class ThroughputCallback(tf.keras.callbacks.Callback):
    """Measures training samples/s over all ranks, epoch by epoch.

    `epoch_samples_per_sec` lists each epoch's figure; `samples_per_sec` is the mean over
    the epochs after the first (which pays for tracing), or the first if it is the only one.
    """

    def __init__(self, global_batch, steps_per_epoch):
        super().__init__()
        self.samples = global_batch * steps_per_epoch
        self.epoch_samples_per_sec = []
        self._start = None

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_samples_per_sec.append(self.samples / (time.perf_counter() - self._start))

    @property
    def samples_per_sec(self):
        rates = self.epoch_samples_per_sec
        if not rates:
            return None
        return sum(rates[1:]) / len(rates[1:]) if len(rates) > 1 else rates[0]


def rank0_callbacks(log_dir=None):
    """Callbacks that write files or print, returned on rank 0 only (empty elsewhere)."""
    if hvd.rank() != 0:
        return []
    return [tf.keras.callbacks.TensorBoard(log_dir)] if log_dir else []


def _floats(logs):
    return {k: float(v) for k, v in (logs or {}).items()}
