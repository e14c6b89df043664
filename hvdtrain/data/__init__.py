"""The data forms `hvdtrain.fit` trains on, one file each, behind one interface (`Data`, in
`base`), and the one function that says which form a user's data is (`as_data`, in
`forms`)::

    hvdtrain.fit(build_model, (x, y))                                        # arrays.py
    hvdtrain.fit(build_model, hvdtrain.DatasetData(make_dataset, 60_000))    # datasets.py
    hvdtrain.fit(build_model, hvdtrain.FileData("data/*.tfrecord", parse))   # files.py
    hvdtrain.fit(build_model, py_dataset)        # a PyDataset, a Sequence: batches.py

Every form shards before it shuffles and gives every rank the same steps; the recipe asks the
form for a rank's batches and never asks which form it holds. An epoch's shares between the
ranks (equal, or by speed under `--sync-balance`) are planned here too (`shares`). A new data
form is one new file here and one line in `forms.as_data`.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names are, for readers and tools (the docs' reference: griffe)
    from hvdtrain.data.arrays import ArrayData
    from hvdtrain.data.base import (
        Data,
        Placement,
        chain,
        eval_dataset,
        num_samples,
        pack,
        shard_indices,
        share_dataset,
        steps_per_epoch,
        structure,
        train_dataset,
    )
    from hvdtrain.data.datasets import DatasetData

# Each name loads its module on first use (`base`, unless named here), so that an entry
# point's flags are checked, and a submodule that needs no TensorFlow (`mnist`, `sources`,
# `shares`) loads, before TensorFlow.
_ELSEWHERE = {"ArrayData": "arrays", "DatasetData": "datasets"}

__all__ = [
    "Data",
    "ArrayData",
    "DatasetData",
    "Placement",
    "chain",
    "eval_dataset",
    "num_samples",
    "pack",
    "shard_indices",
    "share_dataset",
    "steps_per_epoch",
    "structure",
    "train_dataset",
]


def __getattr__(name):
    if name in __all__:
        module = _ELSEWHERE.get(name, "base")
        value = getattr(importlib.import_module(f"hvdtrain.data.{module}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hvdtrain.data' has no attribute {name!r}")


def __dir__():
    return sorted(set(__all__) | set(globals()))
