"""The other workloads and training options: CIFAR-10, image folders, mixed precision,
fp16 allreduce and gradient accumulation, each on real ranks for a few steps."""

import json
import pickle

import numpy as np
import pytest
from conftest import worker

from hvdtrain.errors import HvdtrainError


def _metrics(path):
    m = json.loads(path.read_text())
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1  # ranks in sync
    return m


@pytest.mark.parametrize("keras", ["2", "3"])
def test_accumulating_n_batches_of_b_matches_one_batch_of_n_times_b(keras, shared_jobs, tmp_path):
    acc, big = tmp_path / "acc.npz", tmp_path / "big.npz"
    alone = shared_jobs.get(1, "none")
    alone.run_script([worker("accumulate.py"), acc, "16", "2", "8", keras])
    alone.run_script([worker("accumulate.py"), big, "32", "1", "4", keras])
    a, b = np.load(acc), np.load(big)
    for k in ("arr_0", "arr_1", "arr_2", "arr_3"):
        np.testing.assert_allclose(a[k], b[k], atol=1e-6, rtol=0)
    assert a["iterations"] == 8 and b["iterations"] == 4  # every step counts
    two = tmp_path / "two.npz"
    shared_jobs.get(2, "gloo").run_script([worker("accumulate.py"), two, "8", "2", "8", keras])
    assert len(set(np.load(two)["digests"])) == 1


@pytest.mark.parametrize(
    "flags",
    [
        ["--mixed-precision", "bfloat16", "--fp16-allreduce", "--accumulate", "2"],
        ["--mixed-precision", "bfloat16", "--fp16-allreduce", "--accumulate", "2", "--keras", "3"],
        ["--mixed-precision", "float16"],  # loss scaling around the distributed optimizer
    ],
)
def test_precision_and_compression_options_keep_ranks_in_sync(flags, shared_jobs, tmp_path):
    metrics = tmp_path / "m.json"
    shared_jobs.get(2, "gloo").run_script(
        [
            "-m",
            "hvdtrain.mnist",
            "--model",
            "mlp",
            "--epochs",
            "1",
            "--limit-samples",
            "1024",
            "--metrics-json",
            str(metrics),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            *flags,
        ],
    )
    m = _metrics(metrics)
    assert m["mixed_precision"] == f"mixed_{flags[1]}"
    assert m["test_accuracy"] > 0.5
    assert (tmp_path / "ckpt" / "model.keras").exists()


@pytest.mark.parametrize("keras", ["3"])  # Keras 2's CIFAR-10: the ResNet-50 test below
def test_cifar10_synthetic_fallback_is_announced(keras, shared_jobs, tmp_path):
    metrics = tmp_path / "m.json"
    args = ["-m", "hvdtrain.cifar10", "--epochs", "1", "--limit-samples", "256",
            "--batch-size", "16", "--metrics-json", str(metrics), "--keras", keras]  # fmt: skip
    proc = shared_jobs.get(2, "gloo").run_script(args)
    assert "SYNTHETIC random images" in proc.stdout
    m = _metrics(metrics)
    assert m["data_source"] == "synthetic" and m["size"] == 2 and m["steps_per_epoch"] == 8
    assert m["keras"].startswith(f"Keras {keras}")


def _cifar_batches(folder, n=8):
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": rng.integers(0, 10, n).tolist(),
        }
        (folder / name).write_bytes(pickle.dumps(batch))


def test_cifar10_reads_the_python_batches_and_refuses_code_in_them(tmp_path):
    from hvdtrain.cifar10 import load_cifar10

    _cifar_batches(tmp_path / "cifar-10-batches-py")
    (x, y), (xt, yt) = load_cifar10("data-dir", str(tmp_path))
    assert x.shape == (40, 32, 32, 3) and x.dtype == np.uint8 and y.shape == (40,)
    assert xt.shape == (8, 32, 32, 3)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "cifar-10-batches-py" / "test_batch").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(HvdtrainError, match="refusing to load builtins.print"):
        load_cifar10("data-dir", str(tmp_path))


def _image_folder(root, per_class=6):
    import tensorflow as tf

    rng = np.random.default_rng(0)
    for c, name in enumerate(("cat", "dog")):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 256, (48 + 8 * i, 64, 3), dtype=np.uint8) // (c + 1)
            (root / name / f"{i}.png").write_bytes(tf.io.encode_png(pixels).numpy())


@pytest.mark.parametrize("fraction, held", [(0.2, 2), (0.01, 2), (0, 0)])
def test_images_split_holds_out_a_share_of_each_class_and_none_at_0(fraction, held, tmp_path):
    from hvdtrain.images import list_images

    _image_folder(tmp_path / "pets")
    (x, y), (xt, yt), classes = list_images(str(tmp_path / "pets"), fraction)
    assert classes == ["cat", "dog"] and len(xt) == held and len(x) == 12 - held
    assert sorted(yt.tolist()) == [0, 1][: held and 2]  # one of each class, when any
    assert not set(x) & set(xt)


@pytest.mark.parametrize("keras", ["3"])  # Keras 2's model: the test below builds it
def test_images_transfer_learning_on_a_generated_folder(keras, shared_jobs, tmp_path):
    _image_folder(tmp_path / "pets")
    metrics = tmp_path / "m.json"
    args = ["-m", "hvdtrain.images", "--data-dir", str(tmp_path / "pets"), "--epochs", "1",
            "--batch-size", "2", "--test-fraction", "0.2", "--metrics-json", str(metrics),
            "--keras", keras]  # fmt: skip
    proc = shared_jobs.get(2, "gloo").run_script(args)
    assert "random initialisation (no --weights" in proc.stdout
    m = _metrics(metrics)
    assert m["train_samples"] == 10 and m["test_samples"] == 2 and m["steps_per_epoch"] == 2
    assert m["keras"].startswith(f"Keras {keras}")


@pytest.mark.parametrize("keras", ["2", "3"])
def test_images_with_local_weights_freezes_the_base(keras, tmp_path):
    from hvdtrain import frontends
    from hvdtrain.images import build_model

    weights = tmp_path / "base.h5"  # a Keras 2 weights file, as Keras applications ship them
    build_model(2).get_layer("mobilenetv2_1.00_224").save_weights(str(weights))
    model = build_model(2, str(weights), frontends.keras_module(keras))
    assert not model.get_layer("mobilenetv2_1.00_224").trainable
    assert len(model.trainable_weights) == 2  # the new head only


def test_cifar10_resnet50_is_keras_resnet50_for_its_images():
    """In this process: ResNet-50 trains through `fit` in the ImageNet example's test
    (test_examples.py, slow); the CIFAR-10 entry point's run is its small ResNet's."""
    from hvdtrain.cifar10 import build_model

    model = build_model("resnet50")
    assert model.name == "resnet50" and model.input_shape == (None, 32, 32, 3)
    assert model.output_shape == (None, 10) and model.count_params() > 23_000_000
