"""The public building blocks in one process (no launcher): checkpoint labels with several
steps per execution, the export's formats and rank, evaluation that follows the model's
compiled loss and metrics."""

import numpy as np
import pytest
import tensorflow as tf

import hvdtrain


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    hvdtrain.init(threads=1)


def _regression(spe=1):
    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(tf.keras.optimizers.SGD(0.01), "mse", ["mae"], steps_per_execution=spe)
    return model


def test_mid_epoch_checkpoints_are_labelled_with_the_real_step_whatever_the_execution(tmp_path):
    """4 steps per execution, a checkpoint every 3 steps, 10 steps per epoch: Keras calls the
    callback after steps 4, 8 and 10; the checkpoints are at the steps that passed a multiple
    of 3 (4 and 8; 10 ends the epoch), named by those steps."""
    model = _regression(spe=4)
    manager = hvdtrain.CheckpointManager(tmp_path, model, model.optimizer, keep=10)
    callback = hvdtrain.CheckpointCallback(manager, {"steps_per_epoch": 10}, 10, every_steps=3)
    x = np.ones((40, 3), np.float32)
    model.fit(
        x, x[:, :1], batch_size=4, epochs=2, steps_per_epoch=10, callbacks=[callback], verbose=0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch-0001",
        "epoch-0001-step-000004",
        "epoch-0001-step-000008",
        "epoch-0002",
        "epoch-0002-step-000004",
        "epoch-0002-step-000008",
    ]  # fmt: skip (epoch 1, steps 4 and 8; its end; epoch 2, steps 4 and 8; its end)
    found = manager.latest()
    assert (found.epoch, found.step, found.global_step) == (2, 0, 20)


@pytest.mark.parametrize("name", ["model.keras", "model.h5", "saved_model"])
def test_export_follows_the_suffix_makes_the_folder_and_loads_in_plain_keras(tmp_path, name):
    model = _regression()
    path = tmp_path / "missing" / "folder" / name
    assert hvdtrain.export_model(model, _regression, str(path)) == str(path)
    loaded = tf.keras.models.load_model(str(path), compile=False)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-6)
    assert [p.name for p in path.parent.iterdir()] == [name]  # no temporary left behind


def test_export_writes_on_rank_0_only(tmp_path, monkeypatch):
    import horovod.tensorflow as hvd

    if hvd.is_initialized():  # this process is rank 0 of 1: ask as rank 1 of the launcher
        monkeypatch.setattr(hvd, "rank", lambda: 1)
    assert hvdtrain.export_model(_regression(), _regression, str(tmp_path / "m.keras")) is None
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "loss, metrics, labels",
    [
        ("categorical_crossentropy", ["categorical_accuracy"], "one-hot"),  # probabilities
        ("binary_crossentropy", [tf.keras.metrics.AUC(name="auc")], "binary"),
        ("mse", ["mae"], "regression"),
    ],
)
def test_evaluate_follows_the_compiled_loss_and_metrics(loss, metrics, labels):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(203, 5)).astype(np.float32)
    units, activation = {"one-hot": (4, "softmax"), "binary": (1, "sigmoid")}.get(labels, (1, None))
    y = {
        "one-hot": np.eye(4, dtype=np.float32)[rng.integers(0, 4, 203)],
        "binary": rng.integers(0, 2, (203, 1)).astype(np.float32),
        "regression": rng.normal(size=(203, 1)).astype(np.float32),
    }[labels]
    model = tf.keras.Sequential([tf.keras.Input((5,)), tf.keras.layers.Dense(units, activation)])
    model.compile("sgd", loss, metrics)
    expected = model.evaluate(x, y, batch_size=203, verbose=0, return_dict=True)
    got = hvdtrain.evaluate(model, hvdtrain.eval_dataset(x, y, 32, 0, 1))
    assert got["samples"] == 203 and set(got) == set(expected) | {"samples"}
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-5), k


@pytest.mark.parametrize("spe", [1, 4])
def test_evaluate_refuses_an_endless_dataset(spe):
    x = np.ones((8, 3), np.float32)
    endless = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).repeat().batch(4)
    with pytest.raises(hvdtrain.HvdtrainError, match="an endless dataset"):
        hvdtrain.evaluate(_regression(spe), endless)


@pytest.mark.parametrize(
    ("lr", "x", "words"),
    [
        (1e30, 1.0, "the weights at epoch 1, step 1 blew up (up to "),
        (0.01, float("nan"), "the weights at epoch 1, step 1 became NaN or infinite"),
        (0.01, 1.0, None),  # trains: nothing said
    ],
)
def test_divergence_stops_on_nan_infinite_or_blown_up_weights(lr, x, words):
    """A huge learning rate blows the weights up to 1e30 and the loss can stay finite (every
    ReLU dead): that is divergence too, as NaN or infinite weights are."""
    from hvdtrain.errors import TrainingDiverged
    from hvdtrain.recipe.callbacks import DivergenceCallback

    model = tf.keras.Sequential([tf.keras.Input((3,)), tf.keras.layers.Dense(1)])
    model.compile(tf.keras.optimizers.SGD(lr), "mse")
    data = np.full((8, 3), x, np.float32), np.ones((8, 1), np.float32)
    callbacks = [DivergenceCallback(2)]
    if words is None:
        model.fit(*data, batch_size=4, callbacks=callbacks, verbose=0)
        return
    with pytest.raises(TrainingDiverged) as caught:
        model.fit(*data, batch_size=4, callbacks=callbacks, verbose=0)
    assert str(caught.value).startswith(f"training diverged: {words}")
    assert "; stopped on every rank, no checkpoint written after it" in str(caught.value)


def test_horovods_graph_code_is_traced_as_it_is_not_converted_by_autograph(monkeypatch):
    """After `hvdtrain.init()`, autograph leaves Horovod's functions alone, as it leaves
    Keras's (they branch on tensors with tf.cond): no generated code for them, and the
    allreduce inside a tf.function gives what it gave converted."""
    import horovod.tensorflow as hvd
    from tensorflow.python.autograph.pyct import transpiler

    transformed = []
    transform = transpiler.GenericTranspiler.transform_function

    def watch(self, fn, user_context):
        transformed.append(getattr(fn, "__module__", ""))
        return transform(self, fn, user_context)

    x = tf.constant([1.0, 2.0])
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(0.1))
    variable = tf.Variable([1.0, 1.0])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.allreduce(variable * x))
        grads = tape.gradient(loss, [variable])
        optimizer.apply_gradients(zip(grads, [variable], strict=True))
        return loss

    monkeypatch.setattr(transpiler.GenericTranspiler, "transform_function", watch)
    assert float(step()) == 3.0
    monkeypatch.undo()
    assert variable.numpy().tolist() == pytest.approx([0.9, 0.8])
    assert not [m for m in transformed if m.startswith("horovod.")], transformed
