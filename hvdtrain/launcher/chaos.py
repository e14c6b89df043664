"""hvdtrain-run chaos: does your script survive the faults hvdtrain promises to survive?

Usage::

    hvdtrain-run chaos -np 2 --faults 7 [--seed S] [--backend B] [--kinds K,K,...]
        [--stall-seconds S] [--json PATH] [--workdir DIR] -- python train.py ARGS

It runs your command (a script on `hvdtrain.ArgumentParser`) twice under `hvdtrain-run`:
once uninterrupted, then again while it injects `--faults` faults, one per attempt, at
moments drawn from `--seed`, resuming with the same command after each, to the end. It
adds `--deterministic` where the command lacks it, and gives each run its own
`--checkpoint-dir` and `--metrics-json` (in `--workdir`; yours are replaced). Then it
compares the final weights (the metrics JSON's `ranks[0].weights_digest`) with the
uninterrupted run's.

The faults (`--kinds`, default all that this machine allows):

    kill-rank           SIGKILL of one rank (a crash, the out-of-memory killer)
    kill-launcher       SIGKILL of hvdtrain-run (a scheduler's hard kill): the ranks end
                        within a second (`hvdtrain.runtime.orphan`)
    term-launcher       SIGTERM of hvdtrain-run (a scheduler's preemption)
    stop-rank           SIGSTOP of one rank: the stall time ends the job (--stall-seconds,
                        default 20, set as HVDTRAIN_STALL_SHUTDOWN_SECONDS)
    kill-in-checkpoint  SIGKILL of rank 0 while it writes a checkpoint
    damage-checkpoint   SIGKILL of one rank, then the newest checkpoint damaged (a byte of
                        a state file changed): the resume skips it for the one before
    full-disk           the checkpoint folder's disk filled (a 64 MB tmpfs mounted for the
                        run: root only) until the run fails at a checkpoint; freed before
                        the resume

After each fault it checks what a user cannot see: that every process of the job ended
(its processes carry `HVDTRAIN_CHAOS_JOB` in their environment) within the fault's
promised time (`promise`), that no Python traceback was printed, and that the newest
complete checkpoint from before the fault is still there or a newer one replaced it. It
prints a line per fault, a table at the end, and with `--json` the totals and each fault.
Exit status: 0 when every fault was survived and the final digest equals the
uninterrupted run's; 1 otherwise; 2 for a mistake in the options.

Here: the runs, their checks and the report. The faults themselves (their schedule, moments,
promised times and injection): `hvdtrain.launcher.faults`.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.errors import main as cli_main
from hvdtrain.launcher import faults
from hvdtrain.launcher.faults import (  # (chaos's own names too)
    KINDS,
    MARKER,
    Fault,
    checkpoint_order,
    complete_checkpoints,
    job_processes,
    moment,
    promise,
    schedule,
    target,
)
from hvdtrain.launcher.hosts import MAX_PROCESSES
from hvdtrain.runtime import processes
from hvdtrain.runtime.numbers import whole_number_type

__all__ = [
    "KINDS",
    "Fault",
    "schedule",
    "job_command",
    "launch_command",
    "promise",
    "moment",
    "totals",
    "table",
    "progress_line",
    "digest_line",
    "job_processes",
    "main",
]

PROG = "hvdtrain-run chaos"
_TRACEBACK = "Traceback (most recent call last)"


def _flag_value(argv, flag):
    """The index of `flag`'s value in `argv` (`--flag V` or `--flag=V`), or None."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return i + 1
        if arg.startswith(flag + "="):
            return i
    return None


def job_command(command, checkpoint_dir, metrics_json):
    """The user's `command` with this run's `--checkpoint-dir` and `--metrics-json` (in
    place of theirs, if given) and `--deterministic` where missing (pure)."""
    argv = list(command)
    for flag, value in (("--checkpoint-dir", checkpoint_dir), ("--metrics-json", metrics_json)):
        i = _flag_value(argv, flag)
        if i is None:
            argv += [flag, value]
        elif argv[i].startswith(flag + "="):
            argv[i] = f"{flag}={value}"
        else:
            argv[i] = value
    if "--deterministic" not in argv:
        argv.append("--deterministic")
    return argv


def launch_command(python, np, backend, command):
    """hvdtrain-run's command line for `command` (pure)."""
    argv = [python, "-m", "hvdtrain.launcher.cli", "-q", "-np", str(np)]
    if backend:
        argv += ["--backend", backend]
    return [*argv, "--", *command]


