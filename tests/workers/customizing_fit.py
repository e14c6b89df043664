"""Models that customize `fit`, written as the Keras guides write them ("Customizing what
happens in fit()", and the keras.io examples: VAE, GAN, WGAN-GP, knowledge distillation,
contrastive pretraining), trained through `hvdtrain.fit` with hvdtrain's flags:

    horovodrun -np 2 -H localhost:2 python tests/workers/customizing_fit.py --models vae,gan \
        --keras 3 --epochs 2 --checkpoint-dir CK --metrics-json OUT/m.json

Each model of `--models` is trained in turn in the same processes, its checkpoints in
CK/<model> and its metrics in OUT/<model>.json (the flags' paths with the model's name).
--keras 3: `import keras` (Keras 3); else tf.keras (Keras 2). --kill-at N: rank 1 SIGKILLs
itself after global step N. --callbacks DIR: Keras's CSVLogger, ModelCheckpoint,
EarlyStopping and ReduceLROnPlateau too, writing into DIR (--plain: the same model and
callbacks with Keras's own fit on one process, no hvdtrain). Models with a flaw on purpose:
`drift` (a train_step that updates a weight outside any optimizer) and `hidden` (a GAN
whose discriminator's optimizer is kept where hvdtrain does not look).
"""

# ruff: noqa: B905  (zip(grads, variables) as the Keras guides write it)

import os
import signal
import sys

import numpy as np
import tensorflow as tf

import hvdtrain

K = None  # the Keras module of --keras
LATENT, SIDE = 4, 8  # generators: 4 numbers -> an 8x8 image


