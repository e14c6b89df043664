"""`Rounds`: H local steps between exchanges of weights, what `--sync local` and `--sync
diloco` share. Its mode (`LocalSGD`, `DiLoCo`) says what an exchange does with the ranks'
mean change; its averager (`Blocking`, `InFlight`) how the mean is made.

- **Gradients.** The model's distributed optimizers average their gradients during the
  synchronous warmup (`--sync-warmup-steps`; the mode gives the default), then stop: a
  `tf.cond` on one variable (`hvdtrain.optimizers.hooks.Gate`) skips the allreduce, and
  each rank steps on its own batch at the synchronous run's learning rate (x ranks).
- **Exchanges.** After every H-th step of an epoch (H = `--sync-every`; where the epoch's
  sharing says under `--sync-balance`), at each epoch's end, before a mid-epoch checkpoint
  and when training stops, the ranks average their changes since the last exchange (the
  anchor minus the weights; float16 on the wire with `--fp16-allreduce`) and their other
  float state (BatchNorm's statistics).
- **The optimizers' own state** (Adam's moments) stays each rank's own, as in both papers,
  and is averaged only before a checkpoint (`before_checkpoint`), so that rank 0's
  checkpoint is the whole state and a resume is exact. An epoch's end without one makes the
  weights one (`now(whole=True)`), not the moments: under Adam they are twice the weights'
  bytes, sent where a slow link is the limit.
- **Between exchanges** the ranks differ by design: the check that they agree runs after the
  run's first exchange and at whole exchanges; an elastic run commits where the ranks agree
  (`ready_to_commit`).
"""

import contextlib
import time

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdtrain.exchange import wire
from hvdtrain.exchange.auto import AutoEvery
from hvdtrain.exchange.callback import ExchangeCallback
from hvdtrain.optimizers.hooks import Gate, set_gate
from hvdtrain.runtime import logs, watchdog

__all__ = [
    "Rounds",
    "Replica",
    "Tally",
    "waiting",
    "weighted",
    "exchange_due",
    "fitting_steps_per_execution",
]


def exchange_due(step_in_epoch, steps_per_epoch, every):
    """True where an exchange falls: every `every`-th step of an epoch, and its last."""
    return step_in_epoch % every == 0 or step_in_epoch >= steps_per_epoch


def fitting_steps_per_execution(default, every):
    """The largest number of steps per execution up to `default` that divides `every` (the
    ranks exchange at an execution's end)."""
    return max(d for d in range(1, min(default, every) + 1) if every % d == 0)


class Replica:
    """This rank's model as an exchange moves it, and where it stands.

    `weights`: the trainable variables; `state`: the model's other float variables
    (BatchNorm's statistics: averaged at every exchange); `opt_state`: the optimizers' float
    state (averaged before checkpoints only); `anchor`: the weights where the ranks last
    agreed. `step` is the global step now, `agreed` the step where the ranks' models last
    agreed, `agreed_whole` where their optimizers did too."""

    def __init__(self, model, optimizers, compression):
        self.weights = wire.tf_variables(model.trainable_variables)
        self.state = [
            v for v in wire.tf_variables(model.non_trainable_variables) if v.dtype.is_floating
        ]
        self.opt_state = [v for opt in optimizers for v in wire.slot_variables(opt)]
        self.anchor = [tf.Variable(v, trainable=False) for v in self.weights]
        self.compression = compression
        self.step = self.agreed = self.agreed_whole = 0

    def in_agreement(self):
        return self.agreed == self.step

    def mean(self, tensor, name):
        """The ranks' mean of `tensor` (compressed on the wire as asked)."""
        return hvd.allreduce(tensor, op=hvd.Average, compression=self.compression, name=name)

    def average_optimizers(self):
        """The optimizers' state set to the ranks' mean; its bytes on the wire."""
        wire.average_variables(self.opt_state, "hvdtrain.exchange.optimizers")
        return wire.wire_bytes(self.opt_state)

    def average_state(self):
        """The BatchNorm statistics set to the ranks' mean; their bytes on the wire."""
        wire.average_variables(self.state, "hvdtrain.exchange.state")
        return wire.wire_bytes(self.state)


