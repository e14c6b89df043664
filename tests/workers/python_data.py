"""A user's script that feeds `hvdtrain.fit` batches made in Python, as Keras's `fit` takes
them, for tests/test_batches.py; each rank writes OUT/rank<r>.json with what it loaded.

    horovodrun -np 2 -H localhost:2 python tests/workers/python_data.py OUT --form sequence

--form sequence: a Keras 2 `tf.keras.utils.Sequence` (augmentation from np.random);
pydataset: a Keras 3 `keras.utils.PyDataset` (--workers N, --processes), the model Keras 3's;
images: ImageDataGenerator(...).flow_from_directory(--images DIR) with random transforms
(Keras 2); generator: a generator function of (); sharded: one of (rank, size); object: a
generator object with steps_per_epoch; images-function: a generator function that builds
flow_from_directory itself. Each with a test set of its kind (images-function: none).
--bad CASE: one of the mistakes of tests/test_batches.py.
"""

import json
import os
import sys

import numpy as np

import hvdtrain

FEATURES = 8
N, TEST = 1000, 301  # samples: batches of 32 leave a short last batch; test batches of 50


def rank():
    return int(os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)


def samples(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).astype("float32")


def batches_class(base, out, bad=None):
    class Batches(base):
        """Batches of (x, y); it writes the index of every batch it loads (and its epoch:
        the on_epoch_end calls so far) to OUT/loads-<rank>.txt, from any worker."""

        def __init__(self, n, batch, seed, name, **kwargs):
            super().__init__(**kwargs)
            self.x, self.y = samples(n, seed)
            self.batch, self.name, self.ends = batch, name, 0

        def __len__(self):
            if bad == "length" and self.name == "train":
                return 31 - rank()  # another length on each rank
            if bad == "empty" and self.name == "train":
                return 0
            return -(-len(self.x) // self.batch)

        def __getitem__(self, i):
            if bad == "raises" and self.name == "train" and i == 7:
                raise KeyError(f"no image for batch {i}")
            if bad == "typo" and self.name == "train" and i == 0:  # read by every rank
                return scale_factor  # noqa: F821
            s = slice(i * self.batch, (i + 1) * self.batch)
            x = self.x[s] + np.random.normal(0, 0.01, size=self.x[s].shape).astype("float32")
            if bad == "shape" and i == 5:
                x = x[:, :4]
            if bad == "dtype" and i == 5:
                x = x.astype("float64")
            with open(os.path.join(out, f"loads-{rank()}.txt"), "a") as f:
                f.write(f"{self.name} {self.ends} {i}\n")
            if bad == "structure" and i == 5:
                return x, self.y[s], self.y[s], self.y[s]
            return x, self.y[s]

        def on_epoch_end(self):
            self.ends += 1

    return Batches


def generators(form, out, bad=None):
    x, y = samples(N, 0)
    xt, yt = samples(TEST, 1)

    def batches(xs, ys, rank_=0, size=1, name="train"):
        for i in range(rank_ * 32, len(xs) - 31, 32 * size):
            with open(os.path.join(out, f"loads-{rank()}.txt"), "a") as f:
                f.write(f"{name} 0 {i // 32}\n")
            if bad == "shape" and name == "train" and i == 3 * 32:  # rank 1's 2nd batch of 2 ranks
                yield xs[i : i + 32, :4], ys[i : i + 32]
                continue
            yield xs[i : i + 32], ys[i : i + 32]
        if name == "test":  # the short last batch of the test set
            rest = len(xs) - len(xs) % 32
            if rest < len(xs) and (rest // 32) % size == rank_:
                yield xs[rest:], ys[rest:]

    if form == "generator":
        return (lambda: batches(x, y)), (lambda: batches(xt, yt, name="test"))
    if form == "sharded":
        return (
            (lambda r, s: batches(x, y, r, s)),
            (lambda r, s: batches(xt, yt, r, s, name="test")),
        )

    def endless():
        while True:
            yield from batches(x, y)

    return endless(), (lambda: batches(xt, yt, name="test"))


def images_function(folder):
    """A generator function of (rank, size) that builds ImageDataGenerator's iterator itself:
    Keras prints `Found 80 images belonging to 2 classes.` at each call, on rank 0 only."""
    from tensorflow.keras.preprocessing.image import ImageDataGenerator

    def batches(rank_, size):
        it = ImageDataGenerator(rescale=1 / 255).flow_from_directory(
            os.path.join(folder, "train"), target_size=(16, 16), batch_size=8,
            class_mode="binary", shuffle=False,
        )  # fmt: skip
        for i in range(rank_, len(it), size):
            yield it[i]

    return batches


def images(folder, out):
    from tensorflow.keras.preprocessing.image import ImageDataGenerator

    gen = ImageDataGenerator(rescale=1 / 255, rotation_range=10, horizontal_flip=True)
    train = gen.flow_from_directory(
        os.path.join(folder, "train"), target_size=(16, 16), batch_size=8, class_mode="binary"
    )
    test = ImageDataGenerator(rescale=1 / 255).flow_from_directory(
        os.path.join(folder, "test"), target_size=(16, 16), batch_size=8, class_mode="binary",
        shuffle=False,
    )  # fmt: skip
    for it, name in ((train, "train"), (test, "test")):  # what each rank loads, by file
        load, ends = it._get_batches_of_transformed_samples, [0]

        def recorded(index_array, it=it, name=name, load=load, ends=ends):
            with open(os.path.join(out, f"loads-{rank()}.txt"), "a") as f:
                for j in index_array:
                    f.write(f"{name} {ends[0]} {it.filenames[j]}\n")
            return load(index_array)

        it._get_batches_of_transformed_samples = recorded
        end = it.on_epoch_end

        def counted(end=end, ends=ends):
            ends[0] += 1
            end()

        it.on_epoch_end = counted
    return train, test


def build(keras, inputs):
    layers = [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1, "sigmoid")]
    if inputs != (FEATURES,):
        layers = [keras.layers.Flatten(), *layers]
    model = keras.Sequential([keras.Input(inputs), *layers])
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy", metrics=["accuracy"]
    )
    return model


