"""Exchanging less: `--sync local` (post-local SGD) and `--sync diloco` (DiLoCo), opt-in modes
of `hvdtrain.fit` where each rank takes H steps on its own between two exchanges of weights.

    hvdtrain-run -np 4 -- python train.py --sync local --sync-every 16
    hvdtrain-run -np 4 -- python train.py --sync diloco --sync-every 64 --outer-lr 0.7

`--sync step` (the default) averages the gradients at every step, as Horovod does; nothing of
this module runs then. Under the other two:

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
  checkpoint, all of them exchanges; an elastic run commits at exchanges only.
"""

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdtrain.flags import OUTER, SYNC_EVERY
from hvdtrain.gate import Gate

__all__ = ["Exchange", "ExchangeCallback", "exchange_due", "fitting_steps_per_execution"]

NAMES = {"local": "local SGD", "diloco": "DiLoCo"}


def exchange_due(step_in_epoch, steps_per_epoch, every):
    """True where an exchange falls: every `every`-th step of an epoch, and its last."""
    return step_in_epoch % every == 0 or step_in_epoch >= steps_per_epoch


def fitting_steps_per_execution(default, every):
    """The largest number of steps per execution up to `default` that divides `every` (the
    ranks exchange at an execution's end)."""
    return max(d for d in range(1, min(default, every) + 1) if every % d == 0)


class OuterState(tf.Module):
    """DiLoCo's outer optimizer state: a momentum per trainable variable. Checkpointed beside
    the optimizers, broadcast and committed with them (it has their `variables` and `built`)."""

    built = True

    def __init__(self, variables):
        super().__init__(name="hvdtrain_outer")
        self.momentum = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]


class Exchange:
    """The exchanges of one run (see the module): made in `Run.setup`, started at every
    (re)start (`begin`), driven by `ExchangeCallback`."""

    def __init__(self, cfg, model, optimizers):
        from hvdtrain import optim

        self.mode, self.every = cfg.sync, cfg.sync_every or SYNC_EVERY
        self.warmup_flag = cfg.sync_warmup_steps
        self.outer_lr = cfg.outer_lr if cfg.outer_lr is not None else OUTER["outer_lr"]
        self.momentum = cfg.outer_momentum
        if self.momentum is None:
            self.momentum = OUTER["outer_momentum"]
        self.compression = hvd.Compression.fp16 if cfg.fp16_allreduce else hvd.Compression.none
        self.gate = Gate()
        optimizers = list(optimizers)
        for opt in optimizers:
            getattr(opt, "inner_optimizer", opt)._hvdtrain_gate = self.gate
        self.weights = optim._tf_variables(model.trainable_variables)
        # Averaged as they are: the model's other float state (BatchNorm's statistics) at
        # every exchange; the optimizers' float state, but their step counters and learning
        # rates, at whole ones only.
        self.state = [
            v for v in optim._tf_variables(model.non_trainable_variables) if v.dtype.is_floating
        ]
        self.opt_state = []
        for opt in optimizers:
            lr = getattr(opt, "_learning_rate", None)
            self.opt_state += [
                v
                for v in optim._tf_variables(opt.variables)
                if v.dtype.is_floating and v is not getattr(lr, "value", lr)
                and "learning_rate" not in v.name
            ]  # fmt: skip
        self.anchor = [tf.Variable(v, trainable=False) for v in self.weights]
        self.outer = OuterState(self.weights) if self.mode == "diloco" else None
        self.warmup = 0  # synchronous steps first: set by `begin`
        # The global step now, where the ranks' models last agreed, and their optimizers.
        self.step = self.agreed = self.agreed_whole = 0
        self.exchanges = self.bytes = 0  # this process's, since the run began
        self.per_exchange = _bytes(self.weights, self.compression) + _bytes(self.state)
        self.syncing = True  # the gate's value, mirrored: no read of the variable per call
        self._exchange_fn = self._state_fn = None

    def holders(self):
        """{name: the state this run keeps beside the model and its optimizers}: DiLoCo's
        outer momentum, checkpointed (where a checkpoint holds it), broadcast, committed."""
        return {"exchange_outer": self.outer} if self.outer is not None else {}

    def begin(self, start_step, lr_warmup_steps):
        """At every (re)start, once every rank holds the same weights (broadcast, restored)."""
        default = lr_warmup_steps if self.mode == "local" else 0
        self.warmup = self.warmup_flag if self.warmup_flag is not None else default
        self.syncing = start_step < self.warmup
        self.gate.on.assign(self.syncing)
        for a, w in zip(self.anchor, self.weights, strict=True):
            a.assign(w)
        self.step = self.agreed = self.agreed_whole = start_step

    def after_steps(self, global_step, step_in_epoch, steps_per_epoch):
        """At an execution's end (every rank): ends the warmup, or exchanges where one is due.
        Returns True after an exchange."""
        self.step = global_step
        if self.syncing:  # these steps averaged their gradients: in agreement
            self.agreed = self.agreed_whole = global_step
            if global_step >= self.warmup:
                self.syncing = False
                self.gate.on.assign(False)
            return False
        if exchange_due(step_in_epoch, steps_per_epoch, self.every):
            return self.now()
        return False

    def in_agreement(self):
        """True when the ranks hold the same model now (after an exchange, in the warmup)."""
        return self.agreed == self.step

    def now(self, whole=False):
        """Exchanges unless the ranks' models already agree; with `whole`, also averages the
        optimizers' state unless it agrees (a collective: every rank calls it at the same
        point, with the same `whole`). Returns True if it exchanged the weights."""
        from hvdtrain import watchdog

        exchanged = not self.in_agreement()
        averaging = whole and self.opt_state and self.agreed_whole != self.step
        if exchanged or averaging:
            watchdog.doing(
                f"exchanging weights with the other ranks ({NAMES[self.mode]})",
                watchdog.OTHER_RANKS,
            )
        if exchanged:
            if self._exchange_fn is None:  # one traced call: eager ops per variable cost
                self._exchange_fn = tf.function(self._exchange, autograph=False)  # more
            self._exchange_fn()
            self.bytes += self.per_exchange
            self.exchanges += 1
            self.agreed = self.step
        if averaging:
            if self._state_fn is None:
                self._state_fn = tf.function(self._average_state, autograph=False)
            self._state_fn()
            self.bytes += _bytes(self.opt_state)
        if whole:
            self.agreed_whole = self.step
        return exchanged

    def _exchange(self):
        from hvdtrain import optim

        deltas = [a - w for a, w in zip(self.anchor, self.weights, strict=True)]
        mean = optim.packed(deltas, "hvdtrain.exchange", self._average)
        if self.outer is None:  # the ranks' mean weights: anchor - mean(anchor - weights)
            for a, d in zip(self.anchor, mean, strict=True):
                a.assign_sub(d)
        else:  # Nesterov SGD on the pseudo-gradient, as torch.optim.SGD(nesterov=True)
            mu, lr = self.momentum, self.outer_lr
            for a, m, d in zip(self.anchor, self.outer.momentum, mean, strict=True):
                m.assign(mu * m + d)
                a.assign_sub(lr * (d + mu * m))
        for w, a in zip(self.weights, self.anchor, strict=True):
            w.assign(a)
        _average_as_they_are(self.state, "hvdtrain.exchange.state")

    def _average_state(self):
        _average_as_they_are(self.opt_state, "hvdtrain.exchange.optimizers")

    def _average(self, tensor, name):
        return hvd.allreduce(tensor, op=hvd.Average, compression=self.compression, name=name)

    def describe(self):
        """For the run's first line: `local SGD every 16 steps after 100 synchronous`."""
        out = f"{NAMES[self.mode]} every {self.every} steps"
        if self.warmup:
            out += f" after {self.warmup} synchronous"
        if self.outer is not None:
            out += f", outer lr {self.outer_lr:g} momentum {self.momentum:g}"
        return out

    def summary(self):
        """The metrics JSON's `sync` section."""
        return {
            "mode": self.mode,
            "every": self.every,
            "warmup_steps": self.warmup,
            "outer_lr": self.outer_lr if self.outer is not None else None,
            "outer_momentum": self.momentum if self.outer is not None else None,
            "fp16": self.compression is hvd.Compression.fp16,
            "exchanges": self.exchanges,
            "bytes_per_exchange": self.per_exchange,
            "bytes_sent": self.bytes,
        }