def images(n, seed):
    """n 8x8 one-channel images in [0, 1] (blobs) and a class per image (4 classes)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    grid = np.stack(np.meshgrid(np.arange(SIDE), np.arange(SIDE), indexing="ij"), -1)
    centres = np.array([[2, 2], [2, 5], [5, 2], [5, 5]])[y][:, None, None, :]
    x = np.exp(-((grid[None] - centres) ** 2).sum(-1) / 3.0)
    x = x + rng.normal(0, 0.05, x.shape)
    return np.clip(x, 0, 1)[..., None].astype("float32"), y.astype("int64")


# -- VAE (keras.io "Variational AutoEncoder"): an optimizer only, the loss in train_step ------
def build_vae():
    class Sampling(K.layers.Layer):
        def call(self, inputs):
            z_mean, z_log_var = inputs
            epsilon = tf.random.normal(shape=tf.shape(z_mean))
            return z_mean + tf.exp(0.5 * z_log_var) * epsilon

    inputs = K.Input((SIDE, SIDE, 1))
    h = K.layers.Dense(16, activation="relu")(K.layers.Flatten()(inputs))
    z_mean, z_log_var = K.layers.Dense(2)(h), K.layers.Dense(2)(h)
    encoder = K.Model(inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])])
    latent = K.Input((2,))
    out = K.layers.Dense(SIDE * SIDE, activation="sigmoid")(K.layers.Dense(16, "relu")(latent))
    decoder = K.Model(latent, K.layers.Reshape((SIDE, SIDE, 1))(out))

    class VAE(K.Model):
        def __init__(self, encoder, decoder, **kwargs):
            super().__init__(**kwargs)
            self.encoder, self.decoder = encoder, decoder
            self.total_loss_tracker = K.metrics.Mean(name="total_loss")
            self.kl_loss_tracker = K.metrics.Mean(name="kl_loss")

        @property
        def metrics(self):
            return [self.total_loss_tracker, self.kl_loss_tracker]

        def call(self, x):
            return self.decoder(self.encoder(x)[2])

        def train_step(self, data):
            with tf.GradientTape() as tape:
                z_mean, z_log_var, z = self.encoder(data)
                reconstruction = self.decoder(z)
                reconstruction_loss = tf.reduce_mean(
                    tf.reduce_sum(K.losses.binary_crossentropy(data, reconstruction), axis=(1, 2))
                )
                kl_loss = -0.5 * (1 + z_log_var - tf.square(z_mean) - tf.exp(z_log_var))
                kl_loss = tf.reduce_mean(tf.reduce_sum(kl_loss, axis=1))
                total_loss = reconstruction_loss + kl_loss
            grads = tape.gradient(total_loss, self.trainable_weights)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            self.total_loss_tracker.update_state(total_loss)
            self.kl_loss_tracker.update_state(kl_loss)
            return {
                "loss": self.total_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result(),
            }

    vae = VAE(encoder, decoder)
    vae.build((None, SIDE, SIDE, 1))  # (Keras 3's ModelCheckpoint saves built models only)
    vae.compile(optimizer=K.optimizers.Adam(1e-3))
    return vae


# -- GAN ("Customizing what happens in fit()"): its own compile, two optimizers ------------
def _discriminator():  # the last layers in float32, as Keras's mixed precision guide says
    return K.Sequential(
        [K.Input((SIDE, SIDE, 1)), K.layers.Flatten(), K.layers.Dense(16),
         K.layers.LeakyReLU(0.2), K.layers.Dense(1, dtype="float32")],
        name="discriminator")  # fmt: skip


def _generator():
    return K.Sequential(
        [K.Input((LATENT,)), K.layers.Dense(16), K.layers.LeakyReLU(0.2),
         K.layers.Dense(SIDE * SIDE, activation="sigmoid"),
         K.layers.Reshape((SIDE, SIDE, 1), dtype="float32")], name="generator")  # fmt: skip


def _scaled(optimizer, loss):
    """The loss as a Keras 3 optimizer scales it (a no-op but under float16 loss scaling, where
    Keras 3 unscales the gradients it applies); Keras 2 applies them as they are."""
    return optimizer.scale_loss(loss) if hasattr(optimizer, "scale_loss") else loss


def gan_class(keep_d_optimizer=True):
    class GAN(K.Model):
        def __init__(self, discriminator, generator, latent_dim):
            super().__init__()
            self.discriminator, self.generator, self.latent_dim = (
                discriminator,
                generator,
                latent_dim,
            )
            self.d_loss_tracker = K.metrics.Mean(name="d_loss")
            self.g_loss_tracker = K.metrics.Mean(name="g_loss")
            if K is not tf.keras:  # Keras 3's guide draws from a seed generator (checkpointed)
                self.seed_generator = K.random.SeedGenerator(1337)

        @property
        def metrics(self):
            return [self.d_loss_tracker, self.g_loss_tracker]

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.g_optimizer = g_optimizer
            if keep_d_optimizer:
                self.d_optimizer = d_optimizer
            else:  # where hvdtrain does not look: never averaged
                self.holder = type("Holder", (), {})()
                self.holder.d_optimizer = d_optimizer
            self.loss_fn = loss_fn

        def _noise(self, batch_size):
            if K is tf.keras:
                return tf.random.normal(shape=(batch_size, self.latent_dim))
            return K.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)

        def train_step(self, real_images):
            if isinstance(real_images, tuple):
                real_images = real_images[0]
            batch_size = tf.shape(real_images)[0]
            generated_images = self.generator(self._noise(batch_size))
            combined_images = tf.concat([generated_images, real_images], axis=0)
            labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
            d_optimizer = self.d_optimizer if keep_d_optimizer else self.holder.d_optimizer
            with tf.GradientTape() as tape:
                predictions = self.discriminator(combined_images)
                d_loss = self.loss_fn(labels, predictions)
                scaled = _scaled(d_optimizer, d_loss)
            grads = tape.gradient(scaled, self.discriminator.trainable_weights)
            d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
            g_optimizer = self.g_optimizer
            misleading_labels = tf.zeros((batch_size, 1))
            with tf.GradientTape() as tape:
                predictions = self.discriminator(self.generator(self._noise(batch_size)))
                g_loss = self.loss_fn(misleading_labels, predictions)
                scaled = _scaled(g_optimizer, g_loss)
            grads = tape.gradient(scaled, self.generator.trainable_weights)
            g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
            self.d_loss_tracker.update_state(d_loss)
            self.g_loss_tracker.update_state(g_loss)
            return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}

    return GAN


def build_gan(keep_d_optimizer=True):
    gan = gan_class(keep_d_optimizer)(_discriminator(), _generator(), LATENT)
    gan.compile(
        d_optimizer=K.optimizers.Adam(learning_rate=3e-4),
        g_optimizer=K.optimizers.Adam(learning_rate=1e-3),
        loss_fn=K.losses.BinaryCrossentropy(from_logits=True),
    )
    return gan


# -- WGAN-GP (keras.io): several critic steps per generator step, a gradient penalty ------
def build_wgan():
    class WGAN(K.Model):
        def __init__(self, discriminator, generator, latent_dim, discriminator_extra_steps=3):
            super().__init__()
            self.discriminator, self.generator, self.latent_dim = (
                discriminator,
                generator,
                latent_dim,
            )
            self.d_steps, self.gp_weight = discriminator_extra_steps, 10.0

        def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
            super().compile()
            self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
            self.d_loss_fn, self.g_loss_fn = d_loss_fn, g_loss_fn

        def gradient_penalty(self, batch_size, real_images, fake_images):
            alpha = tf.random.uniform([batch_size, 1, 1, 1], 0.0, 1.0)
            interpolated = real_images + alpha * (fake_images - real_images)
            with tf.GradientTape() as gp_tape:
                gp_tape.watch(interpolated)
                pred = self.discriminator(interpolated, training=True)
            grads = gp_tape.gradient(pred, [interpolated])[0]
            norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
            return tf.reduce_mean((norm - 1.0) ** 2)

        def train_step(self, real_images):
            if isinstance(real_images, tuple):
                real_images = real_images[0]
            batch_size = tf.shape(real_images)[0]
            for _ in range(self.d_steps):
                random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
                with tf.GradientTape() as tape:
                    fake_images = self.generator(random_latent_vectors, training=True)
                    fake_logits = self.discriminator(fake_images, training=True)
                    real_logits = self.discriminator(real_images, training=True)
                    d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                    gp = self.gradient_penalty(batch_size, real_images, fake_images)
                    d_loss = d_cost + gp * self.gp_weight
                d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
                self.d_optimizer.apply_gradients(
                    zip(d_gradient, self.discriminator.trainable_variables)
                )
            random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
            with tf.GradientTape() as tape:
                generated_images = self.generator(random_latent_vectors, training=True)
                g_loss = self.g_loss_fn(self.discriminator(generated_images, training=True))
            gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
            self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
            return {"d_loss": d_loss, "g_loss": g_loss}

    wgan = WGAN(_discriminator(), _generator(), LATENT)
    wgan.compile(
        d_optimizer=K.optimizers.Adam(learning_rate=2e-4, beta_1=0.5, beta_2=0.9),
        g_optimizer=K.optimizers.Adam(learning_rate=2e-4, beta_1=0.5, beta_2=0.9),
        d_loss_fn=lambda real_img, fake_img: tf.reduce_mean(fake_img) - tf.reduce_mean(real_img),
        g_loss_fn=lambda fake_img: -tf.reduce_mean(fake_img),
    )
    return wgan


# -- Knowledge distillation (keras.io): its own compile, a frozen teacher, two losses ------
def build_distiller():
    def classifier(name, width):
        return K.Sequential(
            [K.Input((SIDE, SIDE, 1)), K.layers.Flatten(), K.layers.Dense(width, "relu"),
             K.layers.Dense(4)], name=name)  # fmt: skip

    class Distiller(K.Model):  # Keras 2's guide: a train_step and a test_step of its own
        def __init__(self, student, teacher):
            super().__init__()
            self.teacher, self.student = teacher, student

        def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                    temperature=3):  # fmt: skip
            super().compile(optimizer=optimizer, metrics=metrics)
            self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
            self.alpha, self.temperature = alpha, temperature

        def call(self, x):
            return self.student(x)

        def distillation(self, x, y, student_predictions):
            teacher_predictions = self.teacher(x, training=False)
            student_loss = self.student_loss_fn(y, student_predictions)
            distillation_loss = self.distillation_loss_fn(
                tf.nn.softmax(teacher_predictions / self.temperature, axis=1),
                tf.nn.softmax(student_predictions / self.temperature, axis=1),
            ) * (self.temperature**2)
            return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                student_predictions = self.student(x, training=True)
                loss = self.distillation(x, y, student_predictions)
            trainable_vars = self.student.trainable_variables
            gradients = tape.gradient(loss, trainable_vars)
            self.optimizer.apply_gradients(zip(gradients, trainable_vars))
            self.compiled_metrics.update_state(y, student_predictions)
            results = {m.name: m.result() for m in self.metrics}
            results.update({"distillation_loss": loss})
            return results

        def test_step(self, data):
            x, y = data
            y_prediction = self.student(x, training=False)
            student_loss = self.student_loss_fn(y, y_prediction)
            self.compiled_metrics.update_state(y, y_prediction)
            results = {m.name: m.result() for m in self.metrics}
            results.update({"student_loss": student_loss})  # not a metric: the last batch's
            return results

    if K is not tf.keras:  # Keras 3's guide: compute_loss of its own, Keras's train_step

        class Distiller(Distiller):  # noqa: F811
            def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                             allow_empty=False):  # fmt: skip
                return self.distillation(x, y, y_pred)

            train_step = K.Model.train_step
            test_step = K.Model.test_step

    teacher = classifier("teacher", 32)
    teacher.trainable = False
    distiller = Distiller(classifier("student", 8), teacher)
    distiller.compile(
        optimizer=K.optimizers.Adam(1e-3),
        metrics=[K.metrics.SparseCategoricalAccuracy()],
        student_loss_fn=K.losses.SparseCategoricalCrossentropy(from_logits=True),
        distillation_loss_fn=K.losses.KLDivergence(),
    )
    return distiller


# -- Contrastive pretraining (keras.io, SimCLR): two optimizers, its own test_step --------
def build_contrastive():
    class ContrastiveModel(K.Model):
        def __init__(self):
            super().__init__()
            self.temperature = 0.1
            self.encoder = K.Sequential(
                [K.Input((SIDE, SIDE, 1)), K.layers.Flatten(), K.layers.Dense(16, "relu")],
                name="encoder")  # fmt: skip
            self.projection_head = K.Sequential(
                [K.Input((16,)), K.layers.Dense(8, "relu"), K.layers.Dense(8)], name="head"
            )
            self.linear_probe = K.Sequential([K.Input((16,)), K.layers.Dense(4)], name="probe")
            self.augmenter = K.Sequential(
                [K.Input((SIDE, SIDE, 1)), K.layers.GaussianNoise(0.1)], name="augmenter"
            )

        def compile(self, contrastive_optimizer, probe_optimizer, **kwargs):
            super().compile(**kwargs)
            self.contrastive_optimizer, self.probe_optimizer = (
                contrastive_optimizer,
                probe_optimizer,
            )
            self.probe_loss = K.losses.SparseCategoricalCrossentropy(from_logits=True)
            self.contrastive_loss_tracker = K.metrics.Mean(name="c_loss")
            self.probe_loss_tracker = K.metrics.Mean(name="p_loss")
            self.probe_accuracy = K.metrics.SparseCategoricalAccuracy(name="p_acc")

        @property
        def metrics(self):
            return [self.contrastive_loss_tracker, self.probe_loss_tracker, self.probe_accuracy]

        def contrastive_loss(self, projections_1, projections_2):
            projections_1 = tf.math.l2_normalize(projections_1, axis=1)
            projections_2 = tf.math.l2_normalize(projections_2, axis=1)
            similarities = tf.matmul(projections_1, projections_2, transpose_b=True)
            similarities /= self.temperature
            batch_size = tf.shape(projections_1)[0]
            labels = tf.range(batch_size)
            loss_1_2 = K.losses.sparse_categorical_crossentropy(
                labels, similarities, from_logits=True
            )
            loss_2_1 = K.losses.sparse_categorical_crossentropy(
                labels, tf.transpose(similarities), from_logits=True
            )
            return (loss_1_2 + loss_2_1) / 2

        def train_step(self, data):
            images, labels = data
            augmented_1 = self.augmenter(images, training=True)
            augmented_2 = self.augmenter(images, training=True)
            with tf.GradientTape() as tape:
                projections_1 = self.projection_head(self.encoder(augmented_1, training=True))
                projections_2 = self.projection_head(self.encoder(augmented_2, training=True))
                contrastive_loss = self.contrastive_loss(projections_1, projections_2)
            variables = self.encoder.trainable_weights + self.projection_head.trainable_weights
            gradients = tape.gradient(contrastive_loss, variables)
            self.contrastive_optimizer.apply_gradients(zip(gradients, variables))
            self.contrastive_loss_tracker.update_state(contrastive_loss)
            with tf.GradientTape() as tape:
                features = self.encoder(images, training=False)
                class_logits = self.linear_probe(features, training=True)
                probe_loss = self.probe_loss(labels, class_logits)
            gradients = tape.gradient(probe_loss, self.linear_probe.trainable_weights)
            self.probe_optimizer.apply_gradients(
                zip(gradients, self.linear_probe.trainable_weights)
            )
            self.probe_loss_tracker.update_state(probe_loss)
            self.probe_accuracy.update_state(labels, class_logits)
            return {m.name: m.result() for m in self.metrics}

        def test_step(self, data):
            images, labels = data
            class_logits = self.linear_probe(self.encoder(images, training=False), training=False)
            self.probe_loss_tracker.update_state(self.probe_loss(labels, class_logits))
            self.probe_accuracy.update_state(labels, class_logits)
            return {m.name: m.result() for m in self.metrics[1:]}

    model = ContrastiveModel()
    model.compile(
        contrastive_optimizer=K.optimizers.Adam(1e-3), probe_optimizer=K.optimizers.Adam(1e-3)
    )
    return model


# -- Named inputs: a dict of arrays, as model.fit(x={...}, y=...) takes it ------------------
def build_named():
    num, cat = K.Input((4,), name="num"), K.Input((1,), name="cat")
    h = K.layers.Concatenate()([num, K.layers.Flatten()(K.layers.Embedding(8, 2)(cat))])
    model = K.Model({"num": num, "cat": cat}, K.layers.Dense(4)(h))
    model.compile(
        optimizer=K.optimizers.Adam(1e-2),
        loss=K.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def named_arrays(n, seed):
    rng = np.random.default_rng(seed)
    cat = rng.integers(0, 8, (n, 1))
    num = rng.normal(size=(n, 4)).astype("float32")
    y = (cat[:, 0] % 4 + (num[:, 0] > 1)) % 4
    return {"num": num, "cat": cat}, y, (1.0 + (y == 0)).astype("float32")


# -- Flawed on purpose ----------------------------------------------------------------------
def build_drift():
    """A regression whose train_step also moves a weight by this rank's own error, from its
    ninth step on (the first epoch of 8 steps agrees and is checkpointed)."""

    class Drifting(K.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = tf.reduce_mean(tf.square(y_pred[:, 0] - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            bias = self.trainable_variables[-1]
            late = tf.cast(self.optimizer.iterations > 8, tf.float32)
            bias.assign_add(late * 0.01 * tf.reduce_mean(y - y_pred[:, 0]) * tf.ones_like(bias))
            return {"loss": loss}

    inputs = K.Input((SIDE, SIDE, 1))
    model = Drifting(inputs, K.layers.Dense(1)(K.layers.Flatten()(inputs)))
    model.compile(optimizer=K.optimizers.SGD(0.01))
    return model


BUILDERS = {
    "vae": build_vae,
    "gan": build_gan,
    "wgan": build_wgan,
    "distiller": build_distiller,
    "contrastive": build_contrastive,
    "named": build_named,
    "drift": build_drift,
    "hidden": lambda: build_gan(keep_d_optimizer=False),
}


def data_for(name, train=256, test=64):
    x, y = images(train, 0)
    # Their own test_step: 67 test samples, so the ranks' shards and last batches differ.
    xt, yt = images(67 if name in ("distiller", "contrastive") else test, 1)
    if name in ("vae", "gan", "wgan", "hidden"):  # fit(x): inputs alone
        return hvdtrain.ArrayData(x)
    if name == "named":  # with sample weights, in training and in the test set
        x, y, w = named_arrays(train, 0)
        return hvdtrain.ArrayData(x, y, test=named_arrays(test, 1), sample_weight=w)
    if name == "drift":
        return hvdtrain.ArrayData(x, y.astype("float32"))
    return hvdtrain.ArrayData(x, y, test=(xt, yt))


def keras_callbacks(folder):
    """Keras's callbacks that steer and that write, as a user passes them to `fit` (the files
    named by the rank that writes them: only rank 0's should exist)."""
    rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    return [
        K.callbacks.EarlyStopping(monitor="loss", min_delta=1000.0, patience=2,
                                  restore_best_weights=True, verbose=1),
        K.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1000.0,
                                      verbose=1),
        K.callbacks.CSVLogger(os.path.join(folder, f"history-{rank}.csv"), append=True),
        K.callbacks.ModelCheckpoint(os.path.join(folder, f"last-{rank}.weights.h5"),
                                    save_weights_only=True),
        # The last epoch's logs at the end, as a tracking service's callback reads them.
        K.callbacks.LambdaCallback(
            on_train_end=lambda logs: print(f"final loss {logs['loss']:.5f}", flush=True)),
    ]  # fmt: skip


