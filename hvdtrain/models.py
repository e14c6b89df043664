"""The MNIST models: a small convnet (default), the same with BatchNorm, and the MLP of
Keras' multi-GPU guide."""

import tensorflow as tf

__all__ = ["build_model", "MODELS"]

MODELS = ("convnet", "convnet-bn", "mlp")


def build_model(name="convnet", keras=tf.keras):
    """A classifier of 28x28x1 images into 10 classes that outputs logits, in `keras`
    (`tf.keras`, Keras 2, or the `keras` module, Keras 3: the layers are the same)."""
    layers = keras.layers
    if name == "convnet":
        body = [
            # Small random shifts and rotations (training only): the embedded set has just
            # 4,500 training digits, and these lift held-out accuracy by about a point.
            layers.RandomTranslation(0.1, 0.1, fill_mode="constant"),
            layers.RandomRotation(0.05, fill_mode="constant"),
            layers.Conv2D(32, 3, activation="relu"),
            layers.Conv2D(64, 3, activation="relu"),
            layers.MaxPooling2D(),
            layers.Dropout(0.25),
            layers.Flatten(),
            layers.Dense(128, activation="relu"),
            layers.Dropout(0.5),
        ]
    elif name == "convnet-bn":  # BatchNorm's moving statistics: averaged across the ranks
        body = [
            layers.Conv2D(32, 3, use_bias=False),
            layers.BatchNormalization(),
            layers.Activation("relu"),
            layers.Conv2D(64, 3, use_bias=False),
            layers.BatchNormalization(),
            layers.Activation("relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(128, activation="relu"),
        ]
    elif name == "mlp":
        body = [
            layers.Flatten(),
            layers.Dense(256, activation="relu"),
            layers.Dense(256, activation="relu"),
        ]
    else:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    return keras.Sequential(
        [keras.Input((28, 28, 1)), *body, layers.Dense(10)], name=f"mnist_{name.replace('-', '_')}"
    )
