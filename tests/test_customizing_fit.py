"""Models that customize `fit` through `hvdtrain.fit` (issue 34): written as the Keras guides
write them (tests/workers/customizing_fit.py: a VAE, a GAN, a WGAN-GP, distillation, a
contrastive model), on both Keras, Gloo and MPI covered pairwise; what hvdtrain finds and
refuses; the check that stops ranks drifting apart; Keras's callbacks against plain Keras;
`ArrayData`'s structures. The settings matrix runs the guide's own `train_step` under every
other pair of settings (its `model` factor)."""

import csv
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from conftest import ROOT, job_env, run_job, worker

import hvdtrain
from hvdtrain.errors import HvdtrainError
from hvdtrain.optimizers import rates
from hvdtrain.recipe import prepare, usercallbacks

WORKER = worker("customizing_fit.py")
CORPUS = ["vae", "gan", "wgan", "distiller", "contrastive", "named"]


@pytest.fixture(scope="module", autouse=True)
def _one_rank():
    hvdtrain.init(threads=1)


def _keras(version):
    if version == "3":
        import keras

        return keras
    return tf.keras


def _corpus_module(version):
    """The worker's models, built with the Keras `version` in this process."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"customizing_fit_{version}", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.K = _keras(version)
    return module


# -- what hvdtrain finds, takes and refuses (one process) ---------------------------------
@pytest.mark.parametrize("version", ["2", "3"])
def test_every_optimizer_the_model_holds_is_found_and_replaced_once(version, tmp_path):
    k = _keras(version)
    from hvdtrain import frontends
    from hvdtrain.recipe import flags

    gan = _corpus_module(version).build_gan()
    gan.extra = [gan.d_optimizer, gan.g_optimizer]  # the same objects again, in a list
    gan.more = {"probe": k.optimizers.SGD(0.5)}
    gan.generator.compile(optimizer=k.optimizers.Adagrad(0.1), loss="mse")  # compiled alone
    frontend = frontends.for_model(gan)
    found = prepare.find_optimizers(gan, frontend)
    assert list(found) == ["optimizer", "g_optimizer", "d_optimizer", "extra[0]", "extra[1]",
                           "more['probe']", "generator.optimizer"]  # fmt: skip
    optimizers = prepare.distribute(gan, frontend, flags.make_config(None), 2)
    assert list(optimizers.by_name) == [n for n in found if not n.startswith("extra")]
    assert gan.extra[0] is gan.d_optimizer is optimizers.by_name["d_optimizer"]
    assert gan.extra[1] is gan.g_optimizer
    assert optimizers.reported == "g_optimizer"  # not Keras's unused default RMSprop
    # Checkpointed, the lists whose items were replaced included (Keras 2's ListWrapper
    # refuses to be saved once an item is replaced in place).
    from hvdtrain.recipe.checkpoint import CheckpointManager

    CheckpointManager(str(tmp_path), gan, optimizers.by_name).save(1)
    assert gan.more["probe"] is optimizers.by_name["more['probe']"]
    assert gan.generator.optimizer is optimizers.by_name["generator.optimizer"]
    assert optimizers.classes == {"optimizer": "RMSprop", "d_optimizer": "Adam",
                                  "g_optimizer": "Adam", "more['probe']": "SGD",
                                  "generator.optimizer": "Adagrad"}  # fmt: skip
    # Each keeps its own single-worker rate, x 2 ranks once the warmup (none yet) is over.
    assert float(optimizers.schedules["d_optimizer"](0)) == pytest.approx(2 * 3e-4)
    assert float(optimizers.schedules["more['probe']"](0)) == pytest.approx(2 * 0.5)
    # --lr sets every optimizer's single-worker rate.
    lr = prepare.distribute(
        _corpus_module(version).build_gan(), frontend, flags.make_config(None, lr=0.01), 1
    )
    assert [float(s(0)) for s in lr.schedules.values()] == pytest.approx([0.01] * 3)


@pytest.mark.parametrize("version", ["2", "3"])
def test_a_loss_added_with_add_loss_and_a_learning_rate_scheduler(version, tmp_path):
    """A model compiled with an optimizer only whose loss comes from add_loss trains; Keras's
    LearningRateScheduler sets the single-worker rate each epoch, as on one device."""
    k = _keras(version)

    class Penalty(k.layers.Layer):  # the loss added inside call, as Keras 3 allows it
        def call(self, x):
            self.add_loss(tf.reduce_mean(tf.square(x - 1.0)))
            return x

    def build():
        inputs = k.Input((3,))
        model = k.Model(inputs, Penalty()(k.layers.Dense(2)(inputs)))
        model.compile(optimizer=k.optimizers.SGD(0.1))
        return model

    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    scheduler = k.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 / (epoch + 1))
    out = hvdtrain.fit(build, hvdtrain.ArrayData(x), epochs=3, batch_size=8,
                       callbacks=[scheduler], warmup_epochs=0)  # fmt: skip
    loss = out["history"]["loss"]
    assert loss[-1] < loss[0]
    rates = out["history"]["lr" if version == "2" else "learning_rate"]
    assert rates == pytest.approx([0.05, 0.025, 0.05 / 3])
    assert out["lr_final"] == pytest.approx(0.05 / 3)  # x 1 rank


@pytest.mark.parametrize("version", ["2", "3"])
def test_a_subclassed_model_called_once_as_the_unbuilt_error_says_trains(version):
    k = _keras(version)

    class Mine(k.Model):
        def __init__(self):
            super().__init__()
            self.dense = k.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

    x = np.zeros((8, 3), "float32")

    def build(call_once):
        model = Mine()
        if call_once:
            model(x[:1])  # what the error says
        else:
            model.build((None, 3))  # Keras 3: its layer stays unbuilt
        model.compile(optimizer="sgd", loss="mse")
        return model

    if version == "3":
        with pytest.raises(
            HvdtrainError, match=r"call the model once on a batch, model\(x\[:1\]\)"
        ):
            hvdtrain.fit(lambda: build(False), (x, x[:, 0]), epochs=1, batch_size=4)
    out = hvdtrain.fit(lambda: build(True), (x, x[:, 0]), epochs=1, batch_size=4)
    assert out["optimizer_iterations"] == 2


REFUSALS = [
    ("not compiled", "a model that is not compiled"),
    ("unbuilt", "layer 'augmenter' is not built"),
    ("no loss", "nothing to train on (no loss in compile, no add_loss, and Keras's own"),
]


@pytest.mark.parametrize(
    "version, case, words",
    [(v, *r) for v in ("2", "3") for r in REFUSALS]
    + [("2", "legacy", "a legacy optimizer (tf.keras.optimizers.legacy.Adam)")],  # Keras 2's
)
def test_a_model_with_no_way_to_train_is_refused_in_one_line_saying_which(version, case, words):
    k = _keras(version)

    def build():
        if case == "legacy":
            model = k.Sequential([k.Input((3,)), k.layers.Dense(1)])
            model.compile(optimizer=k.optimizers.legacy.Adam(), loss="mse")
            return model
        if case == "unbuilt":
            model = _corpus_module(version).build_contrastive()
            model.augmenter = k.Sequential([k.layers.GaussianNoise(0.1)], name="augmenter")
            return model
        model = k.Sequential([k.Input((3,)), k.layers.Dense(1)])
        if case == "no loss":
            model.compile(optimizer="adam")
        return model

    x = np.zeros((8, 3), "float32")
    with pytest.raises(HvdtrainError) as e:
        hvdtrain.fit(build, (x, x[:, 0]), epochs=1, batch_size=4)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("Invalid value for `build_model")


@pytest.mark.parametrize("version", ["2", "3"])
def test_callbacks_read_and_set_the_single_worker_rate_and_updates_apply_it_x_ranks(version):
    import importlib

    k = _keras(version)
    frontend = importlib.import_module(f"hvdtrain.frontends.keras{version}")
    schedule = frontend.WarmupSchedule(0.002, 4, 0)
    opt = hvdtrain.distributed_optimizer(k.optimizers.SGD(schedule))
    opt.learning_rate = schedule
    assert float(np.asarray(opt.learning_rate)) == pytest.approx(0.008)  # Keras's: applied
    rates.show_single_worker_lr(opt)  # as hvdtrain.fit shows it to Keras's callbacks
    w = tf.Variable([0.0]) if version == "2" else k.Variable([0.0])
    opt.build([w])
    assert float(np.asarray(opt.learning_rate)) == pytest.approx(0.002)  # what a callback reads
    opt.learning_rate = 0.001  # ReduceLROnPlateau, LearningRateScheduler (Keras 3)
    if version == "2":
        k.backend.set_value(opt.lr, 0.0005)  # ... and Keras 2's, through `lr`
        assert float(k.backend.get_value(opt.lr)) == pytest.approx(0.0005)
    single = 0.0005 if version == "2" else 0.001
    opt.apply_gradients([(tf.constant([1.0]), w)])
    assert float(np.asarray(w.numpy())[0]) == pytest.approx(-4 * single)  # applied x 4 ranks
    assert float(schedule(1)) == pytest.approx(4 * single)
    with pytest.raises(TypeError, match="not settable"):  # a base schedule: as Keras
        decay = k.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
        frontend.WarmupSchedule(decay, 2, 0).set_single_worker(0.1)


@pytest.mark.parametrize("version", ["2", "3"])
def test_writers_run_on_rank_0_only_steerers_everywhere_and_backup_is_refused(version, tmp_path):
    k = _keras(version)

    class Mine(k.callbacks.Callback):
        pass

    class MyCSV(k.callbacks.CSVLogger):
        pass

    writers = [k.callbacks.ModelCheckpoint(str(tmp_path / "m.weights.h5"), save_weights_only=True),
               k.callbacks.CSVLogger(str(tmp_path / "h.csv")), MyCSV(str(tmp_path / "i.csv")),
               k.callbacks.TensorBoard(str(tmp_path)), hvdtrain.rank0_only(Mine())]  # fmt: skip
    steerers = [k.callbacks.EarlyStopping(), k.callbacks.ReduceLROnPlateau(),
                k.callbacks.LearningRateScheduler(lambda e, lr: lr), Mine(),
                k.callbacks.TerminateOnNaN()]  # fmt: skip
    assert all(usercallbacks.runs_on_rank0_only(c) for c in writers)
    assert not any(usercallbacks.runs_on_rank0_only(c) for c in steerers)
    assert usercallbacks.UserCallbacks(writers + steerers, 1).callbacks == steerers
    assert usercallbacks.UserCallbacks(writers + steerers, 0).callbacks == writers + steerers
    assert usercallbacks.UserCallbacks(steerers, 1).stops_in_epochs  # TerminateOnNaN
    assert not usercallbacks.UserCallbacks(writers + steerers[:-1], 1).stops_in_epochs
    for hook in ("on_batch_end", "on_train_batch_begin"):  # hooks set on the object itself
        lam = k.callbacks.LambdaCallback(**{hook: lambda batch, logs: None})
        assert usercallbacks.UserCallbacks([lam], 1).stops_in_epochs, hook
        assert usercallbacks.own_batch_hooks([lam]), hook  # told they run per execution

    class PerBatch(k.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            pass

    assert usercallbacks.own_batch_hooks([*writers, PerBatch()])
    # Keras's own with batch hooks (ModelCheckpoint, TensorBoard, TerminateOnNaN): no notice.
    assert not usercallbacks.own_batch_hooks(writers + steerers)
    with pytest.raises(HvdtrainError, match="received 'BackupAndRestore'.*checkpoints and resumes"):
        usercallbacks.UserCallbacks([k.callbacks.BackupAndRestore(str(tmp_path / "b"))], 0)


@pytest.mark.parametrize("version", ["2", "3"])
def test_callbacks_see_one_training_and_class_weight_reaches_keras(version, tmp_path):
    """Keras 3 runs a fit per epoch: the callbacks still see one on_train_begin and one
    on_train_end. All-zero class weights: no gradient, the weights stay as built."""
    k = _keras(version)
    seen = []

    class Count(k.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.append("begin")

        def on_epoch_end(self, epoch, logs=None):
            seen.append(epoch)

        def on_train_end(self, logs=None):
            seen.append("end")

    built = []

    def build():
        model = k.Sequential([k.Input((3,)), k.layers.Dense(2, activation="softmax")])
        model.compile(optimizer=k.optimizers.SGD(0.5), loss="sparse_categorical_crossentropy")
        built.append([w.copy() for w in model.get_weights()])
        return model

    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    board = k.callbacks.TensorBoard(str(tmp_path / "tb"))
    out = hvdtrain.fit(build, (x, y), epochs=3, batch_size=8, callbacks=[Count(), board],
                       class_weight={0: 0.0, 1: 0.0}, checkpoint_dir=str(tmp_path))  # fmt: skip
    assert seen == ["begin", 0, 1, 2, "end"]
    assert len(os.listdir(tmp_path / "tb" / "train")) == 1  # one event file, not one an epoch
    assert out["optimizer_iterations"] == 12 and out["history"]["loss"] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("version", ["2", "3"])
def test_a_model_class_of_its_own_is_exported_as_weights_that_load(version, tmp_path):
    from hvdtrain.recipe import outputs

    corpus = _corpus_module(version)
    path = outputs.export_model(corpus.build_gan(), corpus.build_gan, str(tmp_path / "model.keras"))
    assert path == str(tmp_path / "model.weights.h5") and os.path.exists(path)
    fresh = corpus.build_gan()
    fresh.built = True  # never called whole: Keras 3 loads into a model marked built
    fresh.load_weights(path)


def test_evaluation_keeps_a_metric_that_counted_nothing():
    """A false-positive count of 0 is a result (not a metric the test_step left alone)."""
    import tensorflow as tf

    never = tf.keras.initializers.Constant(-5.0)  # predicts 0 for every sample
    dense = tf.keras.layers.Dense(1, "sigmoid", kernel_initializer="zeros", bias_initializer=never)
    model = tf.keras.Sequential([tf.keras.Input((2,)), dense])
    model.compile(optimizer="sgd", loss="binary_crossentropy",
                  metrics=[tf.keras.metrics.FalsePositives(name="fp")])  # fmt: skip
    x, y = np.zeros((8, 2), "float32"), np.zeros(8, "float32")
    got = hvdtrain.evaluate(model, hvdtrain.eval_dataset(x, y, 4, 0, 1))
    assert got["fp"] == 0.0 and got["samples"] == 8


@pytest.mark.parametrize("version", ["2", "3"])
def test_evaluation_counts_samples_in_the_data_and_keeps_what_a_test_step_returns(version):
    """The Keras guide's test_step: its loss tracker updated once a batch (a count of
    batches, not samples), and a value that is no metric beside the metrics."""
    k = _keras(version)

    class CustomModel(k.Model):
        def test_step(self, data):
            x, y = data
            y_pred = self(x, training=False)
            loss = tf.reduce_mean(k.losses.mean_squared_error(y, y_pred))  # one number
            self.tracker.update_state(loss)  # once a batch, unweighted
            return {"loss": self.tracker.result(), "last_batch": tf.reduce_mean(y_pred)}

    inputs = k.Input((2,), name="num")
    model = CustomModel(inputs, k.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss="mse")
    model.tracker = k.metrics.Mean(name="loss")
    x, y = {"num": np.ones((10, 2), "float32")}, np.zeros(10, "float32")
    got = hvdtrain.evaluate(model, hvdtrain.eval_dataset(x, y, 4, 0, 1))  # 4 + 4 + 2
    assert got["samples"] == 10 and got["loss"] >= 0 and "last_batch" in got


@pytest.mark.parametrize("version", ["2", "3"])
def test_evaluation_of_a_stream_of_unknown_length_ends_without_a_warning(version):
    """A test set whose length TensorFlow does not know (lines of files, a filter) under
    several steps per call: Keras 3 warned "Your input ran out of data" on every rank at its
    end (a user's CSV test set); Keras 2 could not run it before hvdtrain counted it."""
    import warnings

    k = _keras(version)
    model = k.Sequential([k.Input((2,)), k.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=16)
    stream = hvdtrain.eval_dataset(np.ones((10, 2), "float32"), np.zeros(10, "float32"), 4, 0, 1)
    stream = stream.unbatch().filter(lambda x, y: True).batch(4)
    assert int(stream.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = hvdtrain.evaluate(model, stream)
    assert got["samples"] == 10
    assert not [str(w.message) for w in caught if "ran out of data" in str(w.message)]


# -- ArrayData takes what Keras's fit takes (one process) ---------------------------------
def test_array_data_takes_dicts_tuples_no_labels_and_weights_sharded_together():
    n = 10
    x = {"num": np.arange(n, dtype="float32")[:, None], "cat": np.arange(n) * 10}
    y = {"out": np.arange(n) * 100}
    w = np.arange(n, dtype="float32")
    ds = hvdtrain.train_dataset(x, y, 2, 1, 2, steps=2, sample_weight=w)
    bx, by, bw = next(iter(ds))
    assert set(bx) == {"num", "cat"} and set(by) == {"out"}
    got = bx["num"].numpy()[:, 0].astype(int)
    assert all(i % 2 == 1 for i in got)  # rank 1's shard
    assert (bx["cat"].numpy() == got * 10).all() and (by["out"].numpy() == got * 100).all()
    assert (bw.numpy() == got).all()
    # fit(x) alone: batches of x; a tuple x as (x,), as Keras gives them to train_step.
    alone = next(iter(hvdtrain.train_dataset(np.zeros((4, 3)), None, 2, 0, 1)))
    assert isinstance(alone, tf.Tensor) and alone.shape == (2, 3)
    pair = next(iter(hvdtrain.train_dataset((np.zeros((4, 3)), np.ones((4, 1))), None, 2, 0, 1)))
    assert isinstance(pair, tuple) and len(pair) == 1 and len(pair[0]) == 2
    # fit([a, b], y): a list of inputs of different shapes stays two inputs (tf.data would
    # stack a list into one tensor); a list of labels is an array.
    listed = next(iter(hvdtrain.train_dataset([np.zeros((4, 3)), np.ones((4, 1))], [0, 1, 2, 3],
                                              2, 0, 1)))  # fmt: skip
    assert [t.shape for t in listed[0]] == [(2, 3), (2, 1)] and listed[1].shape == (2,)
    data = hvdtrain.ArrayData(x, y, test=(x, y, w), sample_weight=w)
    assert data.num_samples == n and len(next(iter(data.eval_dataset(4, _place())))) == 3


def test_inputs_and_labels_given_as_one_tuple_fail_in_one_line_that_says_so():
    """`ArrayData((x, y))` (tf.data's habit) gives Keras two inputs and no labels: the
    error Keras raises in the first step is kept in a line that says what to write."""
    import keras

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, "softmax")])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return model

    x, y = np.zeros((16, 4), "float32"), np.zeros(16, "int64")
    with pytest.raises(HvdtrainError) as caught:
        hvdtrain.fit(build, hvdtrain.ArrayData((x, y)), epochs=1, batch_size=8)
    text = str(caught.value)
    assert "x, a tuple of 2 arrays with no y (" in text and "pass ArrayData(x, y)" in text
    assert "\n" not in text
    assert hvdtrain.ArrayData((x, y)).explain(ValueError("v")) is not None
    assert hvdtrain.ArrayData(x, y).explain(ValueError("v")) is None  # labels given
    assert hvdtrain.ArrayData((x, x)).explain(ValueError("v")) is not None
    assert hvdtrain.ArrayData(x).explain(ValueError("v")) is None  # one input, no labels
    # Other errors of a model of two inputs and no labels stay as they are.
    assert hvdtrain.ArrayData((x, x)).explain(RuntimeError("a rank was lost")) is None
    assert hvdtrain.ArrayData((x, x)).explain(HvdtrainError("diverged")) is None


