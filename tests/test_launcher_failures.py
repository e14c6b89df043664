"""The one line `hvdtrain-run` prints when a job fails, from the launchers' real messages
(captured from horovodrun 0.28.1 and Open MPI 4.1 on this machine). Pure, but for a few
launchers of one Python line (`supervise`)."""

import pytest

from hvdtrain.launcher.failures import OutputFilter, explain, find_failure, rank_hosts
from hvdtrain.launcher.hosts import Host

HOSTS = rank_hosts([Host("node1", 1), Host("node2", 2)], 3)

GLOO = """\
[0]<stderr>:hvdtrain: rank 0 stopped: Horovod was shut down because another rank failed
Process 1 exit with status code 137.
Terminating remaining workers after failure of Process 1.
Traceback (most recent call last):
  File "/venv/bin/horovodrun", line 8, in <module>
    sys.exit(run_commandline())
             ^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.12/site-packages/horovod/runner/gloo_run.py", line 285, in launch_gloo
    raise RuntimeError('Horovod detected that one or more processes exited with non-zero '
RuntimeError: Horovod detected that one or more processes exited with non-zero status, thus \
causing the job to be terminated. The first process to do so was:
Process name: 1
Exit code: 137

"""

MPI_SIGNAL = """\
--------------------------------------------------------------------------
mpirun noticed that process rank 2 with PID 0 on node node2 exited on signal 9 (Killed).
--------------------------------------------------------------------------
"""

MPI_EXIT = """\
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[40129,1],1]
  Exit code:    3
--------------------------------------------------------------------------
"""

MPI_LOST = """\
--------------------------------------------------------------------------
ORTE has lost communication with a remote daemon.

  HNP daemon   : [[5364,0],0] on node node1
  Remote daemon: [[5364,0],1] on node node2

This is usually due to either a failure of the TCP network
connection to the node, or possibly an internal failure of
the daemon itself. We cannot recover from this failure, and
therefore will terminate the job.
--------------------------------------------------------------------------
"""

# Every process of host B killed (tests/test_lost_hosts.py): the daemon's ssh session ends.
MPI_PEER_GONE = """\
--------------------------------------------------------------------------
ORTE was unable to reliably start one or more daemons.
This usually is caused by:
--------------------------------------------------------------------------
--------------------------------------------------------------------------
An MPI communication peer process has unexpectedly disconnected.  This
usually indicates a failure in the peer process (e.g., a crash or
otherwise exiting without calling MPI_FINALIZE first).

  Local host: hvd-host0
  Local PID:  1069
  Peer host:  node2
--------------------------------------------------------------------------
"""

# A chaos cut-host 0.5 s into a job on 3 namespace hosts under MPI (soak, 2026-12-06): the
# daemon on the cut host could not connect back to mpirun's, and mpirun exited 1.
MPI_DAEMON_UNREACHED = """\
------------------------------------------------------------
A process or daemon was unable to complete a TCP connection
to another process:
  Local host:    hvd-host2
  Remote host:   hvd-host0
This is usually caused by a firewall on the remote host. Please
check that any firewall (e.g., iptables) has been disabled and
try again.
------------------------------------------------------------
--------------------------------------------------------------------------
ORTE was unable to reliably start one or more daemons.
This usually is caused by:
--------------------------------------------------------------------------
"""


def filtered(text):
    f = OutputFilter()
    out = [piece for line in text.splitlines(keepends=True) for piece in f.feed(line)]
    return "".join(out + f.flush()), f


def test_tensorflows_start_up_noise_is_left_out_unless_asked_for():
    """horovodrun's build checks import TensorFlow, and so may ranks before hvdtrain: on
    CPUs where oneDNN is on, each prints these lines whatever TF_CPP_MIN_LOG_LEVEL says."""
    absl = "WARNING: All log messages before absl::InitializeLog() is called are written to "
    absl += "STDERR\n"
    onednn = "I0000 00:00:1795.5 31604 port.cc:153] oneDNN custom operations are on. You may\n"
    text = absl + onednn + f"[1]<stderr>:{absl}[1,0]<stderr>:{onednn}[0]<stderr>:hvdtrain: x\n"
    assert filtered(text)[0] == "[0]<stderr>:hvdtrain: x\n"
    loud = OutputFilter(quiet=False)  # TF_CPP_MIN_LOG_LEVEL=0
    assert [p for line in text.splitlines(keepends=True) for p in loud.feed(line)] == [
        absl,
        onednn,
        f"[1]<stderr>:{absl}",
        f"[1,0]<stderr>:{onednn}",
        "[0]<stderr>:hvdtrain: x\n",
    ]