class Killer(tf.keras.callbacks.Callback):
    """Rank 1 SIGKILLs itself once global step `step` is done (mid-epoch: with one step per
    execution; else at the end of the execution that passed it)."""

    def __init__(self, step, steps_per_epoch):
        super().__init__()
        self.step, self.steps, self.epoch = step, steps_per_epoch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        import horovod.tensorflow as hvd

        if self.epoch * self.steps + batch + 1 >= self.step and hvd.rank() == 1:
            sys.stderr.write(f"rank 1: killing itself after step {self.step}\n")
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    global K
    parser = hvdtrain.ArgumentParser(epochs=2, batch_size=16)
    parser.add_argument("--models", default="gan")
    parser.add_argument("--keras", choices=["2", "3"], default="2")
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--callbacks", default=None)
    parser.add_argument("--plain", action="store_true")
    args = parser.parse_args()
    if args.keras == "3":
        import keras

        K = keras
    else:
        K = tf.keras
    if args.plain:  # Keras's own fit, one process, the global batch of 2 ranks
        tf.keras.utils.set_random_seed(args.seed)
        model = BUILDERS[args.models]()
        x = data_for(args.models).x
        model.fit(x, epochs=args.epochs, batch_size=args.batch_size * 2, verbose=0,
                  callbacks=keras_callbacks(args.callbacks))  # fmt: skip
        return
    for name in args.models.split(","):
        options = {}
        if args.checkpoint_dir:
            options["checkpoint_dir"] = os.path.join(args.checkpoint_dir, name)
        if args.metrics_json:
            folder = os.path.dirname(args.metrics_json)
            options["metrics_json"] = os.path.join(folder, f"{name}.json")
        callbacks = keras_callbacks(args.callbacks) if args.callbacks else []
        if args.kill_at:
            steps = 256 // 2 // args.batch_size
            callbacks.append(Killer(args.kill_at, steps))
        hvdtrain.fit(BUILDERS[name], data_for(name), args, callbacks=callbacks, prog=name,
                     **options)  # fmt: skip
        sys.stderr.write(f"model done: {name}\n")


if __name__ == "__main__":
    main()
