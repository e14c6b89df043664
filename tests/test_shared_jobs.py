"""The shared job (tests/helpers/shared.py) reports each scenario as its own: what every rank
returned and printed, a failure with its rank's traceback, a hang as a failure on its timeout
with the next scenario run in a new job. And what `make test-slow` relies on to keep a module's
Docker daemon, namespace hosts or SLURM cluster in one pytest process: pytest-xdist's groups."""

import os
import subprocess
import sys

import pytest
from helpers.shared import SharedJob


@pytest.fixture(scope="module")
def job():
    with SharedJob(2, "gloo") as shared:
        yield shared


def test_each_rank_answers_with_its_result_in_the_folder_and_environment_given(job, tmp_path):
    replies = job.run("shared_checks:echo", ["a"], cwd=tmp_path, env={"SHARED_CHECK": "1"})
    assert [r["result"] for r in replies] == [["a", 0, str(tmp_path), "1"],
                                              ["a", 1, str(tmp_path), "1"]]  # fmt: skip
    text = "".join(job.output)
    assert "echo a from rank 0" in text and "echo a from rank 1" in text
    assert text.count("echo a on stderr") == 2 and "@@scenario" not in text
    replies = job.run("shared_checks:echo", ["b"])  # the folder and environment were its own
    assert replies[1]["result"][2:] == [replies[1]["result"][2], None]
    assert str(tmp_path) != replies[1]["result"][2] and "echo a" not in "".join(job.output)


def test_a_failing_rank_fails_the_scenario_with_its_traceback_and_the_job_goes_on(job):
    with pytest.raises(pytest.fail.Exception) as failed:
        job.run("shared_checks:fail_on", [1])
    assert "shared_checks:fail_on[1] failed on rank 1" in str(failed.value)
    assert "ValueError: rank 1 fails on purpose" in str(failed.value)
    replies = job.run("shared_checks:exit_with", [3], check=False)
    assert [(r["ok"], r["exit"]) for r in replies] == [(False, 3), (False, 3)]
    starts = job.starts
    assert job.run("shared_checks:echo", ["c"])[0]["result"][0] == "c" and job.starts == starts


def test_a_hanging_scenario_fails_on_its_timeout_and_the_next_runs_in_a_new_job(job):
    starts = job.starts
    with pytest.raises(pytest.fail.Exception) as failed:
        job.run("shared_checks:hang_on", [1], timeout=10)
    assert "rank 1 did not answer within 10 s" in str(failed.value)
    assert "rank 1 hangs on purpose" in str(failed.value)
    assert job.run("shared_checks:echo", ["d"])[1]["result"][:2] == ["d", 1]
    assert job.starts == starts + 1


GROUPED = """import os, pytest
pytestmark = pytest.mark.xdist_group("one")
@pytest.mark.parametrize("i", range(4))
def test_grouped(i):
    print("@@worker", os.environ["PYTEST_XDIST_WORKER"])
@pytest.mark.parametrize("i", range(4))
@pytest.mark.xdist_group("two")
def test_other(i):
    print("@@worker", os.environ["PYTEST_XDIST_WORKER"])
"""


@pytest.mark.timeout(120)
def test_xdist_groups_keep_their_tests_in_one_worker(tmp_path):
    """Under pytest 9.2 `--dist loadgroup` spread a group's tests over the workers, silently
    (pytest-dev/pytest-xdist#1386): two daemons then shared one Docker data root."""
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-s",
         "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, timeout=100, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    workers = {}
    for line in proc.stdout.splitlines():
        if line.startswith("[gw") and "PASSED" in line:
            test = line.split("PASSED ", 1)[1].split("[")[0].rsplit("::", 1)[1]
            workers.setdefault(test, set()).add(line.split("]", 1)[0][1:])
    assert set(workers) == {"test_grouped", "test_other"}, proc.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), workers
