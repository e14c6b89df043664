"""`hvdtrain.init(comm=...)` on an mpi4py communicator, inside one real `mpirun -np 2`."""

import json

from conftest import run_job, worker


def _results(out):
    return sorted(
        (json.loads(p.read_text()) for p in out.glob("world*.json")), key=lambda r: r["world_rank"]
    )


def test_split_communicator_makes_two_independent_one_rank_jobs(tmp_path):
    run_job(2, "mpirun", [worker("mpi4py_comm.py"), str(tmp_path), "split"])
    a, b = _results(tmp_path)
    for r in (a, b):
        assert r["world_size"] == 2 and r["mpi_enabled"]
        assert (r["size"], r["rank"], r["local_size"]) == (1, 0, 1)
        assert r["steps"] == 4
    assert [a["allreduce_sum"], b["allreduce_sum"]] == [1.0, 2.0]  # each job sums only itself
    # Same start, different data, no allreduce between them: the weights part ways.
    assert a["digest_init"] == b["digest_init"]
    assert a["digest_trained"] != b["digest_trained"]


def test_world_communicator_makes_one_two_rank_job(tmp_path):
    run_job(2, "mpirun", [worker("mpi4py_comm.py"), str(tmp_path), "world"])
    a, b = _results(tmp_path)
    assert [(r["rank"], r["size"]) for r in (a, b)] == [(0, 2), (1, 2)]
    assert a["allreduce_sum"] == b["allreduce_sum"] == 3.0
    # Different data on each rank, gradients averaged: identical weights.
    assert a["digest_trained"] == b["digest_trained"] != a["digest_init"]


def test_comm_under_gloo_is_refused_instead_of_ignored(tmp_path):
    proc = run_job(2, "gloo", [worker("mpi4py_comm.py"), str(tmp_path), "world"], check=False)
    assert proc.returncode != 0
    assert "Invalid value for `comm`" in proc.stdout + proc.stderr
    assert not list(tmp_path.glob("world*.json"))
