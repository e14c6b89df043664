"""A user's training script on hvdtrain's public API alone, as tests/test_recipe.py runs it:
its own model (BatchNorm, dropout, a sigmoid output with binary cross-entropy and AUC) and its
own data, in one of hvdtrain's forms.

    horovodrun -np 2 -H localhost:2 python tests/workers/recipe.py --data tfrecord --files DIR \
        --checkpoint-dir ck --metrics-json m.json [--kill-at 7]

--data arrays: numpy arrays; tfrecord: DIR/train-*.tfrecord and DIR/test-*.tfrecord (written
by `write_tfrecords`); per-host: DIR/<host>/train-*.tfrecord and test-*.tfrecord on each
host; dataset: a tf.data pipeline made per rank and epoch, its test set read from
DIR/test-*.tfrecord (a stream of unknown length); batches: a Keras `Sequence` (Keras 2) or
`PyDataset` (Keras 3) of --batch-size, with noise drawn from np.random as augmentation.
--no-test: no test set. --then-epochs N: once trained, `fit` again to N epochs in the same
process (it resumes from --checkpoint-dir).
--keras 3: the same model in Keras 3 (`import keras`). --own-train-step: the same layers in
a model class with its own train_step (the Keras guide "Customizing what happens in fit()").
--kill-at N: rank 1 SIGKILLs itself after global step N;
--stall-at N: it hangs there (its watchdog ends it). --stall-in-data: rank 1 hangs while
loading its data, before any collective. --spoil-metrics-folder: the metrics
JSON's folder becomes a file when training ends (the final write fails). --fill-disk-at-epoch
N: rank 0 fills the checkpoint folder's file system when epoch N begins.
"""

import functools
import glob
import os
import signal
import sys
import time

import numpy as np
import tensorflow as tf

import hvdtrain

FEATURES = 8


def own_train_step(keras):
    """A model class with the train_step of the Keras guide "Customizing what happens in
    fit()" (each Keras's version)."""
    if keras is tf.keras:

        class CustomModel(keras.Model):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = self.compiled_loss(y, y_pred, regularization_losses=self.losses)
                trainable_vars = self.trainable_variables
                gradients = tape.gradient(loss, trainable_vars)
                self.optimizer.apply_gradients(zip(gradients, trainable_vars, strict=True))
                self.compiled_metrics.update_state(y, y_pred)
                return {m.name: m.result() for m in self.metrics}

        return CustomModel

    class CustomModel(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(y=y, y_pred=y_pred)
            trainable_vars = self.trainable_variables
            gradients = tape.gradient(loss, trainable_vars)
            self.optimizer.apply(gradients, trainable_vars)
            for metric in self.metrics:
                if metric.name == "loss":
                    metric.update_state(loss)
                else:
                    metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    return CustomModel


def _layers(keras, own_step):
    """The model's layers: a Sequential, or with `own_step` the same graph in the guide's
    model class with its own train_step."""
    layers = [
        keras.layers.Dense(32, activation="relu"),
        keras.layers.BatchNormalization(),
        keras.layers.Dropout(0.2),
        keras.layers.Dense(1, activation="sigmoid"),
    ]
    if not own_step:
        return keras.Sequential([keras.Input((FEATURES,)), *layers])
    inputs = h = keras.Input((FEATURES,))
    for layer in layers:
        h = layer(h)
    return own_train_step(keras)(inputs, h)


def build_model_keras3(jit_compile="auto", own_step=False):
    import keras

    model = _layers(keras, own_step)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="binary_crossentropy",
        metrics=["accuracy", keras.metrics.AUC(name="auc")],
        jit_compile=jit_compile,
    )
    return model


def build_model(jit_compile=None, own_step=False):
    model = _layers(tf.keras, own_step)
    model.compile(
        tf.keras.optimizers.Adam(0.01),
        "binary_crossentropy",
        ["accuracy", tf.keras.metrics.AUC(name="auc")],
        jit_compile=jit_compile,
    )
    return model


