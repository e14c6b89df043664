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
    """Saves a checkpoint at the end of every epoch (and every `every_steps` steps), on
    rank 0 only.

    Args:
        manager: a `hvdtrain.CheckpointManager`.
        extra: fields to record in each checkpoint's manifest (e.g. size, batch).
        steps_per_epoch: steps in a full epoch (needed with `every_steps`).
        every_steps: also save mid-epoch every this many global steps (0 = epoch ends only).
        start_step: the global step training starts from (after a resume).
    """

    def __init__(self, manager, extra=None, steps_per_epoch=None, every_steps=0, start_step=0):
        super().__init__()
        self.manager = manager
        self.extra = extra or {}
        self.steps_per_epoch = steps_per_epoch
        self.every_steps = every_steps
        self.global_step = start_step

    def on_train_batch_end(self, batch, logs=None):
        self.global_step += 1
        if hvd.rank() != 0 or not self.every_steps or self.global_step % self.every_steps:
            return
        epoch, step = divmod(self.global_step, self.steps_per_epoch)
        if step:  # an epoch's last step is saved by on_epoch_end
            path = self.manager.save(epoch, self.extra, step=step)
            log.info("saved checkpoint %s (epoch %d, step %d)", path, epoch + 1, step)

    def on_epoch_end(self, epoch, logs=None):
        if hvd.rank() != 0:
            return
        path = self.manager.save(epoch + 1, {**self.extra, "logs": _floats(logs)})
        log.info("saved checkpoint %s (epoch %d)", path, epoch + 1)


class DeterministicRandomness(tf.keras.callbacks.Callback):
    """Makes dropout and augmentation layers draw from a seed that is a pure function of
    (seed, rank, global step), so a resumed run repeats an uninterrupted one bit for bit.

    Needs `tf.keras.backend.experimental.enable_tf_random_generator()` before the model
    is built (the layers then keep a `tf.random.Generator`, reset here before each step).
    """

    def __init__(self, seed, rank, start_step=0):
        super().__init__()
        self.seed, self.rank, self.global_step = seed, rank, start_step

    def on_train_batch_begin(self, batch, logs=None):
        for i, layer in enumerate(self.model.submodules):
            rng = getattr(layer, "_random_generator", None)
            if rng is None or not hasattr(rng, "_maybe_init"):
                continue
            rng._maybe_init()  # Keras creates the generator lazily
            generator = getattr(rng, "_generator", None)
            if generator is not None:
                generator.reset_from_seed(hash((self.seed, self.rank, self.global_step, i)))
        self.global_step += 1


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

    def __init__(self, global_batch, steps_per_epoch=None):
        super().__init__()
        self.global_batch = global_batch
        self.epoch_samples_per_sec = []
        self._start = None
        self._batches = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._start, self._batches = time.perf_counter(), 0

    def on_train_batch_end(self, batch, logs=None):
        self._batches = batch + 1  # with steps_per_execution > 1, Keras calls once per execution

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self._start
        self.epoch_samples_per_sec.append(self._batches * self.global_batch / seconds)

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
