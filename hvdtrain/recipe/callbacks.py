"""Keras callbacks that know about ranks: checkpoints on rank 0, throughput, logs."""

import logging
import math
import sys
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdtrain.errors import TrainingDiverged, invalid_value
from hvdtrain.recipe import names
from hvdtrain.runtime.stall import stall_shutdown_seconds
from hvdtrain.runtime.watchdog import OTHER_RANKS, OWN_SETUP, OWN_WORK, Watchdog, doing

__all__ = [
    "CheckpointCallback",
    "DivergenceCallback",
    "ProgressCallback",
    "ThroughputCallback",
    "ModelStateAverageCallback",
    "WatchdogCallback",
    "rank0_callbacks",
]

log = logging.getLogger("hvdtrain")


class CheckpointCallback(tf.keras.callbacks.Callback):
    """Saves a checkpoint at the end of every epoch (and every `every_steps` steps), on
    rank 0 only, labelled with the real step whatever `steps_per_execution` is.

    Args:
        manager: a `hvdtrain.CheckpointManager`.
        fields: `Manifest` fields to record (size, global_batch, steps_per_epoch, prog, data).
        steps_per_epoch: steps in a full epoch (needed with `every_steps`).
        every_steps: also save mid-epoch when a multiple of this many global steps has
            passed (0 = epoch ends only); with several steps per execution, at the end of
            the execution that passed it. Every rank averages the model's non-trainable
            state then (a collective: give this callback to every rank).
        start_step: the global step training starts from (after a resume).
        history: the metrics of the epochs before `start_step` (the resumed manifest's
            `history`); each epoch's are added, and every checkpoint holds them all.
        extra: `() -> dict` for the manifest's `extra`, called at each save.
        check: `() -> None`, called on every rank before a mid-epoch save (a collective;
            `hvdtrain.check_weights_agree`); an epoch's end is checked before this runs.
        before_save: `() -> None`, called on every rank before every save, mid-epoch (before
            `check`) and at an epoch's end (a collective: the exchange's `before_checkpoint`,
            which makes the ranks' whole state one under `--sync local/diloco`).
    """

    def __init__(
        self,
        manager,
        fields=None,
        steps_per_epoch=None,
        every_steps=0,
        start_step=0,
        history=None,
        extra=None,
        check=None,
        before_save=None,
    ):
        super().__init__()
        self.extra, self.check, self.before_save = extra, check, before_save
        if every_steps and not steps_per_epoch:
            raise invalid_value("steps_per_epoch", steps_per_epoch, "steps with every_steps")
        self.history = {k: list(v) for k, v in (history or {}).items()}
        self.manager, self.fields = manager, dict(fields or {})
        self.steps_per_epoch, self.every_steps = steps_per_epoch, every_steps
        self.start_step = self.global_step = start_step
        self._first = self._offset = 0
        self._last = None  # (epoch, extra, logs) of the last epoch-end checkpoint

    def on_epoch_begin(self, epoch, logs=None):
        # `fit` numbers batches from where it started: mid-epoch after a resume.
        self._first = epoch * (self.steps_per_epoch or 0)
        self._offset = max(0, self.start_step - self._first) if self.steps_per_epoch else 0

    def on_train_batch_end(self, batch, logs=None):
        if not self.steps_per_epoch:
            return
        before = self.global_step
        step = self._offset + batch + 1  # steps done in this epoch (batch: the execution's last)
        self.global_step = self._first + step
        if not self.every_steps or step >= self.steps_per_epoch:
            return  # an epoch's last step is saved by on_epoch_end
        if self.global_step // self.every_steps > before // self.every_steps:
            # Every rank: BatchNorm statistics averaged first, as at epoch ends, so that a
            # resume from rank 0's checkpoint continues what every rank held (bitwise).
            from hvdtrain.recipe.optim import average_model_state

            doing(
                "averaging BatchNorm statistics before a checkpoint, with the other ranks",
                OTHER_RANKS,
            )
            average_model_state(self.model)
            if self.before_save is not None:
                self.before_save()
            if self.check is not None:
                self.check()
            if hvd.rank() == 0:
                epoch = self.global_step // self.steps_per_epoch
                path = self.manager.save(
                    epoch, self._extra(), step=step, history=self.history, **self.fields
                )
                # epoch-0002-step-000050: epoch 2, step 50, as the line says (`names`).
                log.info("saved checkpoint %s (%s)", path,
                         names.describe(self.global_step, self.steps_per_epoch))  # fmt: skip

    def on_epoch_end(self, epoch, logs=None):
        if self.steps_per_epoch:
            self.global_step = (epoch + 1) * self.steps_per_epoch
        logs = _floats(logs)
        for k, v in logs.items():
            self.history.setdefault(k, []).append(v)
        if self.before_save is not None:
            self.before_save()
        if hvd.rank() != 0:
            return
        extra = self._extra()
        path = self.manager.save(epoch + 1, extra, logs=logs, history=self.history, **self.fields)
        self._last = (epoch + 1, extra, logs)
        log.info("saved checkpoint %s (epoch %d)", path, epoch + 1)

    def rewrite_last(self):
        """Rank 0 writes the last epoch-end checkpoint again with the model's weights as they
        are now (EarlyStopping's `restore_best_weights` put the best back after it)."""
        if hvd.rank() != 0 or self._last is None:
            return
        epoch, extra, logs = self._last
        path = self.manager.save(epoch, extra, logs=logs, history=self.history, replace=True,
                                 **self.fields)  # fmt: skip
        log.info("saved checkpoint %s again (epoch %d), with the weights a callback restored",
                 path, epoch)  # fmt: skip

    def _extra(self):
        return self.extra() if self.extra is not None else None


