"""hvdtrain-run chaos: does your script survive the faults hvdtrain promises to survive?

Usage::

    hvdtrain-run chaos -np 2 --faults 7 [--seed S] [--backend B] [--kinds K,K,...]
        [--stall-seconds S] [--json PATH] [--workdir DIR]
        [-H HOST:SLOTS,... | --hostfile FILE] [--network-interface NIC]
        [--ssh-port P] [--ssh-identity-file F] [--elastic] -- python train.py ARGS

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
    kill-host           SIGKILL of every process of the job on one host other than this
                        one, at once (a host's power lost): with -H or --hostfile only
    cut-host            one such host's --network-interface set down (root there) until
                        the job's ranks there ended, then 5-20 s more: the job must end
                        naming the host, and resume once it is back
    slow-link           one such host's link cut to 10 Mbit/s (`tbf` on its
                        --network-interface, root there) for 5-20 s: the run must finish,
                        on the same weights; the report says how much slower
    lossy-link          the same with 2 % of its packets lost and the rest 20 ms late
                        (`netem`, where the kernel has it)

With `-H` or `--hostfile` (hvdtrain-run's dialects, with its `--network-interface` and ssh
options) the job runs on those hosts, and a fault on a rank strikes it on whichever host
runs it, through the same ssh the launch uses: there `python -m hvdtrain.launcher.hostfaults`
(this Python's path, as the launch assumes) finds and signals the job's processes. The
checkpoint folder (in `--workdir`) must be one that every host's rank 0 reaches: rank 0
writes it, so a shared folder or rank 0 on this host.

With `--elastic` (and another host) the job runs under Horovod Elastic instead: one job,
which re-forms at fewer ranks when a host is lost (`kill-host`, the only kind) and takes
it back after a cooldown, its final test accuracy compared with the uninterrupted elastic
run's within a margin (`hvdtrain.launcher.chaoselastic`).

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
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.errors import main as cli_main
from hvdtrain.launcher import chaoselastic, faults
from hvdtrain.launcher.chaosjob import TRACEBACK, Job, digest, job_command, launch_command
from hvdtrain.launcher.chaosreport import (
    digest_line,
    fault_record,
    last_line,
    progress_line,
    table,
    totals,
)
from hvdtrain.launcher.faults import (  # (chaos's own names too)
    HOST_KINDS,
    KINDS,
    LINK_KINDS,
    Fault,
    anchors,
    checkpoint_order,
    complete_checkpoints,
    job_processes,
    moment,
    promise,
    schedule,
)
from hvdtrain.launcher.hostfaults import HostUnreachable, Ranks, cannot, job_hosts
from hvdtrain.launcher.hosts import MAX_PROCESSES
from hvdtrain.runtime.numbers import whole_number_type

__all__ = ["KINDS", "Fault", "schedule", "promise", "moment", "job_processes",
           "job_command", "launch_command", "main"]  # fmt: skip

PROG = "hvdtrain-run chaos"


def _env(args):
    """The jobs' environment: this one's, with chaos's stall time and launcher grace."""
    env = dict(os.environ)
    env.setdefault("HVDTRAIN_STALL_SHUTDOWN_SECONDS", str(args.stall_seconds))
    env.setdefault("HVDTRAIN_LAUNCHER_GRACE_SECONDS", str(faults.GRACE_SECONDS))
    return env


