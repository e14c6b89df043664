"""Exchanging less: `--sync local` (post-local SGD) and `--sync diloco` (DiLoCo), opt-in modes
of `hvdtrain.fit` where each rank takes H steps on its own between two exchanges of weights.

    hvdtrain-run -np 4 -- python train.py --sync local --sync-every 16
    hvdtrain-run -np 4 -- python train.py --sync diloco --sync-every 64

How the ranks exchange is one strategy object per mode, built from the config in one place
(`for_config`) and called by the recipe (`hvdtrain.trainer`) without asking which it holds,
as PyTorch DDP calls its communication hook: `Exchange` is `--sync step` (the default: the
distributed optimizers average the gradients at every step, as Horovod does, and nothing is
left to do between steps), `LocalSGD` is `--sync local` and `DiLoCo` `--sync diloco`, and
`--sync-overlap` mixes `hvdtrain.overlap.Overlapped` into either. A new mode is a new
subclass. Under the two that exchange less:

- **Gradients.** The model's distributed optimizers average their gradients during the
  synchronous warmup (`--sync-warmup-steps`: the learning rate's warmup under `local`, none
  under `diloco`), then stop: a `tf.cond` on one variable (`hvdtrain.gate`) skips the
  allreduce, and each rank steps with its own batch, with the same learning rate (x ranks)
  as the synchronous run.
- **Exchanges.** After every H-th step of an epoch (H = `--sync-every`), at each epoch's end,
  before a mid-epoch checkpoint and when training stops, every rank sends its change since
  the last exchange (the anchor minus its weights: float16 on the wire with
  `--fp16-allreduce`), averaged over the ranks. `local` sets every rank's weights to the
  anchor minus that average (the ranks' mean weights); `diloco` gives the average to an outer
  Nesterov SGD (`--outer-lr`, `--outer-momentum`) that moves the anchor. The model's other
  float variables (BatchNorm's moving statistics) are averaged at every exchange: after one,
  every rank holds the same model.
- **The optimizers' own state** (Adam's moments, momentum) stays each rank's own between
  exchanges, as in both papers, and is averaged only where one state must stand for all:
  at an epoch's end, before a checkpoint, when training stops (`now(whole=True)`). So rank
  0's checkpoint is the whole state and a resume is exact, and the H-step exchange moves
  the weights alone (a third of the bytes under Adam).
- **Between exchanges** the ranks differ by design: the check that they agree
  (`hvdtrain.agreement`) runs after the run's first exchange, at epoch ends and before each
  checkpoint, all of them exchanges; an elastic run commits at exchanges only (the first
  after a commit falls due; with `--sync-overlap`, where the ranks agree only at whole
  exchanges, a due commit makes one).
"""

import time

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdtrain import optim, watchdog
from hvdtrain.errors import invalid_value
from hvdtrain.flags import float16_refused
from hvdtrain.gate import Gate
from hvdtrain.overlap import Overlapped
from hvdtrain.shares import Balance, EqualShares

__all__ = [
    "Exchange",
    "LocalSGD",
    "DiLoCo",
    "OverlappedLocalSGD",
    "OverlappedDiLoCo",
    "ExchangeCallback",
    "for_config",
    "outer_step",
    "exchange_due",
    "fitting_steps_per_execution",
]


OUTER_MOMENTUM = 0.9  # DiLoCo's outer Nesterov momentum, the paper's


