"""`--sync-every auto`: H chosen by measurement, so that the exchange hides behind the steps.

    hvdtrain-run --hostfile hosts.txt -- python train.py --sync local --sync-every auto

The run starts at the smallest candidate H (a multiple of its steps per execution, 16 by
default) of more than one execution (32 by default) and times what it does: each local
step (Keras's executions, the first of an epoch left out) and each exchange (blocking: the
steps' wait for it; overlapped: the exchange's own time in its thread). Under the overlap
a step is timed apart while an exchange is in flight beside it, sharing the CPU with it
(the convnet's step on this machine: 62 ms alone, 115 ms beside one): the rule takes the
steps timed alone (those beside one where none ran alone), since a step slowed by the
exchange makes the exchange look shorter than the round it costs.
After its first `PROBE` exchanges, and again at an epoch's end once `PROBE` more are timed
(unless `--deterministic`), the ranks agree on what an exchange costs, in steps: the
smallest of their ratios of its time to a step's (the rank that reaches an exchange last
waits for the wire alone, the others for it too: a rank slower than another by a share of
its steps stays so at any H), and the most steps' time that an exchange in flight takes
from the steps beside it. They take the smallest H for which

- blocking: the exchange is at most `MARGINS[False]` (5 %) of a round (H steps and it): the
  run keeps 0.95 of its steps' pace, the target over a 1 Gbit/s link (issue 71);
- overlapped: the exchange in flight takes at most `MARGINS[True]` (75 %) of a round's
  steps (the rest is left to the steps' variation), and what it costs the steps is at most
  `MARGINS[False]` of a round, as a blocking exchange's wait is: their wait at each exchange
  point (its own work: sending the change, landing the last mean) and the time it takes
  from the steps beside it (on a rank's one core its copies and reductions share the CPU
  with them: what the executions beside it took over the same steps alone, per exchange;
  where every step ran beside one, as in rounds of one execution, what was timed last),

up to `CAP`, which the accuracy tables of docs/exchanging-less.md set; where no H fits, the
cap is taken and the run says so. A revisit takes a smaller H than the one in force only
where it fits within `STAY` of the margins, so that noise does not move H back and forth.
The H in force is checkpointed (a resume goes on with it) and reported on rank 0 as it is
chosen and in the metrics JSON (`sync.auto`).
"""

import statistics

__all__ = ["AutoEvery", "CAP", "MARGINS", "PROBE", "STAY", "candidates", "choose"]

CAP = 256  # the largest H auto takes (docs/exchanging-less.md, "Accuracy at the H a link needs")
MARGINS = {False: 0.05, True: 0.75}  # {overlapped: the share of a round the exchange may take}
PROBE = 3  # exchanges timed before the first choice
# A revisit takes an H smaller than the one in force only where its exchange fits within this
# share of the margins: one job's exchange and steps vary by 10-20 %, and H moved on that
# (64, 32, 32; 32, 64, 16, 16 on 2026-12-07), each move costing a trace.
STAY = 0.75
SMALLEST = 4  # below it, `--sync step` exchanges as little per sample at no loss


def candidates(unit, cap=CAP):
    """The H auto chooses from: powers of two times `unit` (the steps per execution: the
    ranks exchange at an execution's end), from `SMALLEST` (or `unit`) to `cap`. Pure."""
    h = unit
    while h < SMALLEST:
        h *= 2
    out = [h]
    while out[-1] * 2 <= cap:
        out.append(out[-1] * 2)
    return out


def choose(ratio, options, overlap, blocked=0.0, slowed=0.0, current=None):
    """(the smallest H of `options` whose exchange fits, whether none did and the largest
    was taken) for an exchange of `ratio` steps' time (overlapped: in flight, `blocked`
    steps' time of it that the steps wait for at its point, and `slowed` steps' time it
    takes from the steps beside it). An H smaller than the `current` one must fit within
    `STAY` of the margins: a revisit keeps H where only noise moved. Pure."""
    wait = ratio if not overlap else blocked + slowed
    for h in options:
        share = STAY if current is not None and h < current else 1.0
        blocks = wait <= share * MARGINS[False] / (1 - MARGINS[False]) * h
        if blocks and (not overlap or ratio <= share * MARGINS[True] * h):
            return h, False
    return options[-1], True


