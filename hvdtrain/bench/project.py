"""What to expect on GPU clusters: a simple model of synchronous data-parallel training.

    step time  = compute + allreduce
    allreduce  = 2 (n - 1) / n x gradient bytes / link bandwidth        (a ring allreduce)
    efficiency = compute / step time

`compute` is one worker's forward + backward + update time for its batch; the gradient
crosses each worker's network link 2 (n - 1) / n times in a ring allreduce (reduce-scatter,
then all-gather), so for large n the time tends to 2 x bytes / bandwidth, independent of n.
The model assumes no overlap of communication with the backward pass (Horovod overlaps
them: measured efficiencies come out somewhat higher), no latency term (2 (n - 1) message
latencies: a few ms at 512 GPUs on RoCE) and a flat ring whose slowest link is the network,
not NVLink/PCIe inside a server.

Checked against the Horovod paper (Sergeev & Del Balso, 2018, arXiv:1802.05799): 88-90 %
scaling efficiency for Inception V3 and ResNet-101 on 128-512 Pascal GPUs over 25 Gbit/s
RoCE (batch 64 per GPU). With the P100's single-GPU speed from TensorFlow's benchmarks
(Inception V3: 142 images/s at batch 64, i.e. 0.45 s per step; ResNet-101 estimated from its
FLOPs relative to ResNet-50's 219 images/s: about 115 images/s, 0.56 s per step) the model
predicts 0.88 and 0.83: within a few points, and on the low side, as a model without overlap
should be.

    python -m hvdtrain.bench --project
"""

__all__ = [
    "GBIT",
    "PAPER",
    "ring_allreduce_seconds",
    "efficiency",
    "project",
    "paper_check",
    "default_workloads",
    "exchange_less",
]

GBIT = 1e9 / 8  # bytes per second in one Gbit/s
GPUS = (8, 16, 32, 64, 128, 256, 512)
ROCE_25G = 25 * GBIT  # the Horovod paper's network
IB_100G = 100 * GBIT

# The paper's check: (name, parameters, assumed P100 compute seconds per step at batch 64).
PAPER = {
    "published_efficiency": (0.88, 0.90),
    "gpus": (128, 512),
    "bandwidth": ROCE_25G,
    "models": [
        ("Inception V3", 23.9e6, 64 / 142),  # TF benchmarks, P100, batch 64: 142 images/s
        ("ResNet-101", 44.7e6, 64 / 115),  # estimated: 219 images/s x 4.1 / 7.8 GFLOPs
    ],
}


def ring_allreduce_seconds(nbytes, n, bandwidth):
    """Seconds for a ring allreduce of `nbytes` over `n` workers on links of `bandwidth`
    bytes/s: 2 (n - 1) / n x nbytes / bandwidth (0 for one worker)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth


def efficiency(compute_seconds, nbytes, n, bandwidth, every=1, overlap=False):
    """compute / (compute + allreduce / every) at `n` workers: one allreduce of `nbytes`
    every `every` steps. With `overlap` (`--sync-overlap`) a round's allreduce runs during
    the next round's steps: a round takes max(every x compute, allreduce)."""
    exchange = ring_allreduce_seconds(nbytes, n, bandwidth)
    if overlap:
        work = every * compute_seconds
        return work / max(work, exchange)
    return compute_seconds / (compute_seconds + exchange / every)


def exchange_less(workloads, every=(4, 16, 64), bandwidths=(ROCE_25G, IB_100G), gpus=GPUS):
    """Predicted efficiency of `--sync local` / `diloco` exchanging every H steps: the
    weights once per H steps (`hvdtrain.exchange`: the optimizer's state only at epoch
    ends, left out here), blocking the steps and overlapped with the next round's
    (`--sync-overlap`); the synchronous mode (the gradient every step, no overlap with the
    backward pass) first. No latency, no wait for a slower rank; nothing of accuracy."""
    rows = []
    for w in workloads:
        nbytes = w["params"] * 4
        for bw in bandwidths:
            modes = [("step", 1, False)] + [
                (f"H={h}{', overlapped' if o else ''}", h, o) for h in every for o in (False, True)
            ]
            for mode, h, o in modes:
                rows.append({
                    "name": w["name"], "bandwidth_gbit": bw / GBIT, "mode": mode,
                    "efficiency": {n: efficiency(w["compute_seconds"], nbytes, n, bw, h, o)
                                   for n in gpus},
                })  # fmt: skip
    return rows


