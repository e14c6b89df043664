"""A user's compiled model made ready to train on every rank: its optimizers found and each
replaced by a distributed one, and the way it runs set (steps per execution, no XLA), without
calling its `compile` again: a model's own `compile` (a GAN's `compile(d_optimizer,
g_optimizer, loss_fn)`) takes arguments hvdtrain cannot know.

Where the optimizers are looked for, on both Keras: the model's `optimizer` (what
`compile(optimizer=...)` sets; Keras's `compile()` without one sets an RMSprop), every
attribute of the model that holds a Keras optimizer, directly or in a list, tuple or dict
(`self.d_optimizer`, `self.optimizers = [...]`), as a model's own `compile` keeps them, and
the `optimizer` of every model inside it (a discriminator compiled on its own). Nothing
else: an optimizer that a `train_step` reaches another way (a global, an object of its own)
is not distributed, and the check that the ranks hold the same weights
(`hvdtrain.recipe.agreement`) stops the run after its first steps.

Each optimizer found is replaced, at each place it was found, by a copy (its class and
config) that averages the gradients over the ranks wherever they are applied (Keras's
`train_step`, or `apply_gradients` / `apply` in a `train_step` of the model's own), with its
single-worker learning rate (its own, or `--lr` for every optimizer) x ranks after the
warmup, its accumulation, float16 compression and, under `--mixed-precision float16`, loss
scaling; Keras's callbacks read and set its single-worker rate (`hvdtrain.recipe.usercallbacks`).
Its slots are made for the trainable variables of the model that holds it, so that its state
can be broadcast and restored before the first step.

Refused in one line, before training: a model that is not compiled; one with nothing to
train on (no loss in `compile`, no `add_loss`, and Keras's own `train_step`); a layer not
built yet (its weights would appear after the broadcast); a legacy Keras 2 optimizer
(`tf.keras.optimizers.legacy`); an optimizer already distributed (Horovod's
`DistributedOptimizer`: hvdtrain adds its own).
"""

import dataclasses

import numpy as np

from hvdtrain.errors import invalid_value
from hvdtrain.optimizers import rates
from hvdtrain.recipe import optim

__all__ = ["Optimizers", "check_class_weight", "find_optimizers", "distribute", "trains_itself"]


@dataclasses.dataclass(frozen=True)
class Optimizers:
    """The model's distributed optimizers: `by_name` maps where each was found ("optimizer",
    "d_optimizer", "optimizers[1]") to it, `model.optimizer`'s first, each object once
    (under the first name it was found by); `schedules` their `WarmupSchedule`s, by the
    same names."""

    by_name: dict
    schedules: dict
    classes: dict  # the user's optimizer class names, by the same names
    reported: str  # the one the run's figures name: see `distribute`

    @property
    def main(self):
        """The model's `optimizer` (Keras's own `train_step` uses it), else the first."""
        return next(iter(self.by_name.values()))

    def __iter__(self):
        return iter(self.by_name.values())

    def __len__(self):
        return len(self.by_name)


def find_optimizers(model, frontend):
    """{where: optimizer} of every Keras optimizer the model holds where hvdtrain looks (see
    the module), `model.optimizer` first, then its attributes, the lists, tuples and dicts
    there, and the `optimizer` of each model inside it; an object held at several places
    appears once per place."""
    return {name: opt for name, (opt, _, _) in _places(model, frontend).items()}


def _places(model, frontend):
    """{where: (optimizer, put, owner)}: `put(optimizer)` puts another there, and `owner`
    is the model whose trainable variables the optimizer's slots are made for."""
    found = {}

    def look(name, value, put, owner):
        if isinstance(value, frontend.OPTIMIZER_TYPES):
            found[name] = (value, put, owner)

    look("optimizer", getattr(model, "optimizer", None), _setter(model, "optimizer"), model)
    attributes = [(k, v) for k, v in vars(model).items() if k != "optimizer"]
    for name, value in attributes:  # attributes first: they name an object found twice
        look(name, value, _setter(model, name), model)
    for name, value in attributes:
        if name.startswith("_self_"):  # TensorFlow's tracking of the attributes themselves
            continue
        if isinstance(value, dict):
            items = list(value.items())
        elif isinstance(value, list | tuple):
            items = list(enumerate(value))
        else:
            continue
        for key, item in items:
            look(f"{name}[{key!r}]", item, _item_setter(model, name, key), model)
    for layer in model._flatten_layers(include_self=False):  # a discriminator compiled alone
        if isinstance(layer, frontend.keras.Model):
            opt = getattr(layer, "optimizer", None)
            look(f"{layer.name}.optimizer", opt, _setter(layer, "optimizer"), layer)
    return found


def _setter(holder, name):
    return lambda value: setattr(holder, name, value)


def _item_setter(model, name, key):
    """Sets item `key` of the model's attribute `name` (a list, tuple or dict)."""

    def put(value):
        holder = getattr(model, name)
        if hasattr(holder, "_fields"):  # a namedtuple
            setattr(model, name, holder._replace(**{holder._fields[key]: value}))
        elif isinstance(holder, list | tuple):  # a new one: Keras 2's ListWrapper refuses to
            items = [value if i == key else v for i, v in enumerate(holder)]  # be saved once
            setattr(model, name, tuple(items) if isinstance(holder, tuple) else items)  # changed
        else:
            holder[key] = value

    return put


def trains_itself(model, frontend):
    """True when the model's class has its own `train_step` (or, on Keras 3, `compute_loss`)."""
    base = frontend.keras.Model
    cls = type(model)
    return any(
        getattr(cls, name, None) is not getattr(base, name, None)
        for name in ("train_step", "compute_loss")
        if hasattr(base, name)
    )