def outer_step(every, ranks):
    """DiLoCo's outer learning rate for H=`every` local steps between exchanges and `ranks`
    ranks, where `--outer-lr` is not given; its momentum is `OUTER_MOMENTUM`. Pure.

    An outer Nesterov step of rate r and momentum 0.9 moves the anchor by r / (1 - 0.9) = 10r
    times a pseudo-gradient that repeats round after round, as it does at short H. The paper's
    0.7 (tuned for about 500 inner steps) is 7 times that: it overshot at H=4 to 64 on the
    whole MNIST (-2.27 to -0.88 points against the synchronous run); 0.1 (1 time, local
    SGD's own step, smoothed) was the best of 0.1-0.5 at H=4 and H=16 on 2 ranks
    (docs/exchanging-less.md, "DiLoCo's outer step"). The best rate rises with H (the ranks'
    changes drift apart and their mean shortens) and with the number of ranks (Charles et
    al., 2025): 0.1 up to H=16, times sqrt(H/16) above it, times sqrt(ranks/2) above 2 ranks
    (from the literature, not measured here), at most the paper's 0.7."""
    rate = 0.1 * max(1.0, every / 16) ** 0.5 * max(1.0, ranks / 2) ** 0.5
    return round(min(rate, 0.7), 3)


def exchange_due(step_in_epoch, steps_per_epoch, every):
    """True where an exchange falls: every `every`-th step of an epoch, and its last."""
    return step_in_epoch % every == 0 or step_in_epoch >= steps_per_epoch


def fitting_steps_per_execution(default, every):
    """The largest number of steps per execution up to `default` that divides `every` (the
    ranks exchange at an execution's end)."""
    return max(d for d in range(1, min(default, every) + 1) if every % d == 0)


def for_config(cfg):
    """The exchange strategy of `cfg.sync` and `cfg.sync_overlap` (a `TrainConfig`): the one
    place a mode's name picks its class."""
    return STRATEGIES[cfg.sync, bool(cfg.sync_overlap)](cfg)


class Exchange:
    """How the ranks exchange, as the recipe (`hvdtrain.trainer`) asks it, and `--sync step`
    itself: the distributed optimizers average the gradients of every step (Horovod's way),
    so this strategy has nothing to do between steps. Another strategy is a subclass; the
    recipe calls these methods and never asks which one it holds.

    The order of the calls: `steps_per_execution` and `check_policy` before the model's
    optimizers are distributed, `attach` once they are, `holders` for the checkpoints and
    the broadcast, `begin` at every (re)start, `callbacks` for each `fit`, `before_checkpoint`
    before a mid-epoch checkpoint, `ready_to_commit` where an elastic commit is due, and
    `describe` / `summary` for the run's first line and its metrics JSON.
    """

    mode = "step"
    exchanges_rarely = False  # the ranks meet at every step: Horovod's usual cycle time
    agrees_every_step = True  # the ranks hold the same weights after every step

    def __init__(self, cfg):
        self.cfg = cfg

    def steps_per_execution(self, default):
        """The steps per execution the run takes, from `default`."""
        return default

    def check_policy(self, policy):
        """Refuses, in one line, a mixed-precision policy this strategy cannot train with."""

    def attach(self, model, optimizers):
        """Once the model's optimizers are distributed (`hvdtrain.prepare`)."""

    def holders(self):
        """{name: the state this strategy keeps beside the model and its optimizers}:
        checkpointed (where a checkpoint holds it), broadcast and committed with them."""
        return {}

    def begin(self, start_step, lr_warmup_steps):
        """At every (re)start, once every rank holds the same weights (broadcast, restored)."""

    def check_data(self, data):
        """Refuses, in one line, a `hvdtrain.Data` this strategy cannot train on."""

    epoch_by_epoch = False  # True: the recipe calls `fit` once per epoch and asks `share`
    current = None  # this rank's `Share` of the current epoch; None: equal shares

    def share(self, epoch, steps):
        """This rank's `hvdtrain.shares.Share` of epoch `epoch` (`steps` steps a rank in equal
        shares), or None for its equal shard."""
        return None

    def stop_agreed(self, mine, agree):
        """Within an epoch, after an execution (every rank): whether the ranks agree to stop,
        `mine` this rank's ask. `agree(mine)` is a collective that says whether any rank
        asked; it runs where the ranks meet after this execution. None: not here (the ask
        is held to a later one)."""
        return agree(mine)

    def rank_steps(self):
        """This rank's steps in the current epoch where its share is not equal, else None."""
        return self.current.steps if self.current is not None else None

    def callbacks(self, steps_per_epoch, start_step, check):
        """The callbacks that drive it, first among `fit`'s: `check(when)` is the check that
        the ranks agree, to call where they should."""
        return []

    def before_checkpoint(self):
        """Every rank, before a mid-epoch checkpoint: the ranks' whole state made one."""

    def in_agreement(self):
        """True when the ranks hold the same model now."""
        return True

    def ready_to_commit(self):
        """Every rank, at a step where an elastic commit is due: True when the ranks hold one
        model and may commit here; False to wait for a later step."""
        return self.in_agreement()

    def describe(self):
        """Its part of the run's first line ("" for none)."""
        return ""

    def rank_figures(self):
        """This rank's own figures, for the metrics JSON's `ranks` (gathered from each)."""
        return {}

    def summary(self):
        """The metrics JSON's `sync` section."""
        return {"mode": self.mode}


