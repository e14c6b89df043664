"""A user's Keras 3 script on batches made in Python (a `keras.utils.PyDataset`): the chaos
soak's third data form (`hvdtrain.bench.soak`), beside arrays and files.

    hvdtrain-run -np 2 -- python -m hvdtrain.bench.pydataset_job --checkpoint-dir ckpt

Synthetic: 20 normal features, 4 classes from a fixed linear map, each batch made from its
index (the same batch on a resume).
"""

import keras
import numpy as np

import hvdtrain

__all__ = ["Samples", "build_model", "main"]

FEATURES, CLASSES = 20, 4


class Samples(keras.utils.PyDataset):
    """`n` samples in batches of `batch_size`, drawn once from `seed`."""

    def __init__(self, n, batch_size, seed, **kwargs):
        super().__init__(**kwargs)
        rng = np.random.default_rng(seed)
        self.x = rng.normal(size=(n, FEATURES)).astype("float32")
        mix = np.random.default_rng(0).normal(size=(FEATURES, CLASSES))
        self.y = np.argmax(self.x @ mix, axis=1).astype("int32")
        self.batch_size = batch_size

    def __len__(self):
        return len(self.x) // self.batch_size

    def __getitem__(self, index):
        part = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[part], self.y[part]


def build_model():
    """Compiled as for one device, with the single-worker learning rate."""
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])  # fmt: skip
    return model


def main():
    args = hvdtrain.ArgumentParser(description=__doc__, epochs=3, batch_size=32).parse_args()
    train = Samples(512, args.batch_size, seed=1)
    test = Samples(128, args.batch_size, seed=2)
    hvdtrain.fit(build_model, (train, test), args)


if __name__ == "__main__":
    main()