def test_rank_hosts_fill_host_by_host():
    assert HOSTS == ["node1", "node2", "node2"]


def test_gloo_names_the_dead_rank_and_drops_horovodruns_traceback():
    shown, f = filtered(GLOO)
    assert "Traceback" not in shown and "Process name" not in shown
    assert "rank 0 stopped" in shown and "Process 1 exit with status code 137." in shown
    failure = find_failure(f.seen, HOSTS)
    assert (failure.rank, failure.host, failure.exit_code) == (1, "node2", 137)
    assert explain(failure, HOSTS) == (
        "rank 1 on host node2 was killed by signal 9 (SIGKILL) first; the job was ended"
    )


def test_gloo_one_line_of_the_patched_horovodrun():
    # launch/horovod-patches/0007: the traceback's fields on one line, no traceback.
    head = GLOO[: GLOO.index("Traceback (most recent call last):")]
    line = (
        "horovodrun: Horovod detected that one or more processes exited with non-zero status, "
        "so the job was stopped; the first: Process name: 1, Exit code: 137\n"
    )
    shown, f = filtered(head + line)
    assert "Process name" not in shown and "rank 0 stopped" in shown
    failure = find_failure(f.seen, HOSTS)
    assert (failure.rank, failure.host, failure.exit_code) == (1, "node2", 137)
    elastic = line.replace("Process name: 1", "Process name: node2[0]")
    failure = find_failure([elastic], HOSTS)
    assert (failure.rank, failure.host, failure.exit_code) == (None, "node2", 137)


def test_gloo_rank_whose_ssh_session_ended_is_a_lost_host():
    # Captured from two containers as two hosts, the second killed (tests/test_docker_image.py).
    failure = find_failure(GLOO.replace("137", "255").splitlines(), HOSTS)
    assert (failure.rank, failure.host, failure.exit_code) == (1, "node2", 255)
    assert explain(failure, HOSTS).startswith(
        "rank 1 on host node2 was lost first: exit status 255, ssh's when its connection ends"
    )


def test_mpirun_signal_exit_status_and_lost_host():
    failure = find_failure(MPI_SIGNAL.splitlines(), HOSTS)
    assert (failure.rank, failure.host, failure.signal, failure.exit_code) == (2, "node2", 9, 137)
    diverged = "[1,1]<stderr>:train.py [rank 1]: error: training diverged at step 7 ...\n"
    failure = find_failure((diverged + MPI_EXIT).splitlines(), HOSTS)
    assert (failure.rank, failure.host, failure.exit_code) == (1, "node2", 3)
    assert "exit status 3 (training diverged at step 7 ...)" in explain(failure, HOSTS)
    # A script's own sys.exit(3), with no error line of hvdtrain's: not hvdtrain's meaning.
    failure = find_failure(MPI_EXIT.splitlines(), HOSTS)
    assert "exit status 3 (see its output above)" in explain(failure, HOSTS)
    failure = find_failure(MPI_LOST.splitlines(), HOSTS)
    assert failure.lost_host == "node2"
    assert explain(failure, HOSTS).startswith("lost host node2 (ranks 1, 2): Open MPI lost")
    assert explain(failure, HOSTS, answers=True).startswith("lost host node2 (ranks 1, 2)")
    failure = find_failure(MPI_PEER_GONE.splitlines(), HOSTS)
    assert (failure.lost_host, failure.exit_code) == ("node2", 255)
    assert explain(failure, HOSTS).startswith("lost host node2 (ranks 1, 2): Open MPI lost")
    daemon = find_failure(MPI_DAEMON_UNREACHED.splitlines(), HOSTS)
    assert (daemon.lost_host, daemon.unreached, daemon.exit_code) == (
        "hvd-host2", "hvd-host0", 255
    )  # fmt: skip
    assert explain(daemon, HOSTS).startswith(
        "lost host hvd-host2: Open MPI's daemon there could not connect back to hvd-host0 as "
        "the job started (the network between them was down, or a firewall blocks it)"
    )  # fmt: skip
    # The same banner where node2 still answers (this host, or the probe after the job): a
    # rank's process ended there, not the host (a chaos kill-rank of rank 0 under MPI on 3
    # hosts was named "lost host" for the launch host itself).
    assert explain(failure, HOSTS, answers=True) == (
        "a rank on host node2 (ranks 1, 2) ended without a word: Open MPI's other ranks lost "
        "their connection to it while the host still answers (the process was killed or "
        "crashed: a kill, the out-of-memory killer); the job was ended"
    )


