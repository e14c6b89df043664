"""A user's Keras 3 model (`import keras`: functional, `keras.ops`, BatchNorm, AdamW, AUC)
through `hvdtrain.fit` on real ranks: examples/keras3_fit.py. The settings matrix
(test_settings_matrix.py) runs Keras 3 beside Keras 2 under every other pair of settings."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, job_env

SCRIPT = os.path.join(ROOT, "examples", "keras3_fit.py")


def train(jobs, np, backend, out, epochs):
    args = [SCRIPT, "--epochs", str(epochs), "--checkpoint-dir", str(out / "ckpt"),
            "--metrics-json", str(out / "m.json")]  # fmt: skip
    proc = jobs.get(np, backend).run_script(args)
    assert "Traceback" not in proc.stdout + proc.stderr
    return json.loads((out / "m.json").read_text())


@pytest.fixture(scope="module")
def alone(tmp_path_factory, shared_jobs):
    return train(shared_jobs, 1, "none", tmp_path_factory.mktemp("keras3-alone"), 3)


@pytest.mark.parametrize("backend", ["gloo"])  # Keras 3 under MPI: the settings matrix
def test_keras3_trains_on_two_ranks_resumes_and_exports_for_plain_keras(
    backend, alone, shared_jobs, tmp_path
):
    first = train(shared_jobs, 2, backend, tmp_path, 3)
    assert first["size"] == 2 and first["test_samples"] == 2000
    assert len({r["weights_digest"] for r in first["ranks"]}) == 1  # BatchNorm averaged too
    # 8,000 samples, batch 64 x 2 ranks: 62 steps an epoch (not a multiple of 16 per call)
    assert first["steps_per_epoch"] == 62 and first["optimizer_iterations"] == 3 * 62
    assert first["lr_final"] == pytest.approx(2e-3)  # 1e-3 x 2 ranks after the warmup
    assert first["test"]["auc"] == pytest.approx(alone["test"]["auc"], abs=0.02)
    assert first["test"]["auc"] > 0.9

    again = train(shared_jobs, 2, backend, tmp_path, 5)  # the same command, two epochs more
    assert again["resumed_from"]["epoch"] == 3 and again["optimizer_iterations"] == 5 * 62
    assert len(again["history"]["val_auc"]) == 5
    assert len({r["weights_digest"] for r in again["ranks"]}) == 1

    # The export, in a process with plain Keras 3 only (no hvdtrain, no Horovod).
    check = (
        "import keras, numpy as np, sys\n"
        "m = keras.saving.load_model(sys.argv[1])\n"
        "p = m.predict(np.zeros((3, 10), 'float32'), verbose=0)\n"
        "assert p.shape == (3, 1) and np.isfinite(p).all()\n"
        "print('loaded', type(m).__name__)\n"
    )
    env = {k: v for k, v in job_env().items() if k != "TF_USE_LEGACY_KERAS"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-c", check, str(tmp_path / "ckpt" / "model.keras")],
        env=env, capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0 and "loaded Functional" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("backend", ["jax", "torch", "numpy"])
def test_a_keras3_backend_other_than_tensorflow_is_one_clear_error(backend):
    """In this process (Keras's backend is fixed when it is imported, and JAX and PyTorch are
    not installed here: with KERAS_BACKEND=numpy, building a model already imports JAX)."""
    from hvdtrain.errors import HvdtrainError
    from hvdtrain.frontends import keras3

    with pytest.raises(HvdtrainError) as caught:
        keras3.check(None, backend)
    message = str(caught.value)
    assert message.startswith(
        f"Invalid value for `KERAS_BACKEND`: received '{backend}'; expected 'tensorflow'"
    )
    assert len(message.splitlines()) == 1 and message.endswith("Set KERAS_BACKEND=tensorflow.")


def test_a_keras3_custom_loop_with_the_building_blocks_trains_and_resumes(shared_jobs, tmp_path):
    """examples/keras3_custom_loop.py: `distributed_optimizer` on a Keras 3 optimizer,
    `broadcast_initial_state`, `average_model_state`, `evaluate`, `CheckpointManager`."""
    script = os.path.join(ROOT, "examples", "keras3_custom_loop.py")
    args = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--metrics-json", str(tmp_path / "m.json")]
    for epochs in (2, 3):  # then the same command with one epoch more: a resume
        proc = shared_jobs.get(2, "gloo").run_script([script, "--epochs", str(epochs), *args])
        assert "Traceback" not in proc.stdout + proc.stderr
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["size"] == 2 and m["start_epoch"] == 2
    assert m["optimizer_steps"] == 3 * 39  # 5,000 samples, 2 ranks x 64: 39 steps an epoch
    assert m["test"]["samples"] == 1000 and m["test"]["accuracy"] > 0.8
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1


@pytest.mark.parametrize("backend", ["mpi"])  # through fit under Gloo: test_schedules.py
def test_keras3_loss_scaling_skips_a_step_on_every_rank_when_one_ranks_gradients_overflow(
    backend, shared_jobs, tmp_path
):
    from conftest import worker

    shared_jobs.get(2, backend).run_script(
        [worker("loss_scale_checks.py"), tmp_path, "--keras", "3"]
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["finite"] for r in ranks] == [False, False]  # both skip, nobody waits
    # Skipped, then one averaged update, 1 - 0.1 x mean(0, 1), the same on both ranks: the
    # gradients were given without scale_loss, so they are applied as given.
    assert ranks[0]["w"] == ranks[1]["w"] == pytest.approx([1 - 0.05] * 3, abs=1e-7)
    assert ranks[0]["scale"] == ranks[1]["scale"] == 2.0**14  # halved once, from 2**15
    assert ranks[0]["iterations"] == ranks[1]["iterations"] == 2  # the skipped step counts


@pytest.mark.parametrize("keras", ["3"])  # the same check in trainer.py for both Keras
def test_xla_asked_for_is_turned_off_in_one_line(keras, shared_jobs, tmp_path):
    """Horovod's allreduce cannot run inside XLA: a model compiled with jit_compile=True
    (or, on Keras 3, "auto" on a GPU) trains without it, and rank 0 says so once."""
    from conftest import worker

    metrics = tmp_path / "m.json"
    args = [worker("recipe.py"), "--keras", keras, "--jit-compile", "--epochs", "1",
            "--metrics-json", str(metrics)]  # fmt: skip
    proc = shared_jobs.get(2, "gloo").run_script(args)
    out = proc.stdout
    assert out.count("jit_compile turned off: Horovod's allreduce cannot be XLA-compiled") == 1
    assert "Traceback" not in out and json.loads(metrics.read_text())["size"] == 2


def test_warmup_schedule_goes_into_the_optimizers_of_both_keras():
    """`hvdtrain.WarmupSchedule` in a Keras 3 optimizer failed when it was built (Keras 3 took
    the Keras 2 schedule for a callable of no arguments); now, with Keras 3 imported, it is a
    schedule of both, over a base schedule of either, and each Keras saves and loads it."""
    import keras
    import tensorflow as tf

    import hvdtrain
    from hvdtrain.optimizers.rates import warmup_lr

    def decays():
        return [k.optimizers.schedules.ExponentialDecay(0.1, 4, 0.5) for k in (keras, tf.keras)]

    for k in (keras, tf.keras):
        for base in (0.1, *decays()):
            opt = k.optimizers.SGD(hvdtrain.WarmupSchedule(base, 2, 10))
            again = k.optimizers.deserialize(k.optimizers.serialize(opt))
            assert isinstance(again._learning_rate, hvdtrain.WarmupSchedule)
            for step in (0, 5, 12):
                single = base if isinstance(base, float) else 0.1 * 0.5 ** (step / 4)
                expected = warmup_lr(step, single, 2, 10)
                assert float(again._learning_rate(step)) == pytest.approx(expected, rel=1e-6)
            assert float(opt.learning_rate) == pytest.approx(0.1)  # step 0: the base rate
