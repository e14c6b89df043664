"""Optimisation: the learning rate scaled by the number of ranks, a warmup, and the
distributed optimizer.

With N ranks the global batch is N times the per-rank batch, so the learning rate is
scaled by N (Goyal et al., 2017). Starting at the full rate destabilises the first steps,
so it ramps linearly from the single-worker rate to N times that over the warmup.
"""

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import tensorflow as tf

from hvdtrain import compat, frontends
from hvdtrain.errors import invalid_value

__all__ = [
    "scaled_lr",
    "warmup_lr",
    "WarmupMath",
    "WarmupSchedule",
    "rescale_schedule",
    "distributed_optimizer",
    "is_distributed",
    "fp16_compression",
    "broadcast_initial_state",
    "average_model_state",
]


def scaled_lr(base_lr, size):
    """The learning rate for `size` ranks: `base_lr` (the single-worker rate) x `size`."""
    return base_lr * size


def warmup_lr(step, base_lr, size, warmup_steps):
    """The learning rate at `step`: `base_lr` at step 0, rising linearly to
    `scaled_lr(base_lr, size)` at `warmup_steps`, constant after."""
    if warmup_steps <= 0:
        return scaled_lr(base_lr, size)
    progress = min(1.0, step / warmup_steps)
    return base_lr * (1.0 + (size - 1) * progress)


class WarmupMath:
    """`warmup_lr` in TensorFlow ops, for a Keras `LearningRateSchedule` subclass that sets
    `schedules` (its Keras's `optimizers.schedules`)."""

    schedules = None

    def __init__(self, base_lr, size, warmup_steps):
        if isinstance(base_lr, dict):  # from get_config: deserialized by its own Keras
            base_lr = dict(base_lr)
            base_lr = _schedules(base_lr.pop("keras", None), self.schedules).deserialize(base_lr)
        if _schedules_of(base_lr) is None:  # a schedule of either Keras, or a number
            if isinstance(base_lr, bool) or not isinstance(base_lr, int | float) or base_lr <= 0:
                raise invalid_value("lr", base_lr, "a positive single-worker learning rate")
            base_lr = float(base_lr)
        self.base_lr = base_lr
        self.size = int(size)
        self.warmup_steps = int(warmup_steps)
        # The single-worker rate that callbacks read and set (ReduceLROnPlateau,
        # LearningRateScheduler, see `single_worker`): a variable, so a change needs no new
        # trace of the train step. Not tracked by Keras: hvdtrain checkpoints it itself.
        self.rate = None
        if isinstance(base_lr, float):
            with tf.init_scope():
                self.rate = tf.Variable(base_lr, dtype=tf.float32, trainable=False)

    def single_worker(self, step):
        """The single-worker rate at `step`: the variable callbacks set (a number), or the
        base schedule's value."""
        if self.rate is not None:
            return self.rate
        return tf.cast(self.base_lr(step), tf.float32)

    def set_single_worker(self, value):
        """Sets the single-worker rate (what a callback sets on one device); the applied rate
        stays that x ranks after the warmup. As Keras, refused for a base schedule."""
        if self.rate is None:
            raise TypeError(
                "This optimizer was created with a `LearningRateSchedule` object as its "
                "`learning_rate` constructor argument, hence its learning rate is not settable."
            )
        self.rate.assign(float(value))

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        base = self.single_worker(step)
        if self.warmup_steps <= 0:
            return base * float(self.size)
        progress = tf.minimum(1.0, step / float(self.warmup_steps))
        return base * (1.0 + (self.size - 1) * progress)

    def get_config(self):
        base = self.base_lr
        if self.rate is not None and tf.executing_eagerly():  # as a callback last set it
            base = float(self.rate.numpy())
        if not isinstance(base, float):  # the two Keras serialize alike: name which one
            package = type(base).__module__.partition(".")[0]
            base = {**_schedules_of(base).serialize(base), "keras": package}
        return {"base_lr": base, "size": self.size, "warmup_steps": self.warmup_steps}


def _schedules_of(value):
    """The `optimizers.schedules` module of the Keras whose `LearningRateSchedule` `value` is
    (Keras 2's, or Keras 3's where a script imported it), else None."""
    found = [tf.keras.optimizers.schedules]
    if compat.keras3_imported():
        found.append(compat.keras3_imported().optimizers.schedules)
    return next((s for s in found if isinstance(value, s.LearningRateSchedule)), None)


