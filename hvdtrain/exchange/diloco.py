"""`--sync diloco`: DiLoCo (Douillard et al., 2023). Local SGD whose exchange gives the ranks'
mean change (the pseudo-gradient) to an outer Nesterov SGD that moves the anchor."""

import tensorflow as tf

from hvdtrain.exchange.rounds import Rounds

__all__ = ["DiLoCo", "OuterState", "outer_step", "outer_momentum", "OUTER_MOMENTUM"]

OUTER_MOMENTUM = 0.9  # DiLoCo's outer Nesterov momentum, the paper's
# The largest H at which the rate's rise with H was measured: above it, on 2 ranks, 0.4 at
# H=256 (a reach of 4 with the momentum) diverged on the MNIST MLP and convnet
# (docs/exchanging-less.md, "DiLoCo's outer step").
H_MEASURED = 64
HORIZON = 3  # exchanges of a run per exchange of the momentum's memory, 1 / (1 - momentum)


def outer_momentum(exchanges):
    """DiLoCo's outer momentum for a run of `exchanges` exchanges (None: unknown), where
    neither `--outer-lr` nor `--outer-momentum` is given: the paper's 0.9, whose memory (1 /
    (1 - 0.9) = 10 exchanges) fits a run of 30 or more; a shorter run's memory a third of its
    exchanges (0.5 for 6 exchanges; none for 3 or fewer). Pure."""
    if exchanges is None or exchanges >= HORIZON / (1 - OUTER_MOMENTUM):
        return OUTER_MOMENTUM
    return round(max(0.0, 1 - HORIZON / max(exchanges, 1)), 3)


def outer_step(every, ranks, momentum=OUTER_MOMENTUM):
    """DiLoCo's outer learning rate for H=`every` local steps between exchanges, `ranks`
    ranks and `momentum`, where `--outer-lr` is not given: at momentum 0.9, 0.1 up to H=16
    on 2 ranks, x sqrt(H/16) up to H=`H_MEASURED` (0.2 from there), x sqrt(ranks/2) above 2
    ranks, at most the paper's 0.7. An outer Nesterov step of rate r and momentum m moves
    the anchor by up to r / (1 - m) times a pseudo-gradient that repeats round after round
    (its reach). A momentum fitted below 0.9 to a short run keeps the reach's part above one
    (the momentum's extrapolation) in proportion to itself: none at momentum 0, where the
    anchor moves by the ranks' mean change as local SGD's does. The measurements behind the
    rule are on docs/exchanging-less.md ("DiLoCo's outer step"). Pure."""
    rate = 0.1 * max(1.0, min(every, H_MEASURED) / 16) ** 0.5 * max(1.0, ranks / 2) ** 0.5
    reach = min(rate, 0.7) / (1 - OUTER_MOMENTUM)
    reach = 1 + (reach - 1) * min(momentum, OUTER_MOMENTUM) / OUTER_MOMENTUM
    return round(reach * (1 - momentum), 3)


class OuterState(tf.Module):
    """DiLoCo's outer optimizer state: a momentum per trainable variable. Checkpointed beside
    the optimizers, broadcast and committed with them (it has their `variables` and `built`)."""

    built = True

    def __init__(self, variables):
        super().__init__(name="hvdtrain_outer")
        self.momentum = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]


class OuterSteps(tf.Module):
    """How many outer steps DiLoCo has taken (its momentum's bias correction counts them).
    Checkpointed beside the optimizers, broadcast and committed with them."""

    built = True

    def __init__(self):
        super().__init__(name="hvdtrain_outer_steps")
        with tf.init_scope():
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False)