def _average_as_they_are(variables, name):
    """Sets `variables` to their mean over the ranks (full precision), in one allreduce."""
    if not variables:
        return
    from hvdtrain import optim

    average = lambda t, name: hvd.allreduce(t, op=hvd.Average, name=name)  # noqa: E731
    for v, value in zip(variables, optim.packed(variables, name, average), strict=True):
        v.assign(value)


def _bytes(tensors, compression=hvd.Compression.none):
    """What `tensors` weigh on the wire (float16 under the fp16 compression)."""
    size = 2 if compression is hvd.Compression.fp16 else None
    return sum(
        int(t.shape.num_elements()) * (size if size and t.dtype.is_floating else t.dtype.size)
        for t in tensors
    )


class ExchangeCallback(tf.keras.callbacks.Callback):
    """Drives an `Exchange` (every rank): first among the callbacks, so that all the others
    (the checks, metrics, checkpoints, the user's) see the exchanged weights at an epoch's end.

    Args:
        exchange: the run's `Exchange`.
        steps_per_epoch: steps in a full epoch.
        start_step: the global step the run starts at (a resume: mid-epoch).
        check: `(when) -> None`, the agreement check, after the run's first exchange.
    """

    def __init__(self, exchange, steps_per_epoch, start_step=0, check=None):
        super().__init__()
        self.exchange, self.steps, self.check = exchange, steps_per_epoch, check
        self.start_step = start_step
        self._first = self._offset = 0
        self.checked = False

    def on_epoch_begin(self, epoch, logs=None):
        # `fit` numbers batches from where it started: mid-epoch after a resume.
        self._first = epoch * self.steps
        self._offset = max(0, self.start_step - self._first)

    def on_train_batch_end(self, batch, logs=None):
        step = self._offset + batch + 1
        if self.exchange.after_steps(self._first + step, step, self.steps):
            self._check()

    def on_epoch_end(self, epoch, logs=None):
        # One state for all (a checkpoint may follow), and the weights too after an epoch
        # that a callback cut short.
        if self.exchange.now(whole=True):
            self._check()

    def _check(self):
        if not self.checked and self.check is not None:
            self.checked = True
            self.check("after the first exchange")
