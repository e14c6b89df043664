"""The learning rate under data parallelism: scaled by the number of ranks, warmed up, and
shown to Keras's callbacks as the single-worker rate.

With N ranks the global batch is N times the per-rank batch, so the learning rate is
scaled by N (Goyal et al., 2017). Starting at the full rate destabilises the first steps,
so it ramps linearly from the single-worker rate to N times that over the warmup. Both
Keras's frontends build on this module; it imports neither of them.
"""

import functools

import tensorflow as tf

from hvdtrain.errors import invalid_value
from hvdtrain.optimizers.hooks import hooks_of
from hvdtrain.runtime import compat

__all__ = [
    "scaled_lr",
    "warmup_lr",
    "WarmupMath",
    "WarmupSchedule",
    "keras3_schedule",
    "single_worker_lr",
    "show_single_worker_lr",
    "rescale_schedule",
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
            cls = keras3_schedule()
        return super().__new__(cls)


@functools.cache  # one class: registering it twice would fail
def keras3_schedule():
    """`WarmupSchedule` as a schedule of both Keras (`hvdtrain.frontends.keras3`'s): made
    once Keras 3 is imported, and registered with both Keras so that either loads it."""
    keras = compat.keras3_imported()

    @keras.saving.register_keras_serializable(package="hvdtrain", name="WarmupSchedule")
    @tf.keras.utils.register_keras_serializable(package="hvdtrain", name="WarmupScheduleKeras3")
    class WarmupScheduleKeras3(WarmupSchedule, keras.optimizers.schedules.LearningRateSchedule):
        """`hvdtrain.WarmupSchedule` once Keras 3 is imported: a schedule of both Keras (the
        optimizers of each check for their own base class), saved and loaded by either."""

        schedules = keras.optimizers.schedules

    WarmupScheduleKeras3.__name__ = WarmupScheduleKeras3.__qualname__ = "WarmupSchedule"
    return WarmupScheduleKeras3


def single_worker_lr(keras_property):
    """The `learning_rate` (and `lr`) property of a distributed optimizer class: Keras's
    (`keras_property`), but for an optimizer over a `WarmupSchedule` that `show_single_worker_lr`
    marked (`hvdtrain.fit`'s): there what a callback reads and sets is the single-worker rate
    (as on one device: `ReduceLROnPlateau` halves it, `LearningRateScheduler` sets it), and the
    rate applied stays that x ranks after the warmup. Inside the optimizer's own update
    (`hooks.applying`) it is Keras's property: the rate applied."""

    def steered(self):
        schedule, hooks = getattr(self, "_learning_rate", None), hooks_of(self)
        single = hooks is not None and hooks.single_worker and not hooks.applying
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


def show_single_worker_lr(optimizer):
    """Makes `optimizer` (a distributed one, or a loss-scale one around it) show and take the
    single-worker rate of its `WarmupSchedule` as its `learning_rate` (`single_worker_lr`):
    what `hvdtrain.fit` does, so that Keras's callbacks steer it as on one device."""
    hooks_of(optimizer).single_worker = True
    return optimizer


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