def main():
    parser = hvdtrain.ArgumentParser(description=__doc__, epochs=3)
    parser.add_argument("out")
    parser.add_argument("--form", default="sequence")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--processes", action="store_true")
    parser.add_argument("--images", help="the folder of train/ and test/ images")
    parser.add_argument("--bad", help="a mistake to make")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.form == "pydataset":
        import keras

        cls = batches_class(keras.utils.PyDataset, args.out, args.bad)
        loading = {"workers": args.workers, "use_multiprocessing": args.processes}
        data = (cls(N, 32, 0, "train", **loading), cls(TEST, 50, 1, "test"))
    else:
        import tensorflow as tf

        keras = tf.keras
        if args.form == "sequence":
            cls = batches_class(keras.utils.Sequence, args.out, args.bad)
            data = (cls(N, 32, 0, "train"), cls(TEST, 50, 1, "test"))
        elif args.form == "images":
            data = images(args.images, args.out)
        elif args.form == "images-function":
            data = images_function(args.images)
        else:
            train, test = generators(args.form, args.out, args.bad)
            steps = {"steps_per_epoch": 15} if args.form == "object" else {}
            data = hvdtrain.BatchData(train, test=test, **steps)
    inputs = (16, 16, 3) if args.form.startswith("images") else (FEATURES,)
    result = hvdtrain.fit(lambda: build(keras, inputs), data, args)
    train = data[0] if isinstance(data, tuple) else None
    ends = getattr(train, "ends", None)
    record = {k: result[k] for k in ("steps_per_epoch", "samples_per_epoch", "batch_size",
                                     "test_samples", "test", "history", "ranks")}  # fmt: skip
    record["ends"] = ends
    with open(os.path.join(args.out, f"rank{rank()}.json"), "w") as f:
        json.dump(record, f)
    print(f"rank {rank()} done", file=sys.stderr)


if __name__ == "__main__":
    main()
