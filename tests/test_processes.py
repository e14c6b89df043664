"""The process table (`hvdtrain.runtime.processes`), read from real processes: a `sleep`
started here is found, read back, signalled and ended; a recorded process whose id another
process now holds (a wrong start time recorded) is neither alive nor signalled."""

import os
import signal
import subprocess
import time
import uuid

import pytest

from hvdtrain.runtime import processes
from hvdtrain.runtime.processes import Recorded

pytestmark = pytest.mark.timeout(60)
MARK = "HVDTRAIN_TEST_PROCESSES"


@pytest.fixture
def sleeper():
    """A `sleep 60` in a session of its own, a marker in its environment; ended after."""
    marker = uuid.uuid4().hex
    proc = subprocess.Popen(["sleep", "60"], env={**os.environ, MARK: marker},
                            start_new_session=True)  # fmt: skip
    try:
        yield proc, marker
    finally:
        proc.kill()
        proc.wait()


def _until(condition, seconds=10):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_process_is_read_back(sleeper):
    proc, marker = sleeper
    start = processes.started(proc.pid)
    assert start is not None and start >= processes.started() > 0  # started after this one
    assert processes.started(proc.pid) == start  # the same figure, read again
    assert processes.record(proc.pid) == Recorded(proc.pid, start)
    assert processes.alive(proc.pid) and processes.alive(proc.pid, start)
    assert processes.parent(proc.pid) == os.getpid()
    assert processes.session(proc.pid) == proc.pid  # start_new_session: its own
    assert _until(lambda: processes.command_line(proc.pid) == ["sleep", "60"])
    assert processes.environment(proc.pid)[MARK] == marker
    assert processes.ancestors(proc.pid)[0] == (
        os.getpid(), processes.started(), processes.command_line(os.getpid()))  # fmt: skip
    assert Recorded(proc.pid, start) in processes.descendants(os.getpid())
    assert processes.session_processes(proc.pid) == [Recorded(proc.pid, start)]
    assert processes.marked(MARK, marker) == {
        Recorded(proc.pid, start): processes.environment(proc.pid)
    }
    assert processes.marked(MARK, "another job") == {}


def test_a_stopped_process_is_stopped(sleeper):
    proc, _ = sleeper
    assert processes.state(proc.pid) != processes.STOPPED
    assert processes.send(processes.record(proc.pid), signal.SIGSTOP)
    assert _until(lambda: processes.state(proc.pid) == processes.STOPPED)
    assert processes.alive(proc.pid)  # stopped is not ended


def test_a_reused_id_is_neither_alive_nor_signalled(sleeper):
    """What a pid that another process took looks like: the id is there, its start is not
    the recorded one."""
    proc, marker = sleeper
    other = Recorded(proc.pid, processes.started(proc.pid) - 1.0)
    assert not processes.alive(*other)
    assert not processes.send(other, signal.SIGKILL)
    assert processes.send_all([other], signal.SIGKILL) == []
    assert proc.poll() is None and processes.alive(proc.pid)  # the sleep was not touched
    mine = processes.record(proc.pid)
    assert processes.send_all([mine, other], signal.SIGTERM) == [proc.pid]
    assert proc.wait(10) == -signal.SIGTERM


def test_an_ended_process_is_gone(sleeper):
    proc, marker = sleeper
    mine = processes.record(proc.pid)
    proc.kill()
    assert _until(lambda: processes.state(proc.pid) == "zombie")  # not waited for yet
    assert not processes.alive(*mine)
    assert processes.marked(MARK, marker) == {}  # a zombie is no living process of a job
    assert processes.command_line(proc.pid) == []
    proc.wait()
    for read, none in ((processes.started, None), (processes.state, None),
                       (processes.parent, None), (processes.session, None),
                       (processes.command_line, []), (processes.environment, {}),
                       (processes.descendants, []), (processes.record, None)):  # fmt: skip
        assert read(proc.pid) == none, read
    assert not processes.alive(proc.pid) and not processes.send(mine, signal.SIGKILL)


def test_a_session_is_signalled_whole():
    """Every process of a session (a shell and its child), and nothing else."""
    shell = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    try:
        assert _until(lambda: len(processes.session_processes(shell.pid)) == 2)
        members = processes.session_processes(shell.pid)
        assert {p.pid for p in members} >= {shell.pid}
        assert [p for p in members if p.pid != shell.pid] == processes.descendants(shell.pid)
        assert sorted(processes.send_all(members, signal.SIGKILL)) == sorted(p.pid for p in members)
        assert shell.wait(10) == -signal.SIGKILL
        assert _until(lambda: not processes.session_processes(shell.pid))
    finally:
        shell.kill()
        shell.wait()


def test_ancestors_end_below_process_1():
    lineage = processes.ancestors()
    assert lineage and lineage[0][0] == os.getppid()
    assert all(pid > 1 for pid, _, _ in lineage)
    assert all(isinstance(start, float) and argv for _, start, argv in lineage[:1])


def test_the_machines_busy_seconds_grow():
    before = processes.busy_cpu_seconds()
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:  # 0.2 s of this process's own CPU
        pass
    after = processes.busy_cpu_seconds()
    assert before is not None and after >= before + 0.1


def test_the_table_is_read_by_psutil_only():
    """No module of hvdtrain reads /proc's process files itself any more, but for the one
    link psutil has no reader for (a process's network namespace, in processes.py)."""
    root = os.path.dirname(os.path.dirname(processes.__file__))
    readers = []
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(folder, name)).read()
                text = "\n".join(x for x in text.splitlines() if "/ns/net" not in x)
                if '"/proc"' in text or "/proc/{" in text or '"/proc/stat"' in text:
                    readers.append(os.path.relpath(os.path.join(folder, name), root))
    assert readers == [], readers
