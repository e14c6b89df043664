"""`Exchange`: what the recipe asks of how the ranks exchange, in the order it asks it."""

from typing import Protocol

__all__ = ["Exchange"]


class Exchange(Protocol):
    """The interface of every mode's exchange (`EveryStep`, `Rounds`). The recipe calls, in
    order: `configure` before the model's optimizers are distributed, `attach` once they
    are, `begin` at every (re)start, `callbacks` for each Keras `fit`, `stop_agreed` where a
    callback asks to stop, `before_checkpoint` before every checkpoint,
    `ready_to_commit` where an elastic commit is due; and `describe`, `summary` and
    `rank_figures` for the run's first line and its metrics JSON."""

    exchanges_rarely: bool  # the ranks meet every few steps only: Horovod's longer cycle

    def configure(self, policy, steps_per_execution, sharing):
        """Refuses a mixed-precision `policy` it cannot train with (one line); keeps the
        epoch's `sharing` (`hvdtrain.data.shares`); returns the steps per execution the
        run takes, from `steps_per_execution`."""

    def attach(self, model, optimizers):
        """Takes hold of `model` and its distributed `optimizers`; returns {name: the state
        it keeps beside them}, checkpointed, broadcast and committed with them."""

    def begin(self, start_step, lr_warmup_steps, end_step=None):
        """At every (re)start, once every rank holds the same weights; `end_step`: the run's
        last global step (None: unknown)."""

    def callbacks(self, steps_per_epoch, start_step, check):
        """The Keras callbacks that drive it, first among `fit`'s: `check(when)` is the check
        that the ranks hold the same weights, to call where they first should."""

    def stop_agreed(self, mine, agree):
        """Within an epoch, after an execution (every rank): whether the ranks agree to stop,
        `mine` this rank's ask; `agree(mine)` is a collective saying whether any rank asked.
        None: not here (the ask is held to a later point)."""

    def before_checkpoint(self):
        """Every rank, before every checkpoint (mid-epoch, or at an epoch's end after its
        callbacks): the ranks' whole state made one, the optimizers' included."""

    def ready_to_commit(self):
        """Every rank, where an elastic commit is due: True when the ranks hold one model
        and may commit here; False to wait for a later step."""

    def describe(self):
        """Its part of the run's first line ("" for none)."""

    def summary(self):
        """The metrics JSON's `sync` section."""

    def rank_figures(self):
        """This rank's own figures, for the metrics JSON's `ranks`."""