# mpirun names the first rank to *exit*: rank 0, which stopped at once because rank 1 failed
# while rank 1 was still unwinding (seen in 1 run of 2, Open MPI 4.1 on this machine).
MPI_STOPPED_FIRST = (
    "[1,0]<stderr>:hvdtrain: rank 0 stopped: Horovod was shut down because another rank failed, "
    "exited or stalled, or its host was lost (see its error)\n"
    + MPI_EXIT.replace("[[40129,1],1]", "[[1039,1],0]").replace(
        "Exit code:    3", "Exit code:    1"
    )
)


def test_mpirun_naming_a_rank_that_only_stopped_names_the_one_that_failed():
    failed = "[1,1]<stderr>:hvdtrain: rank 1 failed: InvalidArgumentError: bad record\n"
    failure = find_failure((failed + MPI_STOPPED_FIRST).splitlines(), HOSTS)
    assert (failure.rank, failure.host, failure.exit_code) == (1, "node2", 1)
    assert explain(failure, HOSTS).startswith("rank 1 on host node2 failed first: exit status 1")
    # Rank 1 left with sys.exit(7), no line of its own: rank 0 is not blamed for it.
    failure = find_failure(MPI_STOPPED_FIRST.splitlines(), HOSTS)
    assert explain(failure, HOSTS) == (
        "rank 0 on host node1 exited first (exit status 1), stopped because another rank "
        "ended or failed: see the ranks' output above; the job was ended"
    )


# Open MPI 4.1's banner before MPI_EXIT's when a rank exits non-zero (on this machine).
MPI_PRIMARY = """\
--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
"""


def test_mpiruns_end_of_job_banners_are_left_out_but_still_read():
    """The 11 lines after the one line repeat what hvdtrain-run's last line says, and so do
    the 3 of a rank killed by a signal; another dashed block of mpirun's stays."""
    said = "[1,1]<stderr>:train.py [rank 1]: error: training diverged at step 7\n"
    shown, f = filtered(said + MPI_PRIMARY + MPI_EXIT)
    assert shown == said
    failure = find_failure(f.seen, HOSTS)
    assert (failure.rank, failure.exit_code) == (1, 3)
    shown, f = filtered(said + MPI_PRIMARY + MPI_SIGNAL)
    assert shown == said
    assert (find_failure(f.seen, HOSTS).signal, find_failure(f.seen, HOSTS).rank) == (9, 2)
    other = "-" * 74 + "\nAn ORTE daemon has unexpectedly failed after launch\n" + "-" * 74 + "\n"
    assert filtered(other)[0] == other


def _exited(rank, code):
    return MPI_EXIT.replace("[[40129,1],1]", f"[[40129,1],{rank}]").replace("   3", f"   {code}")


