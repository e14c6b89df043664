"""Input pipelines: shard before shuffle and repeat, equal steps on every rank.

The order matters. Sharding first gives each rank a fixed, disjoint part of the data;
shuffling then mixes only that part, and `repeat()` lets every rank run the same number
of steps even when the shards differ in size by one sample (a rank that ran out of data
early would skip an allreduce and hang the others).
"""

import numpy as np
import tensorflow as tf

from hvdtrain.errors import invalid_value

__all__ = ["shard_indices", "steps_per_epoch", "train_dataset", "eval_dataset"]


def shard_indices(num_samples, rank, size):
    """The sample indices of `rank`'s shard: every `size`-th one, from `rank`.

    The shards are disjoint and together cover all `num_samples`; their sizes differ by at
    most one.
    """
    if size < 1:
        raise invalid_value("size", size, "a positive number of ranks")
    if not 0 <= rank < size:
        raise invalid_value("rank", rank, f"0 <= rank < {size}")
    return np.arange(rank, num_samples, size)


def steps_per_epoch(num_samples, batch_size, size):
    """Steps per epoch, the same on every rank: full batches of the smallest shard."""
    steps = (num_samples // size) // batch_size
    if steps < 1:
        raise invalid_value(
            "batch_size",
            batch_size,
            f"at most {num_samples // size} (the {num_samples} samples split over "
            f"{size} rank(s) must fill at least one batch per rank)",
        )
    return steps


def train_dataset(x, y, batch_size, rank, size, seed=0, shuffle=True, map_fn=None, cache=True):
    """An endless, per-rank training dataset; run it for `steps_per_epoch(...)` steps.

    Shard -> cache -> shuffle (reshuffled each epoch) -> repeat -> map -> batch -> prefetch.
    `map_fn(x, y)` (decoding, augmentation) runs after the shuffle, in parallel, so random
    augmentations differ every epoch; `cache=False` for data too large for memory.
    """
    idx = shard_indices(len(x), rank, size)
    ds = tf.data.Dataset.from_tensor_slices((x[idx], y[idx]))
    if cache:
        ds = ds.cache()
    if shuffle:
        ds = ds.shuffle(len(idx), seed=seed, reshuffle_each_iteration=True)
    ds = ds.repeat()
    if map_fn is not None:
        ds = ds.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.batch(batch_size, drop_remainder=True)
    return ds.prefetch(tf.data.AUTOTUNE)


def eval_dataset(x, y, batch_size, rank, size, map_fn=None):
    """This rank's shard of an evaluation set, each sample once (the last batch may be short).

    Shards differ in size, so ranks may run different numbers of batches: evaluation
    must not use collectives per batch (see `hvdtrain.metrics.evaluate`).
    """
    idx = shard_indices(len(x), rank, size)
    ds = tf.data.Dataset.from_tensor_slices((x[idx], y[idx]))
    if map_fn is not None:
        ds = ds.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)
