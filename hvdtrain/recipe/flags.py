"""A run's options: `TrainConfig`, and the one argument parser that gives a script hvdtrain's
standard flags.

    parser = hvdtrain.ArgumentParser(description=__doc__, epochs=10, batch_size=64)
    parser.add_argument("--data", default="data/")          # your own flags beside them
    args = parser.parse_args()                             # checked: a bad value is one line
    hvdtrain.fit(build_model, data, args)

    horovodrun -np 4 python train.py --epochs 5 --checkpoint-dir ckpt --metrics-json m.json

No TensorFlow here: the launcher and the benchmark use the same parser class (with
`training=False`), and a bad flag fails before TensorFlow loads.
"""

import argparse
import dataclasses
import math
import os
import sys

from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.runtime.numbers import whole_number, whole_number_type
from hvdtrain.runtime.uncaught import report_uncaught

__all__ = ["ArgumentParser", "TrainConfig", "make_config", "PROGRESS", "SYNC_MODES"]

PROGRESS = ("auto", "bar", "lines", "off")
SYNC_MODES = ("step", "local", "diloco")
SYNC_EVERY = 16  # --sync-every's default under --sync local/diloco
AUTO = "auto"  # --sync-every auto: H chosen by measurement (`hvdtrain.exchange.auto`)
OUTER = ("outer_lr", "outer_momentum")  # DiLoCo's outer Nesterov SGD (exchange.outer_step)
# The whole-number fields: (minimum, maximum, whether the maximum is hvdtrain's guard
# against a typo rather than a limit of the thing). Their flags read the digits 0-9 only.
WHOLE_NUMBERS = {
    "epochs": (1, None, False),
    "batch_size": (1, None, False),
    "seed": (0, 2**31 - 1, False),  # numpy's seed range
    "limit_samples": (1, None, False),
    "threads": (1, 4096, True),  # per rank
    "accumulate": (1, None, False),
    "steps_per_execution": (1, None, False),
    "keep_checkpoints": (1, None, False),
    "checkpoint_every": (0, None, False),
    "eval_batch_size": (1, None, False),
    "commit_every": (1, None, False),
    "sync_every": (1, None, False),
    "sync_warmup_steps": (0, None, False),
}
_SYNC_NUMBERS = ("sync_every", "sync_warmup_steps")  # checked with --sync (`_check_sync`)


