"""The exchange modes where the wire is the limit: ranks on namespace hosts (one each) whose
links are rate-limited with Linux's `tbf` (root only), each job as a user runs it
(`hvdtrain-run -H a:1,b:1 -- python -m hvdtrain.mnist ...`), beside the ceiling of the same
run: the same ranks unconnected, each host training its share alone.

    python -m hvdtrain.bench.links --data-dir ../shared/mnist --out out/links
    python -m hvdtrain.bench.links --hosts 3 --links 100 --models mlp --every 16,64
    python -m hvdtrain.bench.links --quick --out out/links-quick        # the smoke run

For every number of hosts, link rate (Mbit/s) and model: the ceiling, the synchronous job,
the same with `--fp16-allreduce`, local SGD and DiLoCo blocking and overlapped at each H, and
each with `--sync-every auto`, blocking, overlapped, overlapped in 16 bits (`--jobs auto`:
those alone, beside the ceiling). A job's figure is the median samples/s of its epochs
after the first (rank 0's epoch lines: the steps with their exchanges, not the evaluation),
its share of the ceiling against the mean of the ceilings measured just before and just
after it (the machine's pace drifts over a cell's minutes: the tables give their spread);
each job's samples are sized from the projection so that its epochs take about `--seconds`
(every exchange-less job's as the cap's, H=256, the same in every row of a cell, so that an
`auto` job's epochs hold a round at any H it picks).
Beside each: of the ceiling, the share of the exchange's time hidden (overlapped jobs), the
bytes each rank puts on its link per sample it trains, and the projection's figure for the
same link (`projected`: the ring model of `hvdtrain.bench.project` with the epoch's rounds
and its whole exchange at the end, from the bytes and each host's rate in the ceilings
beside the job: the ranks meet at every exchange, so a job steps at its slowest host's
pace, which the tables' "hosts' pace" row gives as a share of the ceiling).
`links.json` (every job's figures) and `links.md` (the tables) go to `--out`. The machine's
cores are shared by every host: three ranks on two cores compute slower than two, in the
ceiling as in the jobs.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from hvdtrain.bench.modes import epoch_rates, steady
from hvdtrain.bench.netns import NamespaceHosts, cannot_make_namespaces
from hvdtrain.bench.project import GBIT, efficiency, ring_allreduce_seconds
from hvdtrain.bench.runner import quiet_wait
from hvdtrain.bench.workers import MARKER
from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.errors import main as cli_main
from hvdtrain.exchange.auto import CAP

__all__ = [
    "main",
    "plan",
    "samples_for",
    "wire_bytes_per_sample",
    "markdown",
    "projected",
    "PARAMS",
]

PROG = "python -m hvdtrain.bench.links"
CEILING = "ceiling"
PARAMS = {"mlp": 269_322, "convnet": 1_199_882}  # float32 parameters of hvdtrain.models
_BATCH = 64


# The smoke run's jobs (`--quick`): one of each kind (the synchronous gradient in 32 and 16
# bits, a fixed H and `auto`, each blocking and overlapped), not `auto` in 16 bits too.
QUICK_JOBS = (
    "step", "step fp16", "local H=16", "local H=16 overlap", "local auto", "local auto overlap"
)  # fmt: skip


def plan(every, modes=("local", "diloco"), auto=True):
    """One cell's jobs: [(label, flags)], the ceiling first (flags None). Pure."""
    out = [(CEILING, None), ("step", []), ("step fp16", ["--fp16-allreduce"])]
    for mode in modes:
        for h in every:
            flags = ["--sync", mode, "--sync-every", str(h)]
            out += [(f"{mode} H={h}", flags), (f"{mode} H={h} overlap", flags + ["--sync-overlap"])]
        if auto:
            flags = ["--sync", mode, "--sync-every", "auto"]
            out.append((f"{mode} auto", flags + ["--no-sync-overlap"]))
            out.append((f"{mode} auto overlap", flags + ["--sync-overlap"]))
            out.append(
                (f"{mode} auto overlap fp16", flags + ["--sync-overlap", "--fp16-allreduce"])
            )
    return out


