"""A script that does not resume exactly: its model starts from weights drawn from
unseeded random numbers (`np.random.default_rng()`), different in every run.

    hvdtrain-run chaos -np 2 --faults 0 -- python tests/workers/unseeded.py --epochs 1
"""

import numpy as np
import tensorflow as tf

import hvdtrain


def build_model():
    start = tf.keras.initializers.Constant(np.random.default_rng().normal())  # unseeded
    model = tf.keras.Sequential(
        [tf.keras.Input((8,)), tf.keras.layers.Dense(2, kernel_initializer=start)]
    )
    model.compile(
        tf.keras.optimizers.SGD(0.01),
        tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


if __name__ == "__main__":
    args = hvdtrain.ArgumentParser(epochs=1, batch_size=16).parse_args()
    x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")  # seeded: the same
    hvdtrain.fit(build_model, (x, (x[:, 0] > 0).astype("int64")), args)