@dataclasses.dataclass
class TrainConfig:
    """Everything `hvdtrain.fit` can be told; each field is also a flag (`--batch-size`).

    Args:
        epochs: epochs in all (a resumed run trains the rest).
        batch_size: per-rank batch; the global batch is ranks x this.
        lr: the single-worker learning rate; None keeps the one of the optimizer given to
            `compile` in `build_model`. It rises to lr x ranks over `warmup_epochs`.
        warmup_epochs: epochs of the linear warmup from lr to lr x ranks (0: none).
        seed: the random seed (shuffling, initial weights; + rank for dropout).
        limit_samples: train on the first N samples only (in-memory arrays).
        threads: CPU threads per rank (default: the host's cores / local ranks).
        mixed_precision: None, "auto", "float16" or "bfloat16" (loss scaling for float16).
        fp16_allreduce: send gradients as float16 (half the bytes; changes the math slightly).
        accumulate: average the gradients of N local batches before each allreduce.
        steps_per_execution: training steps per call into TensorFlow; None: 16, or 1 when
            something acts on every step (`checkpoint_every`, `deterministic`).
        checkpoint_dir: checkpoints (rank 0) and resume from the newest valid one.
        keep_checkpoints: how many complete checkpoints to keep.
        require_resume: refuse to start from scratch: an error (exit 2) when
            `checkpoint_dir` holds no usable checkpoint.
        checkpoint_every: also checkpoint every N steps mid-epoch (0: epoch ends only).
        deterministic: deterministic ops and per-step random seeds: a killed and resumed run
            ends with the same weights as an uninterrupted one (bitwise on CPU); Horovod's
            tensor fusion off.
        metrics_json: rank 0 writes the run's figures here.
        log_dir: TensorBoard logs (rank 0).
        progress: "auto" (a bar on a terminal, else a line every `progress_seconds`), "bar",
            "lines" or "off"; rank 0 only.
        progress_seconds: seconds between progress lines in a log.
        eval_batch_size: per-rank batch for evaluation.
        elastic: train under Horovod Elastic (launch with `hvdtrain-run --elastic`).
        commit_every: steps between in-memory commits of an elastic run (with `sync`
            "local" or "diloco": at the first exchange after that many steps).
        sync: how the ranks exchange (`hvdtrain.exchange`): "step" averages the gradients
            of every step (the default); "local" (post-local SGD) and "diloco" let each rank
            take `sync_every` steps on its own between exchanges of weights.
        sync_every: H, the local steps between two exchanges (default 16), or "auto": the
            smallest H whose exchange fits in a round's steps, measured as the run goes
            (`hvdtrain.exchange.auto`).
        sync_warmup_steps: synchronous steps before the local ones (default: the learning
            rate's warmup under "local", none under "diloco").
        outer_lr: DiLoCo's outer learning rate (default: fitted to `sync_every` and the
            number of ranks, `hvdtrain.exchange.outer_step`).
        outer_momentum: DiLoCo's outer Nesterov momentum (default 0.9).
        sync_overlap: under "local" or "diloco", run each exchange while the next local
            steps do, its mean applied at the next exchange (default: on with
            `sync_every="auto"`, off with a fixed H: docs/exchanging-less.md, "Measured where
            the wire is the limit").
        sync_balance: under "local" or "diloco", share each epoch's batches out in
            proportion to the ranks' measured speeds, so that no rank waits at an exchange
            (`hvdtrain.data.shares`; default: off, equal shares).
    """

    epochs: int = 1
    batch_size: int = 32
    lr: float | None = None
    warmup_epochs: float = 1.0
    seed: int = 0
    limit_samples: int | None = None
    threads: int | None = None
    mixed_precision: str | None = None
    fp16_allreduce: bool = False
    accumulate: int = 1
    steps_per_execution: int | None = None
    checkpoint_dir: str | None = None
    keep_checkpoints: int = 2
    require_resume: bool = False
    checkpoint_every: int = 0
    deterministic: bool = False
    metrics_json: str | None = None
    log_dir: str | None = None
    progress: str = "auto"
    progress_seconds: float = 30.0
    eval_batch_size: int = 256
    elastic: bool = False
    commit_every: int = 10
    sync: str = "step"
    sync_every: int | str | None = None
    sync_warmup_steps: int | None = None
    outer_lr: float | None = None
    outer_momentum: float | None = None
    sync_overlap: bool | None = None
    sync_balance: bool | None = None

    def __post_init__(self):
        for name in WHOLE_NUMBERS:
            if name not in _SYNC_NUMBERS:
                _whole(self, name)
        if self.lr is not None and not (_number(self.lr) and 0 < self.lr < math.inf):
            raise invalid_value("--lr", self.lr, "a positive learning rate")
        if not (_number(self.warmup_epochs) and 0 <= self.warmup_epochs < math.inf):
            raise invalid_value("--warmup-epochs", self.warmup_epochs, "a number >= 0")
        if self.mixed_precision not in (None, "auto", "float16", "bfloat16"):
            raise invalid_value(
                "--mixed-precision", self.mixed_precision, "auto, float16 or bfloat16"
            )
        if self.progress not in PROGRESS:
            raise invalid_value("--progress", self.progress, ", ".join(PROGRESS))
        if not (_number(self.progress_seconds) and 0 < self.progress_seconds < math.inf):
            raise invalid_value("--progress-seconds", self.progress_seconds, "seconds > 0")
        if self.elastic and self.accumulate > 1:
            raise invalid_value("--accumulate", self.accumulate, "1 with --elastic")
        for name in ("metrics_json", "log_dir", "checkpoint_dir"):
            path = getattr(self, name)
            if path is not None and (not isinstance(path, str) or not path.strip()):
                raise invalid_value(_flag(name), path, "a path")
        if self.require_resume and not self.checkpoint_dir:
            raise invalid_value("--require-resume", True, "--checkpoint-dir with it")
        if self.metrics_json and os.path.isdir(self.metrics_json):
            raise invalid_value("--metrics-json", self.metrics_json, "a file path, not a folder")
        _check_sync(self)

    @property
    def exchange_every(self):
        """H under `--sync local/diloco`: `sync_every`, else its default (16); under `auto`
        the H it starts from."""
        return self.sync_every if self.sync_every not in (None, AUTO) else SYNC_EVERY

    @property
    def overlapped(self):
        """Whether the exchange runs in flight: `sync_overlap`, else on where H is chosen by
        measurement (`auto`: a run for a link slower than its steps) and off at a fixed H."""
        if self.sync_overlap is not None:
            return self.sync_overlap
        return self.sync_every == AUTO

    def float16_refused(self):
        """The refusal of float16 (loss scaling) under `--sync local/diloco`: raised here for
        the flag, and by the exchange for `auto`, which picks float16 on a GPU."""
        return invalid_value(
            "--mixed-precision",
            self.mixed_precision,
            f"bfloat16 with --sync {self.sync}: float16's loss scaling is agreed through the "
            "gradients' exchange, which its local steps skip",
        )