def default_workloads(convnet_compute_seconds=None, convnet_params=None):
    """The projected workloads: a ResNet-50-sized gradient (25.6M float32 parameters) at the
    P100's 219 images/s (batch 64: 0.29 s per step) and at a faster GPU (0.1 s per step), and
    the MNIST convnet with the compute time measured here (one CPU core) and with an
    assumed GPU step of 2 ms."""
    rows = [
        {
            "name": "ResNet-50 (P100, batch 64)",
            "params": 25.6e6,
            "compute_seconds": 64 / 219,
            "compute_source": "assumed: P100 at 219 images/s (TF benchmarks)",
        },
        {
            "name": "ResNet-50 (faster GPU, batch 64)",
            "params": 25.6e6,
            "compute_seconds": 0.1,
            "compute_source": "assumed: 640 images/s",
        },
        {
            "name": "ResNet-50 (current GPU, batch 64)",
            "params": 25.6e6,
            "compute_seconds": 0.028,
            "compute_source": "assumed: 28 ms per step (about 2,300 images/s)",
        },
    ]
    if convnet_params:
        if convnet_compute_seconds:
            rows.append(
                {
                    "name": "MNIST convnet (measured: 1 CPU core, batch 64)",
                    "params": convnet_params,
                    "compute_seconds": convnet_compute_seconds,
                    "compute_source": "measured here (hvdtrain, -np 1)",
                }
            )
        rows.append(
            {
                "name": "MNIST convnet (GPU, batch 64)",
                "params": convnet_params,
                "compute_seconds": 0.002,
                "compute_source": "assumed: 2 ms per step",
            }
        )
    return rows


def project(workloads, bandwidths=(ROCE_25G, IB_100G), gpus=GPUS, bytes_per_param=4):
    """Predicted efficiency per workload, bandwidth and number of GPUs (a list of rows)."""
    rows = []
    for w in workloads:
        nbytes = w["params"] * bytes_per_param
        for bw in bandwidths:
            rows.append(
                {
                    **w,
                    "gradient_bytes": nbytes,
                    "bandwidth_gbit": bw / GBIT,
                    "allreduce_seconds": {n: ring_allreduce_seconds(nbytes, n, bw) for n in gpus},
                    "efficiency": {
                        n: efficiency(w["compute_seconds"], nbytes, n, bw) for n in gpus
                    },
                }
            )
    return rows


def paper_check():
    """The model's prediction for the paper's setting, next to the published figures."""
    lo, hi = PAPER["published_efficiency"]
    rows = []
    for name, params, compute in PAPER["models"]:
        predicted = {
            n: efficiency(compute, params * 4, n, PAPER["bandwidth"]) for n in PAPER["gpus"]
        }
        rows.append(
            {
                "name": name,
                "params": params,
                "compute_seconds": compute,
                "bandwidth_gbit": PAPER["bandwidth"] / GBIT,
                "predicted": predicted,
                "published": [lo, hi],
            }
        )
    return rows


def _fmt_table(rows, gpus=GPUS):
    head = "| workload | compute/step | gradient | link | " + " | ".join(f"{n}" for n in gpus)
    lines = [head + " |", "|" + " --- |" * (4 + len(gpus))]
    for r in rows:
        cells = [
            r["name"],
            f"{r['compute_seconds'] * 1000:.1f} ms",
            f"{r['gradient_bytes'] / 1e6:.1f} MB",
            f"{r['bandwidth_gbit']:g} Gbit/s",
        ] + [f"{r['efficiency'][n]:.2f}" for n in gpus]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def exchange_markdown(rows, gpus=(8, 64, 512)):
    """`exchange_less`'s rows as a Markdown table."""
    lines = ["| workload | link | exchange | " + " | ".join(f"{n} GPUs" for n in gpus) + " |",
             "|" + " --- |" * (3 + len(gpus))]  # fmt: skip
    for r in rows:
        cells = [r["name"], f"{r['bandwidth_gbit']:g} Gbit/s", r["mode"]]
        cells += [f"{r['efficiency'][n]:.2f}" for n in gpus]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(rows, check):
    """The projection and the paper check as Markdown."""
    out = [
        "Predicted scaling efficiency (no overlap; step = compute + 2(n-1)/n x bytes / link):",
        "",
        _fmt_table(rows),
        "",
        "Check against the Horovod paper (25 Gbit/s RoCE, P100, batch 64 per GPU):",
        "",
        "| model | params | compute/step (assumed) | predicted at 128 | at 512 | published |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in check:
        out.append(
            f"| {r['name']} | {r['params'] / 1e6:.1f}M | {r['compute_seconds'] * 1000:.0f} ms | "
            f"{r['predicted'][128]:.2f} | {r['predicted'][512]:.2f} | "
            f"{r['published'][0]:.2f}-{r['published'][1]:.2f} |"
        )
    return "\n".join(out)
