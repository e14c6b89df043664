"""examples/: the single-device diff stays small, and each example trains on 2 real ranks."""

import ast
import difflib
import json
import os
import re

import pytest
from conftest import ROOT, ours, run_job
from helpers.image_folders import class_folders

EXAMPLES = os.path.join(ROOT, "examples")
LAUNCH_COMMANDS = [
    "horovodrun -np 2 -H localhost:2 python examples/{}",
    "hvdtrain-run --hostfile hosts.txt -- python examples/{}",
    "mpirun -np 2 python examples/{}",
]


def _read(name):
    with open(os.path.join(EXAMPLES, name)) as f:
        return f.read()


def _rank_lines(output, rank):  # the examples import TensorFlow first: its noise is not ours
    return [line for line in ours(output) if re.match(rf"\[{rank}\]<std(out|err)>", line)]


def test_keras_fit_is_the_single_device_script_plus_at_most_10_marked_lines():
    single, dist = _read("keras_fit_single.py"), _read("keras_fit.py")
    diff = list(difflib.unified_diff(single.splitlines(), dist.splitlines(), lineterm=""))
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in diff if line.startswith("-") and not line.startswith("---")]
    assert 0 < len(added) <= 10, "\n".join(diff)
    assert len(removed) <= len(added)
    assert all("# Horovod:" in line for line in added), "\n".join(added)


def test_docstrings_give_the_launch_commands():
    for name in ("keras_fit.py", "custom_loop.py"):
        doc = ast.get_docstring(ast.parse(_read(name)))
        assert f"python examples/{name}" in doc
        for command in LAUNCH_COMMANDS:
            assert command.format(name) in doc, (name, command)


def test_single_device_script_runs(tmp_path):
    metrics = tmp_path / "m.json"
    args = ["--epochs", "1", "--steps", "3", "--metrics-json", str(metrics)]
    run_job(1, "none", [os.path.join(EXAMPLES, "keras_fit_single.py"), *args])
    m = json.loads(metrics.read_text())
    assert len(m["history"]["loss"]) == 1 and 0 <= m["test"]["accuracy"] <= 1


def as_keras3(source):
    """A Keras 2 script made Keras 3 as a user would: `import keras` for tf.keras, compile's
    metrics by keyword (Keras 3's third positional argument is loss_weights)."""
    source = source.replace("import tensorflow as tf\n", "import keras\nimport tensorflow as tf\n")
    source = source.replace("tf.keras.", "keras.")
    return source.replace(
        "model.compile(opt, loss=loss,", "model.compile(optimizer=opt, loss=loss,"
    )


@pytest.mark.parametrize("keras", ["2", "3"])
def test_keras_fit_on_two_ranks(keras, shared_jobs, tmp_path):
    """The building blocks in a user's own `fit` (warmup schedule, distributed optimizer,
    broadcast, metric averaging), on either Keras: 3 is the same script on `import keras`."""
    script = os.path.join(EXAMPLES, "keras_fit.py")
    if keras == "3":
        script = tmp_path / "keras3_fit_blocks.py"
        script.write_text(as_keras3(_read("keras_fit.py")))
        assert "tf.keras" not in script.read_text()
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.json"
    args = ["--epochs", "2", "--steps", "5", "--checkpoint-dir", str(ckpt)]
    proc = shared_jobs.get(2, "gloo").run_script([script, *args, "--metrics-json", metrics])
    m = json.loads(metrics.read_text())
    assert [r["rank"] for r in m["ranks"]] == [0, 1]
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1
    assert len(m["history"]["loss"]) == 2 and 0 <= m["test"]["accuracy"] <= 1
    assert sorted(os.listdir(ckpt)) == ["epoch-01.weights.h5", "epoch-02.weights.h5"]
    output = proc.stdout
    assert any("test loss" in line for line in _rank_lines(output, 0))
    # Keras 3's own warning on every rank (its `fit` shuffles by default, a dataset never).
    quiet = [
        line
        for line in _rank_lines(output, 1)
        if "shuffle" not in line and "data_adapter" not in line
    ]
    assert not quiet, output[-3000:]