def totals(records, digests_equal):
    """The run's totals from the fault `records` (dicts) (pure)."""
    injected = [r for r in records if r["injected"]]
    return {
        "faults": len(injected),
        "not_injected": len(records) - len(injected),
        "survived": sum(1 for r in injected if r["survived"]),
        "digests_equal": bool(digests_equal),
        "hangs": sum(1 for r in injected if r["hang"]),
        "left_behind": sum(r["processes_left"] for r in injected),
        "tracebacks": sum(1 for r in injected if r["traceback"]),
        "checkpoints_lost": sum(1 for r in injected if r["checkpoint_lost"]),
        "failed_alone": sum(1 for r in records if r.get("failed_alone")),
    }


def progress_line(record, total):
    """`fault 3/7 kill-rank (rank 1) at epoch 2 step 4 (training): ended in 6.1 s, exit 1:
    <its line>` (pure)."""
    who = f" ({target(record)})" if target(record) != "-" else ""
    head = f"fault {record['index']}/{total} {record['kind']}{who}"
    if not record["injected"]:
        return f"{head}: not injected ({record['line']})"
    when = record["when"]
    at = f"at epoch {when['epoch']} step {when['step']} ({when['phase']})"
    problems = [
        p
        for p, bad in (
            (f"HANG (over {record['promise']:g} s)", record["hang"]),
            (f"{record['processes_left']} process(es) left behind", record["processes_left"]),
            ("a traceback printed", record["traceback"]),
            ("a checkpoint lost", record["checkpoint_lost"]),
        )
        if bad
    ]
    verdict = "; ".join(problems) if problems else "ok"
    line = f": {record['line']}" if record["line"] else ""
    return (
        f"{head} {at}: ended in {record['seconds_to_end']:.1f} s, exit "
        f"{record['exit_status']}, {verdict}{line}"
    )