class DivergenceCallback(tf.keras.callbacks.Callback):
    """Ends training with `TrainingDiverged` (exit status 3) as soon as it diverges, on
    every rank at the same step, before anything is checkpointed after it.

    No collective is needed for the ranks to agree: after each step every rank holds the
    same weights (the gradients are averaged), so a NaN or infinite gradient on any rank
    makes the weights non-finite on all of them at once. The check reads the last trainable
    variable after every execution (a NaN anywhere on the loss's path reaches it within a
    step), and the epoch's loss averaged over the ranks at each epoch's end. A weight beyond
    `WEIGHT_LIMIT` in magnitude counts as diverged too: a huge learning rate can blow the
    weights up to 1e30 while every ReLU dies, and the loss stays finite but meaningless. Put
    it after `MetricAverageCallback` and before `CheckpointCallback`.
    """

    # Beyond this, a weight's square overflows float32 (3.4e38): no sensible model gets there
    # (targets of 1e10, a bias of 1e10, are far below it).
    WEIGHT_LIMIT = 1e19

    def __init__(self, steps_per_epoch, lr=None, start_step=0):
        super().__init__()
        self.steps_per_epoch, self.lr = steps_per_epoch, lr
        self.start_step = start_step
        self._probe = None
        self._first = self._offset = 0

    def on_epoch_begin(self, epoch, logs=None):
        # `fit` numbers batches from where it started: mid-epoch after a resume. (The step is
        # counted here: a model's own `optimizer` may be one its train_step never uses.)
        self._first = epoch * self.steps_per_epoch
        self._offset = max(0, self.start_step - self._first)

    def on_train_begin(self, logs=None):
        variables = self.model.trainable_variables
        self._probe = variables[-1] if variables else None

    def on_train_batch_end(self, batch, logs=None):
        if self._probe is None:
            return
        values = np.abs(self._probe.numpy())
        if not (values <= self.WEIGHT_LIMIT).all():  # NaN compares False
            # batch: the execution's last
            done = min(self._offset + batch + 1, self.steps_per_epoch)
            epoch, step = divmod(self._first + done - 1, self.steps_per_epoch)
            what = (
                f"blew up (up to {values.max():.3g} in magnitude, beyond {self.WEIGHT_LIMIT:g}: "
                "float32 overflows on its square)"
                if np.isfinite(values).all()
                else "became NaN or infinite"
            )
            self._stop(f"the weights at epoch {epoch + 1}, step {step + 1} {what}")

    def on_epoch_end(self, epoch, logs=None):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            self._stop(f"the loss of epoch {epoch + 1} ({float(loss)}) became NaN or infinite")

    def _stop(self, what):
        lr = f" (now {self.lr:g})" if isinstance(self.lr, float) else ""
        raise TrainingDiverged(
            f"training diverged: {what}; stopped on every rank, no checkpoint written after "
            f"it (the newest one is kept). Lower --lr{lr}, lengthen --warmup-epochs, or check "
            "the data and the loss (NaN or infinite values, inputs or targets not scaled)."
        )


