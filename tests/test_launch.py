"""`hvdtrain.launch` from plain Python: a function run on 2 real ranks under hvdtrain-run's
supervision (Gloo and MPI), rank 0's value back, rank 0's lines in the caller's streams, a
failing rank as one `JobFailed` line, Ctrl-C ending every rank; and the pure parts (a
rank's pieces of a line joined, the lines routed by rank, the arguments checked).
tests/test_notebook.py runs the same from a real Jupyter kernel."""

import os
import signal
import sys
import threading
import time

import cloudpickle
import psutil
import pytest

import hvdtrain
from hvdtrain.launcher.notebook import RankOutput
from hvdtrain.launcher.tags import Rejoin, split_tag

# The functions below go to the ranks by value, as a notebook's or a script's do (pytest's
# module is not importable there).
cloudpickle.register_pickle_by_value(sys.modules[__name__])

BOX = "\u2501" * 100  # model.summary's rule: 3 bytes a character


def collective():
    """A real Horovod job: every rank's rank, size and the sum of the ranks; 300 lines of
    box characters on each rank's stdout (30 KB: mpirun reads it in pieces)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvdtrain.init(threads=1)
    total = int(hvd.allreduce(tf.constant(hvd.rank()), op=hvd.Sum))
    for i in range(300):
        print(f"rank {hvd.rank()} line {i} {BOX}")
    return {"rank": hvd.rank(), "size": hvd.size(), "sum": total}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_function_runs_on_every_rank_and_rank_0s_lines_come_back_whole(backend, capsys):
    """Rank 0's value (every rank's with all_ranks), rank 0's 300 lines whole and untagged in
    this process's stdout (not one character cut), no line of rank 1's."""
    values = hvdtrain.launch(collective, np=2, backend=backend, all_ranks=backend == "gloo")
    if backend == "gloo":
        assert values == [{"rank": r, "size": 2, "sum": 1} for r in (0, 1)]
    else:
        assert values == {"rank": 0, "size": 2, "sum": 1}
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if " line " in line]
    assert lines == [f"rank 0 line {i} {BOX}" for i in range(300)], out[-2000:]
    assert "\ufffd" not in out and "rank 1 line" not in out


def fails_on_rank_1(folder):
    from hvdtrain.errors import env_rank

    print(f"rank {env_rank()} starts", flush=True)
    if env_rank() == 0:
        open(os.path.join(folder, "started"), "w").close()
    while env_rank() == 1 and not os.path.exists(os.path.join(folder, "started")):
        time.sleep(0.05)  # rank 0's line is out before the job is ended
    if env_rank() == 1:
        raise ValueError("rank 1 cannot go on")
    time.sleep(30)  # until the job is ended


@pytest.mark.timeout(120)
def test_a_failing_rank_raises_one_line_naming_the_rank_the_error_and_the_line(capsys, tmp_path):
    start = time.monotonic()
    with pytest.raises(hvdtrain.JobFailed) as raised:
        hvdtrain.launch(fails_on_rank_1, str(tmp_path), np=2, backend="gloo")
    assert time.monotonic() - start < 25  # ended, not waited for
    line = fails_on_rank_1.__code__.co_firstlineno + 9
    assert str(raised.value) == (
        "rank 1 failed: ValueError: rank 1 cannot go on (raised in fails_on_rank_1, "
        f"test_launch.py:{line}); exit status 1"
    )
    error = raised.value
    assert isinstance(error, RuntimeError) and isinstance(error, hvdtrain.HvdtrainError)
    assert (error.exit_code, error.rank) == (1, 1)
    assert isinstance(error.rank_error, ValueError)
    captured = capsys.readouterr()
    assert "rank 0 starts" in captured.out and "rank 1 starts" not in captured.out
    assert "[rank 1] Traceback (most recent call last):" in captured.err
    assert '[rank 1]     raise ValueError("rank 1 cannot go on")' in captured.err  # its source


def mistakes_or_dies(how):
    import signal

    from hvdtrain.errors import HvdtrainError, env_rank, invalid_value

    if how == "mistake":  # as a wrong value given to fit: every rank raises it
        raise invalid_value("epochs", -1, "an integer >= 1")
    if env_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)
    raise HvdtrainError("not reached")


@pytest.mark.timeout(120)
def test_a_user_mistake_is_its_own_line_and_a_killed_rank_is_hvdtrain_run_s_line():
    with pytest.raises(hvdtrain.JobFailed) as raised:
        hvdtrain.launch(mistakes_or_dies, "mistake", np=2, backend="gloo")
    assert str(raised.value) == (
        "rank 0 failed: Invalid value for `epochs`: received -1; expected an integer >= 1; "
        "exit status 2"
    )
    with pytest.raises(hvdtrain.JobFailed) as raised:
        hvdtrain.launch(mistakes_or_dies, "dies", np=2, backend="gloo")
    assert str(raised.value) == (
        "rank 1 on host localhost was killed by signal 9 (SIGKILL) first; the job was ended"
    )
    assert (raised.value.exit_code, raised.value.rank) == (137, 1)


def returns_a_lock():
    return threading.Lock()


@pytest.mark.timeout(120)
def test_a_return_value_that_does_not_pickle_is_one_line():
    with pytest.raises(
        hvdtrain.JobFailed,
        match=r"^rank 0 failed: the value returns_a_lock "
        r"returned on rank 0 \(lock\) cannot be sent back to the caller: ",
    ):
        hvdtrain.launch(returns_a_lock, np=2, backend="gloo")  # fmt: skip


def sleeps(folder):
    with open(os.path.join(folder, str(os.getpid())), "w"):
        pass
    time.sleep(300)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_ctrl_c_ends_every_rank_and_raises_keyboard_interrupt(backend, tmp_path):
    """SIGINT to the caller (Ctrl-C; a Jupyter kernel's interrupt) while the ranks run: every
    rank ends within seconds, nothing of the job is left, KeyboardInterrupt is raised."""
    pids = []

    def interrupt_once_started():
        deadline = time.monotonic() + 60
        while len(os.listdir(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids.extend(int(name) for name in os.listdir(tmp_path))
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    before = set(psutil.Process().children(recursive=True))  # (another test's, if any)
    handler = signal.getsignal(signal.SIGINT)  # (SIG_IGN where the run started in background)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        hvdtrain.launch(sleeps, str(tmp_path), np=2, backend=backend)
    assert len(pids) == 2, "the ranks did not start"
    assert time.monotonic() - start < 70
    gone = time.monotonic() + 10
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < gone:
        time.sleep(0.1)
    assert not any(psutil.pid_exists(pid) for pid in pids), "a rank outlived the interrupt"
    assert set(psutil.Process().children(recursive=True)) - before == set()  # the job's: none
    assert signal.getsignal(signal.SIGINT) is handler  # put back


# -- pure: no processes ------------------------------------------------------------------


def test_pieces_of_a_rank_s_line_are_joined_byte_for_byte():
    """Open MPI tags every piece it reads: a character cut between two pieces of rank 0's
    line, and rank 1's line between them."""
    cut = BOX.encode()[:-1].decode("utf-8", "surrogateescape")
    rest = BOX.encode()[-1:].decode("utf-8", "surrogateescape")
    rejoin = Rejoin()
    assert rejoin.feed(f"[1,0]<stdout>:a{cut}[1,1]<stdout>:b\n") == ["[1,1]<stdout>:b\n"]
    assert rejoin.feed(f"[1,0]<stdout>:{rest}c\n") == [f"[1,0]<stdout>:a{BOX}c\n"]
    assert rejoin.feed("mpirun's own line\n") == ["mpirun's own line\n"]
    assert rejoin.feed("[0]<stderr>:a") == [] and rejoin.flush() == ["[0]<stderr>:a\n"]
    assert split_tag("[1,1]<stderr>:x\n") == (1, "stderr", "x\n")
    assert split_tag("[0]<stdout>:x\n") == (0, "stdout", "x\n")
    assert split_tag("plain\n") == (None, None, "plain\n")


def test_rank_0_s_lines_pass_and_another_rank_s_only_once_it_fails():
    import io

    out, err = io.StringIO(), io.StringIO()
    routed = RankOutput(out, err)
    routed.write("stdout", ["[1,0]<stdout>:epoch 1\n", "[1,1]<stdout>:epoch 1\n"])
    routed.write("stderr", ["[1,1]<stderr>:a warning\n", "[1,0]<stderr>:hvdtrain: start\n"])
    routed.write("stderr", ["Process 1 exit with status code 1.\n", "mpirun says\n"])
    routed.write("stderr", ["[1,1]<stderr>:Traceback (most recent call last):\n",
                            "[1,1]<stderr>:ValueError: x\n"])  # fmt: skip
    routed.end(failed=True)
    assert out.getvalue() == "epoch 1\n"
    assert err.getvalue() == (
        "hvdtrain: start\nmpirun says\n[rank 1] Traceback (most recent call last):\n"
        "[rank 1] ValueError: x\n"
    )
    quiet = RankOutput(out, io.StringIO())  # a rank that failed without a line saying so
    quiet.write("stderr", ["[2]<stderr>:Segmentation fault\n"])
    quiet.end(failed=True)
    assert quiet._err.getvalue() == "[rank 2] Segmentation fault\n"


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: hvdtrain.launch(42), "Invalid value for `fn`: received 'an int'"),
        (lambda: hvdtrain.launch(print, np=0), "Invalid value for `np`: received 0"),
        (lambda: hvdtrain.launch(print, env=["A=1"]), "Invalid value for `env`"),
        (lambda: hvdtrain.launch(print, threading.Lock()), "cloudpickle can send"),
        (lambda: hvdtrain.launch(print, hosts="node9:1"), "Invalid value for `workdir`"),
        (
            lambda: hvdtrain.launch(print, backend="tcp"),
            "Invalid value for `backend`: received 'tcp'",
        ),
    ],
)
def test_a_mistake_in_the_arguments_is_one_line_before_anything_starts(call, words):
    with pytest.raises(hvdtrain.HvdtrainError, match=words) as raised:
        call()
    assert "\n" not in str(raised.value)


