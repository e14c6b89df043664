"""The launcher's death ends the job (`hvdtrain.runtime.orphan`), and one job at a time holds a
checkpoint folder (`CheckpointManager.lock`): real launchers killed with SIGKILL."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
from conftest import BIN, job_env, launch_argv, start_job, worker

from hvdtrain.launcher.faults import MARKER, complete_checkpoints, job_processes
from hvdtrain.runtime import orphan, processes

MNIST = ["-m", "hvdtrain.mnist", "--model", "mlp", "--limit-samples", "512"]


@pytest.mark.parametrize(
    "argv, name",
    [
        (["mpirun", "-np", "2", "python", "t.py"], "mpirun"),
        (["/usr/bin/orted", "-mca", "ess", "env"], "orted"),
        (["prted"], "prted"),
        (["/venv/bin/python3.12", "/venv/bin/horovodrun", "-np", "2"], "horovodrun"),
        (["python", "/venv/bin/hvdtrain-run", "-np", "2", "--", "python"], "hvdtrain-run"),
        (["python3", "-m", "hvdtrain.launcher.cli", "-np", "2"], "hvdtrain-run"),
        (["/bin/sh", "-c", "A=1 B=2 mpirun --tag-output -np 2 python t.py"], "sh -c mpirun"),
        (["srun", "--mpi=pmix", "python"], "srun"),
        (["slurmstepd: [1.0]"], None),  # its title, not its path: SLURM ends its tasks itself
        (["python", "train.py"], None),
        (["/bin/sh", "-c", "cd /x > /dev/null 2>&1 && python t.py"], None),
        (["bash", "-c", "python -m hvdtrain.mnist"], None),
        ([], None),
    ],
)
def test_launchers_are_recognized_by_their_command_line(argv, name):
    assert orphan.is_launcher(argv) == name


def test_the_chain_runs_up_to_the_outermost_launcher():
    lineage = [
        (10, 1, ["/bin/sh", "-c", "cd /x && python t.py"]),  # horovodrun's middle shell
        (9, 1, ["python", "/venv/bin/horovodrun", "-np", "2"]),  # its forked copy
        (8, 1, ["python", "/venv/bin/horovodrun", "-np", "2"]),
        (7, 1, ["python", "-m", "hvdtrain.launcher.cli", "-np", "2"]),
        (6, 1, ["bash"]),
        (5, 1, ["sshd: user"]),
    ]
    chain = orphan.launcher_chain(lineage)
    assert [pid for pid, _, _ in chain] == [10, 9, 8, 7]
    assert chain[-1][2] == "hvdtrain-run"
    assert orphan.launcher_chain([(6, 1, ["bash"]), (5, 1, ["tmux"])]) == []


def _lock_holder(folder):
    """A process of its own that holds `folder` as a job's rank 0 does."""
    code = (
        "import sys, time; from hvdtrain.recipe.checkpoint import CheckpointManager; "
        "CheckpointManager(sys.argv[1], None, None).check_writable(); print('held', flush=True); "
        "time.sleep(600)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(folder)], env=job_env(), stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "held\n"
    return proc


@pytest.mark.timeout(120)
def test_a_folder_held_by_a_live_process_is_refused_and_freed_by_its_death(tmp_path):
    from hvdtrain.errors import HvdtrainError
    from hvdtrain.recipe.checkpoint import CheckpointManager

    folder = tmp_path / "ckpt"
    holder = _lock_holder(folder)
    try:
        with pytest.raises(HvdtrainError) as refused:
            CheckpointManager(folder, None, None).check_writable()
        message = str(refused.value)
        assert "\n" not in message
        assert f"--checkpoint-dir {folder} is in use by another job (pid {holder.pid} on this " in (
            message
        )
        CheckpointManager(folder, None, None).check_writable(lock=False)  # elastic: no lock
    finally:
        holder.kill()
        holder.wait()
    manager = CheckpointManager(folder, None, None)
    manager.check_writable()  # the dead holder's lock went with it
    assert os.listdir(folder) == []  # no lock file: a folder listing is the checkpoints
    manager.check_writable()  # again in the same process (an elastic reset, a second fit)
    manager.unlock()
    holder = _lock_holder(folder)  # unlocked: another process takes it
    holder.kill()
    holder.wait()


def _ended_within(marker, seconds):
    """Seconds until no process of the job `marker` is left, or None after `seconds`."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if not job_processes(marker):
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def _end(marker):
    processes.send_all(job_processes(marker), signal.SIGKILL)


@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    "launcher", [pytest.param("hvdtrain-run", marks=pytest.mark.slow), "horovodrun", "mpirun"]
)
def test_killing_the_launcher_ends_every_rank_without_another_checkpoint(launcher, tmp_path):
    """SIGKILL of the launcher (an out-of-memory killer, a scheduler's hard kill): under
    hvdtrain-run (MPI: horovodrun became `sh -c mpirun`), plain horovodrun (Gloo: the ranks
    below `sh -c` middlemen) and plain mpirun, every process of the job ends within seconds
    and no checkpoint appears after the kill. Under hvdtrain-run also: a second job on the
    folder is refused in one line while the first lives, and takes it once it is dead."""
    prefix = {
        "hvdtrain-run": [f"{BIN}/hvdtrain-run", "--backend", "mpi", "-np", "2", "--"],
        "horovodrun": launch_argv(2, "gloo"),
        "mpirun": launch_argv(2, "mpirun"),
    }[launcher]
    ckpt = tmp_path / "ckpt"
    command = [*prefix, sys.executable, *MNIST, "--checkpoint-dir", str(ckpt)]
    marker = uuid.uuid4().hex
    proc, out = start_job([*command, "--epochs", "2000", "--checkpoint-every", "4"],
                          job_env(**{MARKER: marker}), cwd=tmp_path)  # fmt: skip
    try:
        out.wait_for(r"saved checkpoint", 240)
        if launcher == "hvdtrain-run":
            second = subprocess.run([*command, "--epochs", "2000"], env=job_env(), cwd=tmp_path,
                                    capture_output=True, text=True, timeout=200)  # fmt: skip
            text = second.stdout + second.stderr
            assert second.returncode == 2, text[-4000:]
            # Once from the rank (one line, however many ranks), once quoted by the launcher's end.
            refused = [line for line in text.splitlines() if "is in use by another job" in line]
            assert len(refused) == 2, text[-4000:]
            assert refused[-1].startswith("hvdtrain-run: "), text[-4000:]
            assert "Traceback" not in text, text[-4000:]
            assert proc.poll() is None  # the first job trains on
        os.kill(proc.pid, signal.SIGKILL)
        before = set(complete_checkpoints(ckpt))
        ended = _ended_within(marker, 30)
        proc.wait(10)
        assert ended is not None and ended < 10, "".join(out.drain()[-40:])
        assert set(complete_checkpoints(ckpt)) <= before, (before, complete_checkpoints(ckpt))
    finally:
        _end(marker)
    if launcher != "hvdtrain-run":
        return
    # The dead job's folder is free: the same command resumes from it and ends.
    epoch = int(re.match(r"epoch-(\d+)", max(before)).group(1))
    done = subprocess.run([*command, "--epochs", str(epoch + 1)], env=job_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "resum" in done.stdout + done.stderr


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", ["mpirun", "gloo"])
def test_a_rank_that_never_reaches_init_ends_the_wait_of_the_others(backend, tmp_path):
    """Rank 1 never calls hvd.init() (stopped or stuck before it): rank 0 waits in it 10
    stall times (1 s here), then says so in one line and exits 124, which ends the job."""
    start = time.monotonic()
    proc = subprocess.run(
        [*launch_argv(2, backend), sys.executable, worker("never_init.py")],
        env=job_env(HVDTRAIN_STALL_SHUTDOWN_SECONDS="1"), cwd=tmp_path, capture_output=True,
        text=True, timeout=150,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "init returned" not in text, text[-4000:]
    line = (r"hvdtrain: rank 0 waited 10 s in hvd.init\(\) for the other ranks \(one never "
            r"reached it: stopped, or stuck before it\); ending")  # fmt: skip
    assert re.search(line, text), text[-4000:]
    assert time.monotonic() - start < 120


def test_hvdtrain_run_names_itself_to_its_ranks():
    host = socket.gethostname()
    assert orphan._named_launcher({orphan.LAUNCHER_ENV: f"{host}:42:1234"}) == (
        42, 1234, "hvdtrain-run")  # fmt: skip
    assert orphan._named_launcher({orphan.LAUNCHER_ENV: "another-host:42:1234"}) is None
    assert orphan._named_launcher({orphan.LAUNCHER_ENV: f"{host}:x:1"}) is None
    assert orphan._named_launcher({}) is None
    mine = orphan.identity().rsplit(":", 2)
    assert mine[:2] == [host, str(os.getpid())] and float(mine[2]) == processes.started() > 0
    assert orphan._named_launcher({orphan.LAUNCHER_ENV: orphan.identity()})[:2] == (
        os.getpid(), processes.started())  # fmt: skip


@pytest.mark.timeout(300)
def test_hvdtrain_run_killed_while_its_ranks_start_ends_them_at_init(tmp_path):
    """hvdtrain-run SIGKILLed before its ranks reach hvdtrain.init() (the horovodrun and
    mpirun below it live on): the ranks see it gone there and end; nothing is trained."""
    ckpt = tmp_path / "ckpt"
    marker = uuid.uuid4().hex
    proc, out = start_job(
        [f"{BIN}/hvdtrain-run", "--backend", "mpi", "-np", "2", "--", sys.executable, *MNIST,
         "--epochs", "50", "--checkpoint-dir", str(ckpt)],
        job_env(**{MARKER: marker}), cwd=tmp_path,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while (
            time.monotonic() < deadline
            and len(
                [p for p, env in job_processes(marker).items() if "OMPI_COMM_WORLD_RANK" in env]
            )
            < 2
        ):
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # the ranks are importing TensorFlow
        ended = _ended_within(marker, 200)
        assert ended is not None, "".join(out.drain()[-40:])
        assert not complete_checkpoints(ckpt)
    finally:
        _end(marker)
