"""No hangs: a rank that crashes, raises or stops making progress ends the whole job.

Real 2-rank jobs under `horovodrun --gloo` and `horovodrun --mpi` (tests/workers/faults.py:
a small Keras fit loop; rank 1 faults after its 5th step). Each job must exit non-zero
within a bound counted from the fault (the worker writes its time to FAULT_STAMP), and
its output must name the failing rank. The stall time is 5 s here (300 s by default),
set through HVDTRAIN_STALL_SHUTDOWN_SECONDS as a user would.

What ends each job (measured; see also hvdtrain/watchdog.py):
- kill: the launcher sees the rank die (SIGKILL) and ends the others.
- raise: the traceback, then `hvdtrain: rank 1 failed: ...` (hvdtrain.init's excepthook);
  the exiting rank shuts Horovod down, so the waiting rank fails too.
- sleep: the rank's watchdog (`hvdtrain.WatchdogCallback`) after the stall time. Horovod's
  own stall shutdown ends it too (test_horovod_stall_shutdown_alone_ends_the_job). Under Gloo it
  never fired before hvdtrain's patch: Horovod 0.28.1's GlooController only `reserve`d its
  `global_ranks_` vector, so the stall inspector saw zero ranks to report.
"""

import re
import subprocess
import sys
import threading
import time

import pytest
from conftest import BIN, job_env, run_job, worker

STALL = 5  # seconds, for every job here
SLACK = 30  # launcher teardown and a loaded machine
FAULTS = worker("faults.py")
RECORD = []  # (case, job seconds, seconds after the fault), printed at the end
# Two slower cases (about 55 s): `make test-slow` and CI run them, `make test` leaves them out.
slow = pytest.mark.slow


def run_fault(backend, tmp_path, *args):
    stamp = tmp_path / "fault-time"
    start = time.monotonic()
    proc = run_job(
        2,
        backend,
        [FAULTS, *args],
        check=False,
        HVDTRAIN_STALL_SHUTDOWN_SECONDS=str(STALL),
        FAULT_STAMP=str(stamp),
    )
    end, total = time.time(), time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert stamp.exists(), f"the fault was never injected\n{output[-6000:]}"
    after = end - float(stamp.read_text())
    RECORD.append((f"{backend} {' '.join(args)}", total, after))
    print(f"\n{backend} {' '.join(args)}: exit {proc.returncode}, job {total:.1f} s, "
          f"{after:.1f} s after the fault")  # fmt: skip
    return proc, output, after


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    if RECORD:
        lines = [
            f"  {case:<28} job {total:5.1f} s, {after:5.1f} s after"
            for case, total, after in RECORD
        ]
        print("\nno-hang cases:\n" + "\n".join(lines))


