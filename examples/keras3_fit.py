"""Your Keras 3 model (`import keras`, TensorFlow backend) on N processes with `hvdtrain.fit`:
a functional model with `keras.ops`, BatchNorm, AdamW and an AUC metric, on a synthetic
binary task; nothing of Keras 2 in sight.

    horovodrun -np 2 -H localhost:2 python examples/keras3_fit.py --checkpoint-dir ckpt
    # the same command with more --epochs resumes from the newest checkpoint
    hvdtrain-run --hostfile hosts.txt -- python examples/keras3_fit.py --checkpoint-dir ckpt
    python examples/keras3_fit.py --epochs 1                        # one process

hvdtrain tells the Keras apart by the model object: the gradients are averaged over the
ranks inside the optimizer's `apply` (Horovod's TensorFlow ops), the learning rate is scaled
by the ranks after a warmup, the state broadcast from rank 0, BatchNorm statistics averaged,
metrics exact over all ranks. The export (`ckpt/model.keras`) loads in plain Keras 3:
`keras.saving.load_model("ckpt/model.keras")`.
"""

import keras
import numpy as np

import hvdtrain

FEATURES = 10


def build_model():
    """Compiled as for one device, with the single-worker learning rate."""
    inputs = keras.Input((FEATURES,))
    h = keras.layers.Dense(64, activation="relu")(inputs)
    h = keras.layers.BatchNormalization()(h)  # Horovod: statistics averaged over the ranks
    h = keras.ops.concatenate([h, keras.ops.square(inputs)], axis=-1)
    outputs = keras.layers.Dense(1, activation="sigmoid")(h)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-3),
        loss="binary_crossentropy",
        metrics=["accuracy", keras.metrics.AUC(name="auc")],
    )
    return model


def samples(n, seed):
    """x: normal features; y: 1 where x0 - x3 + x1 * x2 > 0."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    return x, (x[:, 0] - x[:, 3] + x[:, 1] * x[:, 2] > 0).astype("float32")


args = hvdtrain.ArgumentParser(description=__doc__, epochs=4, batch_size=64).parse_args()
data = hvdtrain.ArrayData(*samples(8000, 0), test=samples(2000, 1))  # Horovod: sharded
hvdtrain.fit(build_model, data, args)  # Horovod: the whole recipe, on every rank
