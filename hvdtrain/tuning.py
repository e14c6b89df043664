"""Performance defaults: each one measured by `python -m hvdtrain.bench` (its "Tuning"
table), none of them changes the training math.

- `compile_options`: `steps_per_execution` for `model.compile`. Keras then runs that many
  steps inside one `tf.function` call (a `tf.while_loop`) instead of returning to Python
  after every step; the updates are the same, step for step. It removes Keras' per-step
  Python work (callbacks, the iterator, the function call), which is most of a small
  model's step: the MNIST MLP goes from about 1.7 to 1.0 ms per step on one core. Batch
  callbacks (progress bar, TensorBoard's per-batch logs, a watchdog) then run every
  `steps_per_execution` steps, with the step index of the last one.
- `horovod_settings`: variables `hvdtrain.init` sets before `hvd.init()` when the user has
  not set them:
  - HOROVOD_CYCLE_TIME (Horovod: 1 ms): how often Horovod's background thread looks for
    ready tensors. A step waits for the next cycle after its last gradient, on every rank,
    so a 1 ms cycle costs a small model more than its whole compute time. A shorter cycle
    costs the background thread's polling on the same core.
  - OMPI_MCA_mpi_yield_when_idle=1 (Open MPI: 0 unless oversubscribed): an MPI rank
    waiting for a message yields its core instead of spinning on it. With one core per
    rank, Horovod's background thread waits in MPI for the other ranks at every cycle; a
    spinning wait takes the core from the rank's own compute thread.

The environment always wins: a variable set by the user (or `hvdtrain-run
--cycle-time-ms`) is kept, and `compile_options(steps_per_execution=...)` overrides.
"""

__all__ = [
    "STEPS_PER_EXECUTION",
    "CYCLE_TIME_MS",
    "compile_options",
    "horovod_settings",
]

STEPS_PER_EXECUTION = 16
CYCLE_TIME_MS = 0.1
_SETTINGS = {
    "HOROVOD_CYCLE_TIME": f"{CYCLE_TIME_MS:g}",
    "OMPI_MCA_mpi_yield_when_idle": "1",
}


def compile_options(steps_per_epoch=None, steps_per_execution=None):
    """Keyword arguments for `model.compile` that make `fit` faster without changing the math.

    Args:
        steps_per_epoch: when given, `steps_per_execution` is at most this (Keras would
            otherwise shorten every execution to the epoch's end anyway).
        steps_per_execution: overrides `STEPS_PER_EXECUTION`; 1 gives Keras' default
            (batch callbacks after every step).

    Example::

        model.compile(opt, loss=..., metrics=[...], **hvdtrain.compile_options(steps))
    """
    spe = STEPS_PER_EXECUTION if steps_per_execution is None else int(steps_per_execution)
    if steps_per_epoch:
        spe = min(spe, int(steps_per_epoch))
    return {"steps_per_execution": max(1, spe)}


def horovod_settings(environ):
    """The variables `hvdtrain.init` sets before `hvd.init()`: the defaults above that are
    missing from `environ` (pure; `environ` is only read)."""
    return {name: value for name, value in _SETTINGS.items() if name not in environ}