class DeterministicRandomness(tf.keras.callbacks.Callback):
    """Makes dropout and augmentation layers draw from a seed that is a pure function of
    (seed, rank, global step), so a resumed run repeats an uninterrupted one bit for bit.

    Needs `tf.keras.backend.experimental.enable_tf_random_generator()` before the model
    is built (the layers then keep a `tf.random.Generator`, reset here before each step).
    """

    def __init__(self, seed, rank, start_step=0):
        super().__init__()
        self.seed, self.rank, self.global_step = seed, rank, start_step

    def on_train_batch_begin(self, batch, logs=None):
        # Keras 3 has no `submodules`: its layers' seed states are variables, checkpointed.
        for i, layer in enumerate(getattr(self.model, "submodules", ())):
            rng = getattr(layer, "_random_generator", None)
            if rng is None or not hasattr(rng, "_maybe_init"):
                continue
            rng._maybe_init()  # Keras creates the generator lazily
            generator = getattr(rng, "_generator", None)
            if generator is not None:
                generator.reset_from_seed(hash((self.seed, self.rank, self.global_step, i)))
        self.global_step += 1


class ModelStateAverageCallback(tf.keras.callbacks.Callback):
    """At the end of each epoch, averages non-trainable state (BatchNorm statistics) over
    ranks (see `hvdtrain.average_model_state`); put it before evaluation and checkpoints."""

    def on_epoch_end(self, epoch, logs=None):
        from hvdtrain.recipe.optim import average_model_state

        average_model_state(self.model)


class ThroughputCallback(tf.keras.callbacks.Callback):
    """Measures training samples/s over all ranks, epoch by epoch.

    `epoch_samples_per_sec` lists each epoch's figure; `samples_per_sec` is the mean over
    the epochs after the first (which pays for tracing), or the first if it is the only one.
    """

    def __init__(self, global_batch, steps_per_epoch=None, rank_steps=None):
        super().__init__()
        self.global_batch, self.steps_per_epoch = global_batch, steps_per_epoch
        self.rank_steps = rank_steps
        self.epoch_samples_per_sec = []
        self._start = None
        self._batches = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._start, self._batches = time.perf_counter(), 0

    def on_train_batch_end(self, batch, logs=None):
        # With steps_per_execution > 1, Keras calls once per execution (Keras 3 with the
        # execution's whole length, also when the epoch ends sooner).
        done = _epoch_steps(batch + 1, self.steps_per_epoch, self.rank_steps)
        self._batches = min(done, self.steps_per_epoch or done)

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self._start
        self.epoch_samples_per_sec.append(self._batches * self.global_batch / seconds)

    @property
    def samples_per_sec(self):
        rates = self.epoch_samples_per_sec
        if not rates:
            return None
        return sum(rates[1:]) / len(rates[1:]) if len(rates) > 1 else rates[0]


