"""Each rank's share of an epoch under `--sync-balance`: steps in proportion to its speed.

With equal shares, the ranks of `--sync local/diloco` take the same steps between two
exchanges, and the faster rank waits at each exchange for the slower one. Balanced, the
epoch's batches (the same ones, each trained once) are shared out unequally: a rank that took
t seconds a step in the last epoch takes steps in proportion to 1/t in the next. Every rank
still makes the same exchanges, at the same points of the epoch: rank r takes h_r steps
between two (sum h_r = H x ranks), and its part of the epoch's last, shorter round in the
same proportion. The ranks agree on the shares at each epoch's whole exchange, where they
gather their step times; the first epoch, and any epoch with a synchronous step, is shared
equally.

Pure functions and a small state object; `hvdtrain.exchange` holds one per balanced run.
"""

import dataclasses
import math

from hvdtrain.errors import invalid_value

__all__ = ["Share", "split", "plan_epoch", "Balance"]


@dataclasses.dataclass(frozen=True)
class Share:
    """One rank's part of one epoch: `steps` batches from batch `first` of the epoch's order
    (each batch of the epoch on one rank), an exchange after every `every` steps up to
    `last_point`, and one at its end. Its change since the last exchange counts for its
    steps: x `weight` (its steps in a round over an equal share's), x `last_weight` in the
    epoch's last round; the ranks' average of those is their changes' mean weighted by
    steps."""

    first: int
    steps: int
    every: int
    last_point: int
    weight: float = 1.0
    last_weight: float = 1.0

    def exchange_due(self, step_in_epoch):
        """True after the `step_in_epoch`-th step (1-based) if the ranks exchange there."""
        if step_in_epoch >= self.steps:
            return True
        return step_in_epoch % self.every == 0 and step_in_epoch <= self.last_point

    def weight_at(self, step_in_epoch):
        """The weight of the round that ends after the `step_in_epoch`-th step."""
        return self.weight if step_in_epoch <= self.last_point else self.last_weight


def split(total, weights, unit=1, minimum=1):
    """`total` (a multiple of `unit`) in integer parts in proportion to `weights`, each a
    multiple of `unit` and at least `minimum` units; largest remainders first. Pure."""
    n = len(weights)
    if total % unit or total < n * minimum * unit:
        raise invalid_value("total", total, f"a multiple of {unit}, at least {n * minimum * unit}")
    units = total // unit
    free = units - n * minimum
    scale = sum(weights)
    exact = [free * w / scale for w in weights]
    parts = [math.floor(e) for e in exact]
    order = sorted(range(n), key=lambda i: (parts[i] - exact[i], i))
    for i in order[: free - sum(parts)]:
        parts[i] += 1
    return [(p + minimum) * unit for p in parts]


def plan_epoch(steps, every, speeds, unit=1):
    """Every rank's `Share` of an epoch of `steps` steps a rank (equal shares) with an
    exchange after every `every` steps and at the end, `speeds` (steps per second, one a
    rank) setting the proportions; steps between exchanges in multiples of `unit` (the
    steps per execution, which divides `every`). Pure."""
    ranks = len(speeds)
    rounds = math.ceil(steps / every)
    last = steps - (rounds - 1) * every  # the last round's steps, 1 to `every`
    per_round = split(every * ranks, speeds, unit) if rounds > 1 else [0] * ranks
    in_last = split(last * ranks, speeds)
    shares, first = [], 0
    for h, tail in zip(per_round, in_last, strict=True):
        n = (rounds - 1) * h + tail
        weight = h / every if h else tail / last  # (one round: the last one's)
        shares.append(Share(first, n, h or n, (rounds - 1) * h, weight, tail / last))
        first += n
    return shares


class Balance:
    """A run's shares: equal until the ranks have timed an epoch of local steps, then each
    epoch's from the last one's step times (`measured`)."""

    def __init__(self):
        self.speeds = None  # steps per second, one a rank, from the last timed epoch
        self.steps = []  # this rank's steps in each balanced epoch (the metrics JSON)

    def share(self, rank, steps, every, unit):
        """This rank's `Share` of the next epoch, or None for equal shares."""
        if self.speeds is None or len(self.speeds) <= rank:
            return None
        share = plan_epoch(steps, every, self.speeds, unit)[rank]
        self.steps.append(share.steps)
        return share

    def measured(self, speeds):
        """The ranks' gathered steps per second of the epoch just ended (None: not timed)."""
        if speeds and all(s and s > 0 for s in speeds):
            self.speeds = list(speeds)
        else:
            self.speeds = None