BACKENDS = ["gloo", "mpi"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_killed_rank_ends_the_job(backend, tmp_path):
    proc, output, after = run_fault(backend, tmp_path, "kill")
    assert proc.returncode != 0, output[-6000:]
    assert after < SLACK, output[-6000:]
    named = {
        "gloo": r"Process 1 exit with status code 137",
        "mpi": r"process rank 1 with PID \d+ on node \S+ exited on signal 9",
    }
    assert re.search(named[backend], output), output[-6000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_raising_rank_ends_the_job(backend, tmp_path):
    proc, output, after = run_fault(backend, tmp_path, "raise")
    assert proc.returncode != 0, output[-6000:]
    assert after < SLACK, output[-6000:]
    assert "RuntimeError: injected failure on rank 1 at step 5" in output
    assert (
        "hvdtrain: rank 1 failed: RuntimeError: injected failure on rank 1 at step 5 "
        "(last: finished step 5 of epoch 1;" in output
    ), output[-6000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend, keras", [("gloo", "2"), ("mpi", "3")])  # each, once
def test_sleeping_rank_ends_the_job(backend, keras, tmp_path):
    """Named by its own watchdog, for a model of either Keras (3: `import keras`)."""
    proc, output, after = run_fault(
        backend, tmp_path, "sleep", *(["--keras3"] if keras == "3" else [])
    )
    assert proc.returncode != 0, output[-6000:]
    assert STALL <= after < STALL + SLACK, output[-6000:]
    assert re.search(
        r"hvdtrain: rank 1 made no progress for \d+ s \(last: finished step 5 of epoch 1;", output
    ), output[-6000:]
    assert "rank 0 made no progress" not in output  # the waiting rank is not blamed


STUCK_STALL = 10  # Horovod then checks every 2 s (a fifth) and shuts down after 12
# Where rank 1 stops (tests/workers/stuck_rank.py) and what its named line says; rank 0
# waits for it in the next collective, twice the stall time on its watchdog.
STUCK = {
    # A user's epoch-end callback: hvdtrain beats the watchdog at one stall time there.
    "callback": r"rank 1 made no progress for \d+ s \(last: in your callback Sleepy.on_epoch_end\)",
    # A Sequence's __getitem__, in tf.data's thread (`watchdog.doing_in_thread`, one stall
    # time), while the training thread waits inside a step.
    "data": r"rank 1 made no progress for \d+ s \(last: loading a batch of your data "
            r"\(Batches, your code\)\)",
    # Inside a step, before the gradients: Horovod's stall check (1.8 stall times at most)
    # finds rank 1 missing from the allreduce and ends the job; under Gloo since the patch.
    "step": r"Missing ranks:\s*(\[[\d,]+\]<stderr>:)?1!: \[",
}  # fmt: skip


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "where, backend",
    [
        ("callback", "gloo"),
        ("callback", "mpi"),
        ("data", "gloo"),
        pytest.param("data", "mpi", marks=slow),
        ("step", "mpi"),
        pytest.param("step", "gloo", marks=slow),
    ],
)
def test_the_stuck_rank_is_the_one_named(where, backend, tmp_path):
    """Rank 1 stops in a user's callback, in its data's code or inside a step, rank 0 waits
    in the next collective: `hvdtrain-run`'s summary names rank 1, never rank 0. Before:
    rank 0's watchdog fired first under Gloo (both on twice the time) and was blamed, and
    under MPI Horovod's stall shutdown ended the job without a rank named; inside a step
    under Gloo, Horovod's stall check never ran (its controller counted no ranks)."""
    from conftest import BIN, job_env

    proc = subprocess.run(
        [f"{BIN}/hvdtrain-run", "--backend", backend, "-np", "2", "--", sys.executable,
         worker("stuck_rank.py"), where],
        capture_output=True, text=True, timeout=200, cwd=tmp_path,
        env=job_env(HVDTRAIN_STALL_SHUTDOWN_SECONDS=str(STUCK_STALL)),
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert f"rank 1: stuck ({where})" in output, output[-6000:]
    assert proc.returncode == 124, output[-6000:]
    by_watchdog = "hvdtrain-run: rank 1 on host localhost failed first: exit status 124 (it made"
    by_horovod = (
        "hvdtrain-run: rank 1 on host localhost stopped making progress first: the other ranks "
        f"waited for it in a collective for over {STUCK_STALL + 2} s, and Horovod's stall check "
        "ended the job"
    )
    # Outside a step rank 1's watchdog (one stall time) and Horovod's check (one stall time
    # after the waiting rank's collective, then the next check) both name it, whichever
    # comes first; inside a step only Horovod's can (the watchdog gives a step two).
    if where == "step" or by_horovod in output:
        assert by_horovod in output and re.search(STUCK["step"], output), output[-6000:]
    else:
        assert by_watchdog in output, output[-6000:]
    if where != "step" and by_watchdog in output:
        assert re.search(STUCK[where], output), output[-6000:]
    assert "rank 0 made no progress" not in output
    assert "rank 0 on host localhost" not in output
    assert "[hvdtrain:stall" not in output  # the watchdog's marker: read, not printed


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher", ["hvdtrain-run", "horovodrun", "mpirun"])
def test_an_error_every_rank_raises_in_your_code_shows_its_traceback_once(launcher, tmp_path):
    """Both ranks raise in the user's callback: the first line names the function, the
    traceback shows once, the other rank says whose it is (`hvdtrain.runtime.tracebacks`), under
    `hvdtrain-run` (MPI) and plain `horovodrun` (Gloo) and `mpirun`."""
    from conftest import BIN, job_env, launch_argv

    prefix = {
        "hvdtrain-run": [f"{BIN}/hvdtrain-run", "--backend", "mpi", "-np", "2", "--"],
        "horovodrun": launch_argv(2, "gloo"),
        "mpirun": launch_argv(2, "mpirun"),
    }[launcher]

    def one_traceback(where):
        proc = subprocess.run(
            [*prefix, sys.executable, worker("stuck_rank.py"), where],
            capture_output=True, text=True, timeout=150, cwd=tmp_path, env=job_env(),
        )  # fmt: skip
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, output[-6000:]
        # the ranks' own (plain horovodrun --gloo adds its own traceback, untagged, at the end)
        assert output.count("<stderr>:Traceback (most recent call last):") == 1, output[-6000:]
        return output

    output = one_traceback("raise")
    assert output.count("the error below was raised in your code: check_labels "
                        "(stuck_rank.py:") == 1, output  # fmt: skip
    assert re.search(r"the error was raised in your code: check_labels \(stuck_rank.py:\d+\); "
                     r"its traceback is the same as rank [01]'s", output), output  # fmt: skip
    for rank in (0, 1):
        assert f"hvdtrain: rank {rank} failed: ValueError: labels out of range" in output
    # The same before hvd.init() (the script's own data code): one traceback, one line.
    output = one_traceback("raise-early")
    assert re.search(r"hvdtrain: rank [01] failed: ValueError: labels out of range after 0 "
                     r"logs; its traceback is the same as rank [01]'s", output), output  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_horovod_stall_shutdown_alone_ends_the_job(backend, tmp_path):
    """Without the watchdog, hvdtrain.init's stall settings still end the job: Horovod marks
    the missing rank with `!` and shuts down (under Gloo since hvdtrain's patch)."""
    proc, output, after = run_fault(backend, tmp_path, "sleep", "--no-watchdog")
    assert proc.returncode != 0, output[-6000:]
    # Horovod checks every second (the warning time, a fifth of the stall time) and shuts
    # down a check after the stall time; a tensor waits up to two checks as a cached one,
    # then the shutdown time and a check.
    assert STALL <= after < 2 * STALL + SLACK, output[-6000:]
    assert re.search(r"Missing ranks:\s*\S*1!: \[", output), output[-6000:]
    assert f"stalled for longer than {STALL + 1} seconds. Will shutdown." in output


@slow
@pytest.mark.timeout(300)
def test_frozen_rank_ends_the_job_under_mpi(tmp_path):
    """A stopped process (SIGSTOP) freezes Horovod's background thread too, so Horovod's
    stall check never runs under MPI; the waiting rank's watchdog ends the job after
    twice the stall time (it is inside a training step, waiting for the others)."""
    proc, output, after = run_fault("mpi", tmp_path, "stop")
    assert proc.returncode != 0, output[-6000:]
    assert 2 * STALL <= after < 2 * STALL + SLACK, output[-6000:]
    assert re.search(
        r"hvdtrain: rank 0 made no progress for \d+ s, waiting for the other ranks \(last: "
        r"in step 6 of epoch 1 \(.*gradient allreduce with the other ranks\)\); unless "
        r"another rank's line says it was stuck, one of them froze whole",
        output,
    ), output[-6000:]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_stopped_past_the_last_collective_is_named_and_ended(backend, tmp_path):
    """Rank 1 stops itself (SIGSTOP) at its exit, after the job's last collective: no rank
    waits for it, so no watchdog or stall check can end the job; `hvdtrain-run` sees its
    rank stopped for the stall time, ends it and says so (found by the chaos run, which
    waited forever)."""
    start = time.monotonic()
    proc = subprocess.run(
        [f"{BIN}/hvdtrain-run", "--backend", backend, "-np", "2", "--", sys.executable,
         worker("stop_at_exit.py")],
        env=job_env(HVDTRAIN_STALL_SHUTDOWN_SECONDS=str(STALL)), cwd=tmp_path,
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    took, text = time.monotonic() - start, proc.stdout + proc.stderr
    assert proc.returncode == 124, text[-4000:]
    assert "rank 0 done" in text and "rank 1 done" in text, text[-4000:]
    assert re.search(
        r"hvdtrain-run: rank 1 \(pid \d+ on \S+\) was stopped \(SIGSTOP or SIGTSTP\) for 5 s, "
        r"the stall time; ended it and the job$",
        proc.stderr.rstrip(),
    ), text[-4000:]
    assert took < 60 + STALL, text[-4000:]  # the ranks' start-up, the stall time, a second


@slow
@pytest.mark.timeout(300)
def test_validation_on_one_rank_ends_the_job(tmp_path):
    """The classic Horovod stall: evaluating (a collective) on rank 0 alone at the end of
    an epoch. `MetricAverageCallback` evaluates on every rank, so hvdtrain's own loop
    cannot do this; a user's callback can, and the job then ends naming rank 0's
    epoch-end callbacks, not rank 1, which Horovod's stall check would name (missing from
    rank 0's collective) had it not come one check after the watchdog's time."""
    proc, output, after = run_fault("gloo", tmp_path, "eval-alone", "0", "0")
    assert proc.returncode != 0, output[-6000:]
    assert STALL <= after < STALL + SLACK, output[-6000:]
    assert re.search(
        r"hvdtrain: rank 0 made no progress for \d+ s \(last: finished epoch 1; then in "
        r"epoch-end callbacks",
        output,
    ), output[-6000:]


# -- the pieces, without processes -----------------------------------------------------


def test_stall_settings():
    from hvdtrain.errors import HvdtrainError
    from hvdtrain.runtime.process import stall_settings, stall_shutdown_seconds

    check, shutdown = "HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"
    ours = "HVDTRAIN_STALL_SHUTDOWN_SECONDS"
    # Horovod's shutdown one check after the stall time, which is recorded for the watchdogs
    assert stall_settings({}) == {check: "60", shutdown: "360", ours: "300"}
    assert stall_settings({ours: "5"}) == {check: "1", shutdown: "6", ours: "5"}
    assert stall_settings({ours: "5"}, 90) == {check: "18", shutdown: "108", ours: "90"}
    assert stall_settings({}, 4) == {check: "1", shutdown: "5", ours: "4"}
    assert stall_settings({}, 0) == {check: "60", shutdown: "0", ours: "0"}  # off
    # What the user set (e.g. horovodrun --stall-check-*) wins; the shutdown is never
    # below the warning time, which Horovod would silently ignore.
    assert stall_settings({shutdown: "30"}) == {check: "60"}
    assert stall_settings({check: "600"}) == {shutdown: "1200", ours: "300"}
    assert stall_settings({check: "10", shutdown: "20"}, 5) == {}
    # The watchdogs' time: the stall time, before and after init() set the variables
    assert stall_shutdown_seconds({}) == 300
    for environ in ({ours: "5"}, {ours: "0"}):
        assert stall_shutdown_seconds(environ) == int(environ[ours])
        after_init = {**environ, **stall_settings(environ)}
        assert stall_shutdown_seconds(after_init) == int(environ[ours])
    assert stall_shutdown_seconds({shutdown: "30"}) == 30  # Horovod's alone, as the user set it
    assert stall_shutdown_seconds({shutdown: "30", "HOROVOD_STALL_CHECK_DISABLE": "1"}) == 0
    for bad in ("1.5", "-1", "soon", "1e3", "²", "٣", "+5", "1_0"):
        with pytest.raises(HvdtrainError, match="HVDTRAIN_STALL_SHUTDOWN_SECONDS.*received"):
            stall_settings({"HVDTRAIN_STALL_SHUTDOWN_SECONDS": bad})
    for bad in (-1, 2.5, True, "x"):
        with pytest.raises(HvdtrainError, match="stall_shutdown_seconds"):
            stall_settings({}, bad)


def _wait_for(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_watchdog_fires_without_beats_and_names_rank_and_activity():
    from hvdtrain.runtime.watchdog import Watchdog

    fired = []
    dog = Watchdog(0.3, rank=3, on_timeout=fired.append)
    dog.start("step 7")
    for _ in range(10):  # beating keeps it quiet
        time.sleep(0.1)
        dog.beat("step 8")
    assert not fired
    assert _wait_for(lambda: fired)
    assert re.fullmatch(
        r"hvdtrain: rank 3 made no progress for \d+ s \(last: step 8\); .*\n", fired[0]
    )
    dog.stop()


def test_watchdog_waits_twice_as_long_in_a_step_and_ten_times_on_hold():
    from hvdtrain.runtime.watchdog import OTHER_RANKS, OWN_SETUP, Watchdog

    fired = []
    dog = Watchdog(0.3, rank=0, on_timeout=fired.append)
    dog.start("the first step", OWN_SETUP)
    time.sleep(1.5)
    assert not fired  # on hold: 10 x 0.3 s
    assert _wait_for(lambda: fired)
    assert "made no progress for 3 s (last: the first step)" in fired[0]
    dog.stop()
    fired.clear()
    dog.start("again")
    dog.beat("in a step", OTHER_RANKS)
    time.sleep(0.45)
    assert not fired  # 0.45 s < 2 x 0.3 s
    assert _wait_for(lambda: fired)
    assert "s, waiting for the other ranks (last: in a step); unless another rank's" in fired[0]
    dog.stop()


def test_watchdog_names_a_threads_own_work_before_the_waiting_step():
    """`watchdog.doing_in_thread` from another thread (tf.data's, running a user's data
    code): one timeout, while the training thread waits inside a step (two); named for it,
    then forgotten."""
    from hvdtrain.runtime.watchdog import OTHER_RANKS, Watchdog, doing_in_thread

    fired = []
    dog = Watchdog(0.3, rank=1, on_timeout=fired.append)
    dog.start("again")
    dog.beat("in a step", OTHER_RANKS)
    done = threading.Event()

    def load(seconds):
        with doing_in_thread("loading a batch of your data"):
            time.sleep(seconds)
        done.set()

    threading.Thread(target=load, args=(0.1,)).start()
    assert done.wait(5) and not dog._busy  # left: forgotten
    dog.beat("in a step", OTHER_RANKS)
    threading.Thread(target=load, args=(30,), daemon=True).start()
    assert _wait_for(lambda: fired)
    assert "(last: loading a batch of your data)" in fired[0]
    dog.stop()
    assert not dog._busy  # stopping forgets it
    with doing_in_thread("nothing runs"):  # no watchdog running: nothing recorded
        assert not dog._busy


def test_doing_tells_the_watchdog_started_last_while_it_runs():
    """The registry: `doing` and `doing_in_thread` tell the running watchdog started last
    in this process, nothing once it stopped; `last_activity` keeps what it last knew."""
    from hvdtrain.runtime.watchdog import OWN_WORK, Watchdog, doing, doing_in_thread, last_activity

    first, second = Watchdog(60, rank=0), Watchdog(60, rank=0)
    first.start("first started")
    assert Watchdog.latest() is first and first.running
    doing("in your callback A.on_epoch_end")
    assert first.last == last_activity() == "in your callback A.on_epoch_end"
    second.start("second started")
    doing("told to the second", OWN_WORK)
    assert first.last == "in your callback A.on_epoch_end"
    assert Watchdog.latest() is second and last_activity() == "told to the second"
    second.stop()
    doing("told to none")
    with doing_in_thread("told to none either"):
        pass
    assert not second.running and last_activity() == "told to the second"
    first.stop()


@pytest.mark.parametrize("allowance", ["OWN_WORK", "OTHER_RANKS", "OWN_SETUP", "OTHER_RANKS_SETUP"])
def test_each_allowance_is_its_number_of_timeouts(allowance):
    """1, 2, 10 and 12 timeouts; the two that wait for the other ranks say so."""
    from hvdtrain.runtime import watchdog

    waits_for = getattr(watchdog, allowance)
    assert waits_for.timeouts == {"OWN_WORK": 1, "OTHER_RANKS": 2, "OWN_SETUP": 10,
                                  "OTHER_RANKS_SETUP": 12}[allowance]  # fmt: skip
    fired = []
    dog = watchdog.Watchdog(0.1, rank=2, on_timeout=fired.append)
    dog.start("started")
    began = time.monotonic()
    watchdog.doing("what it waits in", waits_for)
    assert _wait_for(lambda: fired, 10)
    assert time.monotonic() - began >= 0.1 * waits_for.timeouts
    assert ("waiting for the other ranks" in fired[0]) is waits_for.others
    assert fired[0].endswith(f"[hvdtrain:stall rank=2 waiting={int(waits_for.others)}]\n")
    dog.stop()


def test_watchdog_stops_and_checks_its_timeout():
    from hvdtrain.errors import HvdtrainError
    from hvdtrain.runtime.watchdog import Watchdog

    fired = []
    dog = Watchdog(0.2, rank=0, on_timeout=fired.append)
    dog.start()
    dog.stop()
    time.sleep(0.5)
    assert not fired
    for bad in (0, -1, "5", True, None):
        with pytest.raises(HvdtrainError, match="Invalid value for `timeout`"):
            Watchdog(bad)


def test_watchdog_callback_follows_the_stall_setting(monkeypatch):
    from hvdtrain.recipe.callbacks import WatchdogCallback

    callback = WatchdogCallback()  # made before hvdtrain.init(): reads the time in fit
    monkeypatch.delenv("HVDTRAIN_STALL_SHUTDOWN_SECONDS", raising=False)
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "42")  # the user's
    callback.on_train_begin()
    assert callback.watchdog.timeout == 42
    callback.on_train_end()
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0")
    callback.on_train_begin()
    assert callback.watchdog is None  # off with the stall shutdown
    assert WatchdogCallback(7).watchdog.timeout == 7


def test_watchdog_callback_times_steps_after_the_first():
    from hvdtrain.recipe.callbacks import WatchdogCallback
    from hvdtrain.runtime import watchdog

    fired = []
    cb = WatchdogCallback(0.3, rank=1, on_timeout=fired.append)

    cb.on_train_begin()
    cb.on_epoch_begin(0)
    # A collective at the epoch's start (the learning rates from rank 0) beats at 2 x 0.3 s;
    # the first step after it still has its 10 x (in a loaded elastic job, both ranks'
    # watchdogs fired while tracing it: the collective's limit had replaced the step's).
    watchdog.doing("taking rank 0's learning rates", watchdog.OTHER_RANKS)
    cb.on_train_batch_begin(0)
    time.sleep(0.8)  # the first step (tracing) has 10 x 0.3 s
    assert not fired
    cb.on_train_batch_end(0)
    cb.on_train_batch_begin(1)
    cb.on_train_batch_end(1)
    assert _wait_for(lambda: fired)
    assert "rank 1 made no progress" in fired[0] and "finished step 2 of epoch 1" in fired[0]
    cb.on_train_end()


def test_watchdog_callback_gives_the_first_validation_its_tracing_time():
    """An epoch's end runs the first validation, which traces and compiles its step: 10 x
    the time there, as for the first step (a loaded elastic job's rank 1 was ended there at
    1 x); the validations after it have 1 x."""
    from hvdtrain.recipe.callbacks import WatchdogCallback

    fired = []
    cb = WatchdogCallback(0.3, rank=1, on_timeout=fired.append)
    cb.on_train_begin()
    cb.on_epoch_begin(0)
    cb.on_train_batch_begin(0)
    cb.on_train_batch_end(0)
    cb.on_epoch_end(0)
    cb.on_test_begin()
    time.sleep(0.8)  # tracing the validation step: 10 x 0.3 s
    assert not fired
    cb.on_test_batch_end(0)
    cb.on_test_end()
    cb.on_epoch_end(1)
    cb.on_test_begin()  # the second validation: traced already
    assert _wait_for(lambda: fired)
    assert "finished epoch 2; then in epoch-end callbacks" in fired[0]
    cb.on_train_end()


def test_stopped_ranks_are_the_stopped_descendants_with_a_rank():
    """What `hvdtrain-run` looks for each second: its launcher's descendants in state T
    whose environment holds a rank; a stopped process without one, or running, is not."""
    import os
    import signal

    from hvdtrain.launcher.supervise import _stopped_ranks
    from hvdtrain.runtime import processes

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    ranks = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
    plain_env = {k: v for k, v in os.environ.items() if k not in ranks}
    ranked = subprocess.Popen(sleep, env={**plain_env, "HOROVOD_RANK": "3"})
    plain = subprocess.Popen(sleep, env=plain_env)
    try:
        assert _stopped_ranks(os.getpid()) == {}  # running
        for proc in (ranked, plain):
            os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10  # the state changes as the signal is delivered
        while not _stopped_ranks(os.getpid()) and time.monotonic() < deadline:
            pass
        assert _stopped_ranks(os.getpid()) == {processes.record(ranked.pid): 3}
        assert _stopped_ranks(plain.pid) == {}  # not a descendant of it
    finally:
        for proc in (ranked, plain):
            proc.kill()
            proc.wait()