def test_an_error_the_ranks_agreed_on_blames_no_rank_that_only_left_after_it():
    """Rank 0 prints an error every rank agreed on (a `__getitem__` failing on batch 0, a
    generator's wrong shape); rank 1 leaves after it with its status and exits first: the
    line says every rank failed alike, under MPI and Gloo."""
    agreed = "train.py: error: gen's batch 1 is float32[32, 4] where the first batches were\n"
    gloo = GLOO.replace("137", "2").replace("[0]<stderr>:hvdtrain: rank 0 stopped", "[0]<stderr>:x")
    for text in (f"[1,0]<stderr>:{agreed}" + _exited(1, 2), f"[0]<stderr>:{agreed}" + gloo):
        failure = find_failure(text.splitlines(), HOSTS)
        assert explain(failure, HOSTS) == (
            "every rank failed alike: exit status 2 (gen's batch 1 is float32[32, 4] where the "
            "first batches were); the job was ended"
        ), text
    # An error of one rank's own still names it.
    own = "[1,1]<stderr>:train.py [rank 1]: error: rank 1's data ran out\n"
    failure = find_failure((own + _exited(1, 2)).splitlines(), HOSTS)
    assert explain(failure, HOSTS).startswith("rank 1 on host node2 failed first: exit status 2")
    # The same traceback on every rank (a typo in `__getitem__`, batch 0): alike; else the
    # rank mpirun named.
    failed = "hvdtrain: rank {} failed: Ids[0] raised NameError: name 'sc' is not defined in "
    failed += "__getitem__ (train.py:9){}\n"
    both = "".join(
        f"[1,{r}]<stderr>:" + failed.format(r, tail)
        for r, tail in (
            (0, " (last: loading (Ids))"),
            (1, "; its traceback is the same as rank 0's"),
        )
    )
    for size, expected in ((2, "every rank failed alike: exit status 1"), (3, "rank 1 on host")):
        failure = find_failure((both + _exited(1, 1)).splitlines(), HOSTS[:size])
        assert explain(failure, HOSTS).startswith(expected), size


def test_a_watchdog_that_waited_for_the_others_is_not_the_one_blamed():
    """Rank 0 waited in a step and its watchdog ended it first (status 124): the rank whose
    own watchdog said it was stuck is named; with none (a frozen process), the words say
    rank 0 waited."""
    from hvdtrain.runtime.watchdog import message

    waited = "[1,0]<stderr>:" + message(0, 20, "in step 6 of epoch 1", waited=True)
    stuck = "[1,1]<stderr>:" + message(1, 10, "in your callback Sleepy.on_epoch_end", False)
    exited = MPI_EXIT.replace("[[40129,1],1]", "[[40129,1],0]").replace("   3", "   124")
    failure = find_failure((waited + stuck + exited).splitlines(), HOSTS)
    assert (failure.rank, failure.host, failure.code, failure.waited) == (1, "node2", 124, False)
    assert explain(failure, HOSTS).startswith("rank 1 on host node2 failed first: exit status "
                                              "124 (it made no progress")  # fmt: skip
    failure = find_failure((waited + exited).splitlines(), HOSTS)
    assert (failure.rank, failure.code, failure.waited) == (0, 124, True)
    assert explain(failure, HOSTS) == (
        "rank 0 on host node1 waited for the other ranks until its watchdog ended it (exit "
        "status 124), and no rank said it was stuck: one of them froze whole (a stopped "
        "process, a host that stopped answering); its line above says where it waited; the "
        "job was ended"
    )


def test_a_watchdogs_line_is_read_by_its_marker_not_its_words():
    """`hvdtrain-run` reads a watchdog's rank, and whether it waited for the others, from the
    marker at the end of its line (the words may change), and prints the line without it."""
    from hvdtrain.runtime.watchdog import message, stalls, without_marker

    stuck = message(1, 10, "in your callback Sleepy.on_epoch_end", waited=False)
    waited = message(0, 20, "in step 6 of epoch 1", waited=True)
    assert stuck.endswith(" ending it so that the launcher ends the job "
                          "[hvdtrain:stall rank=1 waiting=0]\n")  # fmt: skip
    assert waited.endswith("[hvdtrain:stall rank=0 waiting=1]\n")
    assert stalls(f"[1,0]<stderr>:{waited}[1,1]<stderr>:{stuck}") == [(0, True), (1, False)]
    # Other words, the same marker: the same reading. Without the marker: nothing.
    reworded = "[1,1]<stderr>:hvdtrain: rank 1 is stuck [hvdtrain:stall rank=1 waiting=0]\n"
    exited = MPI_EXIT.replace("[[40129,1],1]", "[[40129,1],0]").replace("   3", "   124")
    found = find_failure(("[1,0]<stderr>:" + waited + reworded + exited).splitlines(), HOSTS)
    assert (found.rank, found.code, found.waited) == (1, 124, False)
    words_only = without_marker(stuck)
    assert stalls(words_only) == [] and words_only == stuck.replace(
        " [hvdtrain:stall rank=1 waiting=0]", ""
    )
    found = find_failure(("[1,0]<stderr>:" + waited + words_only + exited).splitlines(), HOSTS)
    assert (found.rank, found.waited) == (0, True)  # rank 1's words alone are not read
    # What the user sees: the line as before, without the marker; `seen` keeps it.
    shown, f = filtered(f"[1,1]<stderr>:{stuck}")
    assert shown == f"[1,1]<stderr>:{words_only}" and "[hvdtrain:stall rank=1" in f.seen[0]


