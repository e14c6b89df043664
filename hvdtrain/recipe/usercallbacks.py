"""Keras's callbacks (and a user's own) given to `hvdtrain.fit`, behaving as in Keras's own
`fit` on one device:

- Callbacks that write run on rank 0 only: Keras's `ModelCheckpoint`, `CSVLogger`,
  `TensorBoard`, `ProgbarLogger` and `RemoteMonitor` (of either Keras, and subclasses of
  them), and any callback marked with `hvdtrain.rank0_only(callback)` (a user's own that
  logs to a service). Every other callback runs on every rank.
- Callbacks that steer training take effect on every rank alike: `model.stop_training` (set
  by `EarlyStopping`, `TerminateOnNaN`, a callback of your own) stops every rank when any
  rank sets it, after the same epoch (or step); the learning rate a callback sets
  (`ReduceLROnPlateau`, `LearningRateScheduler`) is rank 0's on every rank. They see the
  epoch's metrics of all ranks (`hvdtrain.recipe.metrics.MetricAverageCallback` runs first).
- The learning rate a callback reads and sets is the single-worker one, as on one device;
  hvdtrain applies it x ranks after its warmup (`hvdtrain.optimizers.rates.single_worker_lr`).
- They see one training: `on_train_begin` once and `on_train_end` once, although hvdtrain
  may run Keras's `fit` several times (one per epoch on Keras 3; the rest of an interrupted
  epoch after a resume).
- `BackupAndRestore` is refused: hvdtrain checkpoints and resumes itself (`--checkpoint-dir`,
  `--checkpoint-every` for mid-epoch), and Keras's would restore rank 0 alone.

A stop and a learning rate set by a callback are in hvdtrain's checkpoints: a resumed run
does not train past the stop, and goes on at the rate set.
"""

import weakref

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdtrain.errors import invalid_value
from hvdtrain.runtime import watchdog

__all__ = ["rank0_only", "runs_on_rank0_only", "UserCallbacks", "AgreedSteering"]

# Keras's callbacks (either Keras) that write files, print or post: rank 0 only.
WRITERS = ("ModelCheckpoint", "CSVLogger", "TensorBoard", "ProgbarLogger", "RemoteMonitor")
BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")
REFUSED = {
    "BackupAndRestore": "no BackupAndRestore: hvdtrain.fit checkpoints and resumes itself "
    "(--checkpoint-dir, and --checkpoint-every N for mid-epoch checkpoints); Keras's would "
    "restore rank 0 alone"
}


_RANK0_ONLY = weakref.WeakSet()  # the callbacks `rank0_only` marked, for as long as they live


def rank0_only(*callbacks):
    """Marks callbacks of your own to run on rank 0 only in `hvdtrain.fit` (one that logs to a
    service, writes a file, prints); returns the callback (or the list of them)::

        hvdtrain.fit(build_model, data, args, callbacks=[hvdtrain.rank0_only(MyLogger())])
    """
    for callback in callbacks:
        _RANK0_ONLY.add(callback)
    return callbacks[0] if len(callbacks) == 1 else list(callbacks)


def _keras_classes(callback):
    """The names of the classes of Keras (either) that `callback` is an instance of."""
    return {
        k.__name__
        for k in type(callback).__mro__
        if k.__module__.partition(".")[0] in ("keras", "tf_keras")
    }


def runs_on_rank0_only(callback):
    """True for a callback that writes (Keras's writers, or marked by `rank0_only`)."""
    return callback in _RANK0_ONLY or bool(_keras_classes(callback) & set(WRITERS))


def own_batch_hooks(callbacks):
    """Whether a callback of the user's own (its class, or a `LambdaCallback`'s functions)
    has batch hooks: with several steps per execution Keras calls them once per execution."""
    return any(
        _overrides(c, *BATCH_HOOKS) and not _keras_classes(c) - {"Callback", "LambdaCallback"}
        for c in callbacks
    )


def _overrides(callback, *hooks):
    """Whether `callback` defines any of `hooks` itself (not Keras's no-op): its class, or
    the callback itself (`LambdaCallback(on_batch_end=...)` sets the hook on the object)."""
    if any(callable(vars(callback).get(hook)) for hook in hooks):
        return True
    for hook in hooks:
        for k in type(callback).__mro__:
            if hook in k.__dict__:
                if k.__module__.partition(".")[0] not in ("keras", "tf_keras"):
                    return True
                if k.__name__ != "Callback":  # a Keras callback with its own
                    return True
                break
    return False


