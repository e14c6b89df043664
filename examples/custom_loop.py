"""MNIST with a custom training loop (`tf.GradientTape`) on N processes with Horovod.

The custom-loop counterpart of keras_fit.py: the same model and data, trained by a
`tf.function` step instead of `fit`. Every line that is there because of the other processes
is marked `# Horovod:`.

    python examples/custom_loop.py                                       # one process
    horovodrun -np 2 -H localhost:2 python examples/custom_loop.py       # 2 processes, this host
    hvdtrain-run --hostfile hosts.txt -- python examples/custom_loop.py  # every slot of a hostfile
    mpirun -np 2 python examples/custom_loop.py                          # plain Open MPI
    python examples/custom_loop.py --epochs 1 --steps 5                  # a quick check

(`mpirun` as root also needs `--allow-run-as-root`.) `--batch` is per process and `--lr` the
learning rate of one process (raised to N x `--lr` over the first epoch). With
`--checkpoint-dir`, rank 0 saves the model and optimizer after each epoch, and the same
command run again resumes from the newest checkpoint. Data as in keras_fit.py: the embedded
MNIST digits, or `--data keras-cache`.
"""

import argparse
import time

import horovod.tensorflow as hvd
import tensorflow as tf

import hvdtrain

# -- settings: the defaults, each one also a flag (--epochs 1 --steps 5) -------------------
parser = argparse.ArgumentParser(description="MNIST with a custom training loop.")
parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
parser.add_argument("--batch", type=int, default=64, help="samples per step and process")
parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate (one process)")
parser.add_argument("--steps", type=int, default=0, help="steps per epoch (default: all data)")
parser.add_argument("--data", choices=["embedded", "keras-cache"], default="embedded")
parser.add_argument("--seed", type=int, default=0, help="random seed")
parser.add_argument("--checkpoint-dir", help="save here after each epoch (rank 0); resume")
parser.add_argument("--metrics-json", help="write the final figures here")
args = parser.parse_args()
# ------------------------------------------------------------------------------------------

hvdtrain.init()  # Horovod: start Horovod; one GPU and a fair share of the CPUs per process
rank, size = hvd.rank(), hvd.size()  # Horovod: this process's number, and how many there are
main_process = rank == 0  # Horovod: rank 0 alone prints and writes files
tf.keras.utils.set_random_seed(args.seed + rank)  # Horovod: a seed each; weights are broadcast

(x, y), (x_test, y_test) = hvdtrain.load_mnist(args.data)  # x: float32 [n, 28, 28, 1]
# Horovod: each rank trains on its own shard (shuffled, repeated) and evaluates on its own
# part of the test set; all ranks run the same number of steps, or one would wait forever in
# an allreduce that the others never join.
ds = hvdtrain.train_dataset(x, y, args.batch, rank, size, seed=args.seed)
test = hvdtrain.eval_dataset(x_test, y_test, 256, rank, size)
steps = args.steps or hvdtrain.steps_per_epoch(len(x), args.batch, size)

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
# Horovod: the global batch is size x --batch, so the learning rate rises from --lr to
# size x --lr over the first epoch (a warmup keeps the first steps stable).
opt = tf.keras.optimizers.Adam(hvdtrain.WarmupSchedule(args.lr, size, steps))
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model.compile(opt, loss_fn, ["accuracy"])  # the loss and metrics that evaluation reports


@tf.function
def train_step(images, labels):
    with tf.GradientTape() as tape:
        logits = model(images, training=True)
        loss = loss_fn(labels, logits)
    # Horovod: gradient() now averages the gradients over all ranks (an allreduce), so every
    # rank applies the same update.
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    predictions = tf.argmax(logits, axis=-1, output_type=labels.dtype)
    return loss, tf.reduce_sum(tf.cast(predictions == labels, tf.float32))


start_epoch, manager = 0, None
if args.checkpoint_dir:
    manager = hvdtrain.CheckpointManager(args.checkpoint_dir, model, opt)
    opt.build(model.trainable_variables)  # the optimizer's slots, so a checkpoint can fill them
    found = manager.restore_latest() if main_process else None  # Horovod: rank 0 reads it
    start_epoch = hvd.broadcast_object(
        found.epoch if found else 0, root_rank=0
    )  # Horovod: tell all
# Horovod: every rank starts from rank 0's weights and optimizer state (fresh or restored).
# Horovod's own examples broadcast after the first step instead, because Keras creates the
# optimizer's slots in that step; broadcast_initial_state creates them first, so the very
# first update already starts from identical weights, and a checkpoint that rank 0 alone
# restored reaches every rank.
hvdtrain.broadcast_initial_state(model, opt)

batches = iter(ds)
history = []
for epoch in range(start_epoch, args.epochs):
    start = time.perf_counter()
    loss_sum = correct = 0.0
    for _ in range(steps):
        loss, hits = train_step(*next(batches))
        loss_sum, correct = loss_sum + float(loss), correct + float(hits)
    seconds = time.perf_counter() - start
    samples = steps * args.batch
    # Horovod: the epoch's figures over all ranks, each weighted by its number of samples.
    train = hvdtrain.weighted_mean(
        {"loss": loss_sum / steps, "accuracy": correct / samples}, samples
    )
    val = hvdtrain.evaluate(model, test)  # Horovod: every rank its shard, then sums reduced
    history.append({"epoch": epoch + 1, **train, "test_loss": val["loss"], "seconds": seconds})
    if main_process:  # Horovod: rank 0 alone prints and saves
        print(
            f"epoch {epoch + 1}/{args.epochs}: loss {train['loss']:.4f}, accuracy "
            f"{train['accuracy']:.4f}, test accuracy {val['accuracy']:.4f}, "
            f"{samples * size / seconds:.0f} samples/s"  # Horovod: all ranks' samples
        )
        if manager:
            manager.save(epoch + 1)

result = hvdtrain.evaluate(model, test)  # Horovod: every rank takes part in the reduction
ranks = hvdtrain.rank_report(model)  # Horovod: every rank's weights fingerprint (all equal)
if main_process:
    print(f"test loss {result['loss']:.4f}, accuracy {result['accuracy']:.4f}")
    if args.metrics_json:
        metrics = {"size": size, "start_epoch": start_epoch, "history": history}
        metrics.update(test=result, optimizer_steps=int(opt.iterations), ranks=ranks)
        hvdtrain.write_json(args.metrics_json, metrics)