class _Chaos:
    def __init__(self, args, kinds, workdir, hosts=None):
        self.args, self.kinds, self.workdir = args, kinds, workdir
        self.hosts = hosts  # `Hosts`: the job's hosts other than this one, or None
        self.ranks = Ranks(hosts)  # where each rank runs
        self.env = env = _env(args)
        self.stall = float(env["HVDTRAIN_STALL_SHUTDOWN_SECONDS"])
        self.grace = float(env["HVDTRAIN_LAUNCHER_GRACE_SECONDS"])
        self.timeline = {}  # the uninterrupted run: {checkpoint name: seconds after start}
        self.duration = None
        self.attempts = 0

    def _argv(self, name, ckpt):
        metrics = os.path.join(self.workdir, f"{name}.metrics.json")
        command = job_command(self.args.command, ckpt, metrics)
        argv = launch_command(
            sys.executable, self.args.np, self.args.backend, command, self.args.launch
        )
        return argv, metrics

    def reference(self):
        ckpt = os.path.join(self.workdir, "uninterrupted")
        argv, metrics = self._argv("uninterrupted", ckpt)
        job = Job(argv, self.env, os.path.join(self.workdir, "uninterrupted.log"), self.hosts)
        while job.proc.poll() is None:
            for name in complete_checkpoints(ckpt):
                self.timeline.setdefault(name, time.monotonic() - job.started)
            if self.hosts and self.timeline and self.ranks.placed is None:
                self.ranks.place(job.marker, self.args.np)
            time.sleep(0.05)
        self.duration = time.monotonic() - job.started
        job.wait_end(time.monotonic() + 30)
        if job.proc.returncode != 0:
            raise HvdtrainError(
                f"the uninterrupted run failed (exit {job.proc.returncode}: "
                f"{last_line(job.output()) or 'see ' + job.log}); fix it before the chaos run"
            )
        reference = digest(metrics)
        if reference is None:
            raise HvdtrainError(f"the uninterrupted run wrote no weights digest to {metrics}")
        return reference

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
        lead = faults.CUT_LEAD_SECONDS if fault.kind == "cut-host" else 0.0
        remaining = anchors(self.timeline, resumed_from, lead)
        where = moment(fault.fraction, len(remaining), fault.kind == "kill-in-checkpoint")
        if where[0] == "start-up":
            strike = job.started + where[1] * startup
        else:
            # The interval after the anchor as the uninterrupted run took it (not the mean of
            # all, which counts the epochs' evaluations), scaled by this attempt's pace where
            # it wrote the checkpoint before the anchor too: the mean, under another load,
            # put moments past the run's end (a cut, then a slowed link, never struck).
            k, times = where[1], self.timeline
            seen = [self._wait_for(job, ckpt, remaining[i]) for i in (k - 1, k) if i >= 0]
            interval = times[remaining[k + 1]] - times[remaining[k]]  # `moment`: k < len - 1
            if len(seen) == 2 and None not in seen:
                before = times[remaining[k]] - times[remaining[k - 1]]
                interval *= (seen[1] - seen[0]) / before if before > 0 else 1.0
            strike = time.monotonic() + where[2] * interval
        while time.monotonic() < strike and job.proc.poll() is None:
            time.sleep(0.02)
        if fault.kind == "kill-in-checkpoint":
            while job.proc.poll() is None and not faults.writing_checkpoint(ckpt):
                time.sleep(0.002)

    @staticmethod
    def _wait_for(job, ckpt, name):
        """When checkpoint `name` (or a later one) was complete (monotonic), or None if the
        job ended first."""
        while not any(checkpoint_order(n) >= checkpoint_order(name)
                      for n in complete_checkpoints(ckpt)):  # fmt: skip
            if job.proc.poll() is not None:
                return None
            time.sleep(0.02)
        return time.monotonic()

    def _phase(self, ckpt, before):
        """(the complete checkpoints, the phase of the run now): `before` those it began with."""
        newest = complete_checkpoints(ckpt)
        last = max(self.timeline, key=checkpoint_order) if self.timeline else None
        if faults.writing_checkpoint(ckpt):
            return newest, "checkpoint write"
        if newest == before:
            return newest, "start-up"
        if last and newest and checkpoint_order(newest[-1]) >= checkpoint_order(last):
            return newest, "after training"
        return newest, "training"

    def attempt(self, ckpt, fault):
        """Runs the command once, with `fault` (or none); returns (exit status, record)."""
        self.attempts += 1
        argv, metrics = self._argv("chaos", ckpt)
        before = complete_checkpoints(ckpt)
        resumed_from = before[-1] if before else None
        log = os.path.join(self.workdir, f"chaos-{self.attempts}.log")
        job = Job(argv, self.env, log, self.hosts)
        if fault is None:
            job.proc.wait()
            left = job.wait_end(time.monotonic() + 30)
            return job.proc.returncode, {"left": left, "line": last_line(job.output())}
        expected = self._expected(resumed_from)
        record = fault_record(fault, promise(fault.kind, self.stall, self.grace, expected,
                                             slow=fault.seconds))  # fmt: skip
        self._wait_moment(job, ckpt, fault, resumed_from)
        filler = None
        target = None
        if job.proc.poll() is None and fault.kind in (
            "kill-rank",
            "stop-rank",
            "damage-checkpoint",
            "kill-in-checkpoint",
        ):  # (kill-in-checkpoint's rank is 0: the writer)
            target = self.ranks.where(job.marker, fault.rank, job.proc)
        if job.proc.poll() is None:
            newest, phase = self._phase(ckpt, before)
            epoch, step = faults.checkpoint_position(newest[-1] if newest else None)
            record["promise"] = promise(
                fault.kind, self.stall, self.grace, expected, phase, fault.seconds
            )
            record["when"] = {"epoch": epoch, "step": step, "phase": phase,
                              "seconds": round(time.monotonic() - job.started, 1)}  # fmt: skip
            kind = fault.kind
            try:
                if kind in ("kill-launcher", "term-launcher"):
                    os.kill(
                        job.proc.pid, signal.SIGKILL if kind == "kill-launcher" else signal.SIGTERM
                    )
                    hit = True
                elif kind == "full-disk":
                    filler = faults.fill_disk(ckpt)
                    hit = True
                elif kind == "kill-host":
                    record["host"] = self.hosts.names[fault.host % len(self.hosts.names)]
                    hit = self.ranks.strike(
                        job.marker, (record["host"], None), None, "KILL", job.proc
                    )
                elif kind in HOST_KINDS:  # cut-host and the link kinds
                    record["host"] = self.hosts.names[fault.host % len(self.hosts.names)]
                    nic = self.args.network_interface
                    if kind == "cut-host":  # down until the host's ranks end, then more
                        most = promise(kind, self.stall, self.grace, expected, "start-up")
                        why = self.hosts.cut(record["host"], nic, fault.seconds, job.marker, most)
                    else:
                        why = self.hosts.qdisc(record["host"], nic, LINK_KINDS[kind])
                    hit, record["line"] = why is None, why or ""
                else:  # a rank's: the kinds above
                    hit = target is not None and self.ranks.strike(
                        job.marker,
                        target,
                        fault.rank,
                        "STOP" if kind == "stop-rank" else "KILL",
                        job.proc,
                    )
                    if target is not None and self.hosts:
                        record["host"] = target[0] or self.args.here
                record["injected"] = hit
            except (ProcessLookupError, HostUnreachable) as e:
                record["line"] = str(e) if isinstance(e, HostUnreachable) else ""
            if not record["injected"]:
                record["line"] = record["line"] or (
                    "the host's processes were not found running" if kind == "kill-host"
                    else "the rank was not found running"
                )  # fmt: skip
        injected_at = time.monotonic()
        if not record["injected"]:
            job.proc.wait()
            left = job.wait_end(time.monotonic() + 30)
            code = job.proc.returncode
            if not record["line"]:
                record["line"] = "the run ended before the fault's moment"
            if code:  # a failure that no fault caused: the script's, or hvdtrain's
                record["failed_alone"] = True
                record["line"] = f"the run failed by itself, exit {code}: {last_line(job.output())}"
            record["exit_status"] = code
            return job.proc.returncode, record
        if fault.kind == "cut-host":  # its promise from where the run is once the link is down
            while time.monotonic() < injected_at + 1 and job.proc.poll() is None:
                time.sleep(0.05)
            phase = self._phase(ckpt, before)[1]
            record["promise"] = max(record["promise"], promise(
                fault.kind, self.stall, self.grace, expected, phase))  # fmt: skip
        newest_before = (complete_checkpoints(ckpt) or [None])[-1]
        if fault.kind in LINK_KINDS:
            try:
                while time.monotonic() < injected_at + fault.seconds and job.proc.poll() is None:
                    time.sleep(0.1)
            finally:
                self.hosts.qdisc(record["host"], self.args.network_interface)
        left = job.wait_end(injected_at + record["promise"])
        if fault.kind in LINK_KINDS:
            record["slower_seconds"] = round(time.monotonic() - job.started - expected, 1)
        record["seconds_to_end"] = round(time.monotonic() - injected_at, 1)
        if fault.kind == "cut-host":  # (its processes are counted once it is back)
            most = promise(fault.kind, self.stall, self.grace, expected, "start-up")
            back = injected_at + 1 + most + fault.seconds + faults.BACK_SECONDS
            gone, record["host_back"] = self.hosts.wait_back(job.marker, record["host"], back)
            left += gone
        record["hang"] = bool(left)
        record["processes_left"] = left
        if filler:
            os.remove(filler)
        code = job.proc.returncode
        text = job.output()
        record["exit_status"] = code
        record["line"] = last_line(text)
        record["traceback"] = TRACEBACK in text
        after = complete_checkpoints(ckpt)
        record["checkpoint_lost"] = bool(
            newest_before
            and newest_before not in after
            and not any(checkpoint_order(n) > checkpoint_order(newest_before) for n in after)
        )
        if fault.kind == "damage-checkpoint" and after:
            faults.damage_checkpoint(ckpt, after[-1])
            record["damaged"] = after[-1]
        named = record.get("host", "") in record["line"]
        if fault.kind == "cut-host" and code and not named and record.get("host_back"):
            own = self.hosts.hostname(record["host"])  # (Open MPI names a host by its own)
            named = bool(own) and re.search(rf"\b{re.escape(own)}\b", record["line"]) is not None
        record["survived"] = not (
            record["hang"]
            or record["traceback"]
            or record["checkpoint_lost"]
            or (fault.kind in LINK_KINDS and code != 0)  # a poor link must not end the run
            or (fault.kind == "cut-host" and not (code == 0 or named))
            or not record.get("host_back", True)  # a cut host must answer again
        )
        return code, record