class UserCallbacks(tf.keras.callbacks.Callback):
    """The user's callbacks as one Keras callback, for every `fit` of one run: those that
    write on rank 0 only, `on_train_begin` at the first `fit` and `on_train_end` at `end()`.

    Args:
        callbacks: the user's callbacks (of the model's Keras).
        rank: this process's rank.
        params: what Keras's `params` should say across the run (`epochs`, `steps`): each
            `fit` of one epoch would say 1 epoch.
    """

    def __init__(self, callbacks, rank, params=None):
        super().__init__()
        self.all = list(callbacks)
        for callback in self.all:
            refused = _keras_classes(callback) & set(REFUSED)
            if refused:
                name = refused.pop()
                raise invalid_value("callbacks", name, REFUSED[name])
        # What Keras's callbacks print (EarlyStopping's, ReduceLROnPlateau's `verbose=1`):
        # on rank 0 only, as every line of the job.
        self.verbose = {
            id(c): c.verbose for c in self.all if isinstance(getattr(c, "verbose", None), int)
        }
        self.for_rank(rank)
        # The same on every rank (from the whole list): agreeing costs a collective.
        self.stops_in_epochs = any(
            _overrides(c, *BATCH_HOOKS)
            for c in self.all
            if not _keras_classes(c) & set(WRITERS)  # Keras's writers never stop training
        )
        self.run_params = dict(params or {})
        self.began, self.ended = set(), False  # the ids of the callbacks that began
        self.last_logs = None  # the last epoch's, for `on_train_end`
        self.models = {}  # id(callback) -> the model it was given

    def for_rank(self, rank):
        """Runs the callbacks of `rank` from now on (an elastic reset may make this worker
        rank 0: its writers then begin at the next `fit`)."""
        self.callbacks = [c for c in self.all if rank == 0 or not runs_on_rank0_only(c)]
        for c in self.all:
            if id(c) in self.verbose:
                c.verbose = self.verbose[id(c)] if rank == 0 else 0

    def set_model(self, model):
        """Once per callback and model: Keras sets it at every `fit` (one per epoch on Keras
        3), and TensorBoard's opens new event files and writes the graph again each time."""
        super().set_model(model)
        for c in self.callbacks:
            if self.models.get(id(c)) is not model:
                self.models[id(c)] = model
                c.set_model(model)

    def set_params(self, params):
        params = {**(params or {}), **self.run_params}
        super().set_params(params)
        for c in self.callbacks:
            c.set_params(params)

    def _each(self, hook, *args):
        # A hook of the epoch's, the user's own: one timeout there (the ranks waiting for
        # this one in a collective get two), so a rank stuck in it is the one named. Not at
        # batch hooks: the step's own beat (its allreduce waits) must stand.
        own = "batch" not in hook
        for c in self.callbacks:
            if own and _overrides(c, hook):
                watchdog.doing(f"in your callback {type(c).__name__}.{hook}")
            getattr(c, hook)(*args)

    def on_train_begin(self, logs=None):
        for c in self.callbacks:
            if id(c) not in self.began:
                self.began.add(id(c))
                c.on_train_begin(logs)

    def on_train_end(self, logs=None):
        pass  # `end` calls theirs once the run's last fit is done

    def end(self, history=None):
        """The end of the run's training: the callbacks' `on_train_end` (EarlyStopping puts
        the best weights back), once, with the last epoch's logs as Keras's `fit` gives
        them; a run that resumed with no epoch left: the last of the run's `history`."""
        if not self.ended:
            self.ended = True
            logs = self.last_logs
            if logs is None and history:
                logs = {k: v[-1] for k, v in history.items() if v}
            for c in self.callbacks:
                if id(c) in self.began:
                    c.on_train_end(logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._each("on_epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._each("on_epoch_end", epoch, logs)
        self.last_logs = None if logs is None else dict(logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._each("on_train_batch_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._each("on_train_batch_end", batch, logs)

    def on_test_begin(self, logs=None):
        self._each("on_test_begin", logs)

    def on_test_end(self, logs=None):
        self._each("on_test_end", logs)

    def on_test_batch_begin(self, batch, logs=None):
        self._each("on_test_batch_begin", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._each("on_test_batch_end", batch, logs)

    def on_predict_begin(self, logs=None):
        self._each("on_predict_begin", logs)

    def on_predict_end(self, logs=None):
        self._each("on_predict_end", logs)

    def on_predict_batch_begin(self, batch, logs=None):
        self._each("on_predict_batch_begin", batch, logs)

    def on_predict_batch_end(self, batch, logs=None):
        self._each("on_predict_batch_end", batch, logs)

    # Keras 2 calls a kind of batch hook only if some callback implements it.
    def _implements(self, *hooks):
        return any(_overrides(c, *hooks) for c in self.callbacks)

    def _implements_train_batch_hooks(self):
        return self._implements(*BATCH_HOOKS)

    def _implements_test_batch_hooks(self):
        return self._implements("on_test_batch_begin", "on_test_batch_end")

    def _implements_predict_batch_hooks(self):
        return self._implements("on_predict_batch_begin", "on_predict_batch_end")


class AgreedSteering(tf.keras.callbacks.Callback):
    """After the user's callbacks: every rank stops when any rank's callbacks set
    `model.stop_training` (at each epoch's end, and after each execution when a callback
    of the user's acts within epochs), and takes rank 0's single-worker learning rates
    (`rates`, variables) at each epoch's start and end. The stop it agreed on is `stopped`
    (the epoch, or None). `agreeing`: `(mine, agree) -> bool | None`, the run's exchange's
    `stop_agreed` (under `--sync local/diloco` the ranks agree within epochs at exchanges
    only); by default `agree(mine)` after every execution."""

    def __init__(self, rates, within_epochs=False, on_stop=None, agreeing=None):
        super().__init__()
        self.rates, self.within_epochs, self.on_stop = list(rates), within_epochs, on_stop
        self.agreeing = agreeing or (lambda mine, agree: agree(mine))
        self._asked = False  # a stop asked and not yet agreed on
        self.stopped = None
        self._epoch = 0

    def _stop_agreed(self):
        return self._agree(self._asked or bool(getattr(self.model, "stop_training", False)))

    def _agree(self, mine):
        """Every rank: whether any rank's `mine` is True (a collective)."""
        if hvd.size() > 1:
            # Between steps, for the other ranks: a rank stuck on its own is the one named.
            watchdog.doing(
                "agreeing with the other ranks whether a callback stopped training",
                watchdog.OTHER_RANKS,
            )
            flag = tf.constant(int(mine), tf.int32)
            mine = bool(hvd.allreduce(flag, op=hvd.Max, name="hvdtrain.stop_training").numpy())
        self._asked = False
        self.model.stop_training = mine
        return mine

    def _rates_from_rank0(self):
        if hvd.size() == 1 or not self.rates:
            return
        watchdog.doing("taking rank 0's learning rates, set by the callbacks", watchdog.OTHER_RANKS)
        values = tf.stack([tf.cast(r, tf.float64) for r in self.rates])
        values = hvd.broadcast(values, 0, name="hvdtrain.single_worker_lr").numpy()
        for rate, value in zip(self.rates, np.asarray(values), strict=True):
            rate.assign(value)

    def _implements_train_batch_hooks(self):  # Keras 2 calls the batch hooks only if so
        return self.within_epochs

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self._rates_from_rank0()

    def on_train_batch_end(self, batch, logs=None):
        if not self.within_epochs:
            return
        mine = self._asked or bool(getattr(self.model, "stop_training", False))
        verdict = self.agreeing(mine, self._agree)
        if verdict is None or (not verdict and mine):  # held until the ranks agree on it
            self._asked, self.model.stop_training = mine, False
            return
        self._asked, self.model.stop_training = False, verdict
        if verdict:
            self._stop(self._epoch)

    def on_epoch_end(self, epoch, logs=None):
        self._rates_from_rank0()
        if self._stop_agreed():
            self._stop(epoch)

    def _stop(self, epoch):
        self.stopped = epoch
        if self.on_stop is not None:  # (an elastic state keeps it: a reset does not undo it)
            self.on_stop(epoch)
