"""hvdtrain's performance defaults (`hvdtrain.runtime.tuning`): what is set when, and that the
user's settings win. The measurements behind them are `python -m hvdtrain.bench`'s."""

import contextlib
import os
import threading

import pytest
from conftest import run_job

from hvdtrain.errors import HvdtrainError
from hvdtrain.runtime import tuning


def test_compile_options_several_steps_per_call_at_most_an_epoch():
    assert tuning.compile_options() == {"steps_per_execution": tuning.STEPS_PER_EXECUTION}
    assert tuning.compile_options(steps_per_epoch=5) == {"steps_per_execution": 5}
    assert tuning.compile_options(100, steps_per_execution=1) == {"steps_per_execution": 1}
    assert tuning.compile_options(0, steps_per_execution=0) == {"steps_per_execution": 1}


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, {"OMPI_MCA_mpi_yield_when_idle": "1"}),  # one process: Horovod's 1 ms cycle
        ({"HOROVOD_SIZE": "1"}, {"OMPI_MCA_mpi_yield_when_idle": "1"}),
        (
            {"OMPI_COMM_WORLD_SIZE": "2"},
            {"HOROVOD_CYCLE_TIME": "0.1", "OMPI_MCA_mpi_yield_when_idle": "1"},
        ),
        ({"HOROVOD_SIZE": "4", "HOROVOD_CYCLE_TIME": "5"}, {"OMPI_MCA_mpi_yield_when_idle": "1"}),
        (
            {"SLURM_STEP_NUM_TASKS": "8", "OMPI_MCA_mpi_yield_when_idle": "0"},
            {"HOROVOD_CYCLE_TIME": "0.1"},
        ),
        (  # Horovod Elastic: no response cache (a rejoin aborts with it; tuning.py)
            {"HOROVOD_ELASTIC": "1", "HOROVOD_SIZE": "1", "OMPI_MCA_mpi_yield_when_idle": "1"},
            {"HOROVOD_CACHE_CAPACITY": "0"},
        ),
        (
            {"HOROVOD_ELASTIC": "1", "HOROVOD_CACHE_CAPACITY": "64", "HOROVOD_SIZE": "1"},
            {"OMPI_MCA_mpi_yield_when_idle": "1"},
        ),
    ],
)
def test_horovod_settings_only_where_the_user_set_nothing(environ, expected):
    got = tuning.horovod_settings({"OMPI_MCA_btl": "self,tcp", **environ})
    assert got == expected


@pytest.mark.parametrize(
    "btl, expected",
    [(None, "^ofi"), ("^openib", "^openib,ofi"), ("^ofi", None), ("^openib,ofi", None),
     ("self,vader,tcp", None), ("self,tcp,ofi", None)],
)  # fmt: skip
def test_open_mpi_ofi_btl_is_left_out_unless_asked_for(btl, expected):
    """Debian's Open MPI 4.1.4 can deadlock in MPI_Init inside the ofi BTL (tuning.py)."""
    environ = {"OMPI_MCA_mpi_yield_when_idle": "1"} | ({"OMPI_MCA_btl": btl} if btl else {})
    assert tuning.horovod_settings(environ).get("OMPI_MCA_btl") == expected


def test_background_threads_batch_on_cpu_hosts_only():
    assert tuning.background_policy({}, has_gpu=False) == "batch"
    assert tuning.background_policy({}, has_gpu=True) == "normal"
    assert tuning.background_policy({"HVDTRAIN_HOROVOD_THREAD": "normal"}, False) == "normal"
    assert tuning.background_policy({"HVDTRAIN_HOROVOD_THREAD": "IDLE"}, True) == "idle"
    assert tuning.background_policy({"HVDTRAIN_HOROVOD_THREAD": "batch"}, False) == "batch"
    with pytest.raises(HvdtrainError, match="HVDTRAIN_HOROVOD_THREAD`: received 'fast'"):
        tuning.background_policy({"HVDTRAIN_HOROVOD_THREAD": "fast"}, False)


def test_ranks_are_bound_to_their_share_of_the_cores_when_asked_where_nothing_bound_them():
    on = {"HVDTRAIN_CPU_BIND": "cores"}
    cores = tuning.cores_for_rank
    assert cores(on, {0, 1}, 2, 0, 2) == {0} and cores(on, {0, 1}, 2, 1, 2) == {1}
    assert cores(on, set(range(8)), 8, 2, 4) == {4, 5}
    assert cores(on, set(range(8)), 8, 1, 3) == {2, 3}  # 8 // 3 each; 6 and 7 spare
    assert cores(on, {0, 1, 2, 3}, 4, 0, 1) is None  # one rank: nothing to share
    assert cores(on, {0, 1}, 2, 2, 3) is None  # more ranks than cores
    assert cores(on, {2, 3}, 8, 0, 2) is None  # bound already (mpirun, SLURM, cpuset)
    assert cores({}, {0, 1}, 2, 0, 2) is None  # the default: as they are
    assert cores({"HVDTRAIN_CPU_BIND": "None"}, {0, 1}, 2, 0, 2) is None
    # --sync local/diloco on a CPU-only host: bound unless the user says none
    assert cores({}, {0, 1}, 2, 1, 2, default=True) == {1}
    assert cores({"HVDTRAIN_CPU_BIND": "none"}, {0, 1}, 2, 1, 2, default=True) is None
    assert cores({}, {2, 3}, 8, 0, 2, default=True) is None  # a launcher's binding is kept
    assert cores({}, {0, 1}, 2, 2, 3, default=True) is None  # more ranks than cores
    with pytest.raises(HvdtrainError, match="HVDTRAIN_CPU_BIND`: received 'core'"):
        cores({"HVDTRAIN_CPU_BIND": "core"}, {0, 1}, 2, 0, 2)


