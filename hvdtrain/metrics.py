"""Metrics across ranks, weighted by sample count.

A mean of per-rank means is wrong as soon as ranks saw different numbers of samples
(uneven shards of an evaluation set): here every rank contributes sums and counts, and the
ratio of the all-reduced sums is the exact global mean.
"""

import weakref

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

__all__ = ["weighted_mean", "evaluate", "MetricAverageCallback"]


def weighted_mean(values, count):
    """The mean of `values` (a dict of this rank's means over `count` samples) over all ranks,
    each rank weighted by its `count`."""
    keys = sorted(values)
    local = np.array([values[k] * count for k in keys] + [count], dtype=np.float64)
    total = hvd.allreduce(tf.constant(local), op=hvd.Sum, name="hvdtrain.weighted_mean").numpy()
    if total[-1] == 0:
        return {k: float("nan") for k in keys}
    return {k: float(total[i] / total[-1]) for i, k in enumerate(keys)}


_STEP_FNS = weakref.WeakKeyDictionary()  # model -> its traced evaluation step


def _eval_step(model):
    if model not in _STEP_FNS:
        loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf.keras.losses.Reduction.SUM
        )

        @tf.function(reduce_retracing=True)
        def batch_sums(x, y):
            logits = model(x, training=False)
            pred = tf.argmax(logits, axis=-1, output_type=y.dtype)
            correct = tf.reduce_sum(tf.cast(tf.equal(pred, y), tf.float64))
            return tf.cast(loss_fn(y, logits), tf.float64), correct

        _STEP_FNS[model] = batch_sums
    return _STEP_FNS[model]


def evaluate(model, dataset):
    """Loss and accuracy of a logits classifier over every rank's shard, each sample once.

    `dataset` is this rank's shard (see `hvdtrain.data.eval_dataset`); ranks may have
    different numbers of batches, so no collective runs until the end.

    Returns:
        {"loss": ..., "accuracy": ..., "samples": total samples over all ranks}
    """
    batch_sums = _eval_step(model)
    sums = np.zeros(3, dtype=np.float64)  # loss, correct, samples
    for x, y in dataset:
        loss, correct = batch_sums(x, y)
        sums += (loss.numpy(), correct.numpy(), len(y))
    total = hvd.allreduce(tf.constant(sums), op=hvd.Sum, name="hvdtrain.evaluate").numpy()
    n = max(total[2], 1.0)
    return {"loss": total[0] / n, "accuracy": total[1] / n, "samples": int(total[2])}


class MetricAverageCallback(tf.keras.callbacks.Callback):
    """Replaces each epoch's training logs by their sample-weighted mean over all ranks.

    Put it first in the callback list, so checkpoints, logs and early stopping see the
    global values. `samples_per_epoch` is this rank's number of training samples in one
    epoch. When `evaluate_fn` is given, it runs on every rank at the end of each epoch and
    its results join the logs as `val_*` (every rank takes part: validating on rank 0 alone
    would hang the others in the next allreduce). A callback of your own that evaluates
    on rank 0 alone does hang; with `hvdtrain.WatchdogCallback` the job then ends after
    the stall time, naming rank 0 and its epoch-end callbacks (tests/test_no_hangs.py).
    """

    def __init__(self, samples_per_epoch, evaluate_fn=None):
        super().__init__()
        self.samples_per_epoch = samples_per_epoch
        self.evaluate_fn = evaluate_fn

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        train = {k: float(v) for k, v in logs.items() if not k.startswith("val_")}
        logs.update(weighted_mean(train, self.samples_per_epoch))
        if self.evaluate_fn is not None:
            result = self.evaluate_fn()
            logs["val_loss"] = result["loss"]
            logs["val_accuracy"] = result["accuracy"]