def _h(label):
    """(H, overlapped) of a job's label; H 1 for the synchronous job, None for auto."""
    m = re.search(r"H=(\d+)", label)
    h = int(m.group(1)) if m else (None if "auto" in label else 1)
    return h, "overlap" in label


def predicted(label, model, ranks, mbit, step_seconds, every=None):
    """The simple projection's share of the ceiling, to size a job: one exchange of the
    model's float32 parameters (fp16: half) every H steps on a ring of `ranks` over links of
    `mbit`. Pure."""
    h, overlap = _h(label)
    h = every or h or 16
    nbytes = PARAMS[model] * (2 if "fp16" in label else 4)
    return efficiency(step_seconds, nbytes, ranks, mbit * GBIT / 1000, h, overlap)


def projected(label, model, mbit, rates, samples, every=None):
    """The projection of a job's share of the ceiling over its epochs, from `rates`: each
    host's samples/s alone (the ceiling beside the job, one per rank). The ranks meet at
    every exchange, so the job steps at its slowest host's pace: `len(rates)` x the least
    rate of their sum, times the ring model of `hvdtrain.bench.project` with the epoch's
    shape at that host's step, `samples` an epoch in all. The synchronous job sends the
    gradient every step; local SGD and DiLoCo send the weights at each of the epoch's rounds
    but its last, blocking or in flight (a round then waits for what of the exchange its H
    steps did not cover), and at the epoch's end the whole exchange, blocking (the weights:
    the jobs write no checkpoint, before which Adam's two moments would go too,
    `exchange.rounds`). Pure."""
    h, overlap = _h(label)
    h = every or h or 16
    ranks, slowest = len(rates), min(rates)
    pace = ranks * slowest / sum(rates)
    step_seconds = _BATCH / slowest
    per = PARAMS[model] * (2 if "fp16" in label else 4)
    x = ring_allreduce_seconds(per, ranks, mbit * GBIT / 1000)
    if h == 1:
        return pace * step_seconds / (step_seconds + x)
    steps = samples // (ranks * _BATCH)
    rounds = max(1, -(-steps // h))  # an exchange at each H-th step, and the epoch's last
    wait = max(0.0, x - h * step_seconds) if overlap else x
    work = steps * step_seconds
    return pace * work / (work + (rounds - 1) * wait + x)


def samples_for(rate, seconds, ranks, every, least=2048, most=60_000):
    """Training samples per epoch for a job expected at `rate` samples/s to take about
    `seconds` an epoch: at least one round of H steps on every rank, within [least, most]
    (the whole MNIST), in executions of 16 steps (the epoch's last round may be shorter, as a
    user's is). Pure."""
    unit = ranks * _BATCH * 16
    round_ = ranks * _BATCH * max(every or 16, 16)
    n = min(most, max(least, round_, int(rate * seconds)))
    return max(round_, n // unit * unit)


def wire_bytes_per_sample(sync, model, ranks, samples, epochs, fp16=False):
    """Bytes each rank puts on its link per sample it trains (a ring allreduce sends 2 (n -
    1) / n of what it averages): from the metrics JSON's `sync` section, or, for the
    synchronous job, the gradient of every step (`fp16`: in float16). Pure."""
    ring = 2 * (ranks - 1) / ranks
    if sync.get("mode", "step") == "step":
        return ring * PARAMS[model] * (2 if fp16 else 4) / _BATCH
    return ring * sync["bytes_sent"] / (samples * epochs / ranks)


def _mnist(args, model, samples, extra):
    if "local" in extra:  # its steps, not its synchronous warmup (the synchronous job's speed)
        extra = [*extra, "--sync-warmup-steps", "0"]
    return [sys.executable, "-m", "hvdtrain.mnist", "--model", model, "--epochs",
            str(args.epochs), "--batch-size", str(_BATCH), "--lr-decay", "none",
            "--limit-samples", str(samples),
            *(["--data-dir", args.data_dir] if args.data_dir else []), *extra]  # fmt: skip


def _ceiling(hosts, args, model):
    """Every host trains its share alone, all at once: each host's rate (their sum is the
    ceiling)."""
    share = args.ceiling_samples // hosts.count
    procs = [
        subprocess.Popen(hosts.inside(i, _mnist(args, model, share, [])), env=hosts.env(**_ENV),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(hosts.count)
    ]  # fmt: skip
    rates = []
    for proc in procs:
        text = proc.communicate(timeout=args.timeout)[0]
        rate = steady(epoch_rates(text))
        if proc.returncode != 0 or rate is None:
            raise HvdtrainError(
                f"the ceiling's job failed (exit {proc.returncode}): {text[-1500:]}"
            )
        rates.append(rate)
    return rates


def _rates(rates):
    return " + ".join(f"{r:,.0f}" for r in rates)


def _wire(hosts, args, model, mbit):
    """The link's own figure: a Horovod allreduce of the model's weights (float32 and
    float16) between the hosts over the shaped link (`hvdtrain.bench.allreduce`, median of
    back-to-back calls), beside the ring model's seconds for the same bytes."""
    nbytes = [PARAMS[model] * 4, PARAMS[model] * 2]
    sizes = ",".join(map(str, nbytes))
    proc = _coupled(hosts, args, [sys.executable, "-m", "hvdtrain.bench.allreduce", "--sizes",
                                  sizes])  # fmt: skip
    got = {}
    for line in (proc.stdout + proc.stderr).splitlines():
        if MARKER in line:
            r = json.loads(line.partition(MARKER)[2])
            got[r["bytes"]] = r["seconds"]
    if proc.returncode != 0 or len(got) != len(nbytes):
        raise HvdtrainError(f"the link's allreduce failed (exit {proc.returncode}): "
                            f"{(proc.stdout + proc.stderr)[-1500:]}")  # fmt: skip
    return {
        name: {"bytes": n, "measured": got[n],
               "modelled": ring_allreduce_seconds(n, hosts.count, mbit * GBIT / 1000)}
        for name, n in zip(("float32", "float16"), nbytes, strict=True)
    }  # fmt: skip


def _coupled(hosts, args, command):
    """`command` on one rank a host, launched from the first as a user launches it."""
    run = os.path.join(os.path.dirname(sys.executable), "hvdtrain-run")
    argv = [run, "--backend", args.backend, "-H", hosts.hostlist(1), "--", *command]
    return hosts.run(0, argv, timeout=args.timeout, **_ENV)


def _job(hosts, args, model, samples, flags, metrics):
    command = _mnist(args, model, samples, ["--metrics-json", metrics, *flags])
    proc = _coupled(hosts, args, command)
    rate = steady(epoch_rates(proc.stderr + proc.stdout))
    if proc.returncode != 0 or rate is None:
        said = " ".join([hosts.hostlist(1), "--", *command])
        raise HvdtrainError(f"{said} failed (exit {proc.returncode}): "
                            f"{proc.stderr[-1500:]}")  # fmt: skip
    with open(metrics) as f:
        return rate, json.load(f)


_ENV = {"HVDTRAIN_OFFLINE": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}


def _cell(hosts, args, model, mbit, log):
    """The jobs of one (hosts, link, model) cell: [{label, rate, of_ceiling, ...}]. The
    ceiling is measured before the first job and after each: the machine's pace drifts over a
    cell's minutes (13 % in one here), and each job's share is of the mean of the two
    ceilings beside it."""

    def ceiling_now():
        hosts.shape(None)
        quiet_wait(120, log=log)
        out = _ceiling(hosts, args, model)
        hosts.shape(mbit)
        return out

    hosts_rates = [ceiling_now()]  # each ceiling's rate of every host
    ceilings = [sum(hosts_rates[0])]
    step_seconds = _BATCH / (ceilings[0] / hosts.count)  # one rank's step, alone
    log(f"{hosts.count} hosts, {model}: ceiling {ceilings[0]:,.0f} samples/s "
        f"({1000 * step_seconds:.2f} ms a step; hosts {_rates(hosts_rates[0])})")  # fmt: skip
    rows = []
    try:
        wire = _wire(hosts, args, model, mbit)
        log("  the weights' allreduce: " + ", ".join(
            f"{k} {1000 * w['measured']:.1f} ms (modelled {1000 * w['modelled']:.1f})"
            for k, w in wire.items()))  # fmt: skip
        for label, flags in plan(args.every, args.modes)[1:]:
            if (args.jobs and args.jobs not in label) or (args.quick and label not in QUICK_JOBS):
                continue
            # Every exchange-less job's epochs as long as the cap's (auto's too: an epoch
            # shorter than a round would exchange at its end alone, whatever H it chose), so
            # that their rows compare the same epochs.
            h = 1 if _h(label)[0] == 1 else CAP  # (the synchronous job: its own)
            guess = ceilings[0] * predicted(label, model, hosts.count, mbit, step_seconds, h)
            samples = samples_for(guess, args.seconds, hosts.count, h)
            metrics = os.path.join(args.out, f"{hosts.count}h-{mbit}-{model}-{label}.json")
            metrics = metrics.replace(" ", "_")
            machine = quiet_wait(120, log=log)  # nothing else running beside the job
            try:
                rate, m = _job(hosts, args, model, samples, flags, metrics)
            except (HvdtrainError, subprocess.TimeoutExpired) as e:
                log(f"  {label}: failed: {str(e)[:300]}")
                rows.append({"label": label, "error": str(e)[:2000]})
                continue
            hosts_rates.append(ceiling_now())
            ceilings.append(sum(hosts_rates[-1]))
            ceiling = (ceilings[-2] + ceilings[-1]) / 2
            beside = [(a + b) / 2 for a, b in zip(*hosts_rates[-2:], strict=True)]
            sync = m.get("sync") or {}
            chosen = (sync.get("auto") or {}).get("chosen")
            row = {
                "label": label, "rate": rate, "ceiling": ceiling, "of_ceiling": rate / ceiling,
                "samples": samples, "hidden": sync.get("exchange_hidden"),
                "auto": sync.get("auto"),
                "bytes_per_sample": wire_bytes_per_sample(sync, model, hosts.count, samples,
                                                          args.epochs, "fp16" in label),
                "predicted": projected(label, model, mbit, beside, samples, chosen),
                "hosts_rates": beside,
                "test_accuracy": m.get("test_accuracy"), "machine": machine,
            }  # fmt: skip
            rows.append(row)
            log(
                f"  {label}: {rate:,.0f} samples/s, {row['of_ceiling']:.2f} of the ceiling "
                f"beside it ({ceiling:,.0f}: hosts {_rates(beside)}; projected "
                f"{row['predicted']:.2f})" + (f", H={chosen}" if chosen else "")
            )
    finally:
        hosts.shape(None)
    return {
        "ceiling": statistics.median(ceilings),
        "ceilings": ceilings,
        "hosts_rates": hosts_rates,
        "wire": wire,
        "step_seconds": step_seconds,
        "jobs": rows,
    }


def markdown(cells):
    """The tables: one per (hosts, model), a column pair per link. Pure."""
    out = []
    groups = {}
    for c in cells:
        groups.setdefault((c["hosts"], c["model"]), []).append(c)
    for (hosts, model), group in sorted(groups.items()):
        links = [c["mbit"] for c in group]
        out.append(f"\n{hosts} hosts, {model}, batch {_BATCH} a rank; of the ceiling (the "
                   "projection's figure), exchanged bytes per sample a rank:\n")  # fmt: skip
        head = " | ".join(f"{m} Mbit/s" for m in links)
        out += [f"| job | {head} |", "|---" * (len(links) + 1) + "|"]
        out.append("| ceiling, samples/s: median (least-most) | " + " | ".join(
            f"{c['ceiling']:,.0f} ({min(c.get('ceilings', [c['ceiling']])):,.0f}-"
            f"{max(c.get('ceilings', [c['ceiling']])):,.0f})" for c in group) + " |")  # fmt: skip
        if all(c.get("wire") and c.get("hosts_rates") for c in group):  # (since 2026-12-07)
            wires = [c["wire"]["float32"] for c in group]
            out.append(
                "| the weights' allreduce, ms: measured (modelled) | "
                + " | ".join(
                    f"{1000 * w['measured']:.1f} ({1000 * w['modelled']:.1f})" for w in wires
                )
                + " |"
            )
            paces = [[len(r) * min(r) / sum(r) for r in c["hosts_rates"]] for c in group]
            out.append(
                "| hosts' pace: the slowest x hosts, of the ceiling: median | "
                + " | ".join(f"{statistics.median(p):.2f}" for p in paces)
                + " |"
            )
        labels = [j["label"] for j in group[0]["jobs"]]
        for label in labels:
            cols = []
            for c in group:
                j = next((j for j in c["jobs"] if j["label"] == label), {})
                if "rate" not in j:
                    cols.append("failed")
                    continue
                text = (
                    f"{j['of_ceiling']:.2f} ({j['predicted']:.2f}), {j['bytes_per_sample']:,.0f} B"
                )
                if j.get("hidden") is not None:
                    text += f", {j['hidden']:.0%} hidden"
                if j.get("auto"):
                    text += f", H={j['auto']['chosen']}"
                cols.append(text)
            out.append(f"| {label} | " + " | ".join(cols) + " |")
    return "\n".join(out) + "\n"


def _run(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--data-dir", help="the four MNIST IDX files (needed but with --quick)")
    p.add_argument("--out", default="out/links")
    p.add_argument("--hosts", default="2,3", help="numbers of namespace hosts, one rank each")
    p.add_argument("--links", default="1000,100,10", help="link rates, Mbit/s")
    p.add_argument("--models", default="mlp,convnet")
    p.add_argument("--every", default="4,16,64,256", help="the H values")
    p.add_argument("--modes", default="local,diloco")
    p.add_argument("--backend", choices=("gloo", "mpi"), default="gloo")
    p.add_argument("--epochs", type=int, default=4, help="per job; the first is not timed")
    p.add_argument("--seconds", type=float, default=12.0, help="about this long an epoch")
    p.add_argument("--ceiling-samples", type=int, default=12_800, help="the ceiling's, in all")
    p.add_argument("--timeout", type=int, default=900, help="seconds per job")
    p.add_argument("--jobs", help="only the jobs whose label holds this text, e.g. auto")
    p.add_argument("--quick", action="store_true", help="the smoke run: 2 hosts, 100 Mbit/s")
    args = p.parse_args(argv)
    if args.quick:
        args.hosts, args.links, args.models, args.every = "2", "100", "mlp", "16"
        args.modes, args.epochs, args.seconds = "local", 2, 3.0
    if not (args.data_dir or args.quick):  # the embedded 4,500 digits: 35 steps an epoch
        raise invalid_value(
            "--data-dir",
            None,
            "the folder of the four MNIST IDX files: a job's epochs must "
            "hold its rounds of up to 256 steps on every rank, and the embedded digits give "
            "35 (their epoch-end exchange would be every round); or --quick for the smoke run",
        )
    why = cannot_make_namespaces()
    if why:
        raise HvdtrainError(f"{PROG} needs namespace hosts: {why}")
    try:
        hosts_ = [int(x) for x in args.hosts.split(",")]
        links = [int(x) for x in args.links.split(",")]
        args.every = [int(x) for x in args.every.split(",")]
    except ValueError:
        raise invalid_value(
            "--hosts, --links or --every", argv, "comma-separated integers"
        ) from None
    models = args.models.split(",")
    if set(models) - set(PARAMS):
        raise invalid_value("--models", args.models, ", ".join(PARAMS))
    args.modes = args.modes.split(",")
    os.makedirs(args.out, exist_ok=True)

    def log(text):
        print(text, file=sys.stderr, flush=True)

    cells = []
    for n in hosts_:
        with tempfile.TemporaryDirectory() as work, NamespaceHosts(n, work, pin=True) as hosts:
            for model in models:
                for mbit in links:
                    log(f"{n} hosts, {model}, {mbit} Mbit/s")
                    cell = _cell(hosts, args, model, mbit, log)
                    cells.append({"hosts": n, "model": model, "mbit": mbit, **cell})
                    with open(os.path.join(args.out, "links.json"), "w") as f:
                        json.dump({"args": vars(args), "cells": cells}, f, indent=1)
    text = markdown(cells)
    with open(os.path.join(args.out, "links.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


def main(argv=None):
    return cli_main(_run, argv, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