def _parse(argv):
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n")[0],
        epilog=__doc__.split("\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("-np", "--num-proc", dest="np", metavar="N",
                   help="default: the hosts' slots with -H or --hostfile, else 2",
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
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...", help="as hvdtrain-run's")
    where.add_argument("--hostfile", "-hostfile", metavar="FILE", help="as hvdtrain-run's")
    p.add_argument("--network-interface", metavar="NIC", help="as hvdtrain-run's")
    p.add_argument("--ssh-port", metavar="P", help="as hvdtrain-run's",
                   type=whole_number_type("--ssh-port", maximum=65535))  # fmt: skip
    p.add_argument("--ssh-identity-file", metavar="FILE", help="as hvdtrain-run's")
    p.add_argument(
        "--elastic",
        action="store_true",
        help="hosts lost and taken back by an elastic job (kill-host only)",
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
    hosts = job_hosts(args)
    if args.elastic:
        chaoselastic.check(args, args.kinds, hosts)
    kinds = args.kinds or (chaoselastic.KINDS if args.elastic else KINDS)
    for kind in HOST_KINDS:
        why = cannot(kind, hosts, args.network_interface) if kind in kinds else None
        if why and args.kinds:
            raise HvdtrainError(f"cannot inject {kind}: {why}; leave it out of --kinds")
        if why:
            if hosts:
                print(f"{PROG}: {kind} left out: {why}", flush=True)
            kinds = tuple(k for k in kinds if k != kind)
    workdir = args.workdir or tempfile.mkdtemp(prefix="hvdtrain-chaos-")
    os.makedirs(workdir, exist_ok=True)
    workdir = os.path.abspath(workdir)
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
        if args.elastic:
            ok = chaoselastic.run(args, workdir, hosts, _env(args), PROG)
        else:
            ok = _run(args, kinds, workdir, ckpt, hosts)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for job in Job.instances:
            job.wait_end(0)  # (a job already ended: nothing to do)
        if mounted:
            subprocess.run(["umount", "-l", ckpt], capture_output=True, timeout=30)
    if ok and not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


def _run(args, kinds, workdir, ckpt, hosts):
    chaos = _Chaos(args, kinds, workdir, hosts)
    drawn = schedule(args.faults, args.seed, kinds, args.np, len(hosts.names) if hosts else 1)
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
        if code == 0 and (not record["injected"] or fault.kind in (*LINK_KINDS, "cut-host")):
            break  # the run finished (before the fault, or through a poor link)
    if code != 0:
        code, last = chaos.attempt(ckpt, None)
        if code != 0:
            print(
                f"{PROG}: the last run (no fault) failed, exit {code}: {last['line']}", flush=True
            )
    if code == 0:
        final = digest(os.path.join(workdir, "chaos.metrics.json"))
    sums = totals(records, final is not None and final == reference)
    sums["not_struck"] = len(drawn) - len(records)  # the run finished before their turn
    print(table(records), flush=True)
    verdict = digest_line(reference, final)
    unstruck = (f" ({sums['not_struck']} more drawn: the run finished before their turn)"
                if sums["not_struck"] else "")  # fmt: skip
    print(
        f"{PROG}: {sums['faults']} faults injected{unstruck}, {sums['survived']} survived, "
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
            "hosts": [args.here, *(hosts.names if hosts else ())],
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
