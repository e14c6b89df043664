"""`Blocking`: the averager of `--sync local/diloco` without `--sync-overlap`: at an exchange
point every rank sends its change and waits for the ranks' mean."""

import time

import tensorflow as tf

from hvdtrain.exchange import wire
from hvdtrain.exchange.rounds import waiting, weighted

__all__ = ["Blocking"]


class Blocking:
    """The ranks' mean change made at once, in one traced call: each rank's change (the
    anchor minus its weights, x its share under `--sync-balance`) averaged, the anchor moved
    by the mode (`move_anchor`), every rank's weights set to the anchor, the BatchNorm
    statistics averaged. The same at an exchange point and at a whole exchange."""

    overlap = False

    def __init__(self):
        self.replica = self.mode = self.tally = None
        self.per_exchange = 0  # bytes on the wire per exchange
        self.timings = []  # each exchange's seconds, until taken (`--sync-every auto`)
        self._exchange_fn = None

    def attach(self, replica, mode, tally):
        self.replica, self.mode, self.tally = replica, mode, tally
        self.per_exchange = wire.wire_bytes(replica.weights, replica.compression)
        self.per_exchange += wire.wire_bytes(replica.state)

    def begin(self):
        """At every (re)start: traced anew, the anchor at the weights."""
        self._exchange_fn = None  # an elastic reset's job is another: traced anew
        self.start_round()

    def take_timings(self):
        """The seconds of each exchange since the last call."""
        out, self.timings = self.timings, []
        return out

    def start_round(self):
        """The ranks agree: the anchor at their weights."""
        r = self.replica
        for a, w in zip(r.anchor, r.weights, strict=True):
            a.assign(w)

    def epoch_begins(self):
        pass

    def in_agreement(self):
        return self.replica.in_agreement()

    def point(self, weight):
        """An exchange, unless the ranks agree already. True after an exchange."""
        r = self.replica
        if r.in_agreement():
            return False
        began = time.perf_counter()
        with waiting(self.tally, self.mode.name):
            if self._exchange_fn is None:  # one traced call: eager ops per variable cost more
                self._exchange_fn = tf.function(self._exchange, autograph=False)
            self._exchange_fn(weight)
            self.tally.bytes += self.per_exchange
            self.tally.exchanges += 1
            r.agreed = r.step
        self.timings.append(time.perf_counter() - began)
        return True

    def whole(self, weight):
        return self.point(weight)

    def _exchange(self, weight):
        r = self.replica
        changes = weighted([a - w for a, w in zip(r.anchor, r.weights, strict=True)], weight)
        self.mode.move_anchor(r.anchor, wire.packed(changes, "hvdtrain.exchange", r.mean))
        for w, a in zip(r.weights, r.anchor, strict=True):
            w.assign(a)
        wire.average_variables(r.state, "hvdtrain.exchange.state")

    def stop_agreed(self, mine, agree, at_point):
        """At the exchange points only: elsewhere a collective would hold the ranks in step
        (and under `--sync-balance` wait for steps another rank does not take)."""
        return agree(mine) if at_point else None

    def ready_to_commit(self, whole):
        """Where the ranks agree (the first exchange after a commit falls due)."""
        return self.in_agreement()

    def describe(self):
        return ""

    def figures(self):
        return {}
