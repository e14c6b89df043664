"""`--sync step`, the default: the distributed optimizers average every step's gradients
(Horovod's way), so the exchange has nothing to do between steps."""

import tensorflow as tf

__all__ = ["EveryStep", "FirstSteps"]


class EveryStep:
    """The `Exchange` of `--sync step`: every rank holds the same weights after every step."""

    sync = "step"
    exchanges_rarely = False

    @classmethod
    def exchange(cls, cfg, averager):
        return cls()

    def configure(self, policy, steps_per_execution, sharing):
        return steps_per_execution

    def attach(self, model, optimizers):
        return {}

    def begin(self, start_step, lr_warmup_steps, end_step=None):
        pass

    def callbacks(self, steps_per_epoch, start_step, check):
        return [FirstSteps(check)] if check is not None else []

    def stop_agreed(self, mine, agree):
        return agree(mine)

    def before_checkpoint(self):
        pass

    def ready_to_commit(self):
        return True

    def describe(self):
        return ""

    def summary(self):
        return {"mode": self.sync}

    def rank_figures(self):
        return {}


class FirstSteps(tf.keras.callbacks.Callback):
    """`check("after the first steps")` once, after the run's first execution of steps."""

    def __init__(self, check):
        super().__init__()
        self.check, self.checked = check, False

    def on_train_batch_end(self, batch, logs=None):
        if not self.checked:
            self.checked = True
            self.check("after the first steps")