def test_other_tracebacks_pass_through_and_nothing_found_is_none():
    text = 'Traceback (most recent call last):\n  File "x", line 1\nValueError: mine\nafter\n'
    shown, f = filtered(text)
    assert shown == text and find_failure(f.seen) is None


def test_a_rank_ending_starts_the_launchers_grace_and_unanswering_hosts_are_named():
    import pytest

    from hvdtrain.errors import HvdtrainError
    from hvdtrain.launcher.failures import explain_unanswered, is_ending, launcher_grace_seconds
    from hvdtrain.runtime.watchdog import message

    # Seen when host node2's network was cut (tests/test_lost_hosts.py): rank 0's watchdog,
    # then mpirun's abort, which then waits for node2's daemon.
    watchdog = "[1,0]<stderr>:" + message(0, 20, "in step 1 ...", waited=False)
    assert is_ending(watchdog)
    assert is_ending("a non-zero exit code. Per user-direction, the job has been aborted.")
    assert all(is_ending(line) for line in GLOO.splitlines()[:1])
    assert not is_ending("[1,0]<stderr>:hvdtrain: epoch 1/5: 70 steps in 8.4 s")
    assert launcher_grace_seconds({}) == 30
    assert launcher_grace_seconds({"HVDTRAIN_LAUNCHER_GRACE_SECONDS": "2.5"}) == 2.5
    for bad in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(HvdtrainError, match="HVDTRAIN_LAUNCHER_GRACE_SECONDS"):
            launcher_grace_seconds({"HVDTRAIN_LAUNCHER_GRACE_SECONDS": bad})
    timed_out = "ssh: connect to host node2 port 22: Connection timed out"
    line = explain_unanswered({"node2": timed_out}, HOSTS, 30)
    assert line.startswith(f"lost host node2 (ranks 1, 2): it no longer answers ssh ({timed_out})")
    assert "30 s after a rank ended, so hvdtrain-run ended it" in line
    assert "ended it" not in explain_unanswered({"node2": timed_out}, HOSTS)


STUCK_LAUNCHER = """
import os, sys, time
from hvdtrain.launcher.supervise import run_command
# A launcher that forwards nothing and never ends (mpirun after a cut), whose local rank
# leaves its last line before ending.
rank = ("from hvdtrain.errors import note_ending; "
        "note_ending('hvdtrain: rank 0 made no progress for 20 s (last: in step 3)\\\\n')")
launcher = f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {rank!r}]); "
launcher += "time.sleep(600)"
sys.exit(run_command([sys.executable, "-c", launcher], dict(os.environ), ["localhost"], 1))
"""


def _launcher(source, *args):
    """Runs the Python `source` (a launcher under `supervise`) with `args`; its process."""
    import subprocess
    import sys

    from conftest import job_env

    argv = [sys.executable, "-c", source, *args]
    return subprocess.run(argv, env=job_env(), capture_output=True, text=True, timeout=60)


def test_a_rank_that_ends_unheard_still_starts_the_grace():
    proc = _launcher(STUCK_LAUNCHER)
    assert proc.returncode == 128 + 15, proc.stderr  # SIGTERM, after the grace
    assert proc.stderr.splitlines() == [
        "hvdtrain: rank 0 made no progress for 20 s (last: in step 3)",
        "hvdtrain-run: the launcher was still running 1 s after a rank ended; ended it",
    ]


