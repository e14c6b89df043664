"""A scaling benchmark: hvdtrain side by side with plain Horovod and MultiWorkerMirrored.

    python -m hvdtrain.bench --out out/bench            # the full run (about 20 minutes a round)
    python -m hvdtrain.bench --out out/bench --quick    # the smoke test (about a minute)
    python -m hvdtrain.bench --project                  # the GPU-cluster projection only

One run trains the same models on the same synthetic data, per-rank batch and cores with:

- hvdtrain at -np 1 (one core) and -np N (one core per rank), under Gloo and under MPI,
  launched with the commands `hvdtrain-run` builds;
- the baseline recipe: a plain Horovod Keras script as Horovod's docs write it, no tuning;
- `tf.distribute.MultiWorkerMirroredStrategy` with N local workers (TF_CONFIG);
- plain Keras `fit` on one core (the reference for hvdtrain at -np 1);
- this machine's ceiling: N copies of hvdtrain's one-core run side by side, unconnected
  (no software can scale better than the cores slow each other down);

on the MNIST MLP (784-256-256-10, communication-bound) and convnet (compute-bound) at
per-rank batches 32, 64 and 128. Every process is bound to its own core before TensorFlow
starts (one core per rank: `HVDBENCH_CORES_PER_RANK`, default 1).

Each figure is the median of `--repeats` timed windows of a fixed number of steps after a
warm-up window (tracing, buffers). Scaling efficiency = samples/s at N / (N x samples/s of the
same variant at -np 1). It also runs: the tuning experiments behind hvdtrain's defaults (each
default against the alternatives, same workload), an allreduce sweep (4 KB to 64 MB, Gloo and
MPI: time, algbw, busbw = algbw x 2(n-1)/n, next to the memory-copy bandwidth), and the
projection to GPU clusters (`hvdtrain.bench.project`).

Written to `--out DIR`: `bench.json` (everything, with the load average seen before each
job), `bench.md` (the tables), `bench.png` (throughput and efficiency against -np and batch
size; the allreduce sweep; the projection) and `logs/` (each job's output). Progress goes to
stderr as each figure arrives. Before each job it waits (`--quiet-wait`, bounded) until
other processes leave the cores idle, and records what it saw.

`python -m hvdtrain.bench.floor` is the benchmark's companion: a lower bound on what lock
step costs on this machine, whatever software exchanges the gradient (`hvdtrain.bench.floor`).

The launcher side never imports TensorFlow; the workers (`hvdtrain.bench.workers`,
`hvdtrain.bench.allreduce`, `hvdtrain.bench.floor --exchange`) run in the launched processes.
"""