class RoundsState(tf.Module):
    """What a checkpoint keeps of the rounds beside the model: the H in force under `--sync-every
    auto` (0 until chosen). Broadcast and committed with the optimizers."""

    built = True

    def __init__(self):
        super().__init__(name="hvdtrain_rounds")
        with tf.init_scope():
            self.every = tf.Variable(0, dtype=tf.int64, trainable=False)


class Tally:
    """This process's exchanges since the run began: how many, their bytes on the wire, and
    the seconds the steps waited for them."""

    def __init__(self):
        self.exchanges = self.bytes = 0
        self.waited = 0.0


@contextlib.contextmanager
def waiting(tally, name):
    """A block of an exchange that the steps wait for: told to the watchdog (the other ranks
    are awaited), its seconds counted in `tally.waited`."""
    watchdog.doing(f"exchanging weights with the other ranks ({name})", watchdog.OTHER_RANKS)
    began = time.perf_counter()
    try:
        yield
    finally:
        tally.waited += time.perf_counter() - began


def weighted(changes, weight):
    """`changes` x `weight` (a float32 scalar tensor: this rank's share of the round's steps,
    `--sync-balance`), or as they are where `weight` is None (equal shares)."""
    return changes if weight is None else [wire.weighted(c, weight) for c in changes]