class ProgressCallback(tf.keras.callbacks.Callback):
    """Rank 0's progress within each epoch: step, samples/s over all ranks, ETA, and the
    epoch's (rank-averaged) metrics at its end. Put it after `MetricAverageCallback`.

    On a terminal a bar redrawn in place; in a log a line every `seconds`:

        hvdtrain: epoch 2/15: step 35/70 (50%), 2,150 samples/s, ETA 1 s, loss 0.4132
        hvdtrain: epoch 2/15: 70 steps in 2.1 s, 2,133 samples/s; loss 0.4011 - accuracy 0.8788

    Args:
        epochs: of the run.
        steps_per_epoch: of the run.
        global_batch: of the run.
        start_step: the global step training starts from (after a resume).
        mode: "auto" (a bar when `stream` is a terminal, else lines), "bar", "lines", "off".
        seconds: between lines.
        stream: where it writes (stderr).
        rank_steps: `() -> int or None`, this rank's steps in the current epoch where they
            differ from the run's (`--sync-balance`): its steps then count for the epoch's.
    """

    def __init__(
        self,
        epochs,
        steps_per_epoch,
        global_batch,
        start_step=0,
        mode="auto",
        seconds=30.0,
        stream=None,
        rank_steps=None,
    ):
        super().__init__()
        self.rank_steps = rank_steps
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "lines"
        self.mode, self.seconds = mode, seconds
        self.epochs, self.steps, self.global_batch = epochs, steps_per_epoch, global_batch
        self.start_step = start_step
        self._shown = 0.0
        self._traced = False  # the first execution of a process traces and compiles

    def _write(self, text):
        self.stream.write(text)
        self.stream.flush()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch, self._done = epoch, 0
        self._offset = max(0, self.start_step - epoch * self.steps)
        self._start = self._shown = self._last = time.perf_counter()
        self._timed_from = 0  # the steps before the clock started (the traced execution)

    def on_train_batch_end(self, batch, logs=None):
        if self.mode == "off" or hvd.rank() != 0:
            return
        done = _epoch_steps(batch + 1, self.steps, self.rank_steps)
        self._done = min(done, self.steps - self._offset)  # Keras 3 names a whole execution
        now = self._last = time.perf_counter()
        if not self._traced:  # rates from the end of the first execution: not the start-up
            self._traced = True
            if self._offset + self._done < self.steps:
                self._start, self._timed_from = now, self._done
                return
        if now - self._shown < (0.1 if self.mode == "bar" else self.seconds):
            return
        if self._offset + self._done >= self.steps:
            return  # the epoch's line follows
        self._shown = now
        step = self._offset + self._done
        rate = (self._done - self._timed_from) * self.global_batch / max(now - self._start, 1e-9)
        eta = (self.steps - step) * self.global_batch / max(rate, 1e-9)
        loss = f", loss {float(logs['loss']):.4f}" if logs and "loss" in logs else ""
        head = f"epoch {self._epoch + 1}/{self.epochs}"
        if self.mode == "bar":
            filled = int(30 * step / self.steps)
            bar = "=" * filled + (">" if filled < 30 else "") + " " * (29 - filled)
            self._write(
                f"\r{head} [{bar}] {step}/{self.steps} {rate:,.0f} samples/s "
                f"ETA {eta:.0f} s{loss}\x1b[K"
            )
        else:
            self._write(
                f"hvdtrain: {head}: step {step}/{self.steps} ({step / self.steps:.0%}), "
                f"{rate:,.0f} samples/s, ETA {eta:.0f} s{loss}\n"
            )

    def on_epoch_end(self, epoch, logs=None):
        if self.mode == "off" or hvd.rank() != 0:
            return
        seconds = self._last - self._start  # the steps' time: not averaging, evaluation
        timed = self._done - self._timed_from
        rate = timed * self.global_batch / max(seconds, 1e-9)
        # The first epoch of a process: its first execution (tracing, compiling) left out.
        after = f" after the first {self._timed_from}" if self._timed_from else ""
        figures = " - ".join(f"{k} {_short(v)}" for k, v in (logs or {}).items())
        end = "\r\x1b[K" if self.mode == "bar" else ""
        self._write(
            f"{end}hvdtrain: epoch {epoch + 1}/{self.epochs}: {timed} steps{after} in "
            f"{seconds:.1f} s, {rate:,.0f} samples/s; {figures}\n"
        )


def _epoch_steps(done, steps, rank_steps):
    """`done` of this rank's steps in an epoch as the epoch's steps: scaled where this rank
    takes another share than `steps` (`--sync-balance`)."""
    mine = rank_steps() if rank_steps is not None else None
    if not mine or not steps or mine == steps:
        return done
    return round(done * steps / mine)


def _short(value):
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return str(value)