BACK_BY_THE_END = STUCK_LAUNCHER.replace(
    '["localhost"], 1))',
    '["localhost"], 1, probe))',
).replace(
    "rank = (",
    """def probe():  # node2's network cut while the launcher waits, back once it is ended
    def cmdline(pid):
        try:
            return open(f"/proc/{pid}/cmdline").read()
        except OSError:
            return ""
    lines = [cmdline(p) for p in os.listdir("/proc") if p.isdigit()]
    waiting = any("time.sleep(600)" in c and "def probe" not in c for c in lines)
    return {"node2": "Connection timed out"} if waiting else {}
rank = (""",
)


def test_a_host_cut_when_a_rank_ended_is_named_though_back_by_the_end():
    """A chaos run's cut-host under MPI on 3 hosts ended as the launcher still running:
    the probe after the job found the host back. Asked when the grace starts too, it is
    named."""
    proc = _launcher(BACK_BY_THE_END)
    assert proc.returncode == 255, proc.stderr
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("hvdtrain-run: lost host node2: it no longer answers ssh (Connection "
                           "timed out)"), proc.stderr  # fmt: skip
    assert "still waiting for it 1 s after a rank ended, so hvdtrain-run ended it" in last


PEER_GONE_LAUNCHER = """
import os, sys
from hvdtrain.launcher.supervise import run_command
banner = sys.argv[1]
launcher = f"import sys; sys.stderr.write({banner!r}); sys.exit(1)"
down = {"node2": "Connection timed out"} if sys.argv[2] == "down" else {}
sys.exit(run_command([sys.executable, "-c", launcher], dict(os.environ), ["localhost", "node2"],
                     30, lambda: down))
"""


@pytest.mark.parametrize("node2", ["answers", "down"])
def test_a_peers_banner_names_a_lost_rank_where_its_host_answers(node2):
    """Open MPI's "peer process has unexpectedly disconnected" follows a killed rank as
    well as a lost host: hvdtrain-run asks the host before it says which."""
    proc = _launcher(PEER_GONE_LAUNCHER, MPI_PEER_GONE, node2)
    assert proc.returncode == 255, proc.stderr
    last = proc.stderr.splitlines()[-1]
    if node2 == "answers":
        assert last.startswith("hvdtrain-run: a rank on host node2 (rank 1) ended without"), last
    else:
        assert last.startswith("hvdtrain-run: lost host node2 (rank 1): it no longer answers"), last


