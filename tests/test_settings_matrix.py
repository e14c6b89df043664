"""The recipe under combinations of settings, not just the examples' ones: every pair of
values of the factors below is run end to end at least once (pairwise generation, allpairspy),
on a user's script (tests/workers/recipe.py: BatchNorm, dropout, a sigmoid output with AUC),
with real processes under horovodrun.

Each case trains one epoch, then `fit` again to two epochs in the same process, resuming from
its checkpoint (one process set-up per case: the cost that matters here), and asserts: exit 0,
no traceback, every rank on one weights digest, each test sample counted once (`test_samples`
is the test set's size), a complete metrics JSON (the steps per execution used, the learning
rate after the warmup) and the whole history after the resume.

The data form (6 values; per-host files with every rank on one host: test_recipe.py's
per-host records under MPI) and its test set are two factors, each pair of values once. The
crash this matrix was made for (issue 23) took three values together, a FileData test set
and several steps per execution: that case is the first one, grown from all three
(`SEEDS`). Until 2026-12-07 the form and the test set were one factor of 12 values, so that
every form met every other setting with and without a test set: 27 cases, not 16, for
pairs of three factors that no failure has needed. `--steps-per-execution` "default" means
the default's 16: with `--checkpoint-every` or `--deterministic` the default is 1, which the
value "1" covers, so those pairs are left out.
"""

import itertools
import json
import os
import socket

import pytest
from conftest import worker

RECIPE = worker("recipe.py")
FORMS = {  # --data, the folder of its files, test samples over all ranks (per-host: by hosts)
    "arrays": ("arrays", "shared"),
    "dataset": ("dataset", "shared"),
    "files": ("tfrecord", "shared"),
    "files-fewer-than-ranks": ("tfrecord", "one-file"),
    "files-per-two-hosts": ("per-host", "hosts"),  # one rank per host name (Gloo, 2 ranks)
    "batches": ("batches", "shared"),  # a Sequence (Keras 2) or PyDataset (Keras 3)
}
FACTORS = {
    "data": list(FORMS),
    "test": [True, False],
    "steps_per_execution": ["default", "1"],
    "checkpoint_every": [0, 5],
    "deterministic": [False, True],
    "accumulate": [1, 2],
    "mixed_precision": [False, True],
    "warmup_epochs": [0, 1],
    "keras": [2, 3],
    "model": ["compiled", "own-step"],  # Keras's train_step, or the guide's of its own
    "ranks": [1, 2],
    "backend": ["gloo", "mpi"],
}


def _allowed(case):
    """False for the pairs that the default's 16 steps per execution cannot make, and for
    two host names with other than two ranks under Gloo (the form needs one rank per host,
    and mpirun would reach 127.0.0.1 over ssh)."""
    if case.get("data", "").startswith("files-per-two-hosts") and (
        case.get("ranks", 2) != 2 or case.get("backend", "gloo") != "gloo"
    ):
        return False
    return case.get("steps_per_execution") != "default" or not (
        case.get("checkpoint_every") or case.get("deterministic")
    )


# The cases grown first, each from the values it names: the crash of issue 23.
SEEDS = [{"data": "files", "test": True, "steps_per_execution": "default"}]


def pairwise(factors, allowed, seeds=()):
    """Cases (dicts) that hold every allowed pair of values of two factors at least once: one
    grown from each of `seeds` first, then greedily and deterministically, each new case the
    best of those grown from a pair not yet held, each factor taking the value that adds the
    most pairs not yet held."""
    names = list(factors)

    def pairs(case):  # in the order of `names`, as in `todo`
        held = [n for n in names if n in case]
        return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(held, 2)}

    todo = {
        ((a, x), (b, y))
        for a, b in itertools.combinations(names, 2)
        for x, y in itertools.product(factors[a], factors[b])
        if allowed({a: x, b: y})
    }

    def grow(seed):
        case = dict(seed)
        for name in names:
            if name not in case:
                options = [v for v in factors[name] if allowed({**case, name: v})]
                case[name] = max(options, key=lambda v: len(pairs({**case, name: v}) & todo))
        return {name: case[name] for name in names}

    cases = []
    for seed in seeds:
        cases.append(grow(seed))
        todo -= pairs(cases[-1])
    while todo:
        grown = (grow(seed) for seed in sorted(todo, key=str))
        best = max(grown, key=lambda case: len(pairs(case) & todo))
        todo -= pairs(best)
        cases.append(best)
    return cases


CASES = pairwise(FACTORS, _allowed, SEEDS)
SHORT = {"steps_per_execution": "spe", "checkpoint_every": "ckpt", "deterministic": "det",
         "accumulate": "acc", "mixed_precision": "mixed", "warmup_epochs": "warmup",
         "keras": "keras", "ranks": "np", "model": ""}  # fmt: skip


def _name(case):
    parts = [case["data"] + ("+test" if case["test"] else "")]
    for k, v in case.items():
        if k in ("backend", "model"):
            parts.append(str(v))
        elif k in SHORT:
            parts.append(f"{SHORT[k]}{int(v) if v != 'default' else 'def'}")
    return "-".join(parts)


