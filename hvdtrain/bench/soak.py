"""The chaos soak: `hvdtrain-run chaos` across the modes, backends and Kerases, summed.

    python -m hvdtrain.bench.soak --faults 128 --json soak.json              # the figure
    python -m hvdtrain.bench.soak --faults 14 --cells step-gloo-k2,files-mpi # a few cells
    python -m hvdtrain.bench.soak --hosts 2 --faults 30 --kinds kill-host,cut-host,slow-link \\
        --json soak-hosts.json                                  # across namespace hosts (root)

Each cell is one chaos run (`hvdtrain.launcher.chaos`: an uninterrupted run, then the same
command with faults, resumed after each; every kind of fault in turn) on 2 ranks of this
host: `hvdtrain.mnist --model mlp` (arrays) under `--sync step`, `local` and `diloco`,
Gloo and MPI, Keras 2 and 3, examples/tfrecord_train.py (files: its TFRecords, read
with `hvdtrain.FileData`) and `hvdtrain.bench.pydataset_job` (a Keras 3 `PyDataset`) under
Gloo and MPI. `--faults` are spread over the cells in
turn. The JSON holds the totals (`faults`, `survived`, `digests_equal`: the cells whose
final digest equalled the uninterrupted run's, `hangs`, `left_behind`, `tracebacks`,
`checkpoints_lost`) and every cell's own chaos JSON. Exit status 0 when every fault was
survived and every digest equal. It never imports TensorFlow, and its jobs never download
(HVDTRAIN_OFFLINE=1: the embedded digits). On a quiet 2-core host
`--faults 128` (121 injected) took 36 minutes; other work beside it slows it a lot.

With `--hosts N` (2 or 3; root) each cell runs across N namespace test hosts
(`hvdtrain.bench.netns`), one rank a host, chaos started on the first with `--hostfile` and
`--network-interface eth0`, the MNIST jobs on 2,048 samples: the host-level kinds join the
others (those this kernel lacks, `lossy-link`, are left out with a line). `--kinds` is
passed to every cell's chaos.

The cells `elastic-gloo-k2` and `elastic-gloo-k3` (across hosts only, never by default) run
`hvdtrain-run chaos --elastic --kinds kill-host` (`hvdtrain.launcher.chaoselastic`) on the
MNIST convnet, 16 epochs of 1,280 samples: hosts lost and taken back by one elastic job,
its final test accuracy within chaos's margin of the uninterrupted elastic run's (counted
with the digests equal):

    python -m hvdtrain.bench.soak --hosts 3 --faults 4 --cells elastic-gloo-k2,elastic-gloo-k3 \
        --json soak-elastic.json
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from hvdtrain.bench.runner import PACKAGE_ROOT
from hvdtrain.errors import HvdtrainError, exit_with_error, invalid_value

__all__ = ["CELLS", "cells", "spread", "sum_cells", "main"]

PROG = "python -m hvdtrain.bench.soak"
MNIST = ("python", "-m", "hvdtrain.mnist", "--model", "mlp", "--epochs", "3",
         "--checkpoint-every", "4")  # fmt: skip
ELASTIC = ("python", "-m", "hvdtrain.mnist", "--model", "convnet", "--limit-samples", "1280",
           "--epochs", "16", "--commit-every", "5")  # fmt: skip


def cells(root=PACKAGE_ROOT, samples=512):
    """{name: (backend, command)} of the matrix, the MNIST jobs on `samples` (pure)."""
    out = {}
    mnist = (*MNIST, "--limit-samples", str(samples))
    for sync in ("step", "local", "diloco"):
        every = ("--sync-every", "4") if sync != "step" else ()
        for backend in ("gloo", "mpi"):
            for keras in ("2", "3"):
                command = (*mnist, "--sync", sync, *every, "--keras", keras)
                out[f"{sync}-{backend}-k{keras}"] = (backend, command)
    script = os.path.join(root, "examples", "tfrecord_train.py")
    for backend in ("gloo", "mpi"):
        command = ("python", script, "--epochs", "1", "--checkpoint-every", "8")
        out[f"files-{backend}"] = (backend, command)
        command = ("python", "-m", "hvdtrain.bench.pydataset_job", "--checkpoint-every", "4")
        out[f"pydataset-{backend}"] = (backend, command)
    for keras in ("2", "3"):  # (chaos --elastic: across hosts only)
        command = (*ELASTIC, "--keras", keras)
        out[f"elastic-gloo-k{keras}"] = ("gloo", command)
    return out


CELLS = tuple(cells())


def spread(faults, names):
    """{cell: faults} with `faults` dealt over `names` in turn (pure)."""
    out = dict.fromkeys(names, 0)
    for i in range(faults):
        out[names[i % len(names)]] += 1
    return {k: v for k, v in out.items() if v}


def sum_cells(reports):
    """The soak's totals from the cells' chaos JSONs {cell: report or None} (pure)."""
    keys = ("faults", "survived", "hangs", "left_behind", "tracebacks", "checkpoints_lost",
            "not_injected", "failed_alone")  # fmt: skip
    done = {k: r for k, r in reports.items() if r}
    out = {k: sum(r.get(k, 0) for r in done.values()) for k in keys}
    out["cells"] = len(reports)
    out["cells_failed_to_run"] = sorted(k for k, r in reports.items() if not r)
    out["digests_equal"] = sum(  # (an elastic cell: its accuracy within the margin)
        1 for r in done.values() if r.get("digests_equal") or r.get("accuracy_within_margin")
    )
    out["kinds"] = {}
    for r in done.values():
        for record in r.get("records", []):
            if record.get("injected"):
                kind = out["kinds"].setdefault(record["kind"], {"faults": 0, "survived": 0})
                kind["faults"] += 1
                kind["survived"] += bool(record.get("survived"))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--faults", default="100", help="faults in all (default 100)")
    p.add_argument("--seed", default="0", help="the first cell's seed; the next ones follow")
    p.add_argument("--cells", help="comma-separated, default all: " + ",".join(CELLS))
    p.add_argument("--json", required=True, metavar="PATH", help="the totals and every cell")
    p.add_argument("--workdir", help="the cells' folders (default: a new temp folder)")
    p.add_argument("--hosts", default="0", help="namespace hosts, 2 or 3 (default: this one)")
    p.add_argument("--kinds", help="chaos's --kinds for every cell (default: all it can)")
    args = p.parse_args(argv)
    try:
        for name in ("faults", "seed"):
            if not getattr(args, name).isdigit():
                raise invalid_value("--" + name, getattr(args, name), "an integer >= 0")
        if args.hosts not in ("0", "2", "3"):
            raise invalid_value("--hosts", args.hosts, "2 or 3 (namespace hosts), or 0")
        default = ",".join(c for c in CELLS if not c.startswith("elastic"))
        names = [c.strip() for c in (args.cells or default).split(",") if c.strip()]
        for name in names:
            if name not in CELLS:
                raise invalid_value("--cells", name, "cells among " + ", ".join(CELLS))
            if name.startswith("elastic") and args.hosts == "0":
                raise invalid_value("--cells", name, "an elastic cell with --hosts 2 or 3")
        # A SIGTERM ends the cell's chaos run (its jobs too), then the namespace hosts.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        return _soak(args, spread(int(args.faults), names))
    except HvdtrainError as e:
        exit_with_error(PROG, e)


def _soak(args, plan):
    workdir = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="hvdtrain-soak-"))
    if args.hosts == "0":
        return _cells(args, plan, workdir, None)
    from hvdtrain.bench.netns import NamespaceHosts, cannot_make_namespaces

    why = cannot_make_namespaces()
    if why:
        raise HvdtrainError(f"--hosts needs namespace hosts: {why}")
    with NamespaceHosts(int(args.hosts), os.path.join(workdir, "hosts")) as hosts:
        return _cells(args, plan, workdir, hosts)


def _cells(args, plan, workdir, hosts):
    # (across hosts a longer job: its faults strike mid-run, and a slowed link leaves more
    # of it to run)
    matrix, reports, started = cells(samples=2048 if hosts else 512), {}, time.monotonic()
    where = ["-np", "2"]
    if hosts:
        hostfile = os.path.join(workdir, "hosts.txt")
        with open(hostfile, "w") as f:
            f.writelines(f"{a} slots=1\n" for a in hosts.addresses)
        where = ["--hostfile", hostfile, "--network-interface", "eth0"]
    for i, (name, faults) in enumerate(plan.items()):
        backend, command = matrix[name]
        folder = os.path.join(workdir, name)
        os.makedirs(folder, exist_ok=True)
        report = os.path.join(folder, "chaos.json")
        kinds = ["--kinds", args.kinds] if args.kinds else []
        if name.startswith("elastic"):  # (its one kind)
            kinds = ["--elastic", "--kinds", "kill-host"]
        argv = [sys.executable, "-m", "hvdtrain.launcher.cli", "chaos", *where, *kinds,
                "--faults", str(faults), "--seed", str(int(args.seed) + i), "--backend",
                backend, "--json", report, "--workdir", os.path.join(folder, "work"), "--",
                *command]  # fmt: skip
        print(f"{PROG}: {name}: {faults} faults ...", file=sys.stderr, flush=True)
        with open(os.path.join(folder, "chaos.out"), "w") as out:
            offline = {**os.environ, "HVDTRAIN_OFFLINE": "1"}  # a benchmark never downloads
            if hosts:  # (from the first host's namespace; `cd` to the cell's folder there)
                argv = ["sh", "-c", 'cd "$0" && exec "$@"', folder, *argv]
                argv = hosts.inside(0, argv)
                offline = hosts.env(HVDTRAIN_OFFLINE="1")
            chaos = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=folder,
                                     env=offline)  # fmt: skip
            try:
                code = chaos.wait()
            except SystemExit:  # the soak stopped: chaos ends its jobs, the hosts go after
                chaos.terminate()
                chaos.wait(120)
                raise
        try:
            with open(report) as f:
                reports[name] = json.load(f)
        except (OSError, ValueError):
            reports[name] = None
        got = reports[name] or {}
        verdict = "digest " + ("equal" if got.get("digests_equal") else "DIFFERENT")
        if "accuracy_within_margin" in got:  # (an elastic cell)
            verdict = "accuracy " + ("within" if got["accuracy_within_margin"] else "OUTSIDE")
            verdict += " the margin"
        print(f"{PROG}: {name}: exit {code}, {got.get('survived', 0)}/{got.get('faults', 0)} "
              f"survived, {verdict}", file=sys.stderr, flush=True)  # fmt: skip
    sums = sum_cells(reports)
    out = {**sums, "seconds": round(time.monotonic() - started), "plan": plan,
           "hosts": hosts.addresses if hosts else None, "workdir": workdir,
           "reports": reports}  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{PROG}: {sums['faults']} faults in {len(plan)} cells: {sums['survived']} survived, "
          f"{sums['digests_equal']}/{len(plan)} digests equal, {sums['hangs']} hangs, "
          f"{sums['left_behind']} processes left, {sums['tracebacks']} tracebacks",
          flush=True)  # fmt: skip
    ok = sums["survived"] == sums["faults"] and sums["digests_equal"] == len(plan)
    ok = ok and not sums["failed_alone"] and not sums["cells_failed_to_run"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
