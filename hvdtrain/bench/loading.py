"""How fast batches made in Python feed training (issue 48): a Keras 3 `PyDataset` that
augments in Python, through `hvdtrain.fit` at -np 2, against the same samples through
`ArrayData` (no Python in the input path) at -np 2, and against plain Keras's `fit` of the
same `PyDataset` on one process.

    python -m hvdtrain.bench.loading --out out/loading              # 3 rounds, ~5 minutes
    python -m hvdtrain.bench.loading --out out/loading --workers 2 --processes

The work: the embedded MNIST digits (4,500 to train), batches of 64 per process, a small
convnet, 4 epochs; the PyDataset shifts each image by up to 2 pixels with `np.roll`, per
sample, in Python. Each job's figure is its median samples/s over the epochs after the
first (the first holds the start-up). The jobs run interleaved round by round, the order
reversed in even rounds; `loading.json` and `loading.md` go to `--out`. The launcher side
never imports TensorFlow: the jobs are this module with `--job`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from hvdtrain.errors import main as cli_main

__all__ = ["main", "JOBS", "markdown"]

JOBS = ("keras-1", "pydataset-2", "arrays-2")  # the job, and its processes
BATCH, EPOCHS = 64, 4
MARK = "@@loading "


# -- the jobs (TensorFlow from here on) ----------------------------------------------------
def _dataset(keras, x, y, workers, processes):
    import numpy as np

    class Shifted(keras.utils.PyDataset):
        """Batches of 64 images, each shifted by up to 2 pixels (np.roll, per sample)."""

        def __len__(self):
            return len(x) // BATCH

        def __getitem__(self, i):
            xs = x[i * BATCH : (i + 1) * BATCH].copy()
            for k, (dy, dx) in enumerate(np.random.randint(-2, 3, (len(xs), 2))):
                xs[k] = np.roll(xs[k], (dy, dx), axis=(0, 1))
            return xs, y[i * BATCH : (i + 1) * BATCH]

    return Shifted(workers=workers, use_multiprocessing=processes)


def _model(keras):
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def run_job(job, workers, processes):
    """Trains as `job` says; prints `@@loading {json}` (rank 0) with samples/s per epoch."""
    import keras

    import hvdtrain

    (x, y), _ = hvdtrain.load_mnist("embedded")
    x = x.astype("float32")
    if job == "keras-1":
        seconds = []

        class Clock(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                seconds.append(time.perf_counter() - self.start)

        model = _model(keras)
        data = _dataset(keras, x, y, workers, processes)
        model.fit(data, epochs=EPOCHS, verbose=0, callbacks=[Clock()])
        rates = [len(data) * BATCH / s for s in seconds]
        rank = 0
    else:
        if job == "pydataset-2":
            data = _dataset(keras, x, y, workers, processes)
        else:
            data = hvdtrain.ArrayData(x, y)
        out = hvdtrain.fit(lambda: _model(keras), data, epochs=EPOCHS, batch_size=BATCH,
                           progress="off", warmup_epochs=0)  # fmt: skip
        rates, rank = out["epoch_samples_per_sec"], hvdtrain.is_main_process()
        rank = 0 if rank else 1
    if rank == 0:
        print(MARK + json.dumps({"job": job, "epoch_samples_per_sec": rates}), flush=True)


# -- the launcher side ---------------------------------------------------------------------
def command(job, workers, processes):
    """The argv of one job (pure)."""
    inner = [sys.executable, "-m", "hvdtrain.bench.loading", "--job", job,
             "--workers", str(workers)] + (["--processes"] if processes else [])  # fmt: skip
    if job.endswith("-1"):
        return inner
    return ["horovodrun", "--gloo", "-np", "2", "-H", "localhost:2", *inner]


def figure(rates):
    """A job's samples/s: the median of its epochs after the first."""
    return statistics.median(rates[1:] or rates)


def markdown(results, command_line):
    """The table of `results` ({job: [figure per round]}), each against plain Keras."""
    base = statistics.median(results["keras-1"])
    lines = [
        f"`{command_line}`",
        "",
        "| job | samples/s per round | median | x plain Keras (1 process) |",
        "| --- | --- | --- | --- |",
    ]
    for job in JOBS:
        rounds = results[job]
        mid = statistics.median(rounds)
        lines.append(
            f"| {job} | {', '.join(f'{r:,.0f}' for r in rounds)} | {mid:,.0f} | {mid / base:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _run(argv, env):
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
    for line in proc.stdout.splitlines():
        if MARK in line:
            return json.loads(line.split(MARK, 1)[1])["epoch_samples_per_sec"]
    raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m hvdtrain.bench.loading", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("--out", default="out/loading", help="folder of loading.json/.md")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three jobs")
    parser.add_argument("--workers", type=int, default=1, help="the PyDataset's workers")
    parser.add_argument("--processes", action="store_true", help="use_multiprocessing=True")
    parser.add_argument("--job", choices=JOBS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        return run_job(args.job, args.workers, args.processes)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    results = {job: [] for job in JOBS}
    for r in range(args.rounds):
        for job in JOBS if r % 2 == 0 else JOBS[::-1]:
            rate = figure(_run(command(job, args.workers, args.processes), env))
            results[job].append(rate)
            print(f"round {r + 1}: {job} {rate:,.0f} samples/s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    line = " ".join(["python -m hvdtrain.bench.loading", *(argv or sys.argv[1:])])
    with open(os.path.join(args.out, "loading.json"), "w") as f:
        json.dump({"command": line, "workers": args.workers, "processes": args.processes,
                   "samples_per_sec": results}, f, indent=1)  # fmt: skip
    table = markdown(results, line)
    with open(os.path.join(args.out, "loading.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))
