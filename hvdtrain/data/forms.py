"""What a data form is: `fit`'s `data` argument made a `hvdtrain.Data`, in one place.

    hvdtrain.as_data((x, y))                      # ArrayData
    hvdtrain.as_data(((x, y), (x_test, y_test)))  # ArrayData with its test set
    hvdtrain.as_data(my_py_dataset)               # BatchData (a PyDataset, a Sequence)
    hvdtrain.as_data(make_data)                   # make_data() called, then as above

As Keras 3's `get_data_adapter` picks an adapter for `fit`'s `x`, `as_data` picks the `Data`
for `hvdtrain.fit`'s `data`; the trainer asks it once per start. It sits above the data forms
(`hvdtrain.data`, `hvdtrain.data.batches`), which do not import it.
"""

import inspect

import tensorflow as tf

from hvdtrain.data import ArrayData, Data
from hvdtrain.data.batches import BatchData, is_batches
from hvdtrain.data.datasets import batched_by
from hvdtrain.errors import invalid_value

__all__ = ["as_data"]

EXPECTED = (
    "a hvdtrain.Data (ArrayData, DatasetData, FileData, BatchData), (x, y), "
    "((x, y), (x_test, y_test)), or a keras.utils.PyDataset, a Keras Sequence or a "
    "generator (alone or as (train, test))"
)


def as_data(source, limit=None):
    """The `Data` of `source`: a `Data`; (x, y) or ((x, y), (x_test, y_test)) arrays; batches
    made in Python (a `PyDataset`, a `Sequence`, a generator or generator function: a
    `BatchData`), alone or as (train, test); or a function returning one of those, called here
    (a function that returns a generator is one too, called again each epoch).

    Args:
        source: the data, as above.
        limit: train on the first `limit` samples only (`--limit-samples`: arrays only).
    """
    if callable(source) and not isinstance(source, Data) and not is_batches(source):
        made = source()
        if inspect.isgenerator(made):
            made.close()
            made = BatchData(source)
        source = made
    data = _of(source)
    if limit:
        if not isinstance(data, ArrayData):
            raise invalid_value("--limit-samples", limit, "no value: it limits in-memory arrays")
        data = data.limit(limit)
    return data


def _of(data):
    if isinstance(data, Data):
        return data
    parts = data if isinstance(data, tuple | list) else [data]
    given = next((part for part in parts if isinstance(part, tf.data.Dataset)), None)
    if given is not None:  # a whole dataset, as MirroredStrategy's fit takes it
        batched = batched_by(given)
        what = f"a batched tf.data.Dataset ({batched})" if batched else "a tf.data.Dataset"
        raise invalid_value(
            "data", what,
            "hvdtrain.DatasetData(make_dataset, num_samples=N), with make_dataset(rank, size, "
            "seed, epoch) returning this rank's samples for one epoch, unbatched (hvdtrain "
            "shards nothing of a whole dataset, and batches by --batch-size per rank); see "
            "docs/from-tf-distribute.md",
        )  # fmt: skip
    if is_batches(data):
        return BatchData(data)
    if isinstance(data, tuple | list) and len(data) == 2:
        if is_batches(data[0]) and (data[1] is None or is_batches(data[1])):
            return BatchData(*data)
        if all(isinstance(part, tuple | list) and len(part) == 2 for part in data):
            (x, y), test = data
            return ArrayData(x, y, test=test)
        return ArrayData(*data)
    raise invalid_value("data", type(data).__name__, EXPECTED)