def _place():
    from hvdtrain.data import Placement

    return Placement(0, 1, 0, 1, "localhost")


@pytest.mark.parametrize(
    "x, y, words",
    [
        ({"num": np.zeros(4), "cat": np.zeros(3)}, None, "`x['cat']`: received '3 samples'"),
        (np.zeros(4), {"a": np.zeros(4), "b": np.zeros(5)}, "`y['b']`: received '5 samples'"),
        (np.zeros(4), np.zeros(3), "`y`: received '3 samples'; expected one per sample of x"),
    ],
)
def test_array_data_length_mismatch_names_the_key(x, y, words):
    with pytest.raises(HvdtrainError, match=words.replace("[", r"\[").replace("]", r"\]")):
        hvdtrain.ArrayData(x, y)


# -- real ranks ---------------------------------------------------------------------------
def _train(np_, backend, out, *args, check=True, jobs=None):
    """The corpus's worker; in a shared job of `jobs` where one is given."""
    args = [WORKER, "--checkpoint-dir", str(out / "ck"), "--metrics-json", str(out / "m.json"),
            *args]  # fmt: skip
    if jobs is not None:
        return jobs.get(np_, backend).run_script(args, check=check)
    return run_job(np_, backend, args, check=check)


def _metrics(out, name):
    return json.loads((out / f"{name}.json").read_text())


