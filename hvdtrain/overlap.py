"""The overlapped exchange of `--sync local/diloco --sync-overlap` (`hvdtrain.exchange`): a
round's averaging runs in a thread of its own while the next round's steps do, and lands at
the next exchange point with the delay corrected as in "eager updates" (Kale et al., 2025).

`Overlapped` is a mixin over `hvdtrain.exchange.LocalSGD` or `DiLoCo` (their
`OverlappedLocalSGD` and `OverlappedDiLoCo`): it uses their weights, anchor, outer step
(`move_anchor`, `stand_in`) and averaging, and changes when the mean is applied.
"""

import threading
import time

import tensorflow as tf

from hvdtrain import optim, watchdog

__all__ = ["Overlapped", "InFlight"]


class Overlapped:
    """`--sync-overlap`, over `LocalSGD` or `DiLoCo`: the exchange of a round runs while the
    next round's steps do (one exchange in flight per rank), and its mean lands at the next
    exchange point, with the delay corrected as in "eager updates" (Kale et al., 2025).

    Round r starts from `start` and ends at the weights w; this rank's change is
    `own = start - w`. At its end: the previous round's mean (in flight since) lands and
    moves the anchor (`move_anchor`: the same on every rank), round r's `own` goes to the
    ranks' mean in a thread of its own (TensorFlow releases the GIL while Horovod's op
    runs), and the next round starts from `stand_in(own)`: the anchor moved as if this
    rank's own fresh change were the mean. Every rank thus holds the agreed anchor plus its
    own progress since; when the mean of round r lands, it replaces the rank's own change.
    At whole exchanges (epoch ends, checkpoints, the end) the exchange in flight lands, the
    round's change is averaged at once, and every rank holds the anchor, its BatchNorm
    statistics and its optimizers' state averaged: one model, as without the overlap.
    """

    overlapped = True

    def __init__(self, cfg):
        super().__init__(cfg)
        self.start = []  # where this round's steps began (by `attach`)
        self.round_start = 0  # the global step at which this round began
        self.pending = None  # the exchange in flight (`InFlight`), or None
        self.exchange_seconds = 0.0  # the exchanges' own time in their thread
        self.waited_pending = 0.0  # the part of it the steps waited for
        self._rounds = 0
        self._reduce_fn = self._point_fn = None
        # A callback's stop within an epoch travels with the rounds' exchanges: this rank's
        # ask for the next round, and the ranks' verdict of the round that landed last.
        self._asking, self._verdict = False, None

    def attach(self, model, optimizers):
        super().attach(model, optimizers)
        self.start = [tf.Variable(v, trainable=False) for v in self.weights]
        # What a round sends: its change and, last, the ask to stop (see `stop_agreed`),
        # packed into one buffer per dtype, the ask in the float32 one.
        self._sent = [*self.start, tf.zeros([])]
        self._ask_at = sorted({t.dtype.name for t in self._sent}).index("float32")
        self.per_exchange = optim.wire_bytes(
            self.weights, self.compression
        )  # statistics: whole only

    def begin(self, start_step, lr_warmup_steps):
        super().begin(start_step, lr_warmup_steps)
        self.pending = None  # (an elastic reset: the old job's exchange is gone with it)
        self._asking, self._verdict = False, None
        self._point_fn = None  # traced anew (the outer rate: see there)
        self._new_round(self.weights)

    def after_steps(self, global_step, step_in_epoch, steps_per_epoch):
        syncing = self.syncing
        exchanged = super().after_steps(global_step, step_in_epoch, steps_per_epoch)
        if syncing and not self.syncing:  # the warmup's end: the rounds begin here
            self._new_round(self.weights)
        return exchanged

    def epoch_begins(self, global_step):
        super().epoch_begins(global_step)
        if self.in_agreement():
            self.round_start = self.step

    def _new_round(self, weights):
        """The anchor and the round's start set to `weights` (the ranks agree on them)."""
        for a, s, w in zip(self.anchor, self.start, weights, strict=True):
            a.assign(w)
            s.assign(w)
        self.round_start = self.step

    def _continue_from(self, values):
        for s, w, v in zip(self.start, self.weights, values, strict=True):
            s.assign(v)
            w.assign(v)
        self.round_start = self.step

    def in_agreement(self):
        return self.pending is None and super().in_agreement()

    def stop_agreed(self, mine, agree):
        """Between whole exchanges without a collective of its own: the ask goes with the
        next round's exchange, and the ranks stop where the round that carried it lands (at
        most two exchange points after the ask). A blocking 4-byte allreduce at each point
        would wait for the slower rank and hide nothing."""
        if self.syncing:
            return agree(mine)
        self._asking = mine
        if not self._at_point:
            return None
        verdict, self._verdict = self._verdict, None
        return verdict

    def ready_to_commit(self):
        """Between whole exchanges an exchange is always in flight, so the ranks never agree
        there: a due commit makes them agree at once (the whole exchange of a checkpoint)."""
        if not self.in_agreement():
            self.now(whole=True)
        return True

    def now(self, whole=False):
        """At an exchange point (every rank, the same `whole`): a round's exchange started in
        the background, or with `whole` everything landed and averaged. Returns True when
        the ranks hold one model after it."""
        if not whole:
            if self.step == self.round_start or self.agreed == self.step:
                return False
            began = time.perf_counter()
            # One traced call: eager ops per variable, or a call for each part, cost more
            # than the exchange itself on a rank of one core.
            if self._point_fn is None:
                self._point_fn = tf.function(self._point, autograph=False)
            landed = self._landed()
            weight = tf.constant(self.weight, tf.float32)
            asking = tf.constant(float(self._asking), tf.float32)
            self.pending = InFlight(self._reduce, self._point_fn(weight, asking, landed))
            self.round_start = self.step
            self.exchanges += 1
            self.bytes += self.per_exchange
            self.waited += time.perf_counter() - began
            return False
        if self.pending is None and self.agreed == self.step:  # the warmup, or done here
            if self.agreed_whole == self.step:
                return False
            self._new_round(self.weights)
            return super().now(whole=True)  # the optimizers' state
        watchdog.doing(
            f"exchanging weights with the other ranks ({self.name})", watchdog.OTHER_RANKS
        )
        began = time.perf_counter()
        self._land()
        self._verdict = None  # a whole exchange: the ranks agree on a stop themselves
        if self.step > self.round_start:  # this round's change, at once
            own = [s - w for s, w in zip(self.start, self.weights, strict=True)]
            sent = optim.pack([*self._counted(own), tf.zeros([])])
            self.move_anchor(optim.unpack(self._reduce(sent)[0], self._sent)[:-1])
            self.exchanges += 1
            self.bytes += self.per_exchange
        self._continue_from(self.anchor)
        optim.average_variables(self.state, "hvdtrain.exchange.state")
        self.bytes += optim.wire_bytes(self.state)
        self.waited += time.perf_counter() - began
        self.agreed = self.step
        super().now(whole=True)  # the optimizers' state
        return True

    def _point(self, weight, asking, landed):
        """At an exchange point: the anchor moved by the mean `landed` (None: none landed),
        the next round started from the stand-in of this round's change, and what this
        round sends returned: its change x `weight` (its share's steps: `--sync-balance`)
        and the ask to stop, packed."""
        own = [s - w for s, w in zip(self.start, self.weights, strict=True)]
        if landed is not None:
            self.move_anchor(optim.unpack(landed, self._sent)[:-1])
        for s, w, v in zip(self.start, self.weights, self.stand_in(own), strict=True):
            s.assign(v)
            w.assign(v)
        if self.balance.balanced:
            own = [optim.weighted(o, weight) for o in own]
        return optim.pack([*own, asking])

    def _land(self):
        """The exchange in flight, landed: the anchor moved by its mean."""
        landed = self._landed()
        if landed is not None:
            self.move_anchor(optim.unpack(landed, self._sent)[:-1])

    def _landed(self):
        """The mean of the exchange in flight, packed as `_sent`, once it is done (None: none
        in flight); the ranks' verdict on a stop it carried kept for `stop_agreed`."""
        if self.pending is None:
            return None
        watchdog.doing(
            f"exchanging weights with the other ranks ({self.name})", watchdog.OTHER_RANKS
        )
        began = time.perf_counter()
        (mean, asked), seconds = self.pending.result()
        self.waited_pending += time.perf_counter() - began
        self.exchange_seconds += seconds
        self.pending = None
        self._verdict = bool(asked.numpy() > 0)  # the ranks' mean ask: any rank asked
        return mean

    def _counted(self, own):
        """`own` x this round's weight (its share's steps: `--sync-balance`)."""
        if not self.balance.balanced:
            return own
        weight = tf.constant(self.weight, tf.float32)
        return [optim.weighted(o, weight) for o in own]

    def _reduce(self, sent):
        """The ranks' mean of the buffers `sent`, and of the ask in them (one traced call;
        any thread)."""
        if self._reduce_fn is None:
            self._reduce_fn = tf.function(self._reduced, autograph=False)
        return self._reduce_fn(sent)

    def _reduced(self, sent):
        mean = [self._average(f, f"hvdtrain.exchange.overlap.{f.dtype.name}") for f in sent]
        return mean, mean[self._ask_at][-1]

    def describe(self):
        return f"{super().describe()}, overlapped"

    def summary(self):
        return {**super().summary(), "overlap": True, **self._hidden()}

    def rank_figures(self):
        return {**super().rank_figures(), **self._hidden()}

    def _hidden(self):
        spent = self.exchange_seconds
        hidden = 1 - min(self.waited_pending, spent) / spent if spent else None
        return {
            "exchange_seconds": round(spent, 4),
            "exchange_hidden": None if hidden is None else round(hidden, 4),
        }


class InFlight:
    """`fn(own)` in a daemon thread of its own (one that hangs in a collective cannot hold up
    the process's exit, as a thread pool's would): `result()` waits for it and gives
    (its value, its seconds), or raises what it raised."""

    def __init__(self, fn, own):
        self._out = self._error = None
        self._seconds = 0.0
        self._thread = threading.Thread(
            target=self._run, args=(fn, own), name="hvdtrain-exchange", daemon=True
        )
        self._thread.start()

    def _run(self, fn, own):
        began = time.perf_counter()
        try:
            self._out = fn(own)
        except BaseException as e:  # raised where the result is asked for
            self._error = e
        self._seconds = time.perf_counter() - began

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out, self._seconds
