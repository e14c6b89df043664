"""The interface every Keras frontend implements (`keras2`, `keras3`): what the recipe asks of
a model's Keras, the same names in each module. A frontend for another Keras is one more
module with these names, and one more entry in `hvdtrain.frontends.loaded`."""

from typing import Protocol

__all__ = ["Frontend", "NAMES", "missing"]


class Frontend(Protocol):
    """One Keras as the recipe sees it (a module: its constants and functions)."""

    NAME: str  # the Keras's name in messages and the metrics JSON
    PACKAGE: str  # the top-level package of its classes ('tf_keras', 'keras')
    ONE_EPOCH_PER_FIT: bool  # one `fit` an epoch: Keras runs whole executions only
    keras: object  # the Keras module (`tf.keras`, `keras`)
    OPTIMIZER_TYPES: tuple  # what `hvdtrain.recipe.prepare` takes for an optimizer
    LEGACY_OPTIMIZERS: tuple  # its legacy optimizer classes (none on Keras 3)
    WarmupSchedule: type  # `hvdtrain.WarmupSchedule` as this Keras's schedule

    def owns(self, model):
        """Whether `model` is a model of this Keras."""

    def check(self, model):
        """Refuses, in one line, a model of this Keras that hvdtrain cannot train."""

    def compiled(self, model):
        """(compile arguments, the user's optimizer) of a compiled model."""

    def unwrapped(self, opt):
        """The optimizer inside a loss-scale one, else `opt`."""

    def is_compiled(self, model):
        """Whether `compile` was called."""

    def compiled_loss(self, model):
        """The loss given to `compile` (None without one)."""

    def has_added_losses(self, model):
        """Whether the model adds losses of its own (`add_loss`)."""

    def jit_compile(self, model):
        """Whether the user asked for XLA."""

    def configure(self, model, steps_per_execution):
        """`compile(steps_per_execution=..., jit_compile=False)`'s settings on a compiled
        model (Horovod's allreduce cannot be XLA-compiled)."""

    def base_lr(self, opt):
        """The single-worker learning rate of `opt`: a number, or its schedule."""

    def is_distributed(self, opt):
        """Whether hvdtrain (or Horovod) made `opt` distributed already."""

    def distributed_optimizer(self, optimizer, compression=None, backward_passes_per_step=1):
        """`optimizer` averaging its gradients over the ranks (`hvdtrain.optimizers.hooks`
        steers it)."""

    def loss_scale(self, optimizer):
        """Dynamic loss scaling around the distributed `optimizer`, the ranks agreeing on
        skipped steps."""

    def optimizer_variables(self, opt):
        """`opt`'s variables, a loss scale's among them: what a rank shares with the others."""

    def current_loss_scale(self, opt):
        """The dynamic loss scale of a loss-scale optimizer, else None."""

    def set_seed(self, seed):
        """Seeds this Keras's random state."""

    def set_policy(self, policy):
        """Sets this Keras's mixed-precision policy (None: float32)."""

    def float32_outputs(self, model):
        """`model` with its outputs cast back to float32 (mixed precision)."""

    def tensorboard(self, log_dir):
        """This Keras's TensorBoard callback writing to `log_dir`."""

    def deterministic(self):
        """Makes this Keras's ops deterministic (`--deterministic`)."""

    def checkpoint_extras(self, model):
        """What a checkpoint must hold beside the model and its optimizers."""


NAMES = tuple(
    name for name in (*Frontend.__annotations__, *vars(Frontend)) if not name.startswith("_")
)


def missing(module):
    """The names of the interface that `module` lacks (none for a complete frontend)."""
    return [name for name in NAMES if not hasattr(module, name)]