@pytest.fixture(scope="module", params=[("2", "gloo"), ("3", "mpi")], ids=["k2-gloo", "k3-mpi"])
def corpus(request, tmp_path_factory, shared_jobs):
    """The corpus trained at -np 2, one model after the other in the same job: Keras 2 with
    gradient accumulation, Keras 3 with float16 on the wire."""
    version, backend = request.param
    out = tmp_path_factory.mktemp(f"corpus-{version}")
    extra = ["--accumulate", "2"] if version == "2" else ["--fp16-allreduce"]
    models = ",".join(CORPUS)
    proc = _train(2, backend, out, "--keras", version, "--models", models, *extra, jobs=shared_jobs)
    assert "Traceback" not in proc.stdout + proc.stderr
    return version, out


@pytest.mark.parametrize("name", CORPUS)
def test_models_that_customize_fit_train_on_two_ranks_to_one_weights_digest(corpus, name):
    version, out = corpus
    m = _metrics(out, name)
    assert (
        m["status"] == "finished" and m["size"] == 2 and m["keras"].startswith(f"Keras {version}")
    )
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1, m["ranks"]
    iterations = {k: v["iterations"] for k, v in m["optimizers"].items()}
    steps = 2 * m["steps_per_epoch"]  # 2 epochs
    expected = {
        "vae": {"optimizer": steps},
        "gan": {"optimizer": 0, "d_optimizer": steps, "g_optimizer": steps},
        "wgan": {"optimizer": 0, "d_optimizer": 3 * steps, "g_optimizer": steps},  # 3 critic steps
        "distiller": {"optimizer": steps},
        "contrastive": {"optimizer": 0, "contrastive_optimizer": steps, "probe_optimizer": steps},
        "named": {"optimizer": steps},
    }[name]
    assert iterations == expected
    reported = list(iterations)[1] if len(iterations) > 1 else "optimizer"  # not the default
    assert m["optimizer_iterations"] == iterations[reported]
    for opt in m["optimizers"].values():  # each optimizer's own rate x 2 after the warmup
        if opt["iterations"] >= m["steps_per_epoch"]:
            assert opt["lr_final"] == pytest.approx(2 * opt["lr_single_worker"])
    logs = {"vae": {"loss", "kl_loss"}, "gan": {"d_loss", "g_loss"}, "wgan": {"d_loss", "g_loss"},
            "distiller": {"sparse_categorical_accuracy"},
            "contrastive": {"c_loss", "p_loss", "p_acc"},
            "named": {"loss", "accuracy", "val_loss", "val_accuracy"}}[name]  # fmt: skip
    assert logs <= set(m["history"]) and all(len(v) == 2 for v in m["history"].values())
    if name in ("distiller", "contrastive"):  # their own test_step, each sample once
        accuracy = "sparse_categorical_accuracy" if name == "distiller" else "p_acc"
        assert 0 <= m["test"][accuracy] <= 1
        assert "c_loss" not in m["test"]  # what its test_step leaves alone is left out
        # Counted in the data (34 and 33 samples), not by a loss tracker a test_step of its
        # own updates once a batch (the contrastive model's).
        assert m["test_samples"] == 67
    if name == "distiller" and version == "2":  # Keras 2's guide: a value beside the metrics
        assert m["test"]["student_loss"] > 0 and len(m["history"]["val_student_loss"]) == 2
    if name == "named":  # a dict of inputs, sample weights: Keras's own steps
        assert m["test_samples"] == 64 and m["test"]["accuracy"] > 0.3
        assert os.path.exists(out / "ck" / name / "model.keras")
    else:  # classes of their own
        assert os.path.exists(out / "ck" / name / "model.weights.h5")