def distribute(model, frontend, cfg, size, policy=None, log=None):
    """Replaces each optimizer of `model` by its distributed copy (see the module); returns
    the `Optimizers`. Also turns XLA off and sets the steps per execution (`cfg`'s, or the
    default the recipe chose: `spe`)."""
    _check_trainable(model, frontend)
    places = {}  # id(optimizer) -> [(where, put, owner), ...]
    objects = {}
    for where, (opt, put, owner) in _places(model, frontend).items():
        places.setdefault(id(opt), []).append((where, put, owner))
        objects[id(opt)] = opt
    by_name, schedules, classes = {}, {}, {}
    for key, wheres in places.items():
        user = frontend.unwrapped(objects[key])
        name, _, owner = wheres[0]
        if isinstance(user, frontend.LEGACY_OPTIMIZERS):
            raise invalid_value(
                f"build_model ({name})",
                f"a legacy optimizer (tf.keras.optimizers.legacy.{type(user).__name__})",
                "an optimizer of tf.keras.optimizers (e.g. tf.keras.optimizers.Adam): hvdtrain "
                "makes its state before the first step, which legacy optimizers cannot",
            )
        if frontend.is_distributed(user):
            raise invalid_value(
                f"build_model ({name})",
                f"a model compiled with {type(user).__name__} (already distributed)",
                "a plain Keras optimizer: hvdtrain.fit adds Horovod's wrapper",
            )
        # Horovod: the single-worker LR (a number or a schedule) x ranks after a warmup; the
        # warmup's length is set once the steps per epoch are known (`Run.start`).
        schedule = frontend.WarmupSchedule(cfg.lr or frontend.base_lr(user), size, 0)
        config = user.get_config()
        config["learning_rate"] = schedule
        # Horovod: average gradients over the ranks before each update.
        opt = frontend.distributed_optimizer(
            type(user).from_config(config),
            compression=optim.fp16_compression() if cfg.fp16_allreduce else None,
            backward_passes_per_step=cfg.accumulate,
        )
        opt.learning_rate = schedule  # Horovod rebuilt it with a copy: see rescale_schedule
        rates.show_single_worker_lr(opt)  # what Keras's callbacks read and set
        if policy == "mixed_float16":
            opt = frontend.loss_scale(opt)
        # Slots exist before any broadcast or restore (also what an elastic state needs): for
        # the trainable variables of the model that holds it (a GAN's optimizers each get all
        # of the GAN's: the variables a train_step applies them to are not known before).
        opt.build(owner.trainable_variables)
        for _, put, _ in wheres:
            put(opt)
        by_name[name], schedules[name], classes[name] = opt, schedule, type(user).__name__
    # The run's figures (lr_base, lr_final, optimizer_iterations) name `model.optimizer`,
    # unless it is an RMSprop (what Keras's `compile()` sets when given none) beside
    # optimizers of the model's own (a GAN's, which never steps it): then the first of those.
    names = list(by_name)
    default = names[0] == "optimizer" and classes["optimizer"] == "RMSprop"
    reported = names[1] if default and len(names) > 1 else names[0]
    return Optimizers(by_name, schedules, classes, reported)


def _check_trainable(model, frontend):
    """The one-line refusals of a model that has no way to train."""
    if not frontend.is_compiled(model):
        raise invalid_value(
            "build_model",
            "a model that is not compiled",
            "a compiled model, as Keras's own fit needs: model.compile(optimizer=...) with "
            "its loss and metrics, or your model's own compile(...), in build_model",
        )
    unbuilt = [layer for layer in model._flatten_layers(include_self=False) if not layer.built]
    if not model.built and isinstance(model, frontend.keras.Sequential):
        unbuilt.insert(0, model)
    if unbuilt:
        raise invalid_value(
            "build_model",
            f"a model whose layer {unbuilt[0].name!r} is not built (its weights would appear "
            "at the first step, after every rank started from rank 0's)",
            "every layer built in build_model: begin each Sequential with keras.Input(shape), "
            "or call the model once on a batch, model(x[:1]) (Keras 3's .build(input_shape) "
            "leaves a subclassed model's layers unbuilt)",
        )
    if not find_optimizers(model, frontend):
        raise invalid_value(
            "build_model",
            "a model compiled without an optimizer",
            "model.compile(optimizer=...), or optimizers kept as attributes of the model by "
            "its own compile (self.d_optimizer = ...)",
        )
    if (
        frontend.compiled_loss(model) is None
        and not trains_itself(model, frontend)
        and not frontend.has_added_losses(model)
    ):
        raise invalid_value(
            "build_model",
            "a model with nothing to train on (no loss in compile, no add_loss, and Keras's "
            "own train_step)",
            "model.compile(optimizer=..., loss=...), losses added with add_loss, or a "
            "train_step of the model's own",
        )


def check_class_weight(class_weight, model):
    """`class_weight` as Keras's `fit` takes it, or a one-line error now rather than a
    traceback at the first step: {class index: weight}, for a model of one output."""
    if class_weight is None:
        return
    if not isinstance(class_weight, dict) or not all(
        isinstance(c, (int, np.integer)) and isinstance(w, (int, float, np.number))
        for c, w in class_weight.items()
    ):
        raise invalid_value("class_weight", class_weight, "{class index: weight}")
    outputs = len(getattr(model, "outputs", None) or ())  # None: a subclass not yet called
    if outputs > 1:
        raise invalid_value(
            "class_weight",
            class_weight,
            f"a model with one output (Keras weighs the classes of one output only; this "
            f"model has {outputs}): weigh the samples instead, "
            "`hvdtrain.ArrayData(x, y, sample_weight=...)`",
        )
