"""A Keras 3 model (`import keras`, TensorFlow backend) trained by a loop of your own on N
processes, with hvdtrain's building blocks: the Keras 3 counterpart of custom_loop.py. Every
line that is there because of the other processes is marked `# Horovod:`.

    python examples/keras3_custom_loop.py                                     # one process
    horovodrun -np 2 -H localhost:2 python examples/keras3_custom_loop.py     # 2 processes
    hvdtrain-run --hostfile hosts.txt -- python examples/keras3_custom_loop.py
    mpirun -np 2 python examples/keras3_custom_loop.py                        # plain Open MPI

With `--checkpoint-dir`, rank 0 saves after each epoch and the same command resumes.
"""

import argparse

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

import hvdtrain

parser = argparse.ArgumentParser(description="A Keras 3 model, a loop of your own.")
parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
parser.add_argument("--batch", type=int, default=64, help="samples per step and process")
parser.add_argument("--lr", type=float, default=1e-3, help="the learning rate of one process")
parser.add_argument("--checkpoint-dir", help="save here after each epoch (rank 0); resume")
parser.add_argument("--metrics-json", help="write the final figures here")
args = parser.parse_args()

hvdtrain.init()  # Horovod: start Horovod; one GPU and a fair share of the CPUs per process
rank, size = hvd.rank(), hvd.size()  # Horovod: this process's number, and how many there are
keras.utils.set_random_seed(rank)  # Horovod: a seed each; the weights are broadcast

rng = np.random.default_rng(0)
x = rng.normal(size=(6000, 10)).astype("float32")
y = (x[:, 0] - x[:, 3] > 0).astype("float32")[:, None]
x_test, y_test = x[5000:], y[5000:]
x, y = x[:5000], y[:5000]
ds = hvdtrain.train_dataset(x, y, args.batch, rank, size)  # Horovod: this rank's shard
test = hvdtrain.eval_dataset(x_test, y_test, 256, rank, size)  # Horovod: each sample once
steps = hvdtrain.steps_per_epoch(len(x), args.batch, size)  # Horovod: equal on every rank

inputs = keras.Input((10,))
hidden = keras.layers.BatchNormalization()(keras.layers.Dense(32, activation="relu")(inputs))
model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))
# Horovod: the learning rate rises from --lr to size x --lr over the first epoch, and the
# optimizer's apply() averages the gradients over the ranks first.
lr = hvdtrain.WarmupSchedule(args.lr, size, steps)  # a Keras 3 schedule too, with Keras 3 imported
opt = hvdtrain.distributed_optimizer(keras.optimizers.Adam(lr))
loss_fn = keras.losses.BinaryCrossentropy()
model.compile(optimizer=opt, loss=loss_fn, metrics=["accuracy"])  # what evaluation reports
opt.build(model.trainable_variables)  # the optimizer's slots, for the broadcast and restore


@tf.function
def train_step(features, labels):
    with tf.GradientTape() as tape:
        loss = loss_fn(labels, model(features, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply(grads, model.trainable_variables)  # Horovod: averaged over the ranks in apply
    return loss


start_epoch, manager = 0, None
if args.checkpoint_dir:
    manager = hvdtrain.CheckpointManager(args.checkpoint_dir, model, opt)
    found = manager.restore_latest() if rank == 0 else None  # Horovod: rank 0 reads it
    start_epoch = hvd.broadcast_object(found.epoch if found else 0, root_rank=0)  # Horovod
hvdtrain.broadcast_initial_state(model, opt)  # Horovod: every rank starts from rank 0's state

batches = iter(ds)
for epoch in range(start_epoch, args.epochs):
    losses = [float(train_step(*next(batches))) for _ in range(steps)]
    hvdtrain.average_model_state(model)  # Horovod: BatchNorm statistics of all ranks' data
    train = hvdtrain.weighted_mean({"loss": sum(losses) / steps}, steps)  # Horovod: all ranks
    val = hvdtrain.evaluate(model, test)  # Horovod: every rank its shard, then sums reduced
    if rank == 0:  # Horovod: rank 0 alone prints and saves
        print(f"epoch {epoch + 1}: loss {train['loss']:.4f}, test accuracy {val['accuracy']:.4f}")
        if manager:
            manager.save(epoch + 1)

result = hvdtrain.evaluate(model, test)  # Horovod: every rank takes part in the reduction
ranks = hvdtrain.rank_report(model)  # Horovod: every rank's weights fingerprint (all equal)
if rank == 0 and args.metrics_json:
    hvdtrain.write_json(
        args.metrics_json,
        {"size": size, "start_epoch": start_epoch, "test": result, "ranks": ranks,
         "optimizer_steps": int(opt.iterations.numpy())},
    )  # fmt: skip