def _check_sync(c):
    """The one-line refusals of `--sync` and its knobs (pure: `hvdtrain.exchange` runs them)."""
    if c.sync not in SYNC_MODES:
        raise invalid_value("--sync", c.sync, ", ".join(SYNC_MODES))
    for name in _SYNC_NUMBERS:
        if getattr(c, name) != AUTO:  # --sync-every auto
            _whole(c, name)
    if c.outer_lr is not None and not (_number(c.outer_lr) and 0 < c.outer_lr < math.inf):
        raise invalid_value("--outer-lr", c.outer_lr, "a positive learning rate")
    if c.outer_momentum is not None and not (
        _number(c.outer_momentum) and 0 <= c.outer_momentum < 1
    ):
        raise invalid_value("--outer-momentum", c.outer_momentum, "a number from 0 to below 1")
    if c.sync_overlap is not None and not isinstance(c.sync_overlap, bool):
        raise invalid_value("--sync-overlap", c.sync_overlap, "True, False or no value")
    if c.sync_balance is not None and not isinstance(c.sync_balance, bool):
        raise invalid_value("--sync-balance", c.sync_balance, "True, False or no value")
    local = ("sync_every", "sync_warmup_steps", "sync_overlap", "sync_balance")
    for name in (*local, *OUTER) if c.sync == "step" else OUTER if c.sync == "local" else ():
        if getattr(c, name) is not None:
            needs = "--sync local or --sync diloco" if name in local else "--sync diloco"
            raise invalid_value(_flag(name), getattr(c, name), f"no value without {needs}")
    if c.sync == "step":
        return
    if c.accumulate > 1:
        raise invalid_value(
            "--accumulate",
            c.accumulate,
            f"1 with --sync {c.sync}: its local steps already exchange less (a larger "
            "--sync-every, or --batch-size, gives what accumulating would)",
        )
    if c.mixed_precision == "float16":
        raise c.float16_refused()
    if c.sync_balance:
        for name, why in BALANCE_REFUSED:
            if getattr(c, name):
                raise invalid_value("--sync-balance", True, f"no value with {_flag(name)}: {why}")
    spe, every = c.steps_per_execution, c.exchange_every
    if spe is not None and every % spe and c.sync_every != AUTO:
        raise invalid_value(
            "--steps-per-execution",
            spe,
            f"a divisor of --sync-every {every} (the ranks exchange at an execution's end), "
            "or no value: hvdtrain then picks one",
        )


BALANCE_REFUSED = (
    (
        "deterministic",
        "a run that repeats bit for bit shares its epochs equally, not by the "
        "ranks' measured speeds",
    ),
    (
        "checkpoint_every",
        "its ranks take unequal steps, so a mid-epoch checkpoint has no "
        "common step; checkpoints at epoch ends are kept",
    ),
    ("elastic", "an elastic job commits at common steps, which balanced ranks do not have"),
)


def _flag(name):
    return "--" + name.replace("_", "-")


def _number(value):
    return isinstance(value, int | float) and not isinstance(value, bool)


_OPTIONAL = {f.name for f in dataclasses.fields(TrainConfig) if f.default is None}


def _every_type():
    """`--sync-every`'s argparse type: "auto", or a positive integer."""
    number = whole_number_type("--sync-every", *WHOLE_NUMBERS["sync_every"][:2])

    def every(text):
        return AUTO if text.strip() == AUTO else number(text)

    return every


def _whole(config, name):
    """Checks the whole-number field `name` of `config` (an int in its range; None where
    None is its default)."""
    value = getattr(config, name)
    if value is None and name in _OPTIONAL:
        return
    minimum, maximum, bound = WHOLE_NUMBERS[name]
    whole_number(value, _flag(name), minimum, maximum, bound=bound, text=False)


_FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def make_config(config=None, **options):
    """A checked `TrainConfig` from a `TrainConfig`, an argparse namespace (its other
    attributes, a script's own flags, are ignored), a dict or None, with `options` on top."""
    if isinstance(config, TrainConfig):
        values = dataclasses.asdict(config)
    elif config is None:
        values = {}
    elif isinstance(config, dict):
        values = dict(config)
    else:
        values = {k: v for k, v in vars(config).items() if k in _FIELDS}
    values.update(options)
    unknown = sorted(set(values) - _FIELDS)
    for name in unknown:  # Keras fit's own keyword: where hvdtrain takes it
        if name in _KERAS_FIT:
            raise invalid_value(
                "option", name, f"hvdtrain.fit's own; Keras's `{name}` is {_KERAS_FIT[name]}"
            )
    if unknown:
        raise invalid_value("option", unknown[0], f"one of {', '.join(sorted(_FIELDS))}")
    return TrainConfig(**values)


_ARRAYS = "in the data: hvdtrain.ArrayData(x, y"
_KERAS_FIT = {  # keywords of Keras's `fit` that hvdtrain takes elsewhere: where
    "x": f"{_ARRAYS}), hvdtrain.fit's second argument",
    "y": f"{_ARRAYS}), hvdtrain.fit's second argument",
    "validation_data": f"{_ARRAYS}, test=(x_test, y_test)) (DatasetData's test_fn, FileData's "
    "test), evaluated at every epoch's end",
    "validation_split": f"{_ARRAYS}, test=(x_test, y_test)), split as you choose",
    "sample_weight": f"{_ARRAYS}, sample_weight=...)",
    "steps_per_epoch": "set by the data and the global batch, equal on every rank "
    "(limit_samples=... for fewer)",
    "initial_epoch": "the newest checkpoint's in checkpoint_dir, resumed on its own",
    "shuffle": "always on: every epoch shuffled after sharding (seed=...)",
    "verbose": "progress=..., on rank 0 only",
    "validation_freq": "every epoch (with test data in the data)",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse with hvdtrain's errors (one line, `HvdtrainError`: exit 2, no usage dump) and,
    unless `training=False`, hvdtrain's standard training flags with the defaults given.

    Args:
        prog: as argparse's.
        description: as argparse's; shown as written.
        epilog: as argparse's; shown as written.
        allow_abbrev: as argparse's.
        training: add the flags of `TrainConfig` (`--epochs`, `--checkpoint-dir`, ...).
        **defaults: defaults for those flags, by field name (`epochs=15, lr=1e-3`).
    """

    def __init__(
        self,
        prog=None,
        description=None,
        *,
        training=True,
        epilog=None,
        allow_abbrev=True,
        **defaults,
    ):
        report_uncaught()  # a user mistake in the script prints one line, not a traceback
        super().__init__(
            prog=prog,
            description=description,
            epilog=epilog,
            allow_abbrev=allow_abbrev,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        self._training = training
        if training:
            _add_training_flags(self, make_config(**defaults))
        elif defaults:
            raise invalid_value("defaults", sorted(defaults), "none with training=False")

    def error(self, message):  # one line, no usage dump, no traceback
        raise HvdtrainError(f"{message}. See `{self.prog} --help`.")

    def parse_args(self, args=None, namespace=None):
        """Parses and checks the flags (no TensorFlow needed): `args`, by default the command
        line's; in a Jupyter kernel, whose command line is the kernel's own (`-f
        kernel-....json`), none: the defaults and what you set on the result."""
        if args is None and _in_a_kernel(sys.argv[1:]):
            args = []
        parsed = super().parse_args(args, namespace)
        if self._training:
            make_config(parsed)  # raises on a bad value
        return parsed


def _in_a_kernel(argv):
    """Whether this process is a Jupyter kernel (ipykernel loaded) started with its
    connection file (`-f FILE` or `--f=FILE`, as Jupyter and VS Code start it)."""
    if "ipykernel" not in sys.modules:
        return False
    return "-f" in argv or any(arg.startswith("--f=") for arg in argv)


def _add_training_flags(p, d):
    def flag(group, name, help, **kw):
        default = getattr(d, name)
        shown = (
            ""
            if default in (None, False)
            else f" ({default:g})"
            if _number(default)
            else (f" ({default})")
        )
        if isinstance(default, bool):
            kw.setdefault("action", "store_true")
        elif name in WHOLE_NUMBERS:
            minimum, maximum, bound = WHOLE_NUMBERS[name]
            kw.setdefault("type", whole_number_type(_flag(name), minimum, maximum, bound=bound))
        else:
            kw.setdefault("type", type(default) if default is not None else int)
        group.add_argument(_flag(name), default=default, help=help + shown, **kw)

    t = p.add_argument_group("training")
    flag(t, "epochs", "epochs in all")
    flag(t, "batch_size", "per-rank batch")
    flag(
        t,
        "lr",
        "single-worker learning rate, x ranks after the warmup (default: the optimizer's own)",
        type=float,
    )
    flag(t, "warmup_epochs", "epochs to ramp the LR from --lr to --lr x ranks")
    flag(t, "seed", "random seed")
    flag(t, "limit_samples", "train on the first N samples only (arrays)")
    flag(t, "threads", "CPU threads per rank (default: cores / local ranks)")
    t.add_argument(
        "--mixed-precision",
        nargs="?",
        const="auto",
        default=d.mixed_precision,
        choices=["auto", "float16", "bfloat16"],
        help="mixed precision: float16 on GPUs, bfloat16 on CPUs (auto); loss scaling for float16",
    )
    flag(t, "fp16_allreduce", "compress gradients to float16 for the allreduce")
    flag(t, "accumulate", "average gradients of N local batches before each allreduce")
    flag(
        t,
        "steps_per_execution",
        "steps per call into TensorFlow (default: 16, or 1 with "
        "--checkpoint-every/--deterministic)",
    )
    flag(
        t,
        "deterministic",
        "deterministic ops and per-step seeds: a killed and resumed run "
        "ends bitwise like an uninterrupted one (CPU); Horovod's tensor fusion off",
    )
    flag(t, "eval_batch_size", "per-rank batch for evaluation")
    f = p.add_argument_group("files (rank 0 writes them)")
    flag(f, "checkpoint_dir", "save here and resume from the newest valid checkpoint", type=str)
    flag(f, "keep_checkpoints", "checkpoints kept")
    flag(f, "require_resume", "fail instead of starting over when no checkpoint is usable")
    flag(f, "checkpoint_every", "also checkpoint every N steps mid-epoch (0: off)")
    flag(f, "metrics_json", "the run's figures as JSON", type=str)
    flag(f, "log_dir", "TensorBoard logs", type=str)
    f.add_argument(
        "--progress",
        choices=PROGRESS,
        default=d.progress,
        help=f"progress within an epoch: a bar on a terminal, lines in a log ({d.progress})",
    )
    flag(f, "progress_seconds", "seconds between progress lines in a log")
    e = p.add_argument_group("elastic (launch with hvdtrain-run --elastic)")
    flag(e, "elastic", "train under Horovod Elastic: survive failed workers, take in new ones")
    flag(e, "commit_every", "steps between in-memory commits; a failure redoes at most this many")
    x = p.add_argument_group("exchanging less (docs/exchanging-less.md)")
    x.add_argument(
        "--sync",
        choices=SYNC_MODES,
        default=d.sync,
        help="step: average gradients at every step; local: post-local SGD; diloco: DiLoCo "
        f"({d.sync})",
    )
    flag(x, "sync_every", "local steps between exchanges of weights, or auto: the smallest that "
         f"hides the exchange, measured (default {SYNC_EVERY})", type=_every_type())  # fmt: skip
    flag(
        x,
        "sync_warmup_steps",
        "synchronous steps first (default: the LR warmup under local, 0 under diloco)",
    )
    flag(x, "outer_lr", "DiLoCo's outer learning rate (default: fitted to --sync-every and "
         "the ranks; the first line says which ran)", type=float)  # fmt: skip
    flag(x, "outer_momentum", "DiLoCo's outer Nesterov momentum (default 0.9)", type=float)
    x.add_argument(
        "--sync-overlap",
        action=argparse.BooleanOptionalAction,
        default=d.sync_overlap,
        help="run each exchange while the next local steps do (local, diloco; default: on "
        "with --sync-every auto, else off)",
    )
    x.add_argument(
        "--sync-balance",
        action=argparse.BooleanOptionalAction,
        default=d.sync_balance,
        help="share each epoch's batches in proportion to the ranks' measured speeds, so "
        "that no rank waits at an exchange (local, diloco; arrays, a Sequence or PyDataset; "
        "default: off)",
    )
