"""`ArrayData`: samples in memory (numpy arrays, or dicts and tuples of them), each rank
taking every N-th one, shuffled per epoch from (seed, epoch)."""

import functools

import numpy as np
import tensorflow as tf

from hvdtrain.data.base import (
    Data,
    eval_dataset,
    num_samples,
    pack,
    share_dataset,
    structure,
    train_dataset,
)
from hvdtrain.errors import HvdtrainError, invalid_value

__all__ = ["ArrayData"]


class ArrayData(Data):
    """Samples in memory (numpy arrays): each rank takes every N-th one.

    `x`, `y` and `sample_weight` take what Keras's `fit` takes: arrays, or dicts, tuples or
    lists of arrays (named inputs or outputs), sharded and shuffled together; `y` may be
    None (a model that trains on its inputs: `fit(x)`).

    Args:
        x: training inputs (it may hold file paths that `train_map` reads).
        y: training labels (targets), or None.
        test: (x, y) or (x, y, sample_weight) held out for evaluation, or None.
        train_map: a per-sample `(x, y) -> (x, y)` function applied after sharding
            (decoding, augmentation, normalisation); None for arrays ready to use.
        eval_map: the same for the test data.
        source: a short name of where the data came from; notice: one line saying so.
        sample_weight: a weight per training sample (or a dict of them per output), or None.
    """

    def __init__(
        self,
        x,
        y=None,
        test=None,
        train_map=None,
        eval_map=None,
        source="arrays",
        notice=None,
        sample_weight=None,
    ):
        n = num_samples(x, "x")
        for name, part in (("y", y), ("sample_weight", sample_weight)):
            if part is not None and num_samples(part, name) != n:
                raise invalid_value(
                    name, f"{num_samples(part, name)} samples", f"one per sample of x ({n})"
                )
        if test is not None:
            if not isinstance(test, tuple | list) or not 1 <= len(test) <= 3:
                raise invalid_value("test", type(test).__name__, "(x, y) or (x, y, sample_weight)")
            m = num_samples(test[0], "test x")
            for name, part in zip(("test y", "test sample_weight"), test[1:], strict=False):
                if part is not None and num_samples(part, name) != m:
                    raise invalid_value(
                        name, f"{num_samples(part, name)} samples", f"one per test sample ({m})"
                    )
        x, y, sample_weight = structure(x), structure(y), structure(sample_weight)
        self.x, self.y, self.test, self.sample_weight = x, y, test, sample_weight
        self.train_map, self.eval_map = train_map, eval_map
        self.source, self.notice = source, notice or source
        self._all = None  # every sample as tensors (`train_share`)

    def limit(self, n):
        """The first `n` training samples only."""
        first = functools.partial(tf.nest.map_structure, lambda a: a[:n])
        return ArrayData(
            first(self.x),
            None if self.y is None else first(self.y),
            self.test,
            self.train_map,
            self.eval_map,
            self.source,
            self.notice,
            None if self.sample_weight is None else first(self.sample_weight),
        )

    def explain(self, error):
        """A training error where x is a tuple of 2 or 3 and y is None: most likely
        `ArrayData((x, y))`, Keras reading both as the model's inputs. Only Keras's kinds
        of error for a wrong structure (ValueError, TypeError): a model of two inputs and no
        labels keeps every other error as it is."""
        paired = self.y is None and isinstance(self.x, tuple) and len(self.x) in (2, 3)
        if not paired or not isinstance(error, ValueError | TypeError):
            return None
        return HvdtrainError(
            f"training failed on ArrayData's x, a tuple of {len(self.x)} arrays with no y "
            f"({type(error).__name__}: {error}): Keras takes every array of x as a model "
            "input; for inputs and labels pass ArrayData(x, y) (and sample weights as "
            "sample_weight=), as Keras's fit(x, y)"
        )

    def describe(self):
        tested = f", {num_samples(self.test[0], 'test x')} test" if self.test is not None else ""
        return f"{self.notice}; {self.num_samples} train{tested} samples"

    @property
    def num_samples(self):
        return num_samples(self.x, "x")

    def train_dataset(self, batch_size, placement, *, seed, start_step, steps, epochs):
        p = placement
        return train_dataset(
            self.x,
            self.y,
            batch_size,
            p.rank,
            p.size,
            seed=seed,
            map_fn=self.train_map,
            start_step=start_step,
            steps=steps,
            sample_weight=self.sample_weight,
        )

    def train_share(self, batch_size, *, seed, epoch, first, steps):
        if self._all is None:  # every sample, once per process: each epoch's fit takes them
            packed = pack(self.x, self.y, self.sample_weight)
            self._all = tf.nest.map_structure(lambda a: tf.constant(np.asarray(a)), packed)
        return share_dataset(
            self._all, batch_size, seed=seed, epoch=epoch, first=first, steps=steps,
            map_fn=self.train_map,
        )  # fmt: skip

    @property
    def has_test(self):
        return self.test is not None

    def eval_dataset(self, batch_size, placement):
        if self.test is None:
            return None
        x, y, weight = (*self.test, None, None)[:3]
        p = placement
        return eval_dataset(x, y, batch_size, p.rank, p.size, self.eval_map, sample_weight=weight)
