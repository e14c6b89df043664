"""Metrics across ranks, exact whatever the shards: the model's own loss and metrics, their
states summed over the ranks.

A mean of per-rank means is wrong as soon as ranks saw different numbers of samples
(uneven shards of a test set), and an AUC or a precision is no mean at all. Every Keras
metric keeps additive state (a total and a count, true and false positives, a confusion
matrix); summing that state over the ranks gives the metric of all the data, exactly.
"""

import warnings
import weakref

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdtrain.errors import invalid_value

__all__ = ["weighted_mean", "evaluate", "global_results", "MetricAverageCallback"]


def weighted_mean(values, count):
    """The mean of `values` (a dict of this rank's means over `count` samples) over all ranks,
    each rank weighted by its `count`."""
    keys = sorted(values)
    local = np.array([values[k] * count for k in keys] + [count], dtype=np.float64)
    total = hvd.allreduce(tf.constant(local), op=hvd.Sum, name="hvdtrain.weighted_mean").numpy()
    if total[-1] == 0:
        return {k: float("nan") for k in keys}
    return {k: float(total[i] / total[-1]) for i, k in enumerate(keys)}


def _states(model):
    """[(metric name, [state arrays])] of the model's metrics that hold state."""
    return [(m.name, [v.numpy() for v in m.variables]) for m in model.metrics if m.variables]


def global_results(model, keep=None, samples=None):
    """The model's metric results over every rank: each metric's state (total and count,
    confusion counts, ...) summed over the ranks, then its `result()`. A collective: every
    rank calls it, with whatever its metrics hold (none if it saw no batch).

    With `keep` (what Keras's `evaluate` returned on this rank: {name: value}), only the
    results some rank returned: a metric a `test_step` of the model's own never updates is
    left out, as Keras's `evaluate` leaves it out; and what that `test_step` returned
    besides its metrics (a distillation's `student_loss`: Keras reports the last batch's)
    is kept, its mean over the ranks that returned it. With `samples` (this rank's count),
    `samples` is their sum over the ranks."""
    others = {k: _scalar(v) for k, v in (keep or {}).items()}
    others = {k: v for k, v in others.items() if v is not None}
    mine = (_states(model), None if keep is None else sorted(keep), samples, others)
    pairs = hvd.allgather_object(mine, name="hvdtrain.recipe.metrics") if hvd.size() > 1 else [mine]
    gathered = [states for states, *_ in pairs]
    kept = None if keep is None else {name for _, names, *_ in pairs for name in names or ()}
    summed = {}
    for states in gathered:
        for name, arrays in states:
            old = summed.get(name)
            summed[name] = (
                [np.array(a) for a in arrays]
                if old is None
                else [a + b for a, b in zip(old, arrays, strict=True)]
            )
    results = {}
    for m in model.metrics:
        if m.name in summed and len(m.variables) == len(summed[m.name]):
            for v, total in zip(m.variables, summed[m.name], strict=True):
                v.assign(total)
            result = m.result()  # Keras 3's compiled metrics are one metric of metrics
            results.update(
                {k: _number(v) for k, v in result.items()}
                if isinstance(result, dict)
                else {m.name: _number(result)}
            )
    # A rank that saw no batch has not built the compiled metrics: it takes every result
    # from the rank with the most (the same decision on every rank: no one waits alone).
    counts = [len(states) for states in gathered]
    if len(set(counts)) > 1:
        source = counts.index(max(counts))
        taken = hvd.broadcast_object(
            results if hvd.rank() == source else None, root_rank=source, name="hvdtrain.results"
        )
        results = {**taken, **results}
    if kept is not None:
        results = {k: v for k, v in results.items() if k in kept}
        for name in sorted(kept - set(results)):  # not a metric: the mean over the ranks
            values = [o[name] for *_, o in pairs if name in o]
            if values:
                results[name] = float(np.mean(values))
    if samples is not None:
        results["samples"] = sum(n for _, _, n, _ in pairs)
    return results


def _scalar(value):
    """A log's value as a float, or None for what is not one number."""
    try:
        value = np.asarray(value)
    except (TypeError, ValueError):
        return None
    if value.ndim or value.dtype.kind not in "fiub":
        return None
    return float(value)


def _number(value):
    value = np.asarray(value)
    return float(value) if value.ndim == 0 else value.tolist()


