"""How the ranks exchange (`--sync`): a mode, holding an averager, that the recipe
(`hvdtrain.recipe.trainer`) calls through the `Exchange` interface (`protocol.py`) without
asking which it holds, as PyTorch's DDP calls its communication hook::

    hvdtrain-run -np 4 -- python train.py                                 # --sync step
    hvdtrain-run -np 4 -- python train.py --sync local --sync-every 16    # post-local SGD
    hvdtrain-run -np 4 -- python train.py --sync diloco --sync-overlap    # DiLoCo, overlapped

A mode says what is averaged and when (`MODES`):

- `step` (`EveryStep`, the default): the distributed optimizers average the gradients at
  every step, as Horovod does; nothing is left to do between steps.
- `local` (`LocalSGD`) and `diloco` (`DiLoCo`): each rank takes H steps on its own between
  exchanges of weights (`Rounds`: the gate, the warmup, where exchanges fall); an exchange
  sets the ranks to their mean (`local`) or gives the mean change to an outer Nesterov step
  (`diloco`).

An averager says how the mean is made (`AVERAGERS`, `--sync-overlap`): `Blocking`, the steps
waiting for it, or `InFlight`, one exchange in flight while the next round's steps run, its
mean landing at the next exchange point with the delay corrected ("eager updates").

How an epoch's batches are shared between the ranks (equal, or by speed under
`--sync-balance`) is the data's side (`hvdtrain.data.shares`): the exchange asks it where its
exchanges fall. A new mode or averager is one new class in this folder and one line in its
table (docs/development.md shows how).
"""

from hvdtrain.exchange.blocking import Blocking
from hvdtrain.exchange.diloco import DiLoCo, outer_step
from hvdtrain.exchange.inflight import InFlight
from hvdtrain.exchange.local import LocalSGD
from hvdtrain.exchange.protocol import Exchange
from hvdtrain.exchange.rounds import Rounds, exchange_due, fitting_steps_per_execution
from hvdtrain.exchange.step import EveryStep

__all__ = [
    "Exchange",
    "EveryStep",
    "Rounds",
    "LocalSGD",
    "DiLoCo",
    "Blocking",
    "InFlight",
    "MODES",
    "AVERAGERS",
    "for_config",
    "outer_step",
    "exchange_due",
    "fitting_steps_per_execution",
]

MODES = {"step": EveryStep, "local": LocalSGD, "diloco": DiLoCo}  # --sync
AVERAGERS = {False: Blocking, True: InFlight}  # --sync-overlap


def for_config(cfg):
    """The `Exchange` of `cfg` (a `TrainConfig`): its mode's, holding the averager of
    `cfg.overlapped`. The one place a mode's name picks its class."""
    return MODES[cfg.sync].exchange(cfg, AVERAGERS[cfg.overlapped])