def arrays(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.float32)
    return x, y


def write_tfrecords(folder, prefix, sizes, seed):
    """Files of `sizes` records each; returns all (x, y) written, in order."""
    os.makedirs(folder, exist_ok=True)
    x, y = arrays(sum(sizes), seed)
    start = 0
    for i, n in enumerate(sizes):
        with tf.io.TFRecordWriter(os.path.join(folder, f"{prefix}-{i:02d}.tfrecord")) as w:
            for j in range(start, start + n):
                feature = {
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[j])),
                    "y": tf.train.Feature(float_list=tf.train.FloatList(value=[y[j]])),
                }
                w.write(
                    tf.train.Example(
                        features=tf.train.Features(feature=feature)
                    ).SerializeToString()
                )
        start += n
    return x, y


def parse(record):
    spec = {
        "x": tf.io.FixedLenFeature([FEATURES], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.float32),
    }
    f = tf.io.parse_single_example(record, spec)
    return f["x"], f["y"]


class Fault(tf.keras.callbacks.Callback):
    """Rank 1 SIGKILLs itself (`kill`) or stops making progress (`stall`: sleeps for ever)
    once the global step (the optimizer's) reaches `step`."""

    def __init__(self, what, step):
        super().__init__()
        self.what, self.step = what, step

    def on_train_batch_end(self, batch, logs=None):
        import horovod.tensorflow as hvd

        if hvd.rank() == 1 and int(self.model.optimizer.iterations) >= self.step:
            if self.what == "kill":
                print(f"rank 1: killing itself after step {self.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            print(f"rank 1: stalling after step {self.step}", flush=True)
            while True:
                time.sleep(3600)


class SpoilMetricsFolder(tf.keras.callbacks.Callback):
    """At the end of training, puts a file where the metrics JSON's folder is: the write
    after training fails (a full or lost disk, as a user would meet it)."""

    def __init__(self, path):
        super().__init__()
        self.folder = os.path.dirname(os.path.abspath(path))

    def on_train_end(self, logs=None):
        import shutil

        import horovod.tensorflow as hvd

        if hvd.rank() == 0:
            shutil.rmtree(self.folder)
            with open(self.folder, "w") as f:
                f.write("not a folder")


class FillDisk(tf.keras.callbacks.Callback):
    """When epoch `epoch` begins, rank 0 fills the checkpoint folder's file system (a small
    tmpfs in the test) so that the next checkpoint cannot be written."""

    def __init__(self, folder, epoch):
        super().__init__()
        self.folder, self.epoch = folder, epoch

    def on_epoch_begin(self, epoch, logs=None):
        import horovod.tensorflow as hvd

        if hvd.rank() != 0 or epoch + 1 != self.epoch:
            return
        try:
            with open(os.path.join(self.folder, "filler"), "wb") as f:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
        except OSError:
            print("rank 0: the disk is full", flush=True)


def batches(args, x, y):
    """A Sequence (Keras 2) or PyDataset (Keras 3) as Keras's guides write them."""
    if args.keras == "3":
        import keras

        base = keras.utils.PyDataset
    else:
        base = tf.keras.utils.Sequence

    class Batches(base):
        def __init__(self, x, y, batch):
            super().__init__()
            self.x, self.y, self.batch = x, y, batch

        def __len__(self):
            return -(-len(self.x) // self.batch)

        def __getitem__(self, i):
            x = self.x[i * self.batch : (i + 1) * self.batch]
            noise = np.random.normal(0, 0.05, size=x.shape).astype("float32")  # augmentation
            return x + noise, self.y[i * self.batch : (i + 1) * self.batch]

    return Batches(x, y, args.batch_size)


def make_data(args):
    tested = not args.no_test
    if args.data == "batches":
        test = batches(args, *arrays(101, 1)) if tested else None
        return hvdtrain.BatchData(batches(args, *arrays(600, 0)), test=test)
    if args.data == "arrays":
        return hvdtrain.ArrayData(*arrays(600, 0), test=arrays(101, 1) if tested else None)
    if args.data == "tfrecord":
        return hvdtrain.FileData(
            os.path.join(args.files, "train-*.tfrecord"),
            parse,
            test=os.path.join(args.files, "test-*.tfrecord") if tested else None,
            shuffle_buffer=64,
        )
    if args.data == "per-host":

        def mine(split):  # what this host holds: a folder per host name
            return lambda placement: glob.glob(
                os.path.join(args.files, placement.host, f"{split}-*.tfrecord")
            )

        return hvdtrain.FileData(
            mine("train"), parse, test=mine("test") if tested else None, per_host=True,
            shuffle_buffer=64,
        )  # fmt: skip
    x, y = arrays(600, 0)

    def make_dataset(rank, size, seed, epoch):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(size, rank)
        return ds.shuffle(1000, seed=seed * 1000 + epoch, reshuffle_each_iteration=False)

    def make_test(rank, size):  # records read from files: TensorFlow does not know how many
        files = sorted(tf.io.gfile.glob(os.path.join(args.files, "test-*.tfrecord")))
        return tf.data.TFRecordDataset(files).shard(size, rank).map(parse)

    return hvdtrain.DatasetData(make_dataset, len(x), test_fn=make_test if tested else None)


def main():
    parser = hvdtrain.ArgumentParser(description=__doc__, epochs=3, batch_size=16)
    parser.add_argument(
        "--data", choices=["arrays", "tfrecord", "per-host", "dataset", "batches"], default="arrays"
    )
    parser.add_argument("--files", help="the TFRecord folder")
    parser.add_argument("--kill-at", type=int, default=0, help="rank 1 dies after this step")
    parser.add_argument("--stall-at", type=int, default=0, help="rank 1 hangs after this step")
    parser.add_argument("--spoil-metrics-folder", action="store_true")
    parser.add_argument("--stall-in-data", action="store_true", help="rank 1 hangs loading")
    parser.add_argument("--fill-disk-at-epoch", type=int, default=0)
    parser.add_argument("--no-test", action="store_true", help="no test set")
    parser.add_argument("--then-epochs", type=int, default=0, help="fit again to N epochs")
    parser.add_argument("--keras", choices=["2", "3"], default="2", help="the model's Keras")
    parser.add_argument("--jit-compile", action="store_true", help="compile with XLA asked")
    parser.add_argument("--own-train-step", action="store_true", help="the guide's train_step")
    args = parser.parse_args()
    callbacks = [Fault("kill", args.kill_at)] if args.kill_at else []
    callbacks += [Fault("stall", args.stall_at)] if args.stall_at else []
    callbacks += [SpoilMetricsFolder(args.metrics_json)] if args.spoil_metrics_folder else []
    if args.fill_disk_at_epoch:
        callbacks.append(FillDisk(args.checkpoint_dir, args.fill_disk_at_epoch))
    data = make_data(args)
    if args.stall_in_data:

        def data_that_never_loads_on_rank_1():  # called by fit on every rank, after init
            import horovod.tensorflow as hvd

            if hvd.rank() == 1:
                print("rank 1: stalling while loading the data", flush=True)
                while True:
                    time.sleep(3600)
            return data

        data = data_that_never_loads_on_rank_1
    build = build_model_keras3 if args.keras == "3" else build_model
    if args.jit_compile:
        build = functools.partial(build, jit_compile=True)
    if args.own_train_step:
        build = functools.partial(build, own_step=True)
    result = hvdtrain.fit(build, data, args, callbacks=callbacks)
    if args.then_epochs:
        result = hvdtrain.fit(build, data, args, epochs=args.then_epochs)
    print(f"rank done: test {result['test']}", file=sys.stderr)


if __name__ == "__main__":
    main()