def evaluate(model, dataset, callbacks=None):
    """The model's compiled loss and metrics over every rank's shard, each sample once.

    `dataset` is this rank's shard of the test set (batches of (x, y) or (x, y, weight)),
    or None when the rank has none; ranks may have different numbers of batches, so no
    collective runs until the end, when the metrics' states are summed over the ranks
    (`global_results`). Works for any loss and metric of `compile` (logits or
    probabilities, integer or one-hot labels, regression), and for any
    `steps_per_execution`: a stream of unknown length (files, a filter) is counted once
    (see `sized`). `callbacks` go to Keras' `evaluate` (a `WatchdogCallback` keeps watching).

    Returns:
        {"loss": ..., <metric>: ..., "samples": test samples over all ranks}: what Keras's
        `evaluate` returns (with a `test_step` of the model's own: what it returns) over
        all ranks, and the samples counted as the data was read (a loss tracker a
        `test_step` updates once per batch counts batches).
    """
    model.reset_metrics()
    returned, count = {}, None
    if dataset is not None and int(dataset.cardinality()) == 0:  # fewer batches than ranks
        dataset = None
    if dataset is not None:
        dataset, count = _counting(sized(dataset, count=_steps_per_execution(model) > 1))
        try:
            with warnings.catch_warnings():
                # Keras 3 warns "Your input ran out of data" on every rank when a dataset of
                # unknown length ends; for an evaluation that is its end, not a shortfall.
                warnings.filterwarnings("ignore", "Your input ran out of data")
                returned = model.evaluate(dataset, verbose=0, callbacks=callbacks, return_dict=True)
        except ValueError as e:  # Keras' answers to a dataset without a single batch
            if "Empty logs" not in str(e) and "Expected input data to be non-empty" not in str(e):
                raise
    samples = 0 if count is None else int(count.numpy())
    results = global_results(model, keep=returned, samples=samples)
    model.reset_metrics()
    return results


def _counting(dataset):
    """(`dataset`, a variable that counts the samples of the batches read from it)."""
    with tf.device("/CPU:0"):  # where tf.data runs: a variable on a GPU is out of its reach
        count = tf.Variable(0, dtype=tf.int64, trainable=False)

    def add(*batch):
        count.assign_add(tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0])
        return batch if len(batch) > 1 else batch[0]

    return dataset.map(add), count


_SIZED = weakref.WeakKeyDictionary()  # dataset -> the same with its length known


def sized(dataset, count=True):
    """`dataset` with its number of batches known to TensorFlow: as it is when TensorFlow
    knows it, else (with `count`) counted by reading it once, remembered for the same
    dataset object.

    Keras 2 runs several steps per call only over a dataset of known length (else "Could
    not infer the size of the data"); a stream of files or a `filter` has none. Give your
    own dataset a length with `tf.data.experimental.assert_cardinality(n)` to skip the
    count. An endless dataset is an error: evaluation would never end.
    """
    size = int(dataset.cardinality())
    if size == tf.data.INFINITE_CARDINALITY:
        raise invalid_value(
            "test dataset",
            "an endless dataset (repeat() without a count)",
            "a finite dataset that gives each test sample once",
        )
    if size != tf.data.UNKNOWN_CARDINALITY or not count:
        return dataset
    if dataset not in _SIZED:
        count = int(dataset.reduce(np.int64(0), lambda n, _: n + 1))
        _SIZED[dataset] = dataset.apply(tf.data.experimental.assert_cardinality(count))
    return _SIZED[dataset]


def _steps_per_execution(model):
    """The steps per call of the model's compiled `fit`/`evaluate` (1 if it has none)."""
    spe = getattr(model, "_steps_per_execution", None)  # Keras 2: a variable
    return int(spe.numpy()) if spe is not None else 1


class MetricAverageCallback(tf.keras.callbacks.Callback):
    """Replaces each epoch's training logs by the metrics of every rank's batches together
    (states summed, see `global_results`), and adds the test metrics as `val_*`.

    Put it first among the callbacks that read logs, so checkpoints, logs and early
    stopping see the global values. When `evaluate_fn` is given, it runs on every rank at
    the end of each epoch (every rank takes part: validating on rank 0 alone would hang the
    others in the next allreduce). A callback of your own that evaluates on rank 0 alone
    does hang; with `hvdtrain.WatchdogCallback` the job then ends after the stall time,
    naming rank 0 and its epoch-end callbacks (tests/test_no_hangs.py).
    """

    def __init__(self, evaluate_fn=None):
        super().__init__()
        self.evaluate_fn = evaluate_fn

    def on_epoch_end(self, epoch, logs=None):
        if logs is None:
            return
        # What a train_step of the model's own returns besides its metrics (a GAN's losses as
        # tensors: the epoch's last batch's) comes back as its mean over the ranks, for every
        # rank alike, with the metrics in the same collective.
        logs.update(global_results(self.model, keep=logs))
        if self.evaluate_fn is not None:
            result = self.evaluate_fn()
            logs.update({f"val_{k}": v for k, v in result.items() if k != "samples"})