class Rounds:
    """The `Exchange` of `--sync local` and `--sync diloco` (see the module).

    Args:
        cfg: the run's `TrainConfig`.
        mode: what an exchange does with the ranks' mean change (`LocalSGD`, `DiLoCo`).
        averager: how the mean is made (`Blocking`, `InFlight`).
    """

    exchanges_rarely = True  # the ranks meet every H steps: a longer Horovod cycle

    def __init__(self, cfg, mode, averager):
        self.cfg, self.mode, self.averager = cfg, mode, averager
        self.every = cfg.exchange_every
        self.warmup_flag = cfg.sync_warmup_steps
        self.compression = hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none
        # By `attach`: a variable made here (before `hvdtrain.init`) would start TensorFlow
        # with its default threads on every rank.
        self.gate = self.replica = None
        self.optimizers = []
        self.tally = Tally()
        self.sharing = None  # the epochs' sharing (`hvdtrain.data.shares`), by `configure`
        self.unit = 1  # steps per execution: exchanges fall at an execution's end
        self.warmup = 0  # synchronous steps first, by `begin`
        self.syncing = True  # the gate's value, mirrored: no read of the variable per call
        self.at_point = False  # whether the last execution ended at an exchange point
        self.weight = None  # this round's change x this in the ranks' mean (its share)
        # --sync-every auto: H measured as the run goes (`hvdtrain.exchange.auto`).
        self.auto = None
        if cfg.sync_every == "auto":
            self.auto = AutoEvery(averager.overlap, revisit=not cfg.deterministic)
        self.state = None  # `RoundsState`, by `attach`
        self.end_step = None  # the run's last global step, by `begin` (None: unknown)
        self._clocked = None  # the step of the epoch the last timed execution ended at
        self._clocked_exchanges = 0  # the exchanges sent by then

    # -- the Exchange interface ------------------------------------------------------------
    def configure(self, policy, steps_per_execution, sharing):
        if policy == "mixed_float16":  # --mixed-precision auto on a GPU
            raise self.cfg.float16_refused()
        self.sharing = sharing
        default = sharing.execution_steps(steps_per_execution, self.every)
        self.unit = fitting_steps_per_execution(default, self.every)
        if self.auto is not None:
            self.every = self.auto.start(self.unit)
        return self.unit

    def attach(self, model, optimizers):
        self.optimizers = list(optimizers)
        self.gate = Gate()
        for opt in self.optimizers:
            set_gate(opt, self.gate)
        self.replica = Replica(model, self.optimizers, self.compression)
        self.mode.attach(self.replica)
        self.averager.attach(self.replica, self.mode, self.tally)
        self.state = RoundsState()
        return {**self.mode.holders(), "exchange_rounds": self.state}

    def begin(self, start_step, lr_warmup_steps, end_step=None):
        flag = self.warmup_flag
        self.warmup = flag if flag is not None else self.mode.default_warmup(lr_warmup_steps)
        self.syncing = start_step < self.warmup
        self.gate.on.assign(self.syncing)
        r = self.replica
        r.step = r.agreed = r.agreed_whole = start_step
        kept = int(self.state.every.numpy())
        if self.auto is not None and kept and kept in self.auto.options:  # a resume
            self.auto.chosen = self.every = kept
        self.end_step = end_step
        self.mode.begin(hvd.size(), self.every, self._exchanges())  # (an elastic reset too)
        self.averager.begin()
        self.sharing.plan(self.every, self.unit, self.warmup)

    def callbacks(self, steps_per_epoch, start_step, check):
        return [ExchangeCallback(self, steps_per_epoch, start_step, check)]

    def stop_agreed(self, mine, agree):
        """In the synchronous warmup at every execution; then as the averager says (at the
        exchange points only: a collective between them would hold the ranks in step)."""
        if self.syncing:
            return agree(mine)
        return self.averager.stop_agreed(mine, agree, self.at_point)

    def before_checkpoint(self):
        self.now(whole=True)
        r = self.replica
        if r.opt_state and r.agreed_whole != r.step:
            with waiting(self.tally, self.mode.name):
                self.tally.bytes += r.average_optimizers()
        r.agreed_whole = r.step

    def ready_to_commit(self):
        return self.averager.ready_to_commit(lambda: self.now(whole=True))

    def describe(self):
        every = self.every
        if self.auto is not None:
            every = f"auto (from {self.every}, up to {self.auto.options[-1]}: measured)"
        out = f"{self.mode.name} every {every} steps"
        if self.warmup:
            out += f" after {self.warmup} synchronous"
        if self.sharing.per_epoch:
            out += ", balanced by speed"
        return out + self.mode.describe() + self.averager.describe()

    def summary(self):
        return {
            "mode": self.mode.sync,
            "every": self.every,
            "balance": self.sharing.per_epoch,
            "warmup_steps": self.warmup,
            **self.mode.summary(),
            "fp16": self.compression is hvd.Compression.fp16,
            "overlap": self.averager.overlap,
            "exchanges": self.tally.exchanges,
            "bytes_per_exchange": self.averager.per_exchange,
            "bytes_sent": self.tally.bytes,
            "waited_seconds": round(self.tally.waited, 4),
            **self.averager.figures(),
            # Whose the timings above are (the file's: rank 0's); every rank's are in `ranks`.
            "figures_of_rank": hvd.rank(),
            **({"auto": self.auto.summary()} if self.auto is not None else {}),
        }

    def rank_figures(self):
        out = {"exchange_waited_seconds": round(self.tally.waited, 4)}
        if self.sharing.per_epoch:
            out["balanced_epoch_steps"] = list(self.sharing.steps)
        return {**out, **self.averager.figures()}

    # -- what its callback calls (`ExchangeCallback`) ----------------------------------------
    def epoch_begins(self, global_step):
        """At an epoch's first step (every rank holds one model). Under unequal shares a
        rank's last epoch may have ended past the epoch's start: the step counts set to it,
        and each optimizer's steps moved by as much (its learning rate follows them)."""
        self.sharing.begin_epoch(timed=global_step >= self.warmup)  # no synchronous step
        self._clocked = None
        r = self.replica
        if not self.in_agreement():
            return
        if global_step != r.step:
            for opt in self.optimizers:
                opt.iterations.assign_add(global_step - r.step)
            if r.agreed_whole == r.step:
                r.agreed_whole = global_step
            r.step = r.agreed = global_step
        self.averager.epoch_begins()

    def clock(self, step_in_epoch, seconds):
        """After each execution: its `seconds`, from Keras's start of it to its end."""
        self.sharing.clock(step_in_epoch, seconds)
        if self.auto is not None and not self.syncing:  # local steps, the epoch's first left out
            if self._clocked is not None and step_in_epoch > self._clocked:
                # Beside an exchange: one sent since the last execution, or one still running.
                beside = self.averager.overlap and (
                    self.tally.exchanges != self._clocked_exchanges or self.averager.busy()
                )
                steps = step_in_epoch - self._clocked
                self.auto.time_steps(seconds / steps, beside, steps)
            self._clocked, self._clocked_exchanges = step_in_epoch, self.tally.exchanges

    def after_steps(self, global_step, step_in_epoch, steps_per_epoch):
        """At an execution's end (every rank): ends the warmup, or exchanges where one is
        due. Returns True when the ranks hold one model after an exchange."""
        r = self.replica
        r.step = global_step
        if self.syncing:  # these steps averaged their gradients: in agreement
            r.agreed = r.agreed_whole = global_step
            if global_step >= self.warmup:
                self.syncing = False
                self.gate.on.assign(False)
                # The anchor where the local steps begin, as a run resumed here sets it.
                self.averager.start_round()
            return False
        self.at_point = self.sharing.exchange_due(step_in_epoch, steps_per_epoch, self.every)
        if not self.at_point:
            return False
        self.weight = self.sharing.weight_at(step_in_epoch)
        # The epoch's last step makes the whole exchange (as its end would): its time counts
        # with the epoch's steps (the epoch line), and the end finds the ranks agreeing.
        last = step_in_epoch >= (self.sharing.rank_steps() or steps_per_epoch)
        waited = self.tally.waited
        exchanged = self.now(whole=last)
        if self.auto is not None:
            if self.averager.overlap and not last:  # the steps' wait at the point
                self.auto.blocked_seconds.append(self.tally.waited - waited)
            self.auto.exchange_seconds += self.averager.take_timings()
            if self.auto.due(epoch_end=False):
                self._choose()
        return exchanged

    def epoch_ends(self):
        """At an epoch's end, after its whole exchange (every rank): the ranks' speeds
        gathered for the next epoch's shares (`--sync-balance`), H chosen again (auto)."""
        self.sharing.gather(lambda s: hvd.allgather_object(s, name="hvdtrain.shares"))
        if self.auto is not None:
            self.auto.exchange_seconds += self.averager.take_timings()
            if self.auto.due(epoch_end=True):
                self._choose()

    def _exchanges(self):
        """The run's exchanges after its warmup, at the H in force (None: its end unknown)."""
        if self.end_step is None:
            return None
        return max(1, (self.end_step - self.warmup) // self.every)

    def _choose(self):
        """`--sync-every auto`: H agreed from the ranks' measurements, in force from here."""
        r = self.replica

        def agree_max(xs):
            xs = tf.constant(xs, tf.float64)
            return hvd.allreduce(xs, op=hvd.Max, name="hvdtrain.auto").numpy().tolist()

        before, h = self.every, self.auto.choose(agree_max, r.step)
        self.state.every.assign(h)  # checkpointed: a resume goes on with it
        if h != before:
            self.every = h
            self.mode.begin(hvd.size(), h, self._exchanges())  # DiLoCo's rule follows H
            self.sharing.plan(self.every, self.unit, self.warmup)  # (balanced: the next epoch's)
        said = self.auto.said(before)
        logs.get_logger(hvd.rank()).info("--sync-every auto at step %d: %s", r.step, said)

    def in_agreement(self):
        return self.averager.in_agreement()

    def now(self, whole=False):
        """An exchange here (a collective: every rank calls it at the same point, with the
        same `whole`): at an exchange point as the averager makes it, or with `whole` all of
        it landed, one model on every rank (the optimizers' state: `before_checkpoint`).
        Returns True when the ranks hold one model after it and did not before."""
        weight = None if self.weight is None else tf.constant(self.weight, tf.float32)
        if not whole:
            return self.averager.point(weight)
        return self.averager.whole(weight)