def table(records):
    """The faults as a fixed-width table (pure)."""
    rows = [("#", "kind", "hit", "epoch", "step", "phase", "exit", "s to end", "left", "tb",
             "lost", "result")]  # fmt: skip
    for r in records:
        when = r.get("when") or {}
        rows.append(
            (
                str(r["index"]),
                r["kind"],
                target(r).removeprefix("rank "),
                str(when.get("epoch", "-")),
                str(when.get("step", "-")),
                when.get("phase", "-"),
                str(r["exit_status"]),
                f"{r['seconds_to_end']:.1f}" if r["injected"] else "-",
                str(r["processes_left"]),
                "yes" if r["traceback"] else "no",
                "yes" if r["checkpoint_lost"] else "no",
                ("survived" if r["survived"] else "FAILED")
                if r["injected"]
                else ("FAILED ALONE" if r.get("failed_alone") else "not injected"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def digest_line(reference, final):
    """The verdict on the final weights, one line (pure)."""
    if final is None:
        return "the run with faults did not finish: no final weights to compare"
    if final == reference:
        return f"final weights digest equal to the uninterrupted run's ({final[:16]})"
    return (
        f"final weights digest {final[:16]} differs from the uninterrupted run's "
        f"{(reference or '?')[:16]}: the script does not resume exactly (unseeded random "
        "numbers, state outside the model and optimizer, or data order of its own)"
    )


class _Job:
    """One run of the command under hvdtrain-run, its output in `log`."""

    instances = []  # every job of this process: ended with chaos itself (`run`)

    def __init__(self, argv, env, log):
        _Job.instances.append(self)
        self.marker = uuid.uuid4().hex
        self.log = log
        self.started = time.monotonic()
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                argv,
                env={**env, MARKER: self.marker},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def ended(self):
        return self.proc.poll() is not None and not job_processes(self.marker)

    def wait_end(self, deadline):
        """Waits until every process of the job ended or `deadline` (monotonic); returns
        the processes it then ended with SIGKILL (left behind)."""
        while time.monotonic() < deadline:
            if self.ended():
                return 0
            time.sleep(0.1)
        left = job_processes(self.marker)
        processes.send_all(left, signal.SIGKILL)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        return len(left)

    def output(self):
        with open(self.log, errors="replace") as f:
            return f.read()


def _last_line(text):
    """The job's one line about how it ended: its last hvdtrain line."""
    lines = [line.strip() for line in text.splitlines()]
    ours = [line for line in lines if line.startswith(("hvdtrain-run", "hvdtrain:"))]
    return (ours or [""])[-1][:300]


def _digest(metrics_json):
    try:
        with open(metrics_json) as f:
            return json.load(f)["ranks"][0]["weights_digest"]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


class _Chaos:
    def __init__(self, args, kinds, workdir):
        self.args, self.kinds, self.workdir = args, kinds, workdir
        env = dict(os.environ)
        env.setdefault("HVDTRAIN_STALL_SHUTDOWN_SECONDS", str(args.stall_seconds))
        env.setdefault("HVDTRAIN_LAUNCHER_GRACE_SECONDS", str(faults.GRACE_SECONDS))
        self.env = env
        self.stall = float(env["HVDTRAIN_STALL_SHUTDOWN_SECONDS"])
        self.grace = float(env["HVDTRAIN_LAUNCHER_GRACE_SECONDS"])
        self.timeline = {}  # the uninterrupted run: {checkpoint name: seconds after start}
        self.duration = None
        self.attempts = 0

    def _argv(self, name, ckpt):
        metrics = os.path.join(self.workdir, f"{name}.metrics.json")
        command = job_command(self.args.command, ckpt, metrics)
        argv = launch_command(sys.executable, self.args.np, self.args.backend, command)
        return argv, metrics

    def reference(self):
        ckpt = os.path.join(self.workdir, "uninterrupted")
        argv, metrics = self._argv("uninterrupted", ckpt)
        job = _Job(argv, self.env, os.path.join(self.workdir, "uninterrupted.log"))
        while job.proc.poll() is None:
            for name in complete_checkpoints(ckpt):
                self.timeline.setdefault(name, time.monotonic() - job.started)
            time.sleep(0.05)
        self.duration = time.monotonic() - job.started
        job.wait_end(time.monotonic() + 30)
        if job.proc.returncode != 0:
            raise HvdtrainError(
                f"the uninterrupted run failed (exit {job.proc.returncode}: "
                f"{_last_line(job.output()) or 'see ' + job.log}); fix it before the chaos run"
            )
        digest = _digest(metrics)
        if digest is None:
            raise HvdtrainError(f"the uninterrupted run wrote no weights digest to {metrics}")
        return digest

    def _estimates(self):
        """(start-up, seconds between checkpoints) of the uninterrupted run."""
        times = sorted(self.timeline.values())
        interval = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 1.0
        startup = max(1.0, times[0] - interval) if times else self.duration / 2
        return startup, interval

    def _expected(self, resumed_from):
        """The expected seconds of an attempt that resumes from checkpoint `resumed_from`."""
        startup, _ = self._estimates()
        done = self.timeline.get(resumed_from, startup)
        return max(5.0, startup + self.duration - done)

    def _wait_moment(self, job, ckpt, fault, resumed_from):
        """Waits for the fault's moment (`moment`): a share of the start-up, or a share of
        the interval after a checkpoint of the uninterrupted run appears, or of the end."""
        startup, interval = self._estimates()
        after = checkpoint_order(resumed_from) if resumed_from is not None else None
        remaining = [n for n in sorted(self.timeline, key=checkpoint_order)
                     if after is None or checkpoint_order(n) > after]  # fmt: skip
        where = moment(fault.fraction, len(remaining), fault.kind == "kill-in-checkpoint")
        if where[0] == "start-up":
            strike = job.started + where[1] * startup
        else:
            anchor = remaining[where[1]]
            while job.proc.poll() is None and not any(
                checkpoint_order(n) >= checkpoint_order(anchor) for n in complete_checkpoints(ckpt)
            ):
                time.sleep(0.02)
            strike = time.monotonic() + where[2] * interval
        while time.monotonic() < strike and job.proc.poll() is None:
            time.sleep(0.02)
        if fault.kind == "kill-in-checkpoint":
            while job.proc.poll() is None and not faults.writing_checkpoint(ckpt):
                time.sleep(0.002)

    def attempt(self, ckpt, fault):
        """Runs the command once, with `fault` (or none); returns (exit status, record)."""
        self.attempts += 1
        argv, metrics = self._argv("chaos", ckpt)
        before = complete_checkpoints(ckpt)
        resumed_from = before[-1] if before else None
        job = _Job(argv, self.env, os.path.join(self.workdir, f"chaos-{self.attempts}.log"))
        if fault is None:
            job.proc.wait()
            left = job.wait_end(time.monotonic() + 30)
            return job.proc.returncode, {"left": left, "line": _last_line(job.output())}
        expected = self._expected(resumed_from)
        record = {
            "index": fault.index,
            "kind": fault.kind,
            "rank": fault.rank,
            "injected": False,
            "when": None,
            "exit_status": None,
            "line": "",
            "seconds_to_end": 0.0,
            "promise": promise(fault.kind, self.stall, self.grace, expected),
            "hang": False,
            "processes_left": 0,
            "traceback": False,
            "checkpoint_lost": False,
            "survived": False,
        }
        self._wait_moment(job, ckpt, fault, resumed_from)
        filler = None
        target = None
        if job.proc.poll() is None:
            if fault.kind in ("kill-rank", "stop-rank", "damage-checkpoint"):
                target = self._rank_pid(job, fault.rank)
            if fault.kind == "kill-in-checkpoint":
                target = self._rank_pid(job, 0)
        if job.proc.poll() is None:
            newest = complete_checkpoints(ckpt)
            last = max(self.timeline, key=checkpoint_order) if self.timeline else None
            phase = "training"
            if faults.writing_checkpoint(ckpt):
                phase = "checkpoint write"
            elif newest == before:
                phase = "start-up"
            elif last and newest and checkpoint_order(newest[-1]) >= checkpoint_order(last):
                phase = "after training"
            epoch, step = faults.checkpoint_position(newest[-1] if newest else None)
            record["promise"] = promise(fault.kind, self.stall, self.grace, expected, phase)
            record["when"] = {"epoch": epoch, "step": step, "phase": phase,
                              "seconds": round(time.monotonic() - job.started, 1)}  # fmt: skip
            kind = fault.kind
            try:
                if kind in ("kill-launcher", "term-launcher"):
                    os.kill(
                        job.proc.pid, signal.SIGKILL if kind == "kill-launcher" else signal.SIGTERM
                    )
                elif kind == "full-disk":
                    filler = faults.fill_disk(ckpt)
                elif target is not None and not processes.send(
                    target, signal.SIGSTOP if kind == "stop-rank" else signal.SIGKILL
                ):
                    target = None  # it ended meanwhile
                record["injected"] = kind == "full-disk" or target is not None or "launcher" in kind
            except ProcessLookupError:
                pass
            if not record["injected"]:
                record["line"] = "the rank was not found running"
        injected_at = time.monotonic()
        if not record["injected"]:
            job.proc.wait()
            left = job.wait_end(time.monotonic() + 30)
            code = job.proc.returncode
            if not record["line"]:
                record["line"] = "the run ended before the fault's moment"
            if code:  # a failure that no fault caused: the script's, or hvdtrain's
                record["failed_alone"] = True
                record["line"] = (
                    f"the run failed by itself, exit {code}: {_last_line(job.output())}"
                )
            record["exit_status"] = code
            return job.proc.returncode, record
        newest_before = (complete_checkpoints(ckpt) or [None])[-1]
        left = job.wait_end(injected_at + record["promise"])
        record["seconds_to_end"] = round(time.monotonic() - injected_at, 1)
        record["hang"] = bool(left)
        record["processes_left"] = left
        if filler:
            os.remove(filler)
        code = job.proc.returncode
        text = job.output()
        record["exit_status"] = code
        record["line"] = _last_line(text)
        record["traceback"] = _TRACEBACK in text
        after = complete_checkpoints(ckpt)
        record["checkpoint_lost"] = bool(
            newest_before
            and newest_before not in after
            and not any(checkpoint_order(n) > checkpoint_order(newest_before) for n in after)
        )
        if fault.kind == "damage-checkpoint" and after:
            faults.damage_checkpoint(ckpt, after[-1])
            record["damaged"] = after[-1]
        record["survived"] = not (
            record["hang"] or record["traceback"] or record["checkpoint_lost"]
        )
        return code, record

    def _rank_pid(self, job, rank):
        """The rank's process (`processes.Recorded`), waiting for it to start (up to the end
        of the job)."""
        while job.proc.poll() is None:
            process = faults.rank_pid(job.marker, rank)
            if process:
                return process
            time.sleep(0.1)
        return None


def _parse(argv):
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("-np", "--num-proc", dest="np", default=2, metavar="N", help="default 2",
                   type=whole_number_type("-np", maximum=MAX_PROCESSES, bound=True))  # fmt: skip
    p.add_argument("--faults", default=7, metavar="N", help="faults to inject (default 7)",
                   type=whole_number_type("--faults", 0))  # fmt: skip
    p.add_argument("--seed", default=0, metavar="S", help="draws the faults (default 0)",
                   type=whole_number_type("--seed", 0))  # fmt: skip
    p.add_argument("--backend", choices=("gloo", "mpi", "mpirun"), help="hvdtrain-run's")
    p.add_argument("--kinds", metavar="K,K", help="default: " + ",".join(KINDS))
    p.add_argument(
        "--stall-seconds",
        default=faults.STALL_SECONDS,
        metavar="S",
        type=whole_number_type("--stall-seconds"),
        help=f"HVDTRAIN_STALL_SHUTDOWN_SECONDS for the runs (default {faults.STALL_SECONDS})",
    )
    p.add_argument("--json", metavar="PATH", help="write the totals and every fault here")
    p.add_argument("--workdir", metavar="DIR", help="checkpoints and logs (default: a new temp)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        raise HvdtrainError(
            "no command to run; expected e.g. `hvdtrain-run chaos -np 2 --faults 3 -- python "
            "-m hvdtrain.mnist --epochs 2`"
        )
    kinds = tuple(k.strip() for k in (args.kinds or "").split(",") if k.strip())
    for kind in kinds:
        if kind not in KINDS:
            raise invalid_value("--kinds", kind, "a comma-separated list of " + ", ".join(KINDS))
    args.kinds = kinds
    return args


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def run(args):
    """The chaos run of parsed `args`; returns the exit status."""
    workdir = args.workdir or tempfile.mkdtemp(prefix="hvdtrain-chaos-")
    os.makedirs(workdir, exist_ok=True)
    workdir = os.path.abspath(workdir)
    kinds = args.kinds or KINDS
    ckpt = os.path.join(workdir, "chaos")
    mounted = False
    if "full-disk" in kinds:
        why = faults.mount_tmpfs(ckpt, faults.TMPFS_MB)
        if why and args.kinds:
            raise HvdtrainError(f"cannot inject full-disk: {why}; leave it out of --kinds")
        if why:
            print(f"{PROG}: full-disk left out: {why}", flush=True)
            kinds = tuple(k for k in kinds if k != "full-disk")
        mounted = why is None
    # A SIGTERM to chaos itself (a scheduler, the soak stopped) runs the `finally` too: no
    # process of the job left running, no tmpfs left mounted over the folder.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        ok = _run(args, kinds, workdir, ckpt)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for job in _Job.instances:
            job.wait_end(0)  # (a job already ended: nothing to do)
        if mounted:
            subprocess.run(["umount", "-l", ckpt], capture_output=True, timeout=30)
    if ok and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


def _run(args, kinds, workdir, ckpt):
    chaos = _Chaos(args, kinds, workdir)
    drawn = schedule(args.faults, args.seed, kinds, args.np)
    print(f"{PROG}: {len(drawn)} faults (seed {args.seed}); logs and checkpoints in {workdir}",
          flush=True)  # fmt: skip
    print(f"{PROG}: the uninterrupted run ...", flush=True)
    reference = chaos.reference()
    print(f"{PROG}: uninterrupted run: {chaos.duration:.1f} s, digest {reference[:16]}", flush=True)
    records, code, final = [], None, None
    for fault in drawn:
        code, record = chaos.attempt(ckpt, fault)
        records.append(record)
        print(f"{PROG}: {progress_line(record, len(drawn))}", flush=True)
        if code == 0 and not record["injected"]:  # the run finished before the fault
            break
    if code != 0:
        code, last = chaos.attempt(ckpt, None)
        if code != 0:
            print(
                f"{PROG}: the last run (no fault) failed, exit {code}: {last['line']}", flush=True
            )
    if code == 0:
        final = _digest(os.path.join(workdir, "chaos.metrics.json"))
    sums = totals(records, final is not None and final == reference)
    print(table(records), flush=True)
    verdict = digest_line(reference, final)
    print(
        f"{PROG}: {sums['faults']} faults injected, {sums['survived']} survived, "
        f"{sums['hangs']} hangs, {sums['left_behind']} processes left behind, "
        f"{sums['tracebacks']} tracebacks; {verdict}",
        flush=True,
    )
    if args.json:
        out = {
            **sums,
            "seed": args.seed,
            "np": args.np,
            "backend": args.backend,
            "command": list(args.command),
            "reference_digest": reference,
            "final_digest": final,
            "uninterrupted_seconds": round(chaos.duration, 1),
            "workdir": workdir,
            "records": records,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return sums["digests_equal"] and sums["survived"] == sums["faults"] and not sums["failed_alone"]


def main(argv=None):
    """`hvdtrain-run chaos ...`; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    return cli_main(lambda a: run(_parse(a)), args, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