@pytest.mark.parametrize(
    "model, version, backend",
    [("drift", "2", "mpi"), ("hidden", "3", "gloo")],  # each Keras, each backend
)
def test_ranks_that_drift_apart_stop_in_one_line_before_a_checkpoint_of_them(
    model, version, backend, tmp_path
):
    proc = _train(2, backend, tmp_path, "--keras", version, "--models", model, "--epochs", "3",
                  check=False)  # fmt: skip
    err = proc.stderr
    # No rank's traceback (plain horovodrun --gloo prints its own when a rank fails).
    assert proc.returncode != 0 and "<stderr>:Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if "error: the ranks hold different weights" in line]
    assert len(lines) == 1, err[-3000:]
    assert "rank(s) 1 differ from rank 0" in lines[0]
    assert "an optimizer hvdtrain did not distribute" in lines[0]
    m = _metrics(tmp_path, model)
    assert m["status"] == "ranks_disagree"
    folders = sorted(os.listdir(tmp_path / "ck" / model))
    if model == "drift":  # it drifts from its second epoch: the first's checkpoint is kept
        assert "at the end of epoch 2" in lines[0] and folders == ["epoch-0001"]
    else:  # the hidden optimizer from the first step
        assert "after the first steps" in lines[0] and folders == []


def _csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("version, backend", [("3", "gloo"), ("2", "mpi")])
def test_keras_callbacks_write_once_and_steer_every_rank_as_in_plain_keras(
    version, backend, shared_jobs, tmp_path
):
    """EarlyStopping, ReduceLROnPlateau, CSVLogger and ModelCheckpoint: at -np 2 through
    hvdtrain.fit, and on one process with Keras's own fit (the global batch); then the same
    command again, which must not train past the stop."""
    plain, ours = tmp_path / "plain", tmp_path / "ours"
    plain.mkdir()
    ours.mkdir()
    flags = ["--keras", version, "--models", "vae", "--epochs", "6"]
    argv = [sys.executable, WORKER, *flags, "--plain", "--callbacks", str(plain)]
    proc = subprocess.run(
        argv, env=job_env(), capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    args = [*flags, "--warmup-epochs", "0", "--callbacks", str(ours)]
    run = _train(2, backend, ours, *args, jobs=shared_jobs)
    lr = "lr" if version == "2" else "learning_rate"
    expected, got = _csv(plain / "history-0.csv"), _csv(ours / "history-0.csv")
    # Stopped after the epoch plain Keras stops at (3 of 6), at the rates it set.
    assert [r["epoch"] for r in got] == [r["epoch"] for r in expected] == ["0", "1", "2"]
    assert [float(r[lr]) for r in got] == [float(r[lr]) for r in expected]
    assert [float(r[lr]) for r in got] == pytest.approx([1e-3, 1e-3, 5e-4])
    # Written by rank 0 alone: no file of rank 1's.
    assert sorted(p.name for p in ours.iterdir() if "-" in p.name) == [
        "history-0.csv", "last-0.weights.h5"]  # fmt: skip
    m = _metrics(ours, "vae")
    assert m["stopped_early"] == 3 and m["optimizer_iterations"] == 3 * m["steps_per_epoch"]
    # Every rank stopped there: they end on one digest, at the rate set x 2 ranks.
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1
    single = m["optimizers"]["optimizer"]["lr_single_worker"]
    assert single == pytest.approx(2.5e-4) and m["lr_final"] == pytest.approx(2 * single)
    assert "training stopped by a callback after epoch 3" in run.stderr
    # What they print (verbose=1) on rank 0 alone, as plain Keras prints it once.
    for printed in ("ReduceLROnPlateau reducing learning rate", "early stopping"):
        assert run.stdout.count(printed) == proc.stdout.count(printed) > 0, printed
    # on_train_end gets the last epoch's logs (every rank: a callback of the user's).
    final = f"final loss {float(got[-1]['loss']):.5f}"
    assert f"final loss {float(expected[-1]['loss']):.5f}" in proc.stdout
    assert run.stdout.count(final) == 2, run.stdout[-3000:]
    best = m["ranks"][0]["weights_digest"]  # EarlyStopping put the best epoch's back
    # The same command again: the stop is in the checkpoint; nothing more is trained, and
    # the weights are those the stopped run ended with (its last checkpoint written again).
    again = _train(2, backend, ours, *args, jobs=shared_jobs)
    assert "a callback stopped training after epoch 3 (in the checkpoint)" in again.stderr
    m = _metrics(ours, "vae")
    assert m["ranks"][0]["weights_digest"] == best
    assert m["stopped_early"] == 3 and m["optimizer_iterations"] == 3 * m["steps_per_epoch"]
    assert m["optimizers"]["optimizer"]["lr_single_worker"] == pytest.approx(2.5e-4)
    if version == "2":  # asking for more epochs than the stopped run did trains on
        _train(2, backend, ours, *[a if a != "6" else "7" for a in args], jobs=shared_jobs)
        m = _metrics(ours, "vae")
        assert m["optimizer_iterations"] > 3 * m["steps_per_epoch"]


def test_a_rate_set_by_a_callback_is_kept_across_a_resume(shared_jobs, tmp_path):
    """ReduceLROnPlateau halves the rate after epoch 2; the run resumed from that epoch's
    checkpoint goes on at the halved rate (its own state starts afresh, as Keras's does)."""
    for epochs in ("2", "4"):
        _train(2, "gloo", tmp_path, "--keras", "2", "--models", "vae", "--epochs", epochs,
               "--warmup-epochs", "0", "--callbacks", str(tmp_path), jobs=shared_jobs)  # fmt: skip
    rates = [float(r["lr"]) for r in _csv(tmp_path / "history-0.csv")]  # appended by both runs
    assert rates == pytest.approx([1e-3, 1e-3, 5e-4, 5e-4])


@pytest.mark.parametrize("version, backend", [("2", "gloo")])  # Keras 3: test-slow
def test_a_gan_in_float16_has_two_loss_scaled_optimizers_and_one_digest(
    version, backend, shared_jobs, tmp_path
):
    _train(2, backend, tmp_path, "--keras", version, "--models", "gan", "--mixed-precision",
           "float16", jobs=shared_jobs)  # fmt: skip
    m = _metrics(tmp_path, "gan")
    assert m["mixed_precision"] == "mixed_float16"
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1
    for name in ("d_optimizer", "g_optimizer"):
        assert m["optimizers"][name]["loss_scale"] > 0  # a dynamic scale, agreed by the ranks


@pytest.mark.slow
@pytest.mark.parametrize("version, backend", [("3", "mpi")])
def test_a_gan_in_float16_on_keras3(version, backend, shared_jobs, tmp_path):
    test_a_gan_in_float16_has_two_loss_scaled_optimizers_and_one_digest(
        version, backend, shared_jobs, tmp_path
    )


@pytest.mark.parametrize("version, backend", [("3", "gloo")])
def test_a_gan_killed_mid_epoch_resumes_bitwise(version, backend, shared_jobs, tmp_path):
    """--deterministic: the Keras 3 guide's GAN draws its noise from a seed generator, which
    the checkpoint holds. Killed after step 5 (checkpoint at step 4), run again: the same
    weights as a run never interrupted."""
    flags = ["--keras", version, "--models", "gan", "--epochs", "2", "--deterministic",
             "--checkpoint-every", "2"]  # fmt: skip
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    _train(2, backend, whole, *flags, jobs=shared_jobs)
    killed = _train(2, backend, cut, *flags, "--kill-at", "5", check=False)
    assert killed.returncode != 0 and "rank 1: killing itself after step 5" in killed.stderr
    resumed = _train(2, backend, cut, *flags)
    assert "resuming after epoch 1, step 4 of 8" in resumed.stderr
    digests = {r["weights_digest"] for r in _metrics(whole, "gan")["ranks"]}
    assert {r["weights_digest"] for r in _metrics(cut, "gan")["ranks"]} == digests
    assert len(digests) == 1


def test_a_gan_under_local_sgd_exchanges_both_optimizers_state_to_one_digest(shared_jobs, tmp_path):
    """`--sync local`: each optimizer steps alone after the warmup (epoch 1); the weights and
    both Adams' moments are averaged every 2 steps of epoch 2 (8 steps: 4 exchanges)."""
    _train(2, "gloo", tmp_path, "--keras", "2", "--models", "gan", "--epochs", "2", "--sync",
           "local", "--sync-every", "2", jobs=shared_jobs)  # fmt: skip
    m = _metrics(tmp_path, "gan")
    assert m["sync"]["mode"] == "local" and m["sync"]["warmup_steps"] == 8
    assert m["sync"]["exchanges"] == 4 and m["status"] == "finished"
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1


@pytest.mark.slow
@pytest.mark.parametrize(  # elastic's synchronous mode: test_elastic.py
    "sync, restored",
    [(["--sync", "local", "--sync-every", "3", "--commit-every", "2"], 11),
     (["--sync", "local", "--sync-every", "3", "--commit-every", "2", "--sync-overlap"], 10)],
    ids=["local", "local-overlap"],
)  # fmt: skip
def test_a_gan_under_elastic_goes_on_from_the_last_commit_when_a_rank_is_lost(
    sync, restored, tmp_path
):
    """`--elastic` on two hosts of this machine; rank 1 kills itself after step 12 (epoch 2):
    the survivor rolls both optimizers back to the last commit and trains on alone. Under
    `--sync local` (epoch 1 synchronous, then an exchange every 3 steps) a commit waits for
    an exchange: the last is 3 steps into epoch 2, not 4. With `--sync-overlap` the ranks
    agree only at whole exchanges, and a due commit makes one: at step 10 (waiting for one
    would go back to epoch 1's end, step 8)."""
    run = os.path.join(os.path.dirname(sys.executable), "hvdtrain-run")
    argv = [run, "--elastic", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1", "--",
            sys.executable, WORKER, "--elastic", "--keras", "3", "--models", "gan",
            "--epochs", "3", "--kill-at", "12", "--commit-every", "5",
            "--steps-per-execution", "1", "--checkpoint-dir", str(tmp_path / "ck"),
            "--metrics-json", str(tmp_path / "m.json"), *sync]  # fmt: skip
    env = job_env(HOROVOD_ELASTIC_TIMEOUT="60", HOROVOD_GLOO_TIMEOUT_SECONDS="60")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=420, cwd=ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "rank 1: killing itself after step 12" in out
    assert "elastic: a worker failed; 2 -> 1 rank(s)" in out
    m = _metrics(tmp_path, "gan")
    assert m["size"] == 1 and m["status"] == "finished"
    (reset,) = m["elastic"]["resets"]
    assert reset["restored"]["step"] == reset["last_commit"]["step"] <= 12
    assert reset["restored"]["step"] == restored and m["sync"]["exchanges"] > 0
    # Both optimizers rolled back with the weights: the steps of 2 ranks before the commit,
    # then 1 rank's (16 a epoch) from there to the end of epoch 3.
    before = reset["restored"]["step"]
    after = 3 * 16 - (before // 8 * 16 + before % 8 * 2)
    for name in ("d_optimizer", "g_optimizer"):
        assert m["optimizers"][name]["iterations"] == before + after
    assert len(m["history"]["d_loss"]) == 3


def test_keras2_loss_scaling_where_a_train_step_applies_skips_on_every_rank(tmp_path):
    """Keras 2's loss scale, the gradients given to `apply_gradients` (a train_step of the
    user's own): averaged before the skip-or-apply decision, so a step whose gradients
    overflow on rank 1 only is skipped on both (Keras 3's: test_keras3.py)."""
    run_job(2, "mpi", [worker("loss_scale_checks.py"), str(tmp_path), "--keras", "2"])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # Skipped, then one averaged update: 1 - 0.1 x mean(0, 1) (Keras 2 applies as given).
    assert ranks[0]["w"] == ranks[1]["w"] == pytest.approx([1 - 0.05] * 3)
    assert ranks[0]["scale"] == ranks[1]["scale"] == 2.0**14  # halved once, from 2**15
    assert ranks[0]["iterations"] == ranks[1]["iterations"] == 2  # the skipped step counts
