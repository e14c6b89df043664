"""What exchanging less costs in accuracy: `python -m hvdtrain.mnist` on the whole MNIST at
-np 2 (Gloo; `--np` for more ranks), at equal samples, under `--sync step`, `local` and
`diloco` for each H, over several seeds; the mean and spread of the test accuracy per mode.

    python -m hvdtrain.bench.accuracy --data-dir ../shared/mnist --out out/accuracy
    python -m hvdtrain.bench.accuracy --data-dir ../shared/mnist --model convnet-bn --every 16
    python -m hvdtrain.bench.accuracy --data-dir ../shared/mnist --modes diloco --outer 1:0.5,1:0
    python -m hvdtrain.bench.accuracy --data-dir ../shared/mnist --every 16 --overlap both
    python -m hvdtrain.bench.accuracy --data-dir ../shared/mnist --every 16 --balance both
    python -m hvdtrain.bench.accuracy --data-dir ../shared/mnist --every 64 --overlap on --fp16 both

`--data-dir` holds the four canonical IDX files (60,000 + 10,000 digits). Each run is its own
job (`hvdtrain-run --backend gloo -np N`); `accuracy.json` (every run's figures) and
`accuracy.md` (the table) go to `--out`. It never imports TensorFlow. Run again into the same
`--out`, it reuses each finished run made with the same arguments (a study extended to more
H values, modes or seeds runs the new ones alone).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from hvdtrain.errors import HvdtrainError, invalid_value
from hvdtrain.errors import main as cli_main

__all__ = ["main", "plan", "table"]

PROG = "python -m hvdtrain.bench.accuracy"


def plan(
    every,
    modes=("local", "diloco"),
    outers=(),
    overlaps=(False,),
    balances=(False,),
    halves=(False,),
):
    """The modes to run: [(label, flags)], the synchronous one first; DiLoCo once per
    (outer learning rate, outer momentum) of `outers`, or at its defaults; each with the
    blocking exchange, the overlapped one (`--sync-overlap`) or both, by `overlaps`, and with
    equal shares, `--sync-balance` or both, by `balances`, and the change sent in 32 or 16
    bits (`--fp16-allreduce`) or both, by `halves`. Pure."""
    out = [("step", [])]
    for mode in modes:
        for h in every:
            flags = ["--sync", mode, "--sync-every", str(h)]
            steps = [(f"{mode} H={h}", flags)]
            if mode == "diloco" and outers:
                steps = [(f"{mode} H={h} outer {lr}/{momentum}",
                          flags + ["--outer-lr", lr, "--outer-momentum", momentum])
                         for lr, momentum in outers]  # fmt: skip
            for label, more in steps:
                for overlap in overlaps:
                    for balance in balances:
                        for half in halves:
                            name, flags_ = label, list(more)
                            if overlap:
                                name, flags_ = name + " overlapped", flags_ + ["--sync-overlap"]
                            if balance:
                                name, flags_ = name + " balanced", flags_ + ["--sync-balance"]
                            if half:
                                name, flags_ = name + " fp16", flags_ + ["--fp16-allreduce"]
                            out.append((name, flags_))
    return out


def _outers(text):
    """'0.7:0.9,1:0.5' -> [('0.7', '0.9'), ('1', '0.5')] (checked as numbers)."""
    pairs = [tuple(part.split(":")) for part in text.split(",")] if text else []
    try:
        if not all(len(p) == 2 and float(p[0]) > 0 and 0 <= float(p[1]) < 1 for p in pairs):
            raise ValueError
    except ValueError:
        raise invalid_value("--outer", text, "LR:MOMENTUM pairs, e.g. 0.7:0.9,1:0.5") from None
    return pairs


def table(results):
    """{label: [test accuracy per seed]} -> a Markdown table: mean, spread (max - min), and
    the difference to the synchronous mean, in points. Pure."""
    base = statistics.mean(results["step"]) if results.get("step") else None
    lines = ["| mode | seeds | test accuracy, mean | spread | vs step (points) |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for label, accs in results.items():
        mean = statistics.mean(accs)
        diff = "" if base is None or label == "step" else f"{100 * (mean - base):+.2f}"
        lines.append(f"| {label} | {len(accs)} | {100 * mean:.2f} % | "
                     f"{100 * (max(accs) - min(accs)):.2f} | {diff} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _done(metrics, args):
    """A finished run's metrics, where `metrics` holds one made with the same `args` (a
    study run again reuses it: its new modes, H values or seeds alone run); else None."""
    try:
        with open(metrics + ".args") as f:
            same = json.load(f) == args
        with open(metrics) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return None
    return m if same and m.get("status") == "finished" else None


def _run(argv):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--data-dir", required=True, help="the four MNIST IDX files")
    p.add_argument("--out", default="out/accuracy")
    p.add_argument("--model", choices=("mlp", "convnet", "convnet-bn"), default="mlp")
    p.add_argument("--every", default="4,16,64", help="the H values")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--np", type=int, default=2, help="ranks (one host, Gloo)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--warmup-epochs", type=float, default=1.0,
                   help="the learning rate's warmup in every mode, and local SGD's "
                        "synchronous steps (under --epochs, or it never goes local)")  # fmt: skip
    p.add_argument("--lr-decay", choices=("none", "cosine"), default="none",
                   help="the main job's decay of the learning rate (none: as the tables of "
                        "docs/exchanging-less.md were measured)")  # fmt: skip
    p.add_argument("--modes", default="local,diloco", help="of local, diloco")
    p.add_argument("--outer", default="", help="DiLoCo's LR:MOMENTUM pairs, e.g. 1:0.5,1:0")
    p.add_argument(
        "--overlap",
        choices=("off", "on", "both"),
        default="off",
        help="the exchange blocking (off), overlapped (on), or each in turn",
    )
    p.add_argument(
        "--balance",
        choices=("off", "on", "both"),
        default="off",
        help="equal shares (off), --sync-balance (on), or each in turn",
    )
    p.add_argument(
        "--fp16",
        choices=("off", "on", "both"),
        default="off",
        help="the change sent in 32 bits (off), in 16 (--fp16-allreduce: on), or each in turn",
    )
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"local", "diloco"}:
        raise invalid_value("--modes", args.modes, "local, diloco or both: local,diloco")
    outers = _outers(args.outer)
    if not os.path.isdir(args.data_dir):
        raise invalid_value("--data-dir", args.data_dir, "a folder with the MNIST IDX files")
    try:
        every = [int(h) for h in args.every.split(",")]
    except ValueError:
        every = [0]
    if args.np < 1:
        raise invalid_value("--np", args.np, "a number of ranks, 1 or more")
    if any(h < 1 for h in every):
        raise invalid_value("--every", args.every, "H values, e.g. 4,16,64")
    os.makedirs(args.out, exist_ok=True)
    run = os.path.join(os.path.dirname(sys.executable), "hvdtrain-run")
    runs, results = [], {}
    turns = {"off": (False,), "on": (True,), "both": (False, True)}
    for label, flags in plan(
        every, modes, outers, turns[args.overlap], turns[args.balance], turns[args.fp16]
    ):
        for seed in range(args.seeds):
            metrics = os.path.join(args.out, f"{label.replace(' ', '_')}-seed{seed}.json")
            argv = [run, "--backend", "gloo", "-np", str(args.np), "--", sys.executable, "-m",
                    "hvdtrain.mnist", "--model", args.model, "--data-dir", args.data_dir,
                    "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
                    "--seed", str(seed), "--progress", "off", "--metrics-json", metrics,
                    "--warmup-epochs", str(args.warmup_epochs), "--lr-decay", args.lr_decay,
                    *flags]  # fmt: skip
            job = argv[argv.index("--") + 2 :]  # what `_done` compares: the job's own
            m = _done(metrics, job)
            if m is None:
                proc = subprocess.run(argv, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise HvdtrainError(f"{label}, seed {seed} failed: {proc.stderr[-2000:]}")
                with open(metrics) as f:
                    m = json.load(f)
                with open(metrics + ".args", "w") as f:
                    json.dump(job, f)
            runs.append({"mode": label, "seed": seed, "test_accuracy": m["test_accuracy"],
                         "test_samples": m["test_samples"], "sync": m["sync"],
                         "wall_seconds": m["wall_seconds"]})  # fmt: skip
            results.setdefault(label, []).append(m["test_accuracy"])
            print(f"{label} seed {seed}: {100 * m['test_accuracy']:.2f} %", file=sys.stderr)
    text = table(results)
    header = (f"{args.model}, {args.epochs} epochs of 60,000 digits, -np {args.np} x batch "
              f"{args.batch_size} (Gloo), warmup {args.warmup_epochs} epochs, {args.seeds} "
              "seeds; test on 10,000:\n\n")  # fmt: skip
    with open(os.path.join(args.out, "accuracy.json"), "w") as f:
        keys = {
            "model": args.model,
            "np": args.np,
            "epochs": args.epochs,
            "warmup_epochs": args.warmup_epochs,
        }
        json.dump({**keys, "runs": runs}, f, indent=1)
    with open(os.path.join(args.out, "accuracy.md"), "w") as f:
        f.write(header + text)
    print(header + text)
    return 0


def main(argv=None):
    return cli_main(_run, argv, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