@contextlib.contextmanager
def _a_waiting_thread():
    """A thread of this process that waits until the block ends: its native id."""
    ready, stop, tids = threading.Event(), threading.Event(), []

    def wait():
        tids.append(threading.get_native_id())
        ready.set()
        stop.wait(30)

    t = threading.Thread(target=wait)
    t.start()
    ready.wait(30)
    try:
        yield tids[0]
    finally:
        stop.set()
        t.join()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_bind_sets_the_cores_of_the_threads_given():
    with _a_waiting_thread() as tid:
        one = {min(os.sched_getaffinity(0))}
        assert tuning.bind([tid], one) == [tid]
        assert os.sched_getaffinity(tid) == one
        assert os.sched_getaffinity(0) != one or len(os.sched_getaffinity(0)) == 1
        assert tuning.bind([tid], None) == []


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux only")
def test_set_policy_changes_only_the_threads_given():
    with _a_waiting_thread() as tid:
        assert tid in tuning.thread_ids()
        assert tuning.set_policy([tid], "idle") == [tid]
        assert os.sched_getscheduler(tid) == os.SCHED_IDLE
        assert os.sched_getscheduler(threading.get_native_id()) != os.SCHED_IDLE
        assert tuning.set_policy([tid], "batch") == [tid]
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH
        assert tuning.set_policy([2**22 + 12345], "idle") == []  # no such thread: no error


def test_init_applies_the_defaults_on_real_ranks(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(
        "import os, hvdtrain, horovod.tensorflow as hvd\n"
        "hvdtrain.init(exchanges_rarely='RARELY' in os.environ)\n"
        "def policy(t):  # a thread may end between the listing and the look\n"
        "    try:\n"
        "        return os.sched_getscheduler(int(t))\n"
        "    except ProcessLookupError:\n"
        "        return None\n"
        "batch = sum(policy(t) == os.SCHED_BATCH for t in os.listdir('/proc/self/task'))\n"
        "line = f\"rank {hvd.rank()} {os.environ.get('HOROVOD_CYCLE_TIME')} \"\n"
        "line += f\"{os.environ['OMPI_MCA_mpi_yield_when_idle']} {batch > 0} \"\n"
        'line += f"cores {len(os.sched_getaffinity(0))}\\n"\n'
        "os.write(1, line.encode())  # one write: mpirun tags each write of a rank\n"
    )
    every = len(os.sched_getaffinity(0))
    default = {"HOROVOD_CYCLE_TIME": None}  # not the tests' 1 ms (conftest.job_env)
    out = run_job(2, "mpi", [str(script)], **default).stdout
    assert out.count(f"0.1 1 True cores {every}") == 2, out  # not bound by default
    out = run_job(2, "gloo", [str(script)], HOROVOD_CYCLE_TIME="2", HVDTRAIN_CPU_BIND="cores")
    share = every // 2 if every == os.cpu_count() else every  # a bound pytest: left alone
    assert out.stdout.count(f"2 1 True cores {share}") == 2, out.stdout  # the user's cycle
    out = run_job(2, "gloo", [str(script)], RARELY="1", **default)  # as under --sync local/diloco
    assert out.stdout.count(f"1 1 True cores {share}") == 2, out.stdout  # bound by default
    proc = run_job(1, "none", [str(script)], **default)
    assert f"rank 0 None 1 True cores {every}" in proc.stdout, proc.stdout
    assert "TensorFlow started before" not in proc.stderr
    late = tmp_path / "late.py"  # TensorFlow started first: its threads can no longer be set
    late.write_text("import tensorflow as tf, hvdtrain\ntf.Variable(1.0)\n"
                    "hvdtrain.init()\nhvdtrain.init()\n")  # fmt: skip
    err = run_job(2, "gloo", [str(late)]).stderr
    assert err.count("TensorFlow started before hvdtrain.init()") == 1, err  # once, rank 0
    assert "call hvdtrain.init() before anything of TensorFlow's" in err


def test_a_longer_cycle_where_ranks_exchange_every_h_steps_only():
    environ = {
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_MCA_mpi_yield_when_idle": "1",
        "OMPI_MCA_btl": "^ofi",
    }
    assert tuning.horovod_settings(environ, exchanges_rarely=True) == {"HOROVOD_CYCLE_TIME": "1"}
    environ["HOROVOD_CYCLE_TIME"] = "0.5"  # the user's wins
    assert tuning.horovod_settings(environ, exchanges_rarely=True) == {}


def test_no_tensor_fusion_under_deterministic_where_the_user_set_none():
    """Which tensors one fused allreduce holds depends on timing: with 3 ranks or more the
    order of each sum then moved between runs (two digests from two uninterrupted runs on
    3 namespace hosts), so `--deterministic` turns fusion off."""
    environ = {"OMPI_MCA_mpi_yield_when_idle": "1", "OMPI_MCA_btl": "^ofi"}
    assert tuning.horovod_settings(environ, deterministic=True) == {"HOROVOD_FUSION_THRESHOLD": "0"}
    assert tuning.horovod_settings(environ) == {}
    elastic = {**environ, "HOROVOD_ELASTIC": "1"}  # (a re-formation with it off: SIGSEGV)
    assert tuning.horovod_settings(elastic, deterministic=True) == {"HOROVOD_CACHE_CAPACITY": "0"}
    environ["HOROVOD_FUSION_THRESHOLD"] = "1048576"  # the user's wins
    assert tuning.horovod_settings(environ, deterministic=True) == {}
