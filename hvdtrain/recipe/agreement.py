"""The check that every rank holds the same trainable weights: a run whose ranks drift apart
stops, in one line, before a checkpoint of one rank's weights is written.

Data-parallel training keeps the ranks' weights identical only if every update is the same
on every rank: gradients averaged by a distributed optimizer, applied by it. A model whose
`train_step` updates weights another way drifts apart silently: nothing fails, and rank 0's
checkpoint is not the model that was trained. Usual causes: an optimizer hvdtrain did not
find (kept where it does not look: `hvdtrain.recipe.prepare`), a variable assigned in `train_step`
(outside any optimizer) from this rank's batch, or a random op seeded per rank that changes
weights.

`hvdtrain.fit` checks after the run's first execution of steps, at every epoch's end (before
the callbacks that write, and the checkpoint), before a mid-epoch checkpoint, and at the end:
a CRC-32 of each trainable variable on every rank, gathered (a few bytes per variable). In a
loop of your own::

    hvdtrain.check_weights_agree(model, "after epoch 3")   # every rank calls it
"""

import zlib

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdtrain.errors import HvdtrainError
from hvdtrain.runtime import watchdog

__all__ = ["RanksDisagree", "weights_checksums", "check_weights_agree", "WeightsAgreeCallback"]


class RanksDisagree(HvdtrainError):
    """The ranks hold different trainable weights: every rank stops (exit status 6) before
    anything is checkpointed from them."""

    exit_code = 6
    status = "ranks_disagree"  # in the metrics JSON


def weights_checksums(model):
    """[(variable name, CRC-32 of its bytes)] of the model's trainable variables, in order."""
    out = []
    for v in model.trainable_variables:
        name = getattr(v, "path", None) or v.name
        value = np.ascontiguousarray(np.asarray(v.numpy() if hasattr(v, "numpy") else v))
        out.append((name, zlib.crc32(value.tobytes())))
    return out


def check_weights_agree(model, when="now"):
    """Raises `RanksDisagree` on every rank unless every rank holds the same trainable
    weights as rank 0 (a collective: every rank calls it). `when` goes in the message."""
    if hvd.size() == 1:
        return
    mine = weights_checksums(model)
    watchdog.doing(f"comparing the ranks' weights {when}", watchdog.OTHER_RANKS)
    gathered = hvd.allgather_object([c for _, c in mine], name="hvdtrain.weights_agree")
    differ = sorted(
        {
            i
            for sums in gathered[1:]
            for i, (a, b) in enumerate(zip(gathered[0], sums, strict=False))
            if a != b
        }
    )
    lengths = {len(sums) for sums in gathered}
    if not differ and len(lengths) == 1:
        return
    ranks = [r for r, sums in enumerate(gathered) if sums != gathered[0]]
    if len(lengths) > 1:
        what = f"different numbers of trainable variables ({', '.join(map(str, sorted(lengths)))})"
    else:
        names = [mine[i][0] for i in differ]
        shown = ", ".join(repr(n) for n in names[:3])
        shown += f" and {len(names) - 3} more" if len(names) > 3 else ""
        what = f"{len(names)} of {len(mine)} trainable variables differ ({shown})"
    raise RanksDisagree(
        f"the ranks hold different weights {when}: rank(s) {', '.join(map(str, ranks))} differ "
        f"from rank 0 ({what}); stopped on every rank before any checkpoint of them. Usual "
        "causes: an optimizer hvdtrain did not distribute (kept where it does not look: in "
        "model.optimizer or an attribute of the model, or a list, tuple or dict there), a "
        "variable updated in train_step outside any optimizer (assign from this rank's "
        "batch), or a random op seeded per rank that changes weights. See 'Models that "
        "customize fit' in docs/your-model.md."
    )


class WeightsAgreeCallback(tf.keras.callbacks.Callback):
    """`check_weights_agree` after the first execution of steps of the run (not of each
    `fit`; unless `first_steps` is False: the ranks of `--sync local` differ there) and at
    every epoch's end. Put it before the callbacks that write or checkpoint."""

    def __init__(self, first_steps=True):
        super().__init__()
        self.checked_first = not first_steps

    def on_train_batch_end(self, batch, logs=None):
        if not self.checked_first:
            self.checked_first = True
            check_weights_agree(self.model, "after the first steps")

    def on_epoch_end(self, epoch, logs=None):
        check_weights_agree(self.model, f"at the end of epoch {epoch + 1}")