def rank0_callbacks(log_dir=None, tensorboard=tf.keras.callbacks.TensorBoard):
    """Callbacks that write files or print, returned on rank 0 only (empty elsewhere);
    `tensorboard`: the model's Keras's TensorBoard callback class."""
    if hvd.rank() != 0:
        return []
    return [tensorboard(log_dir)] if log_dir else []


def _floats(logs):
    return {k: float(v) for k, v in (logs or {}).items()}


class WatchdogCallback(tf.keras.callbacks.Callback):
    """Runs a `hvdtrain.Watchdog` during `fit`, fed by every step and epoch: a rank that
    makes no progress for the stall time ends with one line saying where it was (see
    `hvdtrain.runtime.watchdog`). A training step waits for the other ranks (its gradient
    allreduce): twice the time, so that the stuck rank names itself first. The first step
    traces and compiles the model, as does the first validation: ten times the time.

    Args:
        timeout: seconds without progress; by default the stall shutdown time in effect
            when training begins (`hvdtrain.init(stall_shutdown_seconds=...)`,
            HVDTRAIN_STALL_SHUTDOWN_SECONDS, 300 s); 0 there turns the watchdog off.
        rank: named in the message (default: Horovod's rank).
        on_timeout: see `hvdtrain.Watchdog`.
        watchdog: a running `hvdtrain.Watchdog` to feed instead of one of its own
            (`hvdtrain.fit` starts one at set-up, so the whole run is watched); it is left
            running when training ends.

    If `fit` raises, the watchdog keeps watching until the process ends, so a hang while
    exiting is ended too; call `callback.watchdog.stop()` to catch the error and go on.
    """

    def __init__(self, timeout=None, rank=None, on_timeout=None, watchdog=None):
        super().__init__()
        self.rank, self.on_timeout = rank, on_timeout
        self.watchdog = None if timeout is None else Watchdog(timeout, rank, on_timeout)
        self._owned = watchdog is None
        if watchdog is not None:
            self.watchdog = watchdog
        self._follow_stall_time = timeout is None and self._owned
        self._epoch = 0
        self._armed = False
        self._validated = False  # a first validation has begun (its step traced)

    def _beat(self, what, waits_for=OWN_WORK):
        if self.watchdog is not None and self._armed:
            self.watchdog.beat(what, waits_for)

    def on_train_begin(self, logs=None):
        self._armed = False  # the first step traces and compiles: a longer limit
        if self._follow_stall_time:  # read now: hvdtrain.init() has run
            if self.watchdog is not None:
                self.watchdog.stop()
            timeout = stall_shutdown_seconds()
            self.watchdog = Watchdog(timeout, self.rank, self.on_timeout) if timeout else None
        if self.watchdog is not None:
            self.watchdog.start(_FIRST_STEP, OWN_SETUP)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1
        self._beat(f"epoch {self._epoch} began")

    def on_train_batch_begin(self, batch, logs=None):
        if not self._armed and self.watchdog is not None:  # the collectives before it beat
            self.watchdog.beat(_FIRST_STEP, OWN_SETUP)
        self._beat(
            f"in step {batch + 1} of epoch {self._epoch} (input, forward, backward, "
            "gradient allreduce with the other ranks)",
            OTHER_RANKS,
        )

    def on_train_batch_end(self, batch, logs=None):
        self._armed = True
        self._beat(
            f"finished step {batch + 1} of epoch {self._epoch}; then in batch-end callbacks "
            "or the next step's input"
        )

    def on_epoch_end(self, epoch, logs=None):
        self._beat(
            f"finished epoch {epoch + 1}; then in epoch-end callbacks (metric averaging, "
            "evaluation, checkpoint)"
        )

    def on_test_begin(self, logs=None):
        if not self._validated:  # the first validation traces and compiles its step
            self._validated = True
            self._beat(f"the first validation after epoch {self._epoch} (tracing and "
                       "compiling)", OWN_SETUP)  # fmt: skip

    def on_test_batch_end(self, batch, logs=None):
        self._beat(f"validation batch {batch + 1} after epoch {self._epoch}")

    def on_train_end(self, logs=None):
        if self.watchdog is not None and self._owned:
            self.watchdog.stop()


_FIRST_STEP = "the first training step (tracing and compiling)"
