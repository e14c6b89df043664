"""Input pipelines: shard before shuffle and repeat, equal steps on every rank.

The order matters. Sharding first gives each rank a fixed, disjoint part of the data;
shuffling then mixes only that part, and the pipeline never ends, so every rank runs the
same number of steps even when the shards differ in size by one sample (a rank that ran
out of data early would skip an allreduce and hang the others).
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


def train_dataset(
    x, y, batch_size, rank, size, seed=0, shuffle=True, map_fn=None, start_step=0, steps=None
):
    """An endless, per-rank training dataset; run it for `steps_per_epoch(...)` steps.

    The batch of global step g is a pure function of (seed, rank, g): epoch e = g // steps
    takes the positions of step g % steps in a permutation of this rank's shard that
    depends only on (seed, e). So `start_step` resumes the pipeline exactly where a
    checkpoint left it, mid-epoch included: no sample skipped or seen twice.

    Shard -> per-epoch permutation -> batch (gathered from memory) -> `map_fn` per sample
    (decoding, augmentation; parallel, order kept) -> prefetch.

    Args:
        x, y: all samples (arrays; x may hold file paths for `map_fn` to read).
        batch_size: per-rank batch.
        rank, size: this rank and the number of ranks.
        seed: the shuffle seed (the same on every rank: the shards differ anyway).
        shuffle: False keeps the shard's order (tests, equivalence checks).
        map_fn: `(x, y) -> (x, y)` per sample, or None.
        start_step: the global step of the first batch (epoch x steps + step in epoch).
        steps: steps per epoch; by default `steps_per_epoch(len(x), batch_size, size)`.
    """
    idx = shard_indices(len(x), rank, size)
    steps = steps or steps_per_epoch(len(x), batch_size, size)
    xs, ys = tf.constant(x[idx]), tf.constant(y[idx])
    last = tf.constant(len(idx) - 1, tf.int64)

    def batch_of(step):
        positions = (step % steps) * batch_size + tf.range(batch_size, dtype=tf.int64)
        if shuffle:
            epoch_seed = tf.stack([tf.constant(seed, tf.int64), step // steps])
            positions = tf.random.experimental.index_shuffle(positions, epoch_seed, last)
        return tf.gather(xs, positions), tf.gather(ys, positions)

    ds = tf.data.Dataset.range(start_step, 2**62).map(batch_of)
    if map_fn is not None:
        ds = ds.unbatch().map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
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
