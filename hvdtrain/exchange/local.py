"""`--sync local`: post-local SGD (Lin et al., 2020). Each rank takes H steps on its own
between exchanges that set every rank's weights to the ranks' mean."""

from hvdtrain.exchange.rounds import Rounds

__all__ = ["LocalSGD"]


class LocalSGD:
    """The mode of `--sync local`: an exchange moves the anchor by the ranks' mean change,
    anchor - mean(anchor - weights), which is the ranks' mean weights. Its synchronous
    warmup is the learning rate's unless `--sync-warmup-steps` says."""

    sync = "local"
    name = "local SGD"

    @classmethod
    def exchange(cls, cfg, averager):
        return Rounds(cfg, cls(cfg), averager())

    def __init__(self, cfg):
        pass

    def attach(self, replica):
        """Once the exchange holds the model (`Replica`)."""

    def begin(self, ranks, every, exchanges=None):
        """At every (re)start, and where H changes (`--sync-every auto`): the job's number of
        `ranks`, H, and the run's number of exchanges (None: unknown)."""

    def holders(self):
        """{name: the state it keeps beside the model}: none."""
        return {}

    def default_warmup(self, lr_warmup_steps):
        """Synchronous steps first unless `--sync-warmup-steps` says: the learning rate's."""
        return lr_warmup_steps

    def move_anchor(self, anchor, mean):
        """The anchor moved by the ranks' `mean` change (in place)."""
        for a, d in zip(anchor, mean, strict=True):
            a.assign_sub(d)

    def stand_in(self, anchor, own):
        """Where `move_anchor` would put the anchor if this rank's change `own` were the
        ranks' mean (the overlap's eager update: `InFlight`)."""
        return [a - d for a, d in zip(anchor, own, strict=True)]

    def describe(self):
        return ""

    def summary(self):
        return {"outer_lr": None, "outer_lr_from": None, "outer_momentum": None,
                "outer_momentum_from": None}  # fmt: skip