class LocalSGD(Exchange):
    """`--sync local`: post-local SGD (see the module). Each rank takes H steps on its own
    between exchanges that set every rank's weights to the ranks' mean."""

    mode = "local"
    name = "local SGD"
    exchanges_rarely = True  # the ranks meet every H steps: a longer Horovod cycle
    agrees_every_step = False

    def __init__(self, cfg):
        super().__init__(cfg)
        self.every = cfg.exchange_every
        self.warmup_flag = cfg.sync_warmup_steps
        self.compression = hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none
        # The gradients' gate, by `attach`: a variable made here (before `hvdtrain.init`)
        # started TensorFlow, which then kept its default threads (as many as the host's
        # cores, on every rank) and ran local SGD at -np 2 at about 0.7 of `--sync step`.
        self.gate = None
        # Set by `attach`: the trainable weights, the model's other float state (BatchNorm's
        # statistics: averaged at every exchange), the optimizers' float state (averaged at
        # whole exchanges only), the anchor (the weights where the ranks last agreed).
        self.weights, self.state, self.opt_state, self.anchor = [], [], [], []
        self.per_exchange = 0  # bytes on the wire per exchange
        self.warmup = 0  # synchronous steps first: set by `begin`
        # The global step now, where the ranks' models last agreed, and their optimizers.
        self.step = self.agreed = self.agreed_whole = 0
        self.exchanges = self.bytes = 0  # this process's, since the run began
        self.waited = 0.0  # seconds the steps waited for exchanges, since the run began
        self.syncing = True  # the gate's value, mirrored: no read of the variable per call
        self._exchange_fn = self._state_fn = None
        # Each epoch's shares (`hvdtrain.shares`): equal, or by speed (--sync-balance).
        self.balance = Balance() if cfg.sync_balance else EqualShares()
        self.epoch_by_epoch = self.balance.balanced
        self.current = None  # this epoch's `Share`, or None (equal shares)
        self.weight = 1.0  # this round's change x this in the ranks' mean (its share)
        self._at_point = False  # whether the last execution ended at an exchange point
        self.unit = 1  # steps per execution (exchanges fall at an execution's end)
        self.optimizers = []

    def steps_per_execution(self, default):
        default = self.balance.execution_steps(default, self.every)
        self.unit = fitting_steps_per_execution(default, self.every)  # exchanges at their ends
        return self.unit

    def check_policy(self, policy):
        if policy == "mixed_float16":  # --mixed-precision auto on a GPU
            raise float16_refused(self.cfg)

    def attach(self, model, optimizers):
        optimizers = self.optimizers = list(optimizers)
        self.gate = Gate()
        for opt in optimizers:
            optim.gate_gradients(opt, self.gate)
        self.weights = optim.tf_variables(model.trainable_variables)
        self.state = [
            v for v in optim.tf_variables(model.non_trainable_variables) if v.dtype.is_floating
        ]
        self.opt_state = [v for opt in optimizers for v in optim.slot_variables(opt)]
        self.anchor = [tf.Variable(v, trainable=False) for v in self.weights]
        self.per_exchange = optim.wire_bytes(self.weights, self.compression) + optim.wire_bytes(
            self.state
        )

    def default_warmup(self, lr_warmup_steps):
        """Synchronous steps first unless `--sync-warmup-steps` says: the learning rate's."""
        return lr_warmup_steps

    def begin(self, start_step, lr_warmup_steps):
        flag = self.warmup_flag
        self.warmup = flag if flag is not None else self.default_warmup(lr_warmup_steps)
        self.syncing = start_step < self.warmup
        self.gate.on.assign(self.syncing)
        for a, w in zip(self.anchor, self.weights, strict=True):
            a.assign(w)
        self.step = self.agreed = self.agreed_whole = start_step
        # Traced anew: a trace holds the outer step's rate, which an elastic reset refits.
        self._exchange_fn = self._state_fn = None

    def callbacks(self, steps_per_epoch, start_step, check):
        return [ExchangeCallback(self, steps_per_epoch, start_step, check)]

    def before_checkpoint(self):
        self.now(whole=True)

    def check_data(self, data):
        if self.balance.balanced and not data.shares:
            raise invalid_value(
                "--sync-balance",
                True,
                "data in memory (arrays, `hvdtrain.ArrayData`), batches by index (a "
                "`Sequence` or `PyDataset` in `hvdtrain.BatchData`) or files every rank lists "
                f"(`hvdtrain.FileData` without per_host): {data.describe()} is sharded by "
                "rank, in equal parts; leave --sync-balance out for it",
            )

    def share(self, epoch, steps):
        """Equal shares for an epoch with synchronous steps (their gradients are averaged at
        every step), else the balance's."""
        self.current, self.weight = None, 1.0
        if epoch * steps >= self.warmup:
            self.current = self.balance.share(hvd.rank(), steps, self.every, self.unit)
        return self.current

    def stop_agreed(self, mine, agree):
        """In the synchronous warmup at every execution; then at the exchange points only: a
        collective between them would hold the ranks in step (and under `--sync-balance`
        wait for steps another rank does not take)."""
        return agree(mine) if self.syncing or self._at_point else None

    def due(self, step_in_epoch, steps_per_epoch):
        """True where an exchange falls after the `step_in_epoch`-th step of this epoch."""
        if self.current is not None:
            return self.current.exchange_due(step_in_epoch)
        return exchange_due(step_in_epoch, steps_per_epoch, self.every)

    def epoch_begins(self, global_step):
        """At an epoch's first step (every rank holds one model). Balanced, the step counts
        set to the epoch's start (a rank's last epoch may have ended past it), and each
        optimizer's steps moved by as much (its learning rate follows them)."""
        self.balance.begin_epoch(timed=global_step >= self.warmup)  # no synchronous step
        if not self.balance.balanced or not self.in_agreement():
            return
        for opt in self.optimizers:
            opt.iterations.assign_add(global_step - self.step)
        self.step = self.agreed = self.agreed_whole = global_step

    def clock(self, step_in_epoch, seconds):
        """After each execution: its `seconds`, from Keras's start of it to its end."""
        self.balance.clock(step_in_epoch, seconds)

    def epoch_ends(self):
        """At an epoch's end, after its whole exchange (every rank): balanced, the ranks'
        speeds gathered for the next epoch's shares."""
        self.balance.gather(lambda speed: hvd.allgather_object(speed, name="hvdtrain.shares"))

    def after_steps(self, global_step, step_in_epoch, steps_per_epoch):
        """At an execution's end (every rank): ends the warmup, or exchanges where one is due.
        Returns True after an exchange."""
        self.step = global_step
        if self.syncing:  # these steps averaged their gradients: in agreement
            self.agreed = self.agreed_whole = global_step
            if global_step >= self.warmup:
                self.syncing = False
                self.gate.on.assign(False)
                # The anchor where the local steps begin, as a run resumed here sets it: an
                # anchor left at the warmup's start gives the same mean in other roundings,
                # and a resume at or before the warmup's end another model (found by
                # `hvdtrain-run chaos`).
                for a, w in zip(self.anchor, self.weights, strict=True):
                    a.assign(w)
            return False
        self._at_point = self.due(step_in_epoch, steps_per_epoch)
        if self._at_point:
            if self.current is not None:  # this rank's change counts for its steps
                self.weight = self.current.weight_at(step_in_epoch)
            return self.now()
        return False

    def in_agreement(self):
        return self.agreed == self.step

    def now(self, whole=False):
        """Exchanges unless the ranks' models already agree; with `whole`, also averages the
        optimizers' state unless it agrees (a collective: every rank calls it at the same
        point, with the same `whole`). Returns True if it exchanged the weights."""
        exchanged = not self.in_agreement()
        averaging = whole and self.opt_state and self.agreed_whole != self.step
        if exchanged or averaging:
            watchdog.doing(
                f"exchanging weights with the other ranks ({self.name})", watchdog.OTHER_RANKS
            )
        began = time.perf_counter()
        if exchanged:
            if self._exchange_fn is None:  # one traced call: eager ops per variable cost
                self._exchange_fn = tf.function(self._exchange, autograph=False)  # more
            self._exchange_fn(tf.constant(self.weight, tf.float32))
            self.bytes += self.per_exchange
            self.exchanges += 1
            self.agreed = self.step
        if averaging:
            if self._state_fn is None:
                self._state_fn = tf.function(self._average_state, autograph=False)
            self._state_fn()
            self.bytes += optim.wire_bytes(self.opt_state)
        if whole:
            self.agreed_whole = self.step
        self.waited += time.perf_counter() - began
        return exchanged

    def _exchange(self, weight):
        deltas = [a - w for a, w in zip(self.anchor, self.weights, strict=True)]
        if self.balance.balanced:  # (a pass over the weights saved where the ranks are equal)
            deltas = [optim.weighted(d, weight) for d in deltas]
        self.move_anchor(optim.packed(deltas, "hvdtrain.exchange", self._average))
        for w, a in zip(self.weights, self.anchor, strict=True):
            w.assign(a)
        optim.average_variables(self.state, "hvdtrain.exchange.state")

    def move_anchor(self, mean):
        """The anchor moved by the ranks' mean change: to the ranks' mean weights,
        anchor - mean(anchor - weights)."""
        for a, d in zip(self.anchor, mean, strict=True):
            a.assign_sub(d)

    def stand_in(self, own):
        """Where the anchor would move if this rank's change `own` were the ranks' mean (the
        overlap's eager update: `OverlappedLocalSGD`)."""
        return [a - d for a, d in zip(self.anchor, own, strict=True)]

    def _average_state(self):
        optim.average_variables(self.opt_state, "hvdtrain.exchange.optimizers")

    def _average(self, tensor, name):
        return hvd.allreduce(tensor, op=hvd.Average, compression=self.compression, name=name)

    def describe(self):
        out = f"{self.name} every {self.every} steps"
        if self.warmup:
            out += f" after {self.warmup} synchronous"
        if self.balance.balanced:
            out += ", balanced by speed"
        return out

    def summary(self):
        return {
            "mode": self.mode,
            "every": self.every,
            "balance": self.balance.balanced,
            "warmup_steps": self.warmup,
            "outer_lr": None,
            "outer_lr_from": None,
            "outer_momentum": None,
            "fp16": self.compression is hvd.Compression.fp16,
            "overlap": False,
            "exchanges": self.exchanges,
            "bytes_per_exchange": self.per_exchange,
            "bytes_sent": self.bytes,
            "waited_seconds": round(self.waited, 4),
        }

    def rank_figures(self):
        out = {"exchange_waited_seconds": round(self.waited, 4)}
        if self.balance.balanced:
            out["balanced_epoch_steps"] = list(self.balance.steps)
        return out


