"""The distributed math, on real ranks, for both Keras: sharding, broadcast, LR, metrics,
equivalence."""

import json
import os

import numpy as np
import pytest
from conftest import run_job, worker


@pytest.fixture(
    scope="module",
    params=[("mpi", "2"), ("gloo", "3")],  # each backend and each Keras (a pairwise cover)
    ids=lambda p: f"{p[0]}-keras{p[1]}",
)
def ranks(request, tmp_path_factory, shared_jobs):
    """Each rank's record, for each backend and Keras (3: the model, optimizer and losses of
    `import keras`, through the same building blocks)."""
    backend, keras = request.param
    out = tmp_path_factory.mktemp(f"dist-{backend}-keras{keras}")
    shared_jobs.get(2, backend).run_script([worker("dist_checks.py"), out, keras])
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["keras"].startswith(keras) for r in records)
    return records


def test_shards_are_disjoint_cover_the_data_and_give_equal_steps(ranks):
    shards = [set(r["shard"]) for r in ranks]
    assert not shards[0] & shards[1]
    assert shards[0] | shards[1] == set(range(1001))
    assert {len(s) for s in shards} == {500, 501}
    assert ranks[0]["steps"] == ranks[1]["steps"] == 50
    for r, shard in zip(ranks, shards, strict=True):
        seen = r["epoch_samples"]
        assert len(seen) == 500 and set(seen) <= shard  # a full epoch of its own shard
        assert seen != sorted(seen)  # shuffled


def test_broadcast_then_training_leave_identical_weights(ranks):
    assert ranks[0]["digest_init"] != ranks[1]["digest_init"]  # different seeds per rank
    assert ranks[0]["digest_broadcast"] == ranks[1]["digest_broadcast"]
    assert ranks[0]["digest_trained"] == ranks[1]["digest_trained"]
    assert ranks[0]["digest_trained"] != ranks[0]["digest_broadcast"]
    assert ranks[0]["optimizer_state"] == ranks[1]["optimizer_state"]


def test_lr_warms_up_from_base_to_base_times_size(ranks):
    r = ranks[0]
    lrs, base = r["lrs"], r["base_lr"]
    assert lrs[0] == pytest.approx(base)
    assert lrs[r["warmup"]] == pytest.approx(base * 2)
    assert lrs[-1] == pytest.approx(base * 2)
    assert all(a <= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_evaluation_is_weighted_by_samples_over_uneven_shards(ranks):
    for r in ranks:
        for result in (r["eval"], r["eval_stream"]):  # the stream: unknown length, 4 per call
            assert result["samples"] == 1001
            assert result["loss"] == pytest.approx(r["eval_exact"]["loss"], rel=1e-6)
            assert result["accuracy"] == pytest.approx(r["eval_exact"]["accuracy"], rel=1e-6)
    naive = (ranks[0]["eval_shard_mean_loss"] + ranks[1]["eval_shard_mean_loss"]) / 2
    assert naive != pytest.approx(ranks[0]["eval_exact"]["loss"], rel=1e-9)
    # weighted_mean: rank 0 reports 0.0 over 1 sample, rank 1 reports 10.0 over 2 samples.
    assert ranks[0]["weighted_mean"]["v"] == pytest.approx(20.0 / 3)


def test_two_ranks_with_batch_b_match_one_rank_with_batch_2b(tmp_path, shared_jobs):
    one, two = tmp_path / "one.npz", tmp_path / "two.npz"
    run_job(1, "none", [worker("equivalence.py"), str(one), "64", "6"])
    shared_jobs.get(2, "gloo").run_script([worker("equivalence.py"), two, "32", "6"])
    a, b = np.load(one), np.load(two)
    assert len(a.files) == len(b.files) == 4
    moved = 0.0
    for k in a.files:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5, rtol=0)
        moved += float(np.abs(a[k]).sum())
    assert moved > 0
    assert os.path.getsize(one) > 0


def test_set_up_errors_that_differ_by_rank_are_one_line_naming_each_rank(tmp_path, shared_jobs):
    """`hvdtrain.agree`: every rank raises one error; where the ranks' messages differ (each
    its own file, say), it names each rank's, one sentence."""
    script = tmp_path / "errors.py"
    script.write_text(
        "import sys, hvdtrain, horovod.tensorflow as hvd\n"
        "from hvdtrain.errors import HvdtrainError\n"
        "hvdtrain.init()\n"
        "def load():\n"
        "    raise HvdtrainError(f'Invalid data file part-{hvd.rank()}: cannot read it.')\n"
        "try:\n"
        "    hvdtrain.agree(load)\n"
        "except HvdtrainError as e:\n"
        f"    open(f'{tmp_path}/rank{{hvd.rank()}}.txt', 'w').write(str(e))\n"
    )
    shared_jobs.get(2, "gloo").run_script([str(script)])
    expected = (
        "rank 0: Invalid data file part-0: cannot read it; "
        "rank 1: Invalid data file part-1: cannot read it."
    )
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == [expected] * 2
