"""`ExchangeCallback`: the Keras callback that drives a `Rounds` exchange through `fit`."""

import time

import tensorflow as tf

__all__ = ["ExchangeCallback"]


class ExchangeCallback(tf.keras.callbacks.Callback):
    """Drives a `Rounds` (every rank): first among the callbacks, so that all the others
    (the checks, metrics, checkpoints, the user's) see the exchanged weights at an epoch's end.

    Args:
        exchange: the run's `Rounds`.
        steps_per_epoch: steps in a full epoch.
        start_step: the global step the run starts at (a resume: mid-epoch).
        check: `(when) -> None`, the agreement check, after the run's first exchange.
    """

    def __init__(self, exchange, steps_per_epoch, start_step=0, check=None):
        super().__init__()
        self.exchange, self.steps, self.check = exchange, steps_per_epoch, check
        self.start_step = start_step
        self._first = self._offset = 0
        self._began = 0.0  # when Keras began the current execution
        self.checked = False

    def on_epoch_begin(self, epoch, logs=None):
        # `fit` numbers batches from where it started: mid-epoch after a resume.
        self._first = epoch * self.steps
        self._offset = max(0, self.start_step - self._first)
        self.exchange.epoch_begins(self._first + self._offset)

    def on_train_batch_begin(self, batch, logs=None):
        self._began = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        step = self._offset + batch + 1
        self.exchange.clock(step, time.perf_counter() - self._began)
        if self.exchange.after_steps(self._first + step, step, self.steps):
            self._check()

    def on_epoch_end(self, epoch, logs=None):
        # One state for all (a checkpoint may follow), and the weights too after an epoch
        # that a callback cut short.
        if self.exchange.now(whole=True):
            self._check()
        self.exchange.epoch_ends()

    def _check(self):
        if not self.checked and self.check is not None:
            self.checked = True
            self.check("after the first exchange")
