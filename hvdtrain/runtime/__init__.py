"""The process a rank runs in: Horovod's start with its GPU, threads and cores
(`process.init`), the performance settings (`tuning`), which Keras `tf.keras` is (`compat`),
the watchdog of a stuck rank (`watchdog`, `stall`), the end of a rank whose launcher died
(`orphan`), logging on rank 0 (`logs`), how an uncaught error is told (`tracebacks`), the
process table (`processes`) and the whole numbers a user types (`numbers`).

Nothing here runs at import: a module's functions change the process only when called. The
launcher imports the modules that need no TensorFlow (`compat`, `stall`, `watchdog`,
`orphan`, `tracebacks`, `processes`, `numbers`).
"""

import importlib

# The old module `hvdtrain.runtime` (before the package, 2026-12): its names, loaded on use.
_OLD = ("init", "is_main_process", "gpu_for_local_rank", "threads_per_rank", "agree",
        "rank_report", "weights_digest", "bound_cores")  # fmt: skip


def __getattr__(name):
    if name in _OLD:
        return getattr(importlib.import_module("hvdtrain.runtime.process"), name)
    raise AttributeError(f"module 'hvdtrain.runtime' has no attribute {name!r}")
