"""Each rank's share of an epoch under `--sync-balance`: steps in proportion to its speed.

With equal shares, the ranks of `--sync local/diloco` take the same steps between two
exchanges, and the faster rank waits at each exchange for the slower one. Balanced, the
epoch's batches (the same ones, each trained once) are shared out unequally: a rank that took
t seconds a step in the last epoch takes steps in proportion to 1/t in the next. Every rank
still makes the same exchanges: rank r's k-th exchange falls k x H x s_r / S steps into its
s_r steps (S: an equal share), on an execution's end. The ranks agree on the shares at each
epoch's whole exchange, where they gather their step times; the first epoch, and any epoch
with a synchronous step, is shared equally.

Pure functions and two small state objects: the recipe asks the run's one (`for_config`) for
each epoch's batches, and the exchange asks it where its exchanges fall.
"""

import bisect
import dataclasses
import math

from hvdtrain.errors import invalid_value

__all__ = ["Share", "split", "plan_epoch", "for_config", "EqualShares", "Balance"]


@dataclasses.dataclass(frozen=True)
class Share:
    """One rank's part of one epoch: `steps` batches from batch `first` of the epoch's order
    (each batch of the epoch on one rank), exchanges after the steps of `points` (the last
    is `steps`). Its change since the last exchange counts for its steps in that round:
    x its `weights` entry (ranks x its steps / all ranks' steps in the round), so that the
    ranks' average is their changes' mean weighted by steps."""

    first: int
    steps: int
    points: tuple
    weights: tuple

    def exchange_due(self, step_in_epoch):
        """True after the `step_in_epoch`-th step (1-based) if the ranks exchange there."""
        return step_in_epoch >= self.steps or step_in_epoch in self.points

    def weight_at(self, step_in_epoch):
        """The weight of the round that ends after the `step_in_epoch`-th step."""
        return self.weights[
            min(bisect.bisect_left(self.points, step_in_epoch), len(self.points) - 1)
        ]


def split(total, weights):
    """`total` in integer parts in proportion to `weights`, largest remainders first. Pure."""
    exact = [total * w / sum(weights) for w in weights]
    parts = [math.floor(e) for e in exact]
    order = sorted(range(len(parts)), key=lambda i: (parts[i] - exact[i], i))
    for i in order[: total - sum(parts)]:
        parts[i] += 1
    return parts


