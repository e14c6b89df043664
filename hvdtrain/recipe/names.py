"""One numbering of epochs and steps for people: hvdtrain's lines, its checkpoint folders'
names and the metrics JSON's `resumed_from` say it alike.

"epoch E, step S" is the S-th step of epoch E, both counted from 1. A checkpoint written after
it is the folder `epoch-000E-step-00000S`; one written at the end of epoch E is `epoch-000E`
(its last step: "epoch E, step <steps per epoch>"). Training resumes with the step after it:

    epoch-0002-step-000006    epoch 2, step 6 of 10 (global step 16): resumes with step 7
    epoch-0002                the end of epoch 2 (global step 20): resumes with epoch 3

Keras's own arguments count epochs from 0, as Keras does (a callback's `on_epoch_end(epoch)`,
`fit`'s `initial_epoch`, the metrics JSON's `initial_epoch`: the epochs done before), and a
checkpoint's manifest keeps `epoch` (the epochs done) and `step` (steps into the next).

Checkpoints of manifest formats 1 and 2 (before 2026-12) named a mid-epoch folder by the
epochs done (`epoch-0001-step-000013`: 13 steps into epoch 2); they are still found, ordered
and resumed by what their manifest says (`position_of`). No TensorFlow here: the launcher's
chaos reads the names too.
"""

import re

__all__ = ["NAME", "NAMED_BY_ITS_EPOCH", "folder_name", "position_of", "human", "describe"]

NAME = re.compile(r"^epoch-([0-9]{4,})(?:-step-([0-9]{6,}))?$")
NAMED_BY_ITS_EPOCH = 3  # the manifest format from which a mid-epoch folder names its epoch


def folder_name(done, step=0):
    """The folder of a checkpoint after `done` whole epochs and `step` steps of the next:
    `epoch-0002` (done=2), `epoch-0003-step-000006` (done=2, step=6)."""
    if step:
        return f"epoch-{done + 1:04d}-step-{step:06d}"
    return f"epoch-{done:04d}"


def position_of(name, format=NAMED_BY_ITS_EPOCH):
    """(epochs done, steps into the next) of checkpoint folder `name`, its manifest of
    `format` (the older formats named a mid-epoch folder by the epochs done); None for a
    name that is not a checkpoint's."""
    m = NAME.match(name)
    if not m:
        return None
    epoch, step = int(m.group(1)), int(m.group(2) or 0)
    if step and format >= NAMED_BY_ITS_EPOCH:
        return (epoch - 1, step) if epoch >= 1 else None
    return epoch, step


def human(global_step, steps):
    """(E, S): the epoch of the last step done (from 1) and its steps done, after
    `global_step` steps of `steps` per epoch; (0, 0) before the first."""
    if global_step <= 0:
        return 0, 0
    epoch, step = divmod(global_step, steps)
    return (epoch, steps) if step == 0 else (epoch + 1, step)


def describe(global_step, steps):
    """`epoch 2, step 6 of 10` or, at an epoch's end, `epoch 2`: where `global_step` steps
    of `steps` per epoch are."""
    epoch, step = human(global_step, steps)
    if step == steps or global_step <= 0:
        return f"epoch {epoch}"
    return f"epoch {epoch}, step {step} of {steps}"
