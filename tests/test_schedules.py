"""The learning rate a step applies and float16 loss scaling, through `hvdtrain.fit` on real
ranks for both Keras: tests/workers/sgd_steps.py, a one-weight model whose every gradient is
exactly 1, so that its weight is minus the sum of the rates applied. The user's own schedule
(an exponential decay) runs under hvdtrain's warmup in float16, a second run with more
epochs resumes it, and with one rank's gradients overflowing at one step every rank skips
that step and halves the scale, which the resumed run restores on every rank."""

import json

import pytest
from conftest import worker

BATCH, SAMPLES, DECAY_STEPS, EPOCHS = 16, 256, 4, 3
STEPS = SAMPLES // 2 // BATCH  # per epoch at 2 ranks: the warmup's length (--warmup-epochs 1)


def lr(step, size=2):
    """The rate of `step`: the user's decay, 0.1 x 0.5^(step/4), times the warmup's ramp."""
    return 0.1 * 0.5 ** (step / DECAY_STEPS) * (1 + (size - 1) * min(1.0, step / STEPS))


def train(jobs, tmp_path, backend, keras, *extra):
    """One epoch, then the same command to EPOCHS (it resumes); each rank's record."""
    record = tmp_path / "record"
    args = [worker("sgd_steps.py"), "--keras", keras, "--record", str(record),
            "--checkpoint-dir", str(tmp_path / "ck"), "--warmup-epochs", "1",
            "--batch-size", str(BATCH), *extra]  # fmt: skip
    for epochs in (1, EPOCHS):
        proc = jobs.get(2, backend).run_script([*args, "--epochs", str(epochs)])
    assert "resuming after epoch 1 (global step" in proc.stderr
    return [json.loads((tmp_path / f"record.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("backend, keras", [("mpi", "2"), ("gloo", "3")])
def test_float16_overflow_on_one_rank_skips_the_step_on_every_rank_and_the_scale_resumes(
    backend, keras, shared_jobs, tmp_path
):
    ranks = train(
        shared_jobs, tmp_path, backend, keras, "--mixed-precision", "float16", "--poison-step", "2"
    )
    skipped = -sum(lr(step) for step in range(EPOCHS * STEPS) if step != 2)
    for r in ranks:
        assert r["iterations"] == EPOCHS * STEPS  # the skipped step counts, as on Keras 2
        assert r["w"] == pytest.approx(skipped, rel=1e-6)
        # Halved once, from 2**15, and restored on every rank by the resume.
        assert r["loss_scale"] == 2.0**14
    # Not the schedule without the warmup, nor one restarted at the resume.
    assert skipped != pytest.approx(
        -sum(lr(s, size=1) * 2 for s in range(EPOCHS * STEPS) if s != 2), rel=1e-3
    )
    restarted = -sum(lr(s) for s in range(STEPS) if s != 2) - sum(lr(s) for s in range(2 * STEPS))
    assert skipped != pytest.approx(restarted, rel=1e-3)
