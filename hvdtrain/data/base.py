"""Input pipelines: shard before shuffle and repeat, equal steps on every rank.

The order matters. Sharding first gives each rank a fixed, disjoint part of the data;
shuffling then mixes only that part, and every rank runs the same number of steps even
when the shards differ in size (a rank that ran out of data early would skip an allreduce
and hang the others). The batch of each global step is a pure function of (seed, rank,
step), so a resume continues at the exact sample.

`hvdtrain.fit` takes the data in one of these forms (each a `Data`):

    hvdtrain.fit(build_model, (x, y))                                  # numpy arrays
    hvdtrain.fit(build_model, hvdtrain.ArrayData(x, y, test=(xt, yt)))
    hvdtrain.fit(build_model, hvdtrain.DatasetData(make_dataset, num_samples=60000))
    hvdtrain.fit(build_model, hvdtrain.FileData("data/train-*.tfrecord", parse))  # files
    hvdtrain.fit(build_model, py_dataset)       # a PyDataset, a Sequence, a generator

with `make_dataset(rank, size, seed, epoch)` returning the rank's samples for one epoch
(see `DatasetData`), `FileData` in `hvdtrain.data.files` (TFRecord, any files, per-host) and
`BatchData` in `hvdtrain.data.batches` (batches made in Python, as Keras's `fit` takes them).
"""

import dataclasses
import os
import socket

import numpy as np
import tensorflow as tf

from hvdtrain.errors import invalid_value

__all__ = [
    "shard_indices",
    "steps_per_epoch",
    "train_dataset",
    "share_dataset",
    "eval_dataset",
    "Placement",
    "Data",
    "chain",
    "pack",
    "structure",
    "num_samples",
]


def shard_indices(num_samples, rank, size):
    """The sample indices of `rank`'s shard: every `size`-th one, from `rank`.

    The shards are disjoint and together cover all `num_samples`; their sizes differ by at
    most one.
    """
    if not isinstance(size, int | np.integer) or size < 1:
        raise invalid_value("size", size, "a positive number of ranks")
    if not 0 <= rank < size:
        raise invalid_value("rank", rank, f"0 <= rank < {size}")
    return np.arange(rank, num_samples, size)