def test_parse_args_in_a_jupyter_kernel_ignores_the_kernel_s_own_arguments(monkeypatch):
    """A kernel's command line is `ipykernel_launcher -f .../kernel-1.json`: parse_args()
    there gives the defaults (a script's command line is still read, and a wrong one is
    still one line)."""
    kernel = ["/venv/lib/ipykernel_launcher.py", "-f", "/root/.local/kernel-1.json"]
    monkeypatch.setattr(sys, "argv", kernel)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    with pytest.raises(hvdtrain.HvdtrainError, match="unrecognized arguments: -f"):
        hvdtrain.ArgumentParser(epochs=3).parse_args()
    monkeypatch.setitem(sys.modules, "ipykernel", sys)  # as in a kernel
    assert hvdtrain.ArgumentParser(epochs=3).parse_args().epochs == 3
    monkeypatch.setattr(sys, "argv", ["x", "--f=/run/kernel-2.json"])  # VS Code's
    assert hvdtrain.ArgumentParser(epochs=3).parse_args().epochs == 3
    monkeypatch.setattr(sys, "argv", ["train.py", "--epochs", "5"])  # %run train.py --epochs 5
    assert hvdtrain.ArgumentParser(epochs=3).parse_args().epochs == 5
    assert hvdtrain.ArgumentParser(epochs=3).parse_args(["--epochs", "7"]).epochs == 7