def test_only_the_launchers_host_leaves_its_last_line(tmp_path, monkeypatch):
    """Ranks of other hosts get the variables too (mpirun -x); where they see the folder
    (a shared /tmp, as the namespace test hosts have), they still leave nothing."""
    import socket

    from hvdtrain.errors import ENDING_DIR_ENV, ENDING_HOST_ENV, note_ending

    monkeypatch.setenv(ENDING_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(ENDING_HOST_ENV, "another-host")
    note_ending("hvdtrain: rank 1 made no progress\n")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(ENDING_HOST_ENV, socket.gethostname())
    note_ending("hvdtrain: rank 0 made no progress\n")
    assert [p.read_text() for p in tmp_path.iterdir()] == ["hvdtrain: rank 0 made no progress\n"]


def _traceback(tag, rank, error="ValueError: bad pixel"):
    body = [
        "hvdtrain: the error below was raised in your code: parse (train.py:12)",
        "Traceback (most recent call last):",
        '  File "train.py", line 12, in parse',
        "    raise ValueError('bad pixel')",
        error,
    ]
    return [f"{tag}{line}\n" for line in body] + [
        f"{tag}hvdtrain: rank {rank} failed: {error} (last: in step 3)\n"
    ]


def test_a_traceback_every_rank_prints_alike_is_shown_once():
    """Each rank's block is held until hvdtrain's last line (interleaved here, as mpirun
    forwards them); the second alike becomes one line, its own last line kept."""
    from hvdtrain.launcher.failures import _Repeats

    r0, r1 = _traceback("[1,0]<stderr>:", 0), _traceback("[1,1]<stderr>:", 1)
    f = OutputFilter()
    out = []
    for a, b in zip(r0, r1, strict=True):
        out += f.feed(a) + f.feed(b)
    assert out == r0 + [
        "[1,1]<stderr>:(the same traceback as rank 0's above)\n",
        r1[-1],
    ]
    # What differs from process to process for the same code (the files autograph writes,
    # object addresses) does not make two tracebacks different.
    a = _traceback("[1,0]<stderr>:", 0, "File /tmp/__autograph_generated_filerz_lv0wh.py")
    b = _traceback("[1,1]<stderr>:", 1, "File /tmp/__autograph_generated_fileq8xk2m1.py")
    f = OutputFilter()
    out = [x for line in a + b for x in f.feed(line)]
    assert out == a + ["[1,1]<stderr>:(the same traceback as rank 0's above)\n", b[-1]]
    # Another error on rank 1 is shown whole; other lines pass at once.
    other = _traceback("[1]<stderr>:", 1, "KeyError: 'label'")
    gloo = _traceback("[0]<stderr>:", 0)
    f = OutputFilter()
    lines = gloo + ["[1]<stderr>:epoch 1/5\n"] + other
    shown = [x for line in lines for x in f.feed(line)]
    assert shown == gloo + ["[1]<stderr>:epoch 1/5\n"] + other
    # A traceback that did not end its process: shown after the hold, or at the end.
    now = [0.0]
    repeats = _Repeats(clock=lambda: now[0])
    held = ["[0]<stderr>:Traceback (most recent call last):\n", "[0]<stderr>:KeyError: 1\n"]
    assert [x for line in held for x in repeats.feed(line)] == []
    now[0] = 6.0
    assert repeats.feed("[1]<stderr>:epoch 2/5\n") == held + ["[1]<stderr>:epoch 2/5\n"]
    assert repeats.feed(held[0]) == [] and repeats.flush() == held[:1]


def test_the_ranks_of_a_job_on_one_host_print_an_alike_traceback_once(tmp_path, monkeypatch):
    """`hvdtrain.runtime.tracebacks`: each launcher's name for the job; the first rank publishes its
    traceback, a later alike one gets that rank back, a different one prints its own."""
    import os
    import stat
    import tempfile

    from hvdtrain.runtime.tracebacks import first_to_raise, job_key

    assert job_key({"PMIX_NAMESPACE": "1556217857", "SLURM_JOB_ID": "7"}) == "1556217857"
    gloo = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": "4242"}
    assert job_key(gloo) == "10.0.0.1/4242"
    assert job_key({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0"}) == "7/0"
    assert job_key({"SLURM_JOB_ID": "7"}) is None and job_key({}) is None
    text = "Traceback ...\n  File /tmp/__autograph_generated_file{}.py\nValueError: x\n"
    assert first_to_raise("job", 1, text.format("ab12"), tmp_path) is None  # prints it
    assert first_to_raise("job", 0, text.format("zz99"), tmp_path) == 1  # the same: one line
    assert first_to_raise("job", 2, "KeyError: 'label'\n", tmp_path) is None  # its own
    assert first_to_raise("other job", 0, text.format("ab12"), tmp_path) is None
    assert [p.suffix for p in tmp_path.iterdir()] == [".traceback"] * 2  # nothing else left
    assert first_to_raise("job", 0, text, tmp_path / "missing") is None  # no file: print
    # An earlier job of the same name (Open MPI's 16-bit job family came back): its file,
    # even alike, is replaced, never answered from (CI: rank 1 then printed in full).
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    assert first_to_raise("job", 0, text, earlier) is None
    (old,) = earlier.iterdir()
    os.utime(old, (0, 0))
    assert first_to_raise("job", 1, text, earlier, started=120) is None  # prints it
    assert first_to_raise("job", 0, text, earlier, started=120) == 1
    # By default in this user's own folder of the temp folder: one others cannot write to.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert first_to_raise("job", 1, text, None) is None and first_to_raise("job", 0, text) == 1
    own = tmp_path / "tmp" / f"hvdtrain-{os.getuid()}"
    assert stat.S_IMODE(own.stat().st_mode) == 0o700
    own.chmod(0o777)  # not its own any more: no file, each rank prints its traceback
    assert first_to_raise("job2", 1, text) is None and first_to_raise("job2", 0, text) is None


def test_the_first_line_names_your_function(tmp_path):
    """The innermost frame of the user's own code, unless it only called hvdtrain or is a
    script's top level."""
    import json
    import sys

    from hvdtrain.recipe import flags
    from hvdtrain.runtime.tracebacks import your_frame

    def parse(x):
        return int(x)

    def caught(fn):
        try:
            fn()
        except Exception:
            return your_frame(sys.exc_info()[2])

    assert caught(lambda: parse("x")).name == "parse"  # raised by the builtin it called
    assert caught(lambda: json.loads("{")).name == "<lambda>"  # in the standard library
    assert caught(lambda: flags.TrainConfig(epochs=-1)) is None  # hvdtrain's own error
    script = tmp_path / "train.py"
    script.write_text("int('z')\n")
    top = compile(script.read_text(), str(script), "exec")
    assert caught(lambda: exec(top, {})) is None  # a script's top level


def test_elastic_names_the_worker_by_its_host():
    """Elastic horovodrun names a process `host[local rank]`: the host, not a rank 127."""
    elastic = GLOO.replace("Process name: 1", "Process name: 127.0.0.1[0]").replace("137", "124")
    failure = find_failure(elastic.splitlines(), HOSTS)
    assert (failure.rank, failure.host, failure.code) == (None, "127.0.0.1", 124)
    assert explain(failure).startswith("a worker on host 127.0.0.1 failed first: exit status 124")


# A rank stuck inside a step (tests/workers/stuck_rank.py step, hvdtrain-run --backend mpi, a
# 10 s stall time): rank 0's Horovod names it, then mpirun names rank 0, which only stopped.
MPI_STALL = """\
[1,0]<stderr>:[2026-11-28 08:45:51.696601: E /tmp/horovod-0.28.1/horovod/common/stall_inspector.cc:105] One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks and are waiting for remainder of ranks for more than 2 seconds. This may indicate that different ranks are trying to submit different tensors or that only subset of ranks is submitting tensors, which will cause deadlock. 
[1,0]<stderr>:Missing ranks:
[1,0]<stderr>:1!: [PartitionedCall/DistributedSGD_Allreduce/cond/then/_7/DistributedSGD_Allreduce/cond/HorovodAllreduce_grads_0]
[1,0]<stderr>:One or more rank (marked by "!") is stalled for longer than 10 seconds. Will shutdown.[1,0]<stderr>:
[1,0]<stderr>:hvdtrain: rank 0 stopped: Horovod was shut down because another rank failed, exited or stalled, or its host was lost (see its error) (last: in step 3 of epoch 2 (input, forward, backward, gradient allreduce with the other ranks))
"""  # noqa: E501, W291
MPI_STALL += MPI_EXIT.replace("],1]", "],0]").replace("Exit code:    3", "Exit code:    1")


def test_horovods_stall_check_names_the_stuck_rank_not_the_first_to_exit():
    failure = find_failure(MPI_STALL.splitlines(), HOSTS)
    assert (failure.rank, failure.host, failure.exit_code) == (1, "node2", 124)
    assert explain(failure, HOSTS) == (
        "rank 1 on host node2 stopped making progress first: the other ranks waited for it in "
        "a collective for over 10 s, and Horovod's stall check ended the job (the time: "
        "HVDTRAIN_STALL_SHUTDOWN_SECONDS, and one check); the job was ended"
    )
    # Several ranks past the time (Gloo's tag): each named, with its host.
    two = MPI_STALL.replace("[1,0]<stderr>:1!: [", "[0]<stderr>:1!: [a]\n[0]<stderr>:2!: [")
    failure = find_failure(two.splitlines(), HOSTS)
    assert failure.stalled_ranks == (1, 2)
    assert explain(failure, HOSTS).startswith(
        "ranks 1 (host node2), 2 (host node2) stopped making progress first: the other ranks "
        "waited for them"
    )
    # Warnings alone (no rank past the shutdown time yet) name nobody.
    warned = MPI_STALL.replace("1!:", "1:").replace("Will shutdown.", "")
    assert find_failure(warned.splitlines(), HOSTS).stalled is None
