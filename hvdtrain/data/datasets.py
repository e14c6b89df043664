"""`DatasetData`: your own `tf.data` pipeline, made per rank and per epoch."""

import tensorflow as tf

from hvdtrain.data.base import Data, chain
from hvdtrain.errors import HvdtrainError, invalid_value, kind_of

__all__ = ["DatasetData"]


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
