"""`DatasetData`: your own `tf.data` pipeline, made per rank and per epoch."""

import tensorflow as tf

from hvdtrain.data.base import Data, chain
from hvdtrain.errors import HvdtrainError, invalid_value, kind_of

__all__ = ["DatasetData", "batched_by"]

# The tf.data steps that batch (Python classes of tf.data: `ds.batch(64)` is a _BatchDataset).
_BATCHING = {
    "_BatchDataset": "batch",
    "_PaddedBatchDataset": "padded_batch",
    "_ParallelBatchDataset": "batch",
    "_DenseToRaggedDataset": "ragged_batch",
    "_MapAndBatchDataset": "map_and_batch",
}


def batched_by(ds):
    """`.batch(64)` (the step, with its size where known) when `ds` batches its samples, or
    None: its own steps, back to its source, hold a batch not undone by an `.unbatch()`
    (what happens inside an `interleave` or `flat_map` is not looked at)."""
    for _ in range(1000):  # a pipeline of steps, each with its input
        name = type(ds).__name__
        if name == "_UnbatchDataset":
            return None
        if name in _BATCHING:
            try:
                size = int(ds._batch_size)
            except (AttributeError, TypeError, ValueError):
                size = ""
            return f".{_BATCHING[name]}({size})"
        ds = getattr(ds, "_input_dataset", None)
        if ds is None:
            return None
    return None


class DatasetData(Data):
    """Your own `tf.data` pipeline, made per rank and per epoch.

        def make_dataset(rank, size, seed, epoch):
            files = tf.data.Dataset.list_files("data/*.csv", shuffle=False)
            ds = files.interleave(tf.data.TextLineDataset).shard(size, rank)  # shard first ...
            return ds.map(parse).shuffle(10_000, seed=seed + epoch)  # ... then shuffle

        hvdtrain.fit(build_model, hvdtrain.DatasetData(make_dataset, num_samples=50_000))

    `make_dataset` returns this rank's samples for one epoch, unbatched; hvdtrain batches
    them and takes `steps_per_epoch` batches (the same on every rank: (num_samples // ranks)
    // batch). Shard the samples as above, or the files only where they divide evenly: three
    files of 600 samples sharded over 2 ranks give one rank 1,200 and the other 600. A rank
    whose dataset ends sooner stops the job with an error naming it, instead of leaving the
    others waiting. For an exact resume, the dataset must depend only
    on its arguments (seed the shuffles with them).

    Args:
        train_fn: `(rank, size, seed, epoch) -> tf.data.Dataset` of samples.
        num_samples: training samples over all ranks.
        test_fn: `(rank, size) -> tf.data.Dataset` of this rank's test samples (each
            sample on one rank), or None.
    """

    source = "tf.data"

    def __init__(self, train_fn, num_samples, test_fn=None):
        if not callable(train_fn):
            raise invalid_value("train_fn", train_fn, "a function (rank, size, seed, epoch)")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise invalid_value("num_samples", num_samples, "the number of training samples")
        self.train_fn, self.test_fn, self._num_samples = train_fn, test_fn, num_samples

    def describe(self):
        return f"a tf.data pipeline of {self.num_samples} training samples"

    @property
    def num_samples(self):
        return self._num_samples

    def train_dataset(self, batch_size, placement, *, seed, start_step, steps, epochs):
        first, skip = divmod(start_step, steps)
        per_epoch = steps * batch_size

        def one(epoch):
            ds = self.train_fn(placement.rank, placement.size, seed, epoch)
            if not isinstance(ds, tf.data.Dataset):
                raise HvdtrainError(
                    f"Invalid value for `train_fn`: it returned {kind_of(ds)}; expected "
                    "a tf.data.Dataset of samples."
                )
            batched = batched_by(ds)
            if batched:
                raise HvdtrainError(
                    f"Invalid value for `train_fn`: it returned a batched tf.data.Dataset "
                    f"({batched}); expected this rank's samples for one epoch, unbatched: "
                    "hvdtrain batches them itself, --batch-size samples per rank. Leave out "
                    f"the {batched} (and the .prefetch after it), as "
                    "docs/from-tf-distribute.md shows."
                )
            # Fewer samples than the steps need: an error on this rank, not a hang.
            ds = ds.take(per_epoch).apply(tf.data.experimental.assert_cardinality(per_epoch))
            return ds.skip(skip * batch_size) if epoch == first else ds

        ds = chain(one(e) for e in range(first, max(epochs, first + 1)))
        return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE)

    @property
    def has_test(self):
        return self.test_fn is not None

    def eval_dataset(self, batch_size, placement):
        if self.test_fn is None:
            return None
        return self.test_fn(placement.rank, placement.size).batch(batch_size)
