"""`hvdtrain-run chaos --elastic`: hosts lost and back under Horovod Elastic, counted.

    hvdtrain-run chaos --elastic --hostfile hosts.txt --network-interface eth0 --faults 2 \\
        -- python train.py --epochs 12

The command (a script on `hvdtrain.ArgumentParser`; chaos adds `--elastic` and
`--deterministic` where missing) runs twice under `hvdtrain-run --elastic --min-np 1
--blacklist-cooldown-range 5 10` on the hosts: once uninterrupted, then as one job during
which, `--faults` times, a host other than this one loses every process of the job at once
(`kill-host`: its power lost) at a moment drawn from `--seed`. An elastic job is not
restarted: Horovod re-forms it at fewer ranks from its last commit, leaves the host out for
the cooldown, then takes it back. For each fault chaos checks that the job re-formed at
fewer ranks within `kill-host`'s promise (`faults.promise`) and Gloo's timeout (with 3 ranks
or more, a rank that waits on another survivor learns of the loss only at that timeout:
HOROVOD_GLOO_TIMEOUT_SECONDS, 30 s by default), and waits for it to grow back to its size
before the next fault; at the end, that the job finished (exit 0, every epoch,
no traceback, nothing left on any host).

The final weights cannot equal the uninterrupted run's bit for bit, and the schedule cannot
repeat: the steps since the last commit are done again at another size (another global
batch, the learning rate scaled to it) from a moment the clock picks. So the final test
accuracy is compared instead: within `MARGIN_POINTS` points of the uninterrupted run's
(docs/fault-tolerance.md says why that margin). The JSON holds `accuracy_within_margin` in
place of `digests_equal` (null there).
"""

import json
import os
import re
import shutil
import sys
import time

from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.launcher.chaosjob import TRACEBACK, Job, job_command, launch_command, read_metrics
from hvdtrain.launcher.chaosreport import fault_record, last_line, totals
from hvdtrain.launcher.faults import promise, schedule
from hvdtrain.launcher.hostfaults import HostUnreachable, Ranks

__all__ = ["COOLDOWN", "MARGIN_POINTS", "KINDS", "check", "launch_options", "run"]

KINDS = ("kill-host",)
COOLDOWN = (5, 10)  # Horovod's --blacklist-cooldown-range: the host is back after it
MARGIN_POINTS = 3.0
STARTUP = 90  # seconds for a worker to start on a host taken back (TensorFlow's import)
GLOO_TIMEOUT = 30  # HOROVOD_GLOO_TIMEOUT_SECONDS's default: a rank that waits on another
# survivor (3 ranks or more) learns of the loss only then
_EPOCH = re.compile(r"hvdtrain: epoch (\d+)/(\d+): ")
_RESET = re.compile(r"elastic: (a worker failed|hosts changed); (\d+) -> (\d+) rank\(s\)")


def check(args, kinds, hosts):
    """The mistakes `--elastic` cannot run with: an HvdtrainError naming the fix."""
    if hosts is None:
        raise HvdtrainError(
            "--elastic: chaos loses a host other than this one; give -H or --hostfile with "
            "another host"
        )
    if args.backend not in (None, "gloo"):
        raise invalid_value("--backend", args.backend, "gloo (or none) under --elastic")
    for kind in kinds:
        if kind not in KINDS:
            raise invalid_value("--kinds", kind, ", ".join(KINDS) + " under --elastic")


def launch_options(launch):
    """hvdtrain-run's options of an elastic chaos job, after the hosts' `launch` (pure)."""
    cooldown = [str(s) for s in COOLDOWN]
    return [*launch, "--elastic", "--min-np", "1", "--blacklist-cooldown-range", *cooldown]


class _Log:
    """What the job has printed so far (its log read as it grows)."""

    def __init__(self, path):
        self.path, self.text = path, ""

    def read(self):
        with open(self.path, errors="replace") as f:
            self.text = f.read()
        return self

    def epoch(self):
        """(the highest epoch line so far, the epochs) or (0, None)."""
        found = [(int(a), int(b)) for a, b in _EPOCH.findall(self.text)]
        return max(found) if found else (0, None)

    def resets(self):
        """[(reason, size before, size after)] of the job's re-formations so far."""
        return [(r, int(a), int(b)) for r, a, b in _RESET.findall(self.text)]


def _gloo_timeout(env):
    try:
        return max(0.0, float(env.get("HOROVOD_GLOO_TIMEOUT_SECONDS", GLOO_TIMEOUT)))
    except ValueError:
        return GLOO_TIMEOUT


