"""`InFlight`: the averager of `--sync-overlap`. A round's averaging runs in a thread of its
own while the next round's steps do, and lands at the next exchange point with the delay
corrected as in "eager updates" (Kale et al., 2025)."""

import threading
import time

import tensorflow as tf

from hvdtrain.exchange import wire
from hvdtrain.exchange.rounds import waiting, weighted
from hvdtrain.runtime import watchdog

__all__ = ["InFlight", "Pending"]


class InFlight:
    """One exchange in flight per rank.

    Round r starts from `start` and ends at the weights w; this rank's change is
    `own = start - w`. At its end: the previous round's mean (in flight since) lands and
    moves the anchor (`move_anchor`: the same on every rank), round r's `own` goes to the
    ranks' mean in a thread of its own (TensorFlow releases the GIL while Horovod's op
    runs), and the next round starts from `stand_in(own)`: the anchor moved as if this
    rank's own fresh change were the mean. Every rank thus holds the agreed anchor plus its
    own progress since; when the mean of round r lands, it replaces the rank's own change.
    At whole exchanges the exchange in flight lands, the round's change is averaged at
    once, and every rank holds the anchor and its BatchNorm statistics averaged: one model,
    as without the overlap.

    A callback's ask to stop travels with the rounds' exchanges (`stop_agreed`): the ask
    for the next round, and the ranks' verdict of the round that landed last.
    """

    overlap = True

    def __init__(self):
        self.replica = self.mode = self.tally = None
        self.per_exchange = 0  # bytes on the wire per exchange (the statistics: whole only)
        self.start = []  # where this round's steps began (by `attach`)
        self.round_start = 0  # the global step at which this round began
        self.pending = None  # the exchange in flight (`Pending`), or None
        self.exchange_seconds = 0.0  # the exchanges' own time in their thread
        self.waited_pending = 0.0  # the part of it the steps waited for
        self.asking, self.verdict = False, None
        self.timings = []  # each exchange's seconds in its thread, until taken
        self._sent = []  # what a round sends: its change and, last, the ask to stop
        self._ask_at = 0  # the buffer (one per dtype) that holds the ask: float32's
        self._reduce_fn = self._point_fn = None

    def attach(self, replica, mode, tally):
        self.replica, self.mode, self.tally = replica, mode, tally
        self.start = [tf.Variable(v, trainable=False) for v in replica.weights]
        self._sent = [*self.start, tf.zeros([])]
        self._ask_at = sorted({t.dtype.name for t in self._sent}).index("float32")
        self.per_exchange = wire.wire_bytes(replica.weights, replica.compression)

    def begin(self):
        """At every (re)start: nothing in flight (an elastic reset: the old job's exchange
        is gone with it), traced anew, a round from the weights."""
        self.pending = None
        self.asking, self.verdict = False, None
        self._point_fn = None  # an elastic reset's job is another: traced anew
        self.start_round()

    def take_timings(self):
        """The seconds of each exchange (in its thread) landed since the last call."""
        out, self.timings = self.timings, []
        return out

    def start_round(self):
        """The ranks agree: the anchor and the round's start at their weights."""
        r = self.replica
        for a, s, w in zip(r.anchor, self.start, r.weights, strict=True):
            a.assign(w)
            s.assign(w)
        self.round_start = r.step

    def epoch_begins(self):
        self.round_start = self.replica.step

    def in_agreement(self):
        return self.pending is None and self.replica.in_agreement()

    def busy(self):
        """Whether an exchange is running in its thread now."""
        return self.pending is not None and self.pending.running()

    def point(self, weight):
        """The last round's mean landed, this round's sent in the background. False: the
        ranks never agree at an exchange point."""
        r = self.replica
        if r.step == self.round_start or r.in_agreement():
            return False
        began = time.perf_counter()
        # One traced call: eager ops per variable, or a call for each part, cost more than
        # the exchange itself on a rank of one core.
        if self._point_fn is None:
            self._point_fn = tf.function(self._point, autograph=False)
        landed = self._landed()
        asking = tf.constant(float(self.asking), tf.float32)
        self.pending = Pending(self._reduce, self._point_fn(weight, asking, landed))
        self.round_start = r.step
        self.tally.exchanges += 1
        self.tally.bytes += self.per_exchange
        self.tally.waited += time.perf_counter() - began
        return False

    def whole(self, weight):
        """Everything landed and averaged. True when the ranks hold one model again."""
        r = self.replica
        if self.pending is None and r.in_agreement():  # the warmup, or done here
            return False
        with waiting(self.tally, self.mode.name):
            landed = self._landed()
            if landed is not None:
                self.mode.move_anchor(r.anchor, wire.unpack(landed, self._sent)[:-1])
            self.verdict = None  # a whole exchange: the ranks agree on a stop themselves
            if r.step > self.round_start:  # this round's change, at once
                own = weighted([s - w for s, w in zip(self.start, r.weights, strict=True)],
                               weight)  # fmt: skip
                mean = self._reduce(wire.pack([*own, tf.zeros([])]))[0]
                self.mode.move_anchor(r.anchor, wire.unpack(mean, self._sent)[:-1])
                self.tally.exchanges += 1
                self.tally.bytes += self.per_exchange
            for s, w, a in zip(self.start, r.weights, r.anchor, strict=True):
                s.assign(a)
                w.assign(a)
            self.round_start = r.step
            self.tally.bytes += r.average_state()
        r.agreed = r.step
        return True

    def _point(self, weight, asking, landed):
        """At an exchange point: the anchor moved by the mean `landed` (None: none landed),
        the next round started from the stand-in of this round's change, and what this
        round sends returned: its change x `weight` and the ask to stop, packed."""
        r = self.replica
        own = [s - w for s, w in zip(self.start, r.weights, strict=True)]
        if landed is not None:
            self.mode.move_anchor(r.anchor, wire.unpack(landed, self._sent)[:-1])
        for s, w, v in zip(self.start, r.weights, self.mode.stand_in(r.anchor, own),
                           strict=True):  # fmt: skip
            s.assign(v)
            w.assign(v)
        return wire.pack([*weighted(own, weight), asking])

    def _landed(self):
        """The mean of the exchange in flight, packed as `_sent`, once it is done (None: none
        in flight); the ranks' verdict on a stop it carried kept for `stop_agreed`."""
        if self.pending is None:
            return None
        watchdog.doing(
            f"exchanging weights with the other ranks ({self.mode.name})", watchdog.OTHER_RANKS
        )
        began = time.perf_counter()
        (mean, asked), seconds = self.pending.result()
        self.waited_pending += time.perf_counter() - began
        self.exchange_seconds += seconds
        self.timings.append(seconds)
        self.pending = None
        self.verdict = bool(asked.numpy() > 0)  # the ranks' mean ask: any rank asked
        return mean

    def wait(self):
        """Waits for the exchange in flight, if any, without landing it (`python -m
        hvdtrain.bench.floor` times a round's whole work this way)."""
        if self.pending is not None:
            self.pending.result()

    def _reduce(self, sent):
        """The ranks' mean of the buffers `sent`, and of the ask in them (one traced call;
        any thread)."""
        if self._reduce_fn is None:
            self._reduce_fn = tf.function(self._reduced, autograph=False)
        return self._reduce_fn(sent)

    def _reduced(self, sent):
        r = self.replica
        mean = [r.mean(f, f"hvdtrain.exchange.overlap.{f.dtype.name}") for f in sent]
        return mean, mean[self._ask_at][-1]

    def stop_agreed(self, mine, agree, at_point):
        """Between whole exchanges without a collective of its own: the ask goes with the
        next round's exchange, and the ranks stop where the round that carried it lands (at
        most two exchange points after the ask). A blocking 4-byte allreduce at each point
        would wait for the slower rank and hide nothing."""
        self.asking = mine
        if not at_point:
            return None
        verdict, self.verdict = self.verdict, None
        return verdict

    def ready_to_commit(self, whole):
        """Between whole exchanges an exchange is always in flight, so the ranks never agree
        there: a due commit makes them agree at once (`whole`: a whole exchange)."""
        if not self.in_agreement():
            whole()
        return True

    def describe(self):
        return ", overlapped"

    def figures(self):
        spent = self.exchange_seconds
        hidden = 1 - min(self.waited_pending, spent) / spent if spent else None
        return {
            "exchange_seconds": round(spent, 4),
            "exchange_hidden": None if hidden is None else round(hidden, 4),
        }


class Pending:
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

    def running(self):
        return self._thread.is_alive()

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._out, self._seconds