def test_the_cases_hold_every_allowed_pair_of_values():
    seen = {((a, c[a]), (b, c[b])) for c in CASES for a, b in itertools.combinations(c, 2)}
    for a, b in itertools.combinations(FACTORS, 2):
        for pair in itertools.product(FACTORS[a], FACTORS[b]):
            if _allowed(dict(zip((a, b), pair, strict=True))):
                assert ((a, pair[0]), (b, pair[1])) in seen, (a, b, pair)
    assert all(_allowed(c) for c in CASES)
    assert len(CASES) <= 16  # about 20 s each: the matrix's share of `make test`
    seed = SEEDS[0]
    assert any(all(c[k] == v for k, v in seed.items()) for c in CASES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """TFRecord files of uneven sizes: 600 training and 101 test samples; the same in one
    file each (fewer files than ranks); and per host (localhost, 127.0.0.1: two host names
    of this machine), with this machine's name pointing at localhost's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    root = tmp_path_factory.mktemp("matrix-data")
    write = recipe.write_tfrecords
    write(str(root / "shared"), "train", [50, 130, 200, 220], seed=0)
    write(str(root / "shared"), "test", [40, 61], seed=1)
    write(str(root / "one-file"), "train", [600], seed=0)
    write(str(root / "one-file"), "test", [101], seed=1)
    write(str(root / "hosts" / "localhost"), "train", [130, 170], seed=2)
    write(str(root / "hosts" / "localhost"), "test", [40], seed=3)
    write(str(root / "hosts" / "127.0.0.1"), "train", [90, 210], seed=4)
    write(str(root / "hosts" / "127.0.0.1"), "test", [61], seed=5)
    if socket.gethostname() not in ("localhost", "127.0.0.1"):
        os.symlink(root / "hosts" / "localhost", root / "hosts" / socket.gethostname())
    return root


def _job_of(case):
    """The ranks, backend and hosts of the case's job: the cases that share them run one
    after the other in one long-lived job (tests/helpers/shared.py)."""
    two_hosts = case["data"].startswith("files-per-two-hosts")
    return case["ranks"], case["backend"], "localhost:1,127.0.0.1:1" if two_hosts else None


@pytest.mark.parametrize("case", sorted(CASES, key=lambda c: str(_job_of(c))), ids=_name)
def test_the_recipe_under_every_pair_of_settings(case, folders, shared_jobs, tmp_path):
    form, tested = case["data"], case["test"]
    flag, folder = FORMS[form]
    ranks = case["ranks"]
    m = tmp_path / "m.json"
    args = ["--data", flag, "--files", str(folders / folder), "--epochs", "1",
            "--then-epochs", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--metrics-json", str(m), "--eval-batch-size", "8",
            "--accumulate", str(case["accumulate"]),
            "--warmup-epochs", str(case["warmup_epochs"]),
            "--checkpoint-every", str(case["checkpoint_every"]),
            "--keras", str(case["keras"])]  # fmt: skip
    args += [] if tested else ["--no-test"]
    args += [] if case["steps_per_execution"] == "default" else ["--steps-per-execution", "1"]
    args += ["--deterministic"] if case["deterministic"] else []
    args += ["--mixed-precision"] if case["mixed_precision"] else []
    args += ["--own-train-step"] if case["model"] == "own-step" else []
    job = shared_jobs.get(*_job_of(case))
    job.run("recipe:main", argv=args)

    output = "".join(job.output)
    assert "Traceback" not in output, output[-4000:]
    out = json.loads(m.read_text())
    assert out["status"] == "finished" and out["size"] == ranks and out["epochs"] == 2
    assert len({r["weights_digest"] for r in out["ranks"]}) == 1, out["ranks"]
    assert out["test_samples"] == (101 if tested else 0)
    if tested:
        assert 0 <= out["test"]["accuracy"] <= 1 and 0 <= out["test"]["auc"] <= 1
    per_step = case["steps_per_execution"] == "1" or case["checkpoint_every"]
    per_step = per_step or case["deterministic"]
    assert out["steps_per_execution"] == (1 if per_step else min(16, out["steps_per_epoch"]))
    assert out["accumulate"] == case["accumulate"]
    assert out["mixed_precision"] == ("mixed_bfloat16" if case["mixed_precision"] else None)
    assert out["lr_final"] == pytest.approx(0.01 * ranks)  # the warmup, if any, is over
    # Resumed after the first epoch, the history whole: both epochs of every figure.
    assert out["resumed_from"]["epoch"] == 1 and out["initial_epoch"] == 1
    assert out["optimizer_iterations"] == 2 * out["steps_per_epoch"]
    expected = {"loss", "accuracy", "auc"}
    expected |= {"val_loss", "val_accuracy", "val_auc"} if tested else set()
    assert set(out["history"]) == expected
    assert all(len(values) == 2 for values in out["history"].values()), out["history"]