def steps_per_epoch(num_samples, batch_size, size):
    """Steps per epoch, the same on every rank: full batches of the smallest shard."""
    for name, value, low in (
        ("num_samples", num_samples, 0),
        ("batch_size", batch_size, 1),
        ("size", size, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
            raise invalid_value(name, value, f"an integer >= {low}")
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
    x,
    y,
    batch_size,
    rank,
    size,
    seed=0,
    shuffle=True,
    map_fn=None,
    start_step=0,
    steps=None,
    sample_weight=None,
):
    """An endless, per-rank training dataset of arrays; run it for `steps` per epoch.

    `x`, `y` and `sample_weight` are what Keras's `fit` takes: arrays, or dicts, tuples or
    lists of them (a model's named inputs or outputs), sharded and shuffled together; `y`
    None for a model that trains on its inputs alone (an autoencoder's `fit(x)`). Batches
    are `(x, y)`, `(x, y, sample_weight)`, or `x` alone, as Keras makes them.

    The batch of global step g is a pure function of (seed, rank, g): epoch e = g // steps
    takes the positions of step g % steps in a permutation of this rank's shard that
    depends only on (seed, e). So `start_step` resumes the pipeline exactly where a
    checkpoint left it, mid-epoch included: no sample skipped or seen twice.

    Shard -> per-epoch permutation -> batch (gathered from memory) -> `map_fn` per sample
    (decoding, augmentation; parallel, order kept) -> prefetch.
    """
    n = num_samples(x, "x")
    idx = shard_indices(n, rank, size)
    steps = steps or steps_per_epoch(n, batch_size, size)
    arrays = tf.nest.map_structure(
        lambda a: tf.constant(np.asarray(a)[idx]), pack(x, y, sample_weight)
    )
    last = tf.constant(len(idx) - 1, tf.int64)

    def batch_of(step):
        positions = (step % steps) * batch_size + tf.range(batch_size, dtype=tf.int64)
        if shuffle:
            epoch_seed = tf.stack([tf.constant(seed, tf.int64), step // steps])
            positions = tf.random.experimental.index_shuffle(positions, epoch_seed, last)
        return tf.nest.map_structure(lambda t: tf.gather(t, positions), arrays)

    return _mapped(tf.data.Dataset.range(start_step, 2**62).map(batch_of), map_fn, batch_size)


def _mapped(batches, map_fn, batch_size):
    """`batches` with `map_fn` per sample (parallel, order kept), prefetched."""
    if map_fn is not None:
        ds = batches.unbatch().map(map_fn, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        batches = ds.batch(batch_size, drop_remainder=True)
    return batches.prefetch(tf.data.AUTOTUNE)


def share_dataset(arrays, batch_size, *, seed, epoch, first, steps, map_fn=None):
    """The batches `first` to `first + steps` of epoch `epoch` over all ranks, from `arrays`
    (`pack`ed samples, every one of them): `--sync-balance`'s share of a rank
    (`hvdtrain.data.shares`).

    The epoch's order is one permutation of all the samples that depends only on (seed,
    epoch); each rank takes a run of its batches, so the ranks' shares, of any sizes that
    add up to the epoch, train each sample of it once.
    """
    n = num_samples(arrays, "x")
    last = tf.constant(n - 1, tf.int64)
    key = tf.constant([seed, epoch], tf.int64)

    def batch_of(i):
        positions = i * batch_size + tf.range(batch_size, dtype=tf.int64)
        positions = tf.random.experimental.index_shuffle(positions, key, last)
        return tf.nest.map_structure(lambda t: tf.gather(t, positions), arrays)

    return _mapped(tf.data.Dataset.range(first, first + steps).map(batch_of), map_fn, batch_size)


def eval_dataset(x, y, batch_size, rank, size, map_fn=None, sample_weight=None):
    """This rank's shard of an evaluation set, each sample once (the last batch may be short);
    `x`, `y` and `sample_weight` as `train_dataset` takes them.

    Shards differ in size, so ranks may run different numbers of batches: evaluation
    must not use collectives per batch (see `hvdtrain.recipe.metrics.evaluate`).
    """
    idx = shard_indices(num_samples(x, "x"), rank, size)
    sharded = tf.nest.map_structure(lambda a: np.asarray(a)[idx], pack(x, y, sample_weight))
    ds = tf.data.Dataset.from_tensor_slices(sharded)
    if map_fn is not None:
        ds = ds.map(map_fn, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size).prefetch(tf.data.AUTOTUNE)


def pack(x, y=None, sample_weight=None):
    """A sample as Keras's `fit` gives it to `train_step`: `(x, y)`, `(x, y, sample_weight)`,
    or `x` alone (a tuple or list `x` as `(x,)`). Lists of arrays become tuples (tf.data
    would stack a list into one tensor), lists of numbers or strings arrays."""
    x, y, sample_weight = structure(x), structure(y), structure(sample_weight)
    if y is None and sample_weight is None:
        return (x,) if isinstance(x, tuple) else x
    return (x, y) if sample_weight is None else (x, y, sample_weight)


def structure(data):
    """`data` with its lists of arrays as tuples and its lists of samples as arrays."""
    if isinstance(data, dict):
        return {k: structure(v) for k, v in data.items()}
    if isinstance(data, list | tuple) and not hasattr(data, "_fields"):
        if _array_like(data):
            return np.asarray(data)
        return tuple(structure(v) for v in data)
    return data


def num_samples(data, name):
    """The number of samples in `data` (an array, or a dict, tuple or list of arrays: each must
    hold as many; a mismatch names the key)."""
    leaves = _leaves(data, name)
    if not leaves:
        raise invalid_value(name, data, "arrays, or a dict, tuple or list of arrays")
    where, first = leaves[0]
    n = len(first)
    for path, array in leaves[1:]:
        if len(array) != n:
            raise invalid_value(path, f"{len(array)} samples", f"{n}, as many as {where}")
    return n


def _leaves(data, name):
    """[(path, array)] of a structure of arrays, `name` and its keys in the paths."""
    if isinstance(data, dict):
        return [leaf for k, v in data.items() for leaf in _leaves(v, f"{name}[{k!r}]")]
    if isinstance(data, tuple | list) and not _array_like(data):
        return [leaf for i, v in enumerate(data) for leaf in _leaves(v, f"{name}[{i}]")]
    if not hasattr(data, "__len__"):
        raise invalid_value(name, type(data).__name__, "an array of samples")
    return [(name, data)]


def _array_like(data):
    """A list or tuple of numbers or strings (samples), not of arrays (inputs)."""
    return not any(hasattr(v, "__len__") and not isinstance(v, str | bytes) for v in data)


def chain(datasets):
    """The datasets one after the other (a balanced tree of `concatenate`)."""
    datasets = list(datasets)
    if not datasets:
        raise invalid_value("datasets", datasets, "at least one dataset")
    while len(datasets) > 1:
        pairs = [datasets[i : i + 2] for i in range(0, len(datasets), 2)]
        datasets = [p[0].concatenate(p[1]) if len(p) == 2 else p[0] for p in pairs]
    return datasets[0]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where this process is: its rank among `size`, and its host (name and local rank).

    `host` is the name the launcher gave the host (horovodrun's HOROVOD_HOSTNAME, so
    `-H localhost:1,127.0.0.1:1` are two hosts), else this machine's name.
    """

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    host: str = "localhost"

    @classmethod
    def current(cls):
        """This process's placement, from Horovod (after `hvdtrain.init()`)."""
        import horovod.tensorflow as hvd

        host = os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
        return cls(hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), host)


class Data:
    """What `hvdtrain.fit` needs from the data; subclass it for a form of your own.

    `prepare` runs on every rank after `hvdtrain.init()` and may use collectives (to count
    samples and agree on them); then `steps_per_epoch` must give the same number on every
    rank, and `train_dataset` must yield exactly that many full batches per epoch.
    """

    source = "data"  # a short name for the metrics JSON
    batch_size = None  # a batch size the data fixes itself (batches made in Python), or None

    def prepare(self, placement, seed=0):
        """Reads what it must (counts, file lists) and agrees with the other ranks."""

    def describe(self):
        """One line for the log."""
        return self.source

    @property
    def num_samples(self):
        """Training samples in all (every rank's shard together)."""
        raise NotImplementedError

    def steps_per_epoch(self, batch_size, placement):
        return steps_per_epoch(self.num_samples, batch_size, placement.size)

    def train_dataset(self, batch_size, placement, *, seed, start_step, steps, epochs):
        """This rank's batches from global step `start_step` to the end of `epochs`."""
        raise NotImplementedError

    def train_share(self, batch_size, *, seed, epoch, first, steps):
        """The batches `first` to `first + steps` of epoch `epoch` in an order over all ranks
        (`--sync-balance`: a rank's unequal share, `hvdtrain.data.shares`); where `shares`."""
        raise NotImplementedError

    @property
    def shares(self):
        """Whether `train_share` gives a rank any part of an epoch: a form that defines it."""
        return type(self).train_share is not Data.train_share

    @property
    def has_test(self):
        """Whether there is a test set (on every rank alike, even one whose share is empty)."""
        return False

    def eval_dataset(self, batch_size, placement):
        """This rank's share of the test set, each sample once over all ranks; or None."""
        return None

    def explain(self, error):
        """A `HvdtrainError` saying what went wrong in reading the data, for an error that
        training met; or None."""
        return None

    def loader_warning(self, placement):
        """One line of warning about how the data is loaded on this host; or None."""
        return None
