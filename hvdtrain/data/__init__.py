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

# Each name loads its module on first use, so that an entry point's flags are checked, and a
# submodule that needs no TensorFlow (`mnist`, `sources`, `shares`) loads, before TensorFlow.
_EXPORTS = {
    "Data": "base",
    "ArrayData": "arrays",
    "DatasetData": "datasets",
    "Placement": "base",
    "chain": "base",
    "eval_dataset": "base",
    "num_samples": "base",
    "pack": "base",
    "shard_indices": "base",
    "share_dataset": "base",
    "steps_per_epoch": "base",
    "structure": "base",
    "train_dataset": "base",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"hvdtrain.data.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hvdtrain.data' has no attribute {name!r}")


def __dir__():
    return sorted(set(__all__) | set(globals()))