class DiLoCo:
    """The mode of `--sync diloco`: an exchange is an outer Nesterov SGD step
    (`--outer-lr`, else `outer_step`'s; `--outer-momentum`, else 0.9) on the ranks' mean
    change; no synchronous warmup unless `--sync-warmup-steps` asks for one.

    The momentum is bias-corrected as Adam's is: its sum of the changes so far is divided by
    1 - momentum^t after t outer steps, so that the first steps move the anchor as far as the
    steady state does (by the mean change itself with the rule's rate), not by a fifth of it.
    A run of a few exchanges kept most of its ranks' progress out of the anchor without it
    (docs/exchanging-less.md, "DiLoCo on a short run")."""

    sync = "diloco"
    name = "DiLoCo"

    @classmethod
    def exchange(cls, cfg, averager):
        return Rounds(cfg, cls(cfg), averager())

    def __init__(self, cfg):
        self.every = cfg.exchange_every
        self.momentum = OUTER_MOMENTUM if cfg.outer_momentum is None else cfg.outer_momentum
        self.momentum_from = "--outer-momentum" if cfg.outer_momentum is not None else None
        # Neither given: the pair fitted to the run's exchanges, H and the ranks.
        self.fitted = cfg.outer_lr is None and cfg.outer_momentum is None
        self.given = cfg.outer_lr  # None: fitted to H and the ranks at every (re)start
        self.outer_lr, self.outer_from = cfg.outer_lr, "--outer-lr"
        self.outer = None  # `OuterState`, by `attach`
        self.steps = None  # `OuterSteps`, by `attach`
        # The rate and momentum as the exchange's trace reads them: variables, so that a new
        # H (`--sync-every auto`) refits them without a trace (seconds for the convnet).
        self.traced = None

    def attach(self, replica):
        self.outer = OuterState(replica.weights)
        self.steps = OuterSteps()
        self.traced = [tf.Variable(0.0, trainable=False) for _ in range(2)]

    def begin(self, ranks, every, exchanges=None):
        self.every = every
        if self.fitted:
            self.momentum = outer_momentum(exchanges)
            self.momentum_from = None if exchanges is None else f"the run's {exchanges} exchanges"
        if self.given is None:
            self.outer_lr = outer_step(self.every, ranks, self.momentum)
            self.outer_from = f"fitted to H={self.every} and {ranks} ranks"
        if not int(self.steps.count.numpy()) and any(
            bool(tf.reduce_any(m != 0)) for m in self.outer.momentum
        ):  # a checkpoint written before the correction: its momentum is at its steady state
            self.steps.count.assign(1000)
        self.traced[0].assign(self.outer_lr)
        self.traced[1].assign(self.momentum)

    def holders(self):
        return {"exchange_outer": self.outer, "exchange_outer_steps": self.steps}

    def _unbias(self, steps):
        """1 / (1 - momentum^steps): the bias correction after `steps` (1 or more) outer
        steps; 1 at momentum 0."""
        return 1.0 / (1.0 - tf.pow(self.traced[1], tf.cast(steps, tf.float32)))

    def default_warmup(self, lr_warmup_steps):
        return 0

    def move_anchor(self, anchor, mean):
        """Nesterov SGD on the pseudo-gradient `mean`, as torch.optim.SGD(nesterov=True)."""
        unbias = self._unbias(self.steps.count.assign_add(1))
        for a, m, d in zip(anchor, self.outer.momentum, mean, strict=True):
            lr, mu = (tf.cast(v, m.dtype) for v in self.traced)  # (a model of float64, too)
            m.assign(mu * m + d)
            a.assign_sub(lr * (d + mu * m * tf.cast(unbias, m.dtype)))

    def stand_in(self, anchor, own):
        """The outer step on `own` as if it were the ranks' mean, its momentum left as is."""
        unbias = self._unbias(self.steps.count + 1)
        out = []
        for a, m, d in zip(anchor, self.outer.momentum, own, strict=True):
            lr, mu = (tf.cast(v, m.dtype) for v in self.traced)
            out.append(a - lr * (d + mu * (mu * m + d) * tf.cast(unbias, m.dtype)))
        return out

    def describe(self):
        out = f", outer lr {self.outer_lr:g} ({self.outer_from}) momentum {self.momentum:g}"
        if self.momentum != OUTER_MOMENTUM and self.momentum_from:
            out += f" (fitted to {self.momentum_from})"
        return out

    def summary(self):
        return {"outer_lr": self.outer_lr, "outer_lr_from": self.outer_from,
                "outer_momentum": self.momentum,
                "outer_momentum_from": self.momentum_from}  # fmt: skip
