"""Supervising the launched job: `run_command` runs the launcher (horovodrun, mpirun, srun)
in its own session, forwards SIGINT and SIGTERM to it, filters its stderr through
`failures.OutputFilter` so that a failed job ends with one line naming the rank and host,
and ends a launcher that outlives a rank's end by its grace. `hvdtrain-run` (cli.py)
parses and builds the command; this module runs it.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from hvdtrain.errors import ENDING_DIR_ENV, ENDING_HOST_ENV, HvdtrainError
from hvdtrain.launcher import failures
from hvdtrain.launcher.noise import noise_unwanted
from hvdtrain.runtime import processes
from hvdtrain.runtime.numbers import decimal
from hvdtrain.runtime.stall import stall_shutdown_seconds
from hvdtrain.runtime.watchdog import without_marker

__all__ = ["PROG", "run_command"]

PROG = "hvdtrain-run"  # the launcher's name, at the start of its lines


def run_command(argv, env, hosts=None, grace=None, probe=None, elastic_spec=None):
    """Runs `argv` with `env` in its own process group; forwards SIGINT/SIGTERM to that
    group; returns its exit code (128+N when it died of signal N). A job that ends after the
    launcher got a signal and passed it on gets one line saying so, not which rank ended
    first.

    With `hosts` (the host of each rank), the launcher's stderr passes through a
    `failures.OutputFilter`: its own traceback after a failed rank is left out and, when
    the job fails, one line names the first rank that failed and its host (or the host
    that was lost); the exit code is then that rank's. With `grace` (seconds), once a line
    says a rank is ending (`failures.is_ending`), the launcher has that long to end before
    every process of its session is ended (SIGTERM, then SIGKILL 10 s later; also the ssh
    clients that mpirun puts in groups of their own): mpirun waits forever for a host
    whose network is gone. The ranks of this host also leave their last line in a folder
    (`errors.note_ending`), which starts the grace when mpirun forwards nothing.
    `probe()`, called after a failed job, returns {host:
    why} for the hosts that no longer answer; those are named as lost (exit 255).
    `elastic_spec`: the job's `ElasticSpec` (see `failures.OutputFilter`).

    A rank of this host stopped whole (SIGSTOP, SIGTSTP) for the stall time is ended, and
    the job with it, in one line naming it (exit 124): its watchdog cannot run, and where
    no other rank waits for it (past the job's last collective) nothing else would end it."""
    child, pending, timers, ended, notes, stopped = [], [], [], [], [], []
    received = []  # the signals forwarded to the job (a preemption, a kill, Ctrl-C)
    lock, done = threading.Lock(), threading.Event()
    ending_dir = tempfile.mkdtemp(prefix="hvdtrain-run-") if grace and hosts else None
    if ending_dir:
        env = {**env, ENDING_DIR_ENV: ending_dir, ENDING_HOST_ENV: socket.gethostname()}

    def forward(signum, frame):
        received.append(signum)
        if not child:  # not started yet: pass it on as soon as it is
            pending.append(signum)
            return
        try:
            os.killpg(child[0].pid, signum)
        except ProcessLookupError:
            pass

    def end_launcher(signum):
        with lock:  # the ranks' last lines that the launcher did not forward, once
            unseen = [n for n in notes if not any(n.strip() in s for s in watch.seen)]
            watch.seen.extend(unseen)
        if not ended:
            sys.stderr.writelines(without_marker(n) for n in unseen)
            sys.stderr.flush()
        ended[:] = [grace]
        _signal_session(child[0].pid, signum)

    def start_grace():
        with lock:
            if timers or done.is_set():
                return
            for delay, signum in ((grace, signal.SIGTERM), (grace + 10, signal.SIGKILL)):
                timers.append(threading.Timer(delay, end_launcher, (signum,)))
                timers[-1].daemon = True
                timers[-1].start()

    def watch_stopped(limit):  # each second, until a rank of this host stays stopped
        since = {}
        while not done.wait(1):
            now, ranks = time.monotonic(), _stopped_ranks(child[0].pid)
            since = {p: since.get(p, now) for p in ranks}  # (a process: its id and start)
            late = [p for p, t in since.items() if now - t >= limit]
            if late:
                stopped.append(
                    f"rank {ranks[late[0]]} (pid {late[0].pid} on {socket.gethostname()}) was "
                    f"stopped (SIGSTOP or SIGTSTP) for {limit:g} s, the stall time; ended it and "
                    "the job"
                )
                processes.send_all(late, signal.SIGKILL)  # (not an id another process took)
                return

    def watch_ending_dir():  # each second, until a rank of this host leaves its last line
        while not done.wait(1):
            notes[:] = _read_notes(ending_dir)
            if notes:
                start_grace()
                return

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    watch = None
    if hosts is not None:
        cooldown = elastic_spec.cooldown_range if elastic_spec else None
        quiet = noise_unwanted(env)
        watch = failures.OutputFilter(elastic=bool(elastic_spec), cooldown=cooldown, quiet=quiet)
    try:
        try:
            child.append(
                subprocess.Popen(
                    argv,
                    env=env,
                    start_new_session=True,
                    stderr=subprocess.PIPE if watch else None,
                    text=True,
                    errors="replace",
                )
            )
        except OSError as e:
            raise HvdtrainError(f"cannot run {argv[0]}: {e.strerror or e}") from None
        for signum in pending:
            forward(signum, None)
        if ending_dir:
            threading.Thread(target=watch_ending_dir, name="hvdtrain-ending", daemon=True).start()
        limit = _stall_time(env) if watch and not elastic_spec else 0
        if limit:  # (elastic: the job goes on without a worker that failed)
            threading.Thread(
                target=watch_stopped, args=(limit,), name="hvdtrain-stopped", daemon=True
            ).start()
        if watch:
            for line in child[0].stderr:
                with lock:
                    shown = watch.feed(line)
                if not ended:  # after that: the launcher's reaction to being ended
                    sys.stderr.writelines(shown)
                    sys.stderr.flush()
                if grace and failures.is_ending(line):
                    start_grace()
            sys.stderr.writelines(watch.flush())
        code = child[0].wait()
    finally:
        with lock:
            done.set()
        for timer in timers:
            timer.cancel()
        if ending_dir:
            shutil.rmtree(ending_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = code if code >= 0 else 128 - code
    if stopped:
        print(f"{PROG}: {stopped[0]}", file=sys.stderr, flush=True)
        return failures.STALLED
    if received and code:  # the job ended because it was told to, not by a rank's failure
        name = signal.Signals(received[0]).name
        print(f"{PROG}: received {name} and passed it to the job, which ended", file=sys.stderr,
              flush=True)  # fmt: skip
        return code
    if watch and code:
        failure = failures.find_failure(watch.seen, hosts)
        down = probe() if probe and not (failure and failure.exit_code == 255) else {}
        if down:
            line, code = failures.explain_unanswered(down, hosts, ended and grace), 255
        elif failure:
            line, code = failures.explain(failure, hosts), failure.exit_code or code
        elif ended:
            line = f"the launcher was still running {grace:g} s after a rank ended; ended it"
        else:
            line = None
        if line:
            print(f"{PROG}: {line}", file=sys.stderr, flush=True)
    return code


def _read_notes(folder):
    """The lines the ranks left in `folder` (`errors.note_ending`), or [] (none yet)."""
    lines = []
    for name in sorted(os.listdir(folder)):
        try:
            with open(os.path.join(folder, name), errors="replace") as f:
                lines.extend(line if line.endswith("\n") else line + "\n" for line in f)
        except OSError:
            pass
    return lines


def _stall_time(env):
    """The job's stall time, or 0 where it is off or not a valid number (the ranks' own
    `hvdtrain.init` then says what is wrong with it, as before)."""
    try:
        return stall_shutdown_seconds(env)
    except HvdtrainError:
        return 0


_RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def _stopped_ranks(root):
    """{`processes.Recorded`: rank} of the descendants of process `root` that are stopped
    and are ranks (a launcher's rank variable in their environment). Descendants, not a
    session: horovodrun starts each rank in a session of its own."""
    out = {}
    for process in processes.descendants(root):
        if processes.state(process.pid) != processes.STOPPED:
            continue
        env = processes.environment(process.pid)  # ({}: gone meanwhile, or not ours)
        for var in _RANK_VARIABLES:
            rank = decimal(env.get(var, ""))
            if rank is not None:
                out[process] = rank
                break
    return out


def _signal_session(sid, signum):
    """Sends `signum` to every process of session `sid`."""
    processes.send_all(processes.session_processes(sid), signum)
