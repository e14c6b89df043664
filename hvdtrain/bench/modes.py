"""The exchange modes through `hvdtrain.fit`, as a user runs them: `python -m hvdtrain.mnist`
under `hvdtrain-run -np 2` with `--sync step`, `local` and `diloco` (blocking and with
`--sync-overlap`) for each H, beside this machine's ceiling, interleaved round by round.

    python -m hvdtrain.bench.modes --data-dir ../shared/mnist --out out/modes
    python -m hvdtrain.bench.modes --data-dir ../shared/mnist --model convnet --every 16
    python -m hvdtrain.bench.modes --quick --out out/modes-quick   # the smoke run
    python -m hvdtrain.bench.modes --data-dir ../shared/mnist --every 16 --balance

- `ceiling`: two unconnected processes of the same job at -np 1, each bound to one core and
  given half the samples (each rank's work), side by side: their rates summed.
- the jobs: every other default of the job (the learning rate's warmup is one epoch, which
  is also local SGD's synchronous warmup), `--lr-decay none`.

A job's figure is the median, over its epochs after the first (the tracing, and the
synchronous warmup of `local`), of rank 0's epoch line (`epoch 2/4: 468 steps in 1.8 s,
33,083 samples/s`: the steps alone, not the evaluation). `modes.json` (every round's figures,
the `sync` section of each job's metrics JSON) and `modes.md` (rates, and ratios to the same
round's ceiling) go to `--out`. It never imports TensorFlow.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys

from hvdtrain.bench.runner import quiet_wait
from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.errors import main as cli_main

__all__ = ["main", "plan", "epoch_rates", "ratios", "markdown"]

PROG = "python -m hvdtrain.bench.modes"
CEILING = "ceiling"
_EPOCH = re.compile(
    r"epoch (\d+)/\d+: \d+ steps(?: after the first \d+)? in [\d.]+ s, ([\d,]+) samples/s"
)


def plan(every, backends, modes=("local", "diloco"), overlap=True, balance=False):
    """The jobs of one round: [(label, backend, flags)], the ceiling first (backend None);
    with `balance`, each exchanging job also with `--sync-balance`. Pure."""
    out = [(CEILING, None, [])]
    for backend in backends:
        out.append((f"step {backend}", backend, []))
        for mode in modes:
            for h in every:
                flags = ["--sync", mode, "--sync-every", str(h)]
                variants = [("", flags)]
                if overlap:
                    variants.append((" overlap", flags + ["--sync-overlap"]))
                if balance:
                    variants += [(f"{name} balanced", more + ["--sync-balance"])
                                 for name, more in list(variants)]  # fmt: skip
                out += [(f"{mode} H={h}{name} {backend}", backend, more)
                        for name, more in variants]  # fmt: skip
    return out


def epoch_rates(text):
    """{epoch: samples/s} of the epoch lines in `text` (rank 0's). Pure."""
    return {int(m[1]): float(m[2].replace(",", "")) for m in _EPOCH.finditer(text)}


def steady(rates):
    """The median of the epochs after the first (the first alone if it is the only one)."""
    later = [r for e, r in sorted(rates.items()) if e > 1] or list(rates.values())
    return statistics.median(later) if later else None


def ratios(rounds):
    """[{label: samples/s}] per round -> {label: [the job's rate / the same round's ceiling]}.
    Pure."""
    out = {}
    for figures in rounds:
        top = figures.get(CEILING)
        for label, rate in figures.items():
            if label != CEILING and top and rate:
                out.setdefault(label, []).append(rate / top)
    return out


def markdown(rounds):
    """The table: each job's median rate over the rounds, and its ratio to the same round's
    ceiling, round by round and the median. Pure."""
    by_ratio = ratios(rounds)
    lines = ["| job | samples/s (median) | of the ceiling, per round | median |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    for label in rounds[0]:
        rates = [r[label] for r in rounds if r.get(label)]
        rate = f"{statistics.median(rates):,.0f}" if rates else "failed"
        each = ", ".join(f"{x:.2f}" for x in by_ratio.get(label, []))
        median = f"{statistics.median(by_ratio[label]):.2f}" if by_ratio.get(label) else ""
        lines.append(f"| {label} | {rate} | {each} | {median} |")
    return "\n".join(lines) + "\n"


_ENV = {**os.environ, "HVDTRAIN_OFFLINE": "1"}  # a benchmark never downloads


def _job(args, extra):
    return [sys.executable, "-m", "hvdtrain.mnist", "--model", args.model, "--epochs",
            str(args.epochs), "--batch-size", str(args.batch_size), "--lr-decay", "none",
            *(["--data-dir", args.data_dir] if args.data_dir else []), *extra]  # fmt: skip


def _ceiling(args, log):
    """Two single-process jobs on half the samples each, each bound to its own core."""
    cores = sorted(os.sched_getaffinity(0))[:2]
    half = ["--limit-samples", str(args.samples // 2), "--threads", "1"]
    procs = []
    for core in cores:
        procs.append(subprocess.Popen(
            _job(args, half), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_ENV,
            preexec_fn=lambda c=core: os.sched_setaffinity(0, {c})))  # fmt: skip
    total, texts = 0.0, []
    for proc in procs:
        text = proc.communicate(timeout=args.timeout)[0]
        texts.append(text)
        rate = steady(epoch_rates(text))
        if proc.returncode != 0 or rate is None:
            log("\n".join(texts))
            raise HvdtrainError(f"the ceiling's job failed (exit {proc.returncode})")
        total += rate
    return total, None


def _distributed(args, backend, flags, metrics):
    run = os.path.join(os.path.dirname(sys.executable), "hvdtrain-run")
    argv = [run, "--backend", backend, "-np", "2", "--",
            *_job(args, ["--limit-samples", str(args.samples), "--metrics-json", metrics,
                         *flags])]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, env=_ENV)
    rate = steady(epoch_rates(proc.stderr + proc.stdout))
    if proc.returncode != 0 or rate is None:
        raise HvdtrainError(f"{' '.join(argv)} failed (exit {proc.returncode}): "
                            f"{proc.stderr[-2000:]}")  # fmt: skip
    with open(metrics) as f:
        m = json.load(f)
    ranks = [r.get("exchange_waited_seconds") for r in m.get("ranks", [])]
    return rate, {"sync": m.get("sync"), "exchange_waited_seconds": ranks}


def _run(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--data-dir", help="the four MNIST IDX files (else the embedded digits)")
    p.add_argument("--out", default="out/modes")
    p.add_argument("--model", choices=("mlp", "convnet", "convnet-bn"), default="mlp")
    p.add_argument("--every", default="4,16,64", help="the H values")
    p.add_argument("--modes", default="local,diloco", help="of local, diloco")
    p.add_argument("--backends", default="mpi,gloo")
    p.add_argument("--no-overlap", action="store_true", help="the blocking exchange alone")
    p.add_argument("--balance", action="store_true", help="each also with --sync-balance")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4, help="per job; the first is not timed")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="training samples per job (60000; the convnet 12800)",
    )
    p.add_argument("--timeout", type=int, default=900, help="seconds per job")
    p.add_argument("--quick", action="store_true", help="the smoke run: 2 epochs, H=4, MPI")
    args = p.parse_args(argv)
    if args.quick:
        args.every, args.modes, args.backends = "4", "local", "mpi"
        args.rounds, args.epochs, args.samples = 1, 2, args.samples or 2048
    if args.samples is None:
        args.samples = 12800 if args.model.startswith("convnet") else 60000
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"local", "diloco"}:
        raise invalid_value("--modes", args.modes, "local, diloco or both: local,diloco")
    backends = [b for b in args.backends.split(",") if b]
    if not backends or set(backends) - {"mpi", "gloo"}:
        raise invalid_value("--backends", args.backends, "mpi, gloo or both: mpi,gloo")
    try:
        every = [int(h) for h in args.every.split(",")]
    except ValueError:
        every = [0]
    if any(h < 1 for h in every):
        raise invalid_value("--every", args.every, "H values, e.g. 4,16,64")
    for name in ("rounds", "epochs", "samples"):
        if getattr(args, name) < 1 or (name == "samples" and args.samples < 4 * args.batch_size):
            raise invalid_value(f"--{name}", getattr(args, name), "a larger count")
    if args.data_dir and not os.path.isdir(args.data_dir):
        raise invalid_value("--data-dir", args.data_dir, "a folder with the MNIST IDX files")
    if len(os.sched_getaffinity(0)) < 2:
        raise HvdtrainError("The ceiling needs two cores; this process may run on one.")
    os.makedirs(args.out, exist_ok=True)
    jobs = plan(every, backends, modes, overlap=not args.no_overlap, balance=args.balance)

    def log(text):
        print(text, file=sys.stderr, flush=True)

    rounds, details = [], []
    for r in range(args.rounds):
        order = jobs if r % 2 == 0 else [jobs[0], *reversed(jobs[1:])]
        figures, extra = {}, {}
        for label, backend, flags in order:
            machine = quiet_wait(60, log=log)
            metrics = os.path.join(args.out, f"{label.replace(' ', '_')}-r{r}.json")
            if backend is None:
                rate, more = _ceiling(args, log)
            else:
                rate, more = _distributed(args, backend, flags, metrics)
            figures[label] = rate
            extra[label] = {"machine": machine, **(more or {})}
            log(f"round {r + 1}: {label}: {rate:,.0f} samples/s")
        rounds.append({label: figures[label] for label, _, _ in jobs})
        details.append(extra)
    header = (f"{args.model}, batch {args.batch_size} per rank, -np 2, {args.samples} samples "
              f"per epoch, epochs 2-{args.epochs} timed, {args.rounds} round(s):\n\n")  # fmt: skip
    text = header + markdown(rounds)
    with open(os.path.join(args.out, "modes.json"), "w") as f:
        json.dump({"args": vars(args), "rounds": rounds, "ratios": ratios(rounds),
                   "details": details}, f, indent=1)  # fmt: skip
    with open(os.path.join(args.out, "modes.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


def main(argv=None):
    return cli_main(_run, argv, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