def _schedules(package, default):
    """The `optimizers.schedules` of the Keras `package` ('tf_keras', 'keras'), else `default`."""
    keras3 = compat.keras3_imported()
    if package == "keras" and keras3 is not None:
        return keras3.optimizers.schedules
    if package == tf.keras.Model.__module__.partition(".")[0]:
        return tf.keras.optimizers.schedules
    return default


@tf.keras.utils.register_keras_serializable(package="hvdtrain")
class WarmupSchedule(WarmupMath, tf.keras.optimizers.schedules.LearningRateSchedule):
    """`warmup_lr` as a Keras schedule: it follows `optimizer.iterations`, so a resumed run
    continues the warmup where the checkpoint left it.

    The optimizers of both Keras take it: once a script has imported Keras 3 (`import
    keras`), the object made is also a Keras 3 schedule (`hvdtrain.frontends.keras3`'s
    subclass), so `keras.optimizers.Adam(hvdtrain.WarmupSchedule(...))` works as
    `tf.keras.optimizers.Adam(...)` does.

    Args:
        base_lr: the single-worker learning rate, or the single-worker schedule (a
            `LearningRateSchedule` of either Keras, e.g. a decay): its value at each step
            is scaled.
        size: the number of ranks.
        warmup_steps: steps from 1x to `size`x (0: none).
    """

    schedules = tf.keras.optimizers.schedules

    def __new__(cls, *args, **kwargs):
        if cls is WarmupSchedule and compat.keras3_imported():  # Keras 3 is in this process
            from hvdtrain.frontends.keras3 import WarmupSchedule as cls
        return super().__new__(cls)


def single_worker_lr(keras_property):
    """The `learning_rate` (and `lr`) property of a distributed optimizer class: Keras's
    (`keras_property`), but for an optimizer over a `WarmupSchedule` that `show_single_worker_lr`
    marked (`hvdtrain.fit`'s): there what a callback reads and sets is the single-worker rate
    (as on one device: `ReduceLROnPlateau` halves it, `LearningRateScheduler` sets it), and the
    rate applied stays that x ranks after the warmup. Inside the optimizer's own update
    (`apply` sets `_hvdtrain_applying`) it is Keras's property: the rate applied."""

    def steered(self):
        schedule = getattr(self, "_learning_rate", None)
        single = self._hvdtrain_single_worker and not self._hvdtrain_applying
        return schedule if single and isinstance(schedule, WarmupMath) else None

    def get(self):
        schedule = steered(self)
        if schedule is None:
            return keras_property.fget(self)
        return schedule.single_worker(self.iterations)

    def set(self, value):
        schedule = steered(self)
        if schedule is None or _schedules_of(value) is not None:
            keras_property.fset(self, value)
        else:
            schedule.set_single_worker(value)

    return property(get, set, doc="The single-worker learning rate (x ranks when applied).")


def class_attribute(cls, name):
    """`name` as `cls` defines it or inherits it (a property itself, not its value)."""
    return next((k.__dict__[name] for k in cls.__mro__ if name in k.__dict__), None)