class OuterState(tf.Module):
    """DiLoCo's outer optimizer state: a momentum per trainable variable. Checkpointed beside
    the optimizers, broadcast and committed with them (it has their `variables` and `built`)."""

    built = True

    def __init__(self, variables):
        super().__init__(name="hvdtrain_outer")
        self.momentum = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]


class DiLoCo(LocalSGD):
    """`--sync diloco`: local SGD whose exchange gives the ranks' mean change to an outer
    Nesterov SGD (`--outer-lr`, `--outer-momentum`) that moves the anchor; no synchronous
    warmup unless `--sync-warmup-steps` asks for one."""

    mode = "diloco"
    name = "DiLoCo"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.momentum = cfg.outer_momentum
        if self.momentum is None:
            self.momentum = OUTER_MOMENTUM
        self.outer_lr, self.outer_from = cfg.outer_lr, "--outer-lr"  # else `_fit`'s rule
        self.outer = None  # `OuterState`, by `attach`

    def _fit(self):
        """The outer learning rate of this job's H and ranks, unless the user gave one."""
        if self.cfg.outer_lr is None:
            ranks = hvd.size()
            self.outer_lr = outer_step(self.every, ranks)
            self.outer_from = f"fitted to H={self.every} and {ranks} ranks"

    def attach(self, model, optimizers):
        super().attach(model, optimizers)
        self.outer = OuterState(self.weights)
        self._fit()

    def begin(self, start_step, lr_warmup_steps):
        super().begin(start_step, lr_warmup_steps)
        self._fit()  # (an elastic reset: the ranks may be more or fewer)

    def holders(self):
        return {"exchange_outer": self.outer}

    def default_warmup(self, lr_warmup_steps):
        return 0

    def move_anchor(self, mean):
        """Nesterov SGD on the pseudo-gradient, as torch.optim.SGD(nesterov=True)."""
        mu, lr = self.momentum, self.outer_lr
        for a, m, d in zip(self.anchor, self.outer.momentum, mean, strict=True):
            m.assign(mu * m + d)
            a.assign_sub(lr * (d + mu * m))

    def stand_in(self, own):
        """The outer step on `own` as if it were the ranks' mean, its momentum left as is."""
        mu, lr = self.momentum, self.outer_lr
        return [
            a - lr * (d + mu * (mu * m + d))
            for a, m, d in zip(self.anchor, self.outer.momentum, own, strict=True)
        ]

    def describe(self):
        return (f"{super().describe()}, outer lr {self.outer_lr:g} ({self.outer_from}) "
                f"momentum {self.momentum:g}")  # fmt: skip

    def summary(self):
        return {**super().summary(), "outer_lr": self.outer_lr, "outer_lr_from": self.outer_from,
                "outer_momentum": self.momentum}  # fmt: skip


class OverlappedLocalSGD(Overlapped, LocalSGD):
    """`--sync local --sync-overlap`."""


class OverlappedDiLoCo(Overlapped, DiLoCo):
    """`--sync diloco --sync-overlap`."""


STRATEGIES = {
    ("step", False): Exchange,
    ("local", False): LocalSGD,
    ("diloco", False): DiLoCo,
    ("local", True): OverlappedLocalSGD,
    ("diloco", True): OverlappedDiLoCo,
}


class ExchangeCallback(tf.keras.callbacks.Callback):
    """Drives a `LocalSGD` (every rank): first among the callbacks, so that all the others
    (the checks, metrics, checkpoints, the user's) see the exchanged weights at an epoch's end.

    Args:
        exchange: the run's `LocalSGD` (or `DiLoCo`).
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
