"""SLURM for real: a single-node cluster started by the test, `sbatch launch/hvdtrain.sbatch`."""

import json
import os

import pytest
from conftest import ROOT, job_env
from slurm_cluster import SlurmCluster, cannot_run_slurm

why_not = cannot_run_slurm()
pytestmark = [
    pytest.mark.skipif(why_not is not None, reason=why_not or ""),
    pytest.mark.slow,
    pytest.mark.xdist_group("slurm"),  # the module's cluster: its tests in one worker
]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), cpus=2) as cluster:
        cluster.env.update(job_env())
        yield cluster


@pytest.mark.parametrize("backend", ["srun", "mpirun"])
def test_sbatch_template_trains_on_two_ranks(slurm, backend, tmp_path):
    metrics, log = tmp_path / "m.json", tmp_path / "job.out"
    slurm.env["HVDTRAIN_BACKEND"] = backend
    job = slurm.sbatch(
        [
            os.path.join(ROOT, "launch", "hvdtrain.sbatch"),
            "--epochs",
            "1",
            "--limit-samples",
            "1024",
            "--metrics-json",
            str(metrics),
        ],
        "--nodes=1",
        "--ntasks=2",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        f"--output={log}",
        cwd=ROOT,
    )
    state = slurm.wait(job, timeout=300)
    output = log.read_text() if log.exists() else "(no job output)"
    assert state == {"state": "COMPLETED", "exit": "0:0"}, output[-5000:]
    m = json.loads(metrics.read_text())
    assert m["size"] == 2 and m["epochs"] == 1
    assert sorted(r["rank"] for r in m["ranks"]) == [0, 1]
    assert len({r["weights_digest"] for r in m["ranks"]}) == 1