def show_single_worker_lr(optimizer):
    """Makes `optimizer` (a distributed one, or a loss-scale one around it) show and take the
    single-worker rate of its `WarmupSchedule` as its `learning_rate` (`single_worker_lr`):
    what `hvdtrain.fit` does, so that Keras's callbacks steer it as on one device."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    inner._hvdtrain_single_worker = True
    return optimizer


def applying(apply):
    """`apply` (an optimizer method that updates the variables) marked as the optimizer's own
    update, where `learning_rate` is the rate applied (`single_worker_lr`)."""

    def method(self, *args, **kwargs):
        self._hvdtrain_applying = True
        try:
            return apply(self, *args, **kwargs)
        finally:
            self._hvdtrain_applying = False

    method.__name__ = getattr(apply, "__name__", "apply")
    return method


def rescale_schedule(model, schedule, size, warmup_steps):
    """Points `schedule` (a `WarmupSchedule`) at `size` ranks and `warmup_steps`; returns
    True when that changed anything.

    Keras evaluates the schedule while tracing the train step, so the rate is a constant in
    the traced step: it is dropped (traced again by the next `fit`) when anything changed.
    `schedule` must be the model optimizer's own object (`optimizer.learning_rate =
    schedule`): `hvd.DistributedOptimizer` rebuilds the optimizer from its config, so the
    schedule given to the wrapped optimizer is a copy.
    """
    if (schedule.size, schedule.warmup_steps) == (int(size), int(warmup_steps)):
        return False
    schedule.size, schedule.warmup_steps = int(size), int(warmup_steps)
    model.train_function = None
    return True


def is_distributed(optimizer):
    """True for an optimizer that `hvd.DistributedOptimizer` (or `distributed_optimizer`)
    made, also inside a loss-scale optimizer."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return getattr(inner, "_allreduce_grads", None) is not None


def distributed_optimizer(optimizer, compression=None, backward_passes_per_step=1, **kwargs):
    """Wraps a Keras optimizer so gradients are averaged across ranks before each update.

    Args:
        optimizer: a Keras optimizer.
        compression: e.g. `fp16_compression()` to send float16 gradients (opt-in: it
            changes the math slightly); None sends them as they are.
        backward_passes_per_step: average the gradients of this many local batches before
            each allreduce and update (local gradient accumulation; 1 = off).
        **kwargs: passed on to `hvd.DistributedOptimizer` (Keras 2).

    A Keras 3 optimizer (`import keras`) gets hvdtrain's own wrapper instead
    (`hvdtrain.frontends.keras3.distributed_optimizer`: its `apply` averages the gradients).
    """
    keras3 = compat.keras3_imported()
    if keras3 is not None and isinstance(optimizer, keras3.optimizers.Optimizer) and not kwargs:
        from hvdtrain.frontends import keras3 as frontend

        return frontend.distributed_optimizer(optimizer, compression, backward_passes_per_step)
    compat.require_keras2()  # Horovod's wrapper fails deep inside `fit` on Keras 3
    if is_distributed(optimizer):  # Horovod would wrap it again, and recurse without end
        raise invalid_value(
            "optimizer",
            type(optimizer).__name__ + " (already distributed)",
            "a plain Keras optimizer: wrap it once",
        )
    if compression is not None:
        kwargs["compression"] = compression
    if backward_passes_per_step > 1:
        kwargs["backward_passes_per_step"] = backward_passes_per_step
        kwargs.setdefault("average_aggregated_gradients", True)
        # An Embedding's gradient is IndexedSlices, which Horovod's local sums refuse ("not
        # supported when backward_passes_per_step > 1 and sparse_as_dense is False").
        kwargs.setdefault("sparse_as_dense", True)
    return _averaging_where_applied(hvd_keras.DistributedOptimizer(optimizer, **kwargs))


def _averaging_where_applied(made):
    """Horovod's Keras 2 optimizer `made`, averaging the gradients also where they are only
    applied.

    Horovod's averages them in `compute_gradients`, which Keras's own `train_step` calls
    (`minimize`); a `train_step` of the user's own (`tape.gradient`, then
    `optimizer.apply_gradients`, as the Keras guides write GANs and VAEs) never calls it, and
    each rank applied its own gradients: the ranks drifted apart, silently. Here
    `apply_gradients` averages the gradients it is given unless `compute_gradients` did in
    the same step (`_hvdtrain_reduced`, set while the step is traced or run). Its class is
    Horovod's with those methods and `learning_rate` (`single_worker_lr`) replaced, made from
    the same namespace as Horovod makes it: a subclass would recurse, Horovod's methods
    calling `super(self.__class__, self)`."""
    horovod = type(made)
    namespace = dict(horovod.__dict__)
    reduce, apply = namespace["_allreduce"], namespace["apply_gradients"]

    def _allreduce(self, grads, variables):
        self._hvdtrain_reduced = True
        return reduce(self, grads, variables)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        try:
            if not self._hvdtrain_reduced:
                pairs = list(grads_and_vars)
                variables = [v for _, v in pairs]
                grads = self._allreduce([g for g, _ in pairs], variables)
                grads_and_vars = list(zip(grads, variables, strict=True))
            return apply(self, grads_and_vars, *args, **kwargs)
        finally:
            self._hvdtrain_reduced = False

    namespace.update(
        _allreduce=_allreduce,
        apply_gradients=applying(apply_gradients),
        _hvdtrain_reduced=False,
        _hvdtrain_applying=False,
        _hvdtrain_single_worker=False,
    )
    keras_lr = class_attribute(horovod, "learning_rate")
    if isinstance(keras_lr, property):  # (legacy optimizers keep theirs)
        namespace["learning_rate"] = single_worker_lr(keras_lr)
    object.__setattr__(made, "__class__", type(horovod.__name__, horovod.__bases__, namespace))
    return made


def fp16_compression():
    """Horovod's float16 gradient compression, for `distributed_optimizer(compression=...)`."""
    return hvd.Compression.fp16


def broadcast_initial_state(model, optimizer=None, root_rank=0):
    """Makes every rank start from rank `root_rank`'s weights and optimizer state.

    Unlike Horovod's `BroadcastGlobalVariablesCallback`, which broadcasts after the first
    batch, this runs before any step: the optimizer's slots are created first, so a state
    restored from a checkpoint on rank 0 reaches every rank, and the first update already
    starts from identical weights. `optimizer` may be a list or a dict of them (a GAN's
    two); their slots are made for all the model's trainable variables if they have none.
    """
    for opt in _each(optimizer):
        if not _is_built(opt):
            opt.build(model.trainable_variables)
    _by_position(
        state_variables(model, optimizer),
        "hvdtrain.broadcast",
        lambda t, name: hvd.broadcast(t, root_rank, name=name),
    )


def state_variables(model, optimizer=None):
    """The `tf.Variable`s of `model` and `optimizer` (built; a loss scale's too; a list or a
    dict of optimizers), in a fixed order: what a rank must share with the others to train
    on as they do. A `WarmupSchedule`'s single-worker rate is among them (a callback may
    have set it)."""
    variables = list(model.variables)
    frontend = frontends.owner(model)
    for opt in _each(optimizer):
        variables += frontend.optimizer_variables(opt) if frontend else opt.variables
        schedule = getattr(getattr(opt, "inner_optimizer", opt), "_learning_rate", None)
        if isinstance(schedule, WarmupMath) and schedule.rate is not None:
            variables.append(schedule.rate)
    return _tf_variables(variables)


def _each(optimizers):
    """The optimizers of None, one, a list or a dict of them, each once, in order."""
    if optimizers is None:
        return []
    if isinstance(optimizers, dict):
        optimizers = list(optimizers.values())
    elif not isinstance(optimizers, list | tuple):
        optimizers = [optimizers]
    seen, out = set(), []
    for opt in optimizers:
        if id(opt) not in seen:
            seen.add(id(opt))
            out.append(opt)
    return out


def _is_built(opt):
    return bool(getattr(opt, "built", False) or getattr(opt, "_built", False))


def average_model_state(model):
    """Averages the model's non-trainable float variables (BatchNorm's moving mean and
    variance) over all ranks.

    The distributed optimizer keeps trainable weights identical, but each rank updates its
    moving statistics from its own batches, so they drift apart; averaging them at the end
    of each epoch gives every rank (and rank 0's checkpoint) statistics of all the data.
    """
    state = [v for v in _tf_variables(model.non_trainable_variables) if v.dtype.is_floating]
    _by_position(
        state, "hvdtrain.state", lambda t, name: hvd.allreduce(t, op=hvd.Average, name=name)
    )


def _by_position(variables, prefix, collective):
    """Assigns `collective(tensor, name)` of `variables` to them: one call per dtype, over the
    variables packed into one buffer, named by `prefix` and the dtype.

    Horovod matches a collective across ranks by its name, and the names it makes itself come
    from the variables' names, which come from each rank's own Keras name counter: once rank 0
    alone has built a layer (the export of a model at the end of `hvdtrain.fit`, a callback of
    its own), a second `fit` in the same process had `dense_4/kernel` on rank 0 and
    `dense_2/kernel` on rank 1, and hung. Names by position cannot drift apart.
    """
    if hvd.size() == 1 or not variables:
        return
    groups = {}
    for v in _tf_variables(variables):
        groups.setdefault(v.dtype.name, []).append(v)
    for dtype, group in sorted(groups.items()):
        flat = tf.concat([tf.reshape(v, [-1]) for v in group], axis=0)
        flat = collective(flat, f"{prefix}.{dtype}")
        parts = tf.split(flat, [int(v.shape.num_elements()) for v in group])
        for v, part in zip(group, parts, strict=True):
            v.assign(tf.reshape(part, v.shape))


def _tf_variables(variables):
    """The `tf.Variable`s (what Horovod's ops take): Keras 2's are, Keras 3's hold one."""
    return [v if isinstance(v, tf.Variable) else v.value for v in variables]