class AutoEvery:
    """The measurements and choices of one run's `--sync-every auto` (see the module).

    Args:
        overlap: whether the exchange is in flight (`--sync-overlap`).
        revisit: choose again at every epoch's end (not under `--deterministic`).
    """

    def __init__(self, overlap, revisit):
        self.overlap, self.revisit = bool(overlap), bool(revisit)
        self.options = []  # the candidates, by `start`
        self.step_seconds = []  # a local step's seconds, per execution timed since the choice
        self.beside_seconds = []  # the same, of executions beside an exchange in flight
        self.beside_steps = []  # the steps of each of those executions
        self.exchange_seconds = []  # each exchange's seconds since the last choice
        self.blocked_seconds = []  # overlapped: the steps' wait at each exchange point
        self.slowed = 0.0  # the steps' time an exchange in flight took, in steps, last timed
        self.chosen = None  # the H in force once measured, else None
        self.measured = None  # what the last choice was made from
        self.capped = False  # whether no H fitted and the cap was taken
        self.choices = []  # [[global step, H]] of every choice

    def start(self, unit):
        """The candidates for executions of `unit` steps; returns the H to start from: the
        smallest candidate of more than one execution, so that a step may run with no
        exchange beside it and the exchange's cost to the steps beside it be timed."""
        self.options = candidates(unit)
        longer = [h for h in self.options if h > unit]
        return self.chosen or (longer or self.options)[0]

    def due(self, epoch_end):
        """Whether to choose now (the same on every rank: it counts exchanges only)."""
        if not self.exchange_seconds:
            return False
        if self.chosen is None:
            return epoch_end or len(self.exchange_seconds) >= PROBE
        # Not on one exchange's time: a choice that moves H on noise costs a trace.
        return epoch_end and self.revisit and len(self.exchange_seconds) >= PROBE

    def time_steps(self, seconds, beside, steps=1):
        """An execution's `seconds` per step of its `steps`; `beside`: an exchange was in
        flight during it."""
        (self.beside_seconds if beside else self.step_seconds).append(seconds)
        if beside:
            self.beside_steps.append(steps)

    def choose(self, agree_max, step):
        """The H the ranks agree on (`agree_max(xs)`: a collective, the largest of each x of
        all ranks), from what was timed since the last choice; then timed anew."""
        exchange = statistics.median(self.exchange_seconds)
        blocked = statistics.median(self.blocked_seconds) if self.blocked_seconds else 0.0
        steps = self.step_seconds or self.beside_seconds
        own = statistics.median(steps) if steps else 0.0
        beside = statistics.median(self.beside_seconds) if self.beside_seconds else 0.0
        # What an exchange in flight takes from the steps beside it, in steps: what the
        # executions beside one took over the same steps alone, per exchange (timed where
        # steps ran both alone and beside one; where every step ran beside one, as in a
        # round of one execution, what was timed last). Not the exchange's time x a share:
        # an exchange starved of the CPU by the steps runs long and takes little from them.
        if self.step_seconds and self.beside_seconds and own > 0:
            lost = sum(  # (signed: the executions' noise cancels, it does not add up)
                (s - own) * n for s, n in zip(self.beside_seconds, self.beside_steps, strict=True)
            )
            self.slowed = max(0.0, lost) / own / len(self.exchange_seconds)
        ratios = [x / own if own > 0 else float(self.options[-1]) for x in (exchange, blocked)]
        agreed = [float(x) for x in agree_max([-ratios[0], -ratios[1], self.slowed])]
        ratio, blocked_ratio, slowed_ratio = -agreed[0], -agreed[1], agreed[2]  # (-max(-x))
        h, self.capped = choose(
            ratio, self.options, self.overlap, blocked_ratio, slowed_ratio, self.chosen
        )
        self.measured = {
            "exchange_seconds": round(exchange, 5),
            "step_seconds": round(own, 6),
            "steps_alone": bool(self.step_seconds),  # False: timed beside an exchange
            "ratio": round(ratio, 3),
            "exchanges": len(self.exchange_seconds),
        }
        if self.overlap:
            self.measured.update(
                blocked_seconds=round(blocked, 5),
                blocked_ratio=round(blocked_ratio, 3),
                beside_seconds=round(beside, 6),  # a step's, beside an exchange in flight
                slowed_ratio=round(slowed_ratio, 3),  # the steps' time an exchange takes
            )
        self.chosen = h
        self.choices.append([int(step), h])
        self.step_seconds, self.beside_seconds, self.beside_steps = [], [], []
        self.exchange_seconds, self.blocked_seconds = [], []
        return h

    def said(self, before):
        """The line of the last choice (`before`: the H it replaced): what was measured, and
        the H chosen."""
        m, h = self.measured, self.chosen
        out = f"an exchange {1000 * m['exchange_seconds']:.1f} ms"
        if self.overlap:
            out += f", waited {1000 * m['blocked_seconds']:.1f} ms"
            if m["slowed_ratio"]:
                out += f", a step beside it {1000 * m['beside_seconds']:.2f} ms"
        out += f", a step {1000 * m['step_seconds']:.2f} ms ({m['ratio']:.1f} steps): H={h}"
        if h != before:
            out += f" (was {before})"
        return out + (f"; no H up to {h} hides it (the cap)" if self.capped else "")

    def summary(self):
        return {
            "chosen": self.chosen,
            "measured": self.measured,
            "margin": MARGINS[self.overlap],
            "candidates": self.options,
            "cap": CAP,
            "capped": self.capped,
            "revisited": self.revisit,
            "choices": self.choices,
        }