def plan_epoch(steps, every, speeds, unit=1):
    """Every rank's `Share` of an epoch of `steps` steps a rank (equal shares) with an
    exchange after every `every` steps and at its end, `speeds` (steps per second, one a
    rank) setting the proportions. Rank r takes s_r steps in proportion to its speed; its
    k-th exchange falls at k x every x s_r / steps, on an execution's end (a multiple of
    `unit`, the steps per execution, which divides `every`): every rank exchanges as often,
    its rounds a step of `unit` longer or shorter than its share, and the epoch's total
    its share within one step. Pure."""
    ranks = len(speeds)
    rounds = math.ceil(steps / every)
    # At least one execution a round: a mid-epoch exchange on an execution's end.
    least = max(rounds, math.ceil(steps * unit / every)) if rounds > 1 else 1
    totals = split(steps * ranks, speeds)
    for r in range(ranks):  # the slowest raised to the least, from the largest share
        short = least - totals[r]
        if short > 0:
            totals[r] += short
            totals[max(range(ranks), key=totals.__getitem__)] -= short
    points = []
    for s in totals:
        mids = [unit * round(k * every * s / (steps * unit)) for k in range(1, rounds)]
        mids = [min(p, unit * ((s - 1) // unit)) for p in mids]  # before its end
        points.append((*mids, s))
    lengths = [[b - a for a, b in zip((0, *p), p, strict=False)] for p in points]  # rounds
    per_round = [sum(column) for column in zip(*lengths, strict=True)]
    shares, first = [], 0
    for s, p, own in zip(totals, points, lengths, strict=True):
        weights = tuple(ranks * m / n for m, n in zip(own, per_round, strict=True))
        shares.append(Share(first, s, p, weights))
        first += s
    return shares


def for_config(cfg):
    """The run's sharing of each epoch between the ranks: `Balance` under `--sync-balance`,
    else `EqualShares`."""
    return Balance() if cfg.sync_balance else EqualShares()


class EqualShares:
    """Every rank's equal shard of each epoch (no `--sync-balance`): what the recipe asks for
    an epoch's batches (`train_dataset`), and the exchange for where its exchanges fall
    (`exchange_due`, `weight_at`), answered the usual way; nothing to time."""

    per_epoch = False  # the recipe need not call Keras's `fit` once per epoch
    steps = ()  # this rank's steps in each balanced epoch: none
    current = None  # this rank's `Share` of the current epoch; None: its equal shard

    def check(self, data):
        """Refuses, in one line, data it cannot share out."""

    def execution_steps(self, default, every):
        """The steps per execution to fit to H, from `default`."""
        return default

    def plan(self, every, unit, from_step):
        """Exchanges every `every` steps, on executions of `unit` steps; shares by speed (if
        any) from global step `from_step` (the synchronous warmup's end) on."""

    def train_dataset(self, data, batch_size, placement, *, seed, first, steps, epochs, todo):
        """(this rank's batches of `fit`'s epochs from global step `first`, their steps in the
        first epoch); `steps` a rank in an equal share, `todo` of them left in this epoch."""
        self.current = None
        ds = data.train_dataset(
            batch_size, placement, seed=seed, start_step=first, steps=steps, epochs=epochs
        )
        return ds, todo

    def rank_steps(self):
        """This rank's steps in the current epoch where its share is not equal, else None."""
        return self.current.steps if self.current is not None else None

    def exchange_due(self, step_in_epoch, steps_per_epoch, every):
        """True where an exchange falls after the `step_in_epoch`-th step of this epoch."""
        if self.current is not None:
            return self.current.exchange_due(step_in_epoch)
        return step_in_epoch % every == 0 or step_in_epoch >= steps_per_epoch

    def weight_at(self, step_in_epoch):
        """The weight of this rank's change in the round that ends after `step_in_epoch`
        (its steps against the ranks' mean), or None where the ranks' rounds are equal."""
        return self.current.weight_at(step_in_epoch) if self.current is not None else None

    def begin_epoch(self, timed):
        """At an epoch's start; `timed`: whether its steps count for the next shares."""

    def clock(self, step_in_epoch, seconds):
        """After each execution: its `seconds`, and the step of the epoch it ended at."""

    def gather(self, allgather):
        """At an epoch's end, on every rank alike: the ranks' speeds gathered (`allgather`:
        one float of this rank -> every rank's), where the shares need them."""


class Balance(EqualShares):
    """`--sync-balance`: equal shares until the ranks have timed an epoch of local steps,
    then each epoch's in proportion to the last one's speeds: the median time a step of its
    executions (Keras's start of one to its end: no callback, no exchange, no other rank's
    wait), the epoch's first execution (tracing, the data's first batch) left out."""

    per_epoch = True  # each epoch's shares are planned at its start: one `fit` an epoch

    def __init__(self):
        self.speeds = None  # steps per second, one a rank, from the last timed epoch
        self.steps = []  # this rank's steps in each balanced epoch (the metrics JSON)
        self.current = None
        self.every, self.unit, self.from_step = 1, 1, 0
        self._timed, self._last, self._times = False, None, []

    def check(self, data):
        if not data.shares:
            raise invalid_value(
                "--sync-balance",
                True,
                "data in memory (arrays, `hvdtrain.ArrayData`), batches by index (a "
                "`Sequence` or `PyDataset` in `hvdtrain.BatchData`) or files every rank lists "
                f"(`hvdtrain.FileData` without per_host): {data.describe()} is sharded by "
                "rank, in equal parts; leave --sync-balance out for it",
            )

    def execution_steps(self, default, every):
        """At most a quarter of H: rounds that differ by less than H."""
        return min(default, max(1, every // 4))

    def plan(self, every, unit, from_step):
        self.every, self.unit, self.from_step = every, unit, from_step

    def train_dataset(self, data, batch_size, placement, *, seed, first, steps, epochs, todo):
        """An epoch that starts past the warmup, once the ranks have timed one: this rank's
        run of the epoch's batches, in proportion to its speed (one epoch a `fit`)."""
        self.current = None
        epoch = first // steps
        if first % steps or first < self.from_step or self.speeds is None:
            return super().train_dataset(
                data, batch_size, placement, seed=seed, first=first, steps=steps, epochs=epochs,
                todo=todo,
            )  # fmt: skip
        self.current = share = plan_epoch(steps, self.every, self.speeds, self.unit)[placement.rank]
        self.steps.append(share.steps)
        ds = data.train_share(batch_size, seed=seed, epoch=epoch, first=share.first,
                              steps=share.steps)  # fmt: skip
        return ds, share.steps

    def begin_epoch(self, timed):
        self._timed, self._last, self._times = timed, None, []

    def clock(self, step_in_epoch, seconds):
        if not self._timed:
            return
        if self._last is not None and step_in_epoch > self._last:
            self._times.append(seconds / (step_in_epoch - self._last))
        self._last = step_in_epoch

    def gather(self, allgather):
        times = sorted(self._times)
        median = times[len(times) // 2] if times else 0.0
        # 0: not timed (synchronous steps, or one execution), and equal shares next
        speeds = allgather(1 / median if median > 0 else 0.0)
        self.speeds = list(speeds) if all(s > 0 for s in speeds) else None
        self._timed, self._last, self._times = False, None, []