def test_custom_loop_on_two_ranks_then_resumes(shared_jobs, tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.json"
    script = os.path.join(EXAMPLES, "custom_loop.py")
    args = ["--steps", "5", "--checkpoint-dir", str(ckpt), "--metrics-json", str(metrics)]
    job = shared_jobs.get(2, "gloo")
    proc = job.run_script([script, "--epochs", "2", *args])
    m = json.loads(metrics.read_text())
    assert m["size"] == 2 and m["start_epoch"] == 0 and m["optimizer_steps"] == 10
    assert [h["epoch"] for h in m["history"]] == [1, 2]
    assert [r["rank"] for r in m["ranks"]] == [0, 1]
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1
    assert sorted(os.listdir(ckpt)) == ["epoch-0001", "epoch-0002"]
    manifest = json.loads((ckpt / "epoch-0002" / "manifest.json").read_text())
    assert manifest["written_by"]["pid"] == m["ranks"][0]["pid"]  # rank 0 wrote it
    output = proc.stdout
    assert len([line for line in _rank_lines(output, 0) if "samples/s" in line]) == 2
    assert not _rank_lines(output, 1), output[-3000:]

    job.run_script([script, "--epochs", "3", *args])  # the same command, one epoch more
    m = json.loads(metrics.read_text())
    assert m["start_epoch"] == 2 and m["optimizer_steps"] == 15  # optimizer state restored
    assert [h["epoch"] for h in m["history"]] == [3]
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1


def test_tfrecord_example_writes_its_files_trains_and_resumes_after_a_kill(tmp_path):
    """examples/tfrecord_train.py: the embedded digits written as TFRecord files, a model
    with BatchNorm trained on 2 ranks with `--checkpoint-every 20`, SIGKILLed mid-epoch after
    its step-20 checkpoint; the command again, with the defaults (16 steps per execution,
    the test set evaluated at each epoch end), resumes there and finishes."""
    import sys

    from conftest import launch_argv, run_until

    data, ckpt, metrics = tmp_path / "data", tmp_path / "ckpt", tmp_path / "m.json"
    argv = launch_argv(2, "gloo") + [
        sys.executable, os.path.join(EXAMPLES, "tfrecord_train.py"), "--epochs", "2",
        "--data-dir", str(data), "--checkpoint-dir", str(ckpt), "--metrics-json", str(metrics),
        "--threads", "1", "--progress", "off",
    ]  # fmt: skip
    every_20 = ["--checkpoint-every", "20"]
    # The checkpoint 20 steps into epoch 1, then the kill.
    lines = run_until(argv + every_20, r"saved checkpoint.*\(epoch 1, step 20 of")
    assert any("epoch-0001-step-000020 (epoch 1, step 20 of" in line for line in lines)
    assert sorted(os.listdir(data)) == ["test-0.tfrecord"] + [
        f"train-{i}.tfrecord" for i in range(6)
    ]
    assert not metrics.exists()

    proc = run_job(2, "gloo", argv[len(launch_argv(2, "gloo")) + 1 :])
    m = json.loads(metrics.read_text())
    assert m["resumed_from"] == {
        "epoch": 1, "step": 20, "checkpoint": "epoch-0001-step-000020", "optimizer_iterations": 20
    }  # fmt: skip
    assert m["data_source"] == "files" and m["train_samples"] == 4500
    assert m["test_samples"] == 500 and m["test"]["accuracy"] > 0.5
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1  # BatchNorm averaged
    assert "resuming after epoch 1, step 20 of" in proc.stdout + proc.stderr
    assert m["steps_per_execution"] == 16 and len(m["history"]["val_loss"]) == 2


@pytest.mark.parametrize("keras, backend", [("2", "gloo"), ("3", "mpi")])
def test_gan_example_trains_both_optimizers_on_two_ranks(keras, backend, shared_jobs, tmp_path):
    """examples/gan.py: the Keras guide's GAN (its own compile and train_step, two
    optimizers) through hvdtrain.fit, launched as the docstring says."""
    doc = ast.get_docstring(ast.parse(_read("gan.py")))
    assert "horovodrun -np 2 -H localhost:2 python examples/gan.py --keras 3" in doc
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.json"
    args = [os.path.join(EXAMPLES, "gan.py"), "--keras", keras, "--epochs", "1",
            "--limit-samples", "640", "--checkpoint-dir", str(ckpt), "--metrics-json",
            str(metrics)]  # fmt: skip
    shared_jobs.get(2, backend).run_script(args)
    m = json.loads(metrics.read_text())
    assert m["status"] == "finished" and m["keras"].startswith(f"Keras {keras}")
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1
    assert {k: v["iterations"] for k, v in m["optimizers"].items()} == {
        "optimizer": 0, "d_optimizer": 5, "g_optimizer": 5}  # fmt: skip
    assert (ckpt / "samples.png").stat().st_size > 0 and (ckpt / "model.weights.h5").exists()


@pytest.mark.slow
def test_the_imagenet_example_trains_resnet50_on_a_folder_of_images(tmp_path):
    """Horovod's keras_imagenet_resnet50.py loading through hvdtrain.fit: every image of the
    epoch trained once and every test image evaluated once, at -np 2 (about 75 s here)."""
    folder = class_folders(tmp_path / "images", {"train": 40, "test": 11}, side=32)
    metrics = tmp_path / "m.json"
    proc = run_job(2, "gloo", [os.path.join(EXAMPLES, "imagenet_resnet50.py"),
                               "--train-dir", folder / "train", "--val-dir", folder / "test",
                               "--image-size", "32", "--epochs", "1", "--batch-size", "8",
                               "--eval-batch-size", "8", "--loader-workers", "1",
                               "--metrics-json", metrics], timeout=400)  # fmt: skip
    assert "Traceback" not in proc.stdout + proc.stderr
    m = json.loads(metrics.read_text())
    assert m["steps_per_epoch"] == 5 and m["samples_per_epoch"] == 80
    assert m["test_samples"] == 22 and len({r["weights_digest"] for r in m["ranks"]}) == 1