def _shrank(resets):
    return any(reason == "a worker failed" and b < a for reason, a, b in resets)


def _grew(resets, size):
    return any(b == size for _, _, b in resets)


def _wait(job, log, until, deadline):
    """Waits until `until(log)` holds, the job ends or `deadline` (monotonic): whether it held."""
    while time.monotonic() < deadline:
        if until(log.read()):
            return True
        if job.proc.poll() is not None:
            return bool(until(log.read()))
        time.sleep(0.2)
    return False


class _Elastic:
    def __init__(self, args, env, workdir, hosts):
        self.args, self.env, self.workdir, self.hosts = args, env, workdir, hosts
        self.stall = float(env["HVDTRAIN_STALL_SHUTDOWN_SECONDS"])
        self.grace = float(env["HVDTRAIN_LAUNCHER_GRACE_SECONDS"])
        self.duration = None

    def _job(self, name):
        ckpt = os.path.join(self.workdir, name)
        shutil.rmtree(ckpt, ignore_errors=True)  # (chaos's own folder: each run from scratch)
        metrics = os.path.join(self.workdir, f"{name}.metrics.json")
        flags = ("--elastic", "--deterministic")
        command = job_command(self.args.command, ckpt, metrics, flags)
        launch = launch_options(self.args.launch)
        argv = launch_command(sys.executable, self.args.np, None, command, launch)
        log = os.path.join(self.workdir, f"{name}.log")
        return Job(argv, self.env, log, self.hosts), metrics

    def reference(self):
        """The uninterrupted elastic run: its metrics (a dict)."""
        job, metrics = self._job("elastic-uninterrupted")
        job.proc.wait()
        self.duration = time.monotonic() - job.started
        job.wait_end(time.monotonic() + 30)
        if job.proc.returncode != 0:
            why = last_line(job.output()) or "see " + job.log
            raise HvdtrainError(
                f"the uninterrupted run failed (exit {job.proc.returncode}: {why}); fix it "
                "before the chaos run"
            )
        out = read_metrics(metrics)
        if not out or out.get("test_accuracy") is None:
            raise HvdtrainError(
                f"the uninterrupted run wrote no test accuracy to {metrics}: --elastic "
                "compares the final test accuracy; give the script test data"
            )
        return out

    def faulted(self, drawn):
        """The job with the `drawn` faults: (exit status, its metrics or None, records)."""
        job, metrics = self._job("elastic-chaos")
        log, ranks = _Log(job.log), Ranks(self.hosts)
        lose = promise("kill-host", self.stall, self.grace) + _gloo_timeout(self.env)
        end_by = job.started + 2 * self.duration + len(drawn) * (lose + COOLDOWN[1] + STARTUP)
        _wait(job, log, lambda x: x.epoch()[0] >= 1, end_by)
        size = self.args.np
        epochs = log.epoch()[1] or 1
        interval = self.duration / (epochs + 1)  # (an epoch, and the start-up as one more)
        records = []
        moments = sorted(f.fraction for f in drawn)
        for fault, fraction in zip(drawn, moments, strict=True):
            record = fault_record(fault, lose)
            records.append(record)
            at = fraction * (epochs - 1)  # after epoch 1 .. before the last one
            _wait(job, log, lambda x, e=1 + int(at): x.epoch()[0] >= e, end_by)
            strike = time.monotonic() + (at - int(at)) * interval
            while time.monotonic() < strike and job.proc.poll() is None:
                time.sleep(0.05)
            if job.proc.poll() is not None or time.monotonic() > end_by:
                record["line"] = "the run ended before the fault's moment"
                continue
            if any(r["injected"] and not r["back"] for r in records):
                record["line"] = "a host lost before was not taken back"
                continue
            host = self.hosts.names[fault.host % len(self.hosts.names)]
            before = len(log.read().resets())
            record["host"] = host
            record["when"] = {"epoch": log.epoch()[0], "step": "-", "phase": "training",
                              "seconds": round(time.monotonic() - job.started, 1)}  # fmt: skip
            try:
                record["injected"] = ranks.strike(job.marker, (host, None), None, "KILL", job.proc)
            except HostUnreachable as e:
                record["line"] = str(e)
            if not record["injected"]:
                continue
            hit = time.monotonic()
            smaller = _wait(job, log, lambda x, n=before: _shrank(x.resets()[n:]), hit + lose)
            record["seconds_to_end"] = round(time.monotonic() - hit, 1)
            record["hang"] = not smaller and job.proc.poll() is None
            back = hit + lose + COOLDOWN[1] + STARTUP
            record["back"] = smaller and _wait(
                job, log, lambda x, n=before: _grew(x.resets()[n + 1 :], size), back
            )
            record["seconds_to_back"] = round(time.monotonic() - hit, 1)
            record["line"] = "; ".join(f"{r}; {a} -> {b} rank(s)" for r, a, b in
                                       log.resets()[before:])  # fmt: skip
        while job.proc.poll() is None and time.monotonic() < end_by + 60:
            time.sleep(0.2)
        hung = job.proc.poll() is None
        left = job.wait_end(time.monotonic() + 30)
        text = job.output()
        for record in records:
            if record["injected"]:
                record["exit_status"] = job.proc.returncode
                record["traceback"] = TRACEBACK in text
                record["hang"] = record["hang"] or hung
        injected = [r for r in records if r["injected"]]
        if injected:
            injected[-1]["processes_left"] = left
        for record in injected:
            record["survived"] = not (
                record["hang"] or record["traceback"] or record["processes_left"]
                or job.proc.returncode != 0
                or not (record["back"] or record is injected[-1])  # (the last: the run may end)
            )  # fmt: skip
        return job.proc.returncode, read_metrics(metrics), records, last_line(text)


def _line(record, total):
    head = f"fault {record['index']}/{total} kill-host (host {record.get('host', '-')})"
    if not record["injected"]:
        return f"{head}: not injected ({record['line']})"
    back = f", at its size again after {record['seconds_to_back']:.1f} s" if record["back"] else ""
    verdict = "ok" if record["survived"] else "FAILED"
    return (
        f"{head} at epoch {record['when']['epoch']}: re-formed in {record['seconds_to_end']:.1f} "
        f"s{back}; {verdict}: {record['line']}"
    )


def run(args, workdir, hosts, env, prog):
    """The elastic chaos run; returns whether everything survived within the margin."""
    chaos = _Elastic(args, env, workdir, hosts)
    drawn = schedule(args.faults, args.seed, KINDS, args.np, len(hosts.names))
    print(f"{prog}: --elastic, {len(drawn)} host(s) lost (seed {args.seed}); logs in {workdir}",
          flush=True)  # fmt: skip
    print(f"{prog}: the uninterrupted elastic run ...", flush=True)
    reference = chaos.reference()["test_accuracy"]
    print(f"{prog}: uninterrupted run: {chaos.duration:.1f} s, test accuracy {reference:.4f}",
          flush=True)  # fmt: skip
    code, out, records, last = chaos.faulted(drawn)
    for record in records:
        print(f"{prog}: {_line(record, len(drawn))}", flush=True)
    final = (out or {}).get("test_accuracy")
    epochs = len((out or {}).get("history", {}).get("loss", []))
    within = final is not None and abs(final - reference) * 100 <= MARGIN_POINTS
    injected = [r for r in records if r["injected"]]
    sums = {
        **totals(records, False),
        "digests_equal": None,  # (the schedule cannot repeat: the accuracy instead)
        "accuracy_within_margin": within,
        "failed_alone": 0 if code == 0 or injected else 1,
    }
    verdict = (
        f"final test accuracy {final:.4f} against the uninterrupted run's {reference:.4f} "
        f"({'within' if within else 'OUTSIDE'} {MARGIN_POINTS:g} points), {epochs} epoch(s), "
        f"{(out or {}).get('size', '?')} rank(s) at the end"
        if final is not None
        else f"the run with faults did not finish (exit {code}: {last})"
    )
    print(f"{prog}: {sums['faults']} host(s) lost, {sums['survived']} survived, "
          f"{sums['hangs']} hangs, {sums['left_behind']} processes left behind, "
          f"{sums['tracebacks']} tracebacks; {verdict}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**sums, "seed": args.seed, "np": args.np, "elastic": True,
                       "hosts": [args.here, *hosts.names], "command": list(args.command),
                       "reference_accuracy": reference, "final_accuracy": final,
                       "margin_points": MARGIN_POINTS, "final_size": (out or {}).get("size"),
                       "resets": (out or {}).get("elastic", {}).get("resets"),
                       "uninterrupted_seconds": round(chaos.duration, 1),
                       "workdir": workdir, "records": records}, f, indent=1)  # fmt: skip
    return within and sums["survived"] == sums["faults"] and code == 0
