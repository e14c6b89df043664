"""`hvdtrain-run doctor --gpu`: what only a GPU node can check, as one command and one table.

    docker run --rm --gpus all --ipc=host hvdtrain:gpu hvdtrain-run doctor --gpu
    hvdtrain-run doctor --gpu                      # this host: one rank per GPU
    hvdtrain-run doctor --gpu -H node1:8,node2:8   # and the allreduce across the hosts

In order, each a row of the table it prints at the end:

1. driver: `nvidia-smi` answers and lists the GPUs (its driver comes from the host, through
   the NVIDIA Container Toolkit, never from the image);
2. link: the GPUs' link, read from `nvidia-smi` (NVLink: its links x speed; else PCIe:
   generation x lanes), and the InfiniBand ports in /sys/class/infiniband: the nominal
   figures the allreduce is compared with;
3. TensorFlow: a CUDA build that sees every GPU (a probe in a child process: the launcher
   never imports TensorFlow), and Horovod built with NCCL;
4. MNIST: `python -m hvdtrain.mnist --epochs 1` on one rank per GPU (or `-np`/`-H`), through
   `hvdtrain-run` with the options given; its metrics JSON gives the accuracy, the samples/s
   and each rank's GPU;
5. pinning: each rank used the GPU of its local rank, none shared;
6. allreduce: Horovod's allreduce (sum, float32) over 1 MiB to 256 MiB on those ranks,
   `NCCL_DEBUG=INFO` on, its bus bandwidth next to the nominal link, and the transport NCCL
   chose (`P2P`, `SHM`, `NET/IB`, `NET/Socket`). Across hosts, `NET/Socket` while the host
   has InfiniBand ports is a problem: NCCL fell back to TCP.

Exit 0 when every row is ok, else 1. Without a GPU (a CPU host, or `docker run` without
`--gpus`) the driver row is a problem, and with `-np N` the other rows still run on CPU, so
the image's own parts are checked anyway. Figures that good hardware gives are in the
docs site's page "Docker and GPU nodes" (docs/docker.md).
"""

import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

__all__ = [
    "GPU_QUERY",
    "SIZES",
    "CPU_SIZES",
    "parse_gpus",
    "nvlink_speed",
    "pcie_speed",
    "infiniband_ports",
    "infiniband_problem",
    "nccl_transports",
    "pinning_problems",
    "allreduce_verdict",
    "format_table",
    "run_gpu_check",
]

MARKER = "HVDTRAIN_GPU "
# The line a benchmark worker prints its result on (`python -m hvdtrain.bench.allreduce`, which
# the sweep runs): its one owner, which `hvdtrain.bench.workers` takes.
BENCH_MARKER = "@@hvdbench "
GPU_QUERY = (
    "index,name,driver_version,pci.bus_id,memory.total,pcie.link.gen.max,pcie.link.width.max"
)
SIZES = (1 << 20, 16 << 20, 256 << 20)  # bytes per allreduce on GPUs
CPU_SIZES = (64 << 10, 1 << 20, 16 << 20)  # and on CPU, where 256 MiB takes seconds
_PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # per direction
_GB = 1e9
_DECODER = json.JSONDecoder()  # raw_decode: a marked line may go on after its JSON

# Runs in a child process: TensorFlow and Horovod as the ranks will load them.
TF_PROBE = r"""
import json, os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
info = tf.sysconfig.get_build_info()
report = {
    "tensorflow": tf.__version__,
    "cuda_build": tf.test.is_built_with_cuda(),
    "cuda": info.get("cuda_version"),
    "cudnn": info.get("cudnn_version"),
    "gpus": len(tf.config.list_physical_devices("GPU")),
}
try:
    import horovod.tensorflow as hvd
    report["nccl"] = int(hvd.nccl_built())
except Exception as e:
    report["horovod_error"] = f"{type(e).__name__}: {e}"[:300]
print("__MARKER__" + json.dumps(report))
"""


def parse_gpus(text):
    """The GPUs in `nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits` output:
    a list of dicts (index, name, driver, bus_id, memory_mib, pcie_gen, pcie_width)."""
    gpus = []
    for line in (text or "").splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 7 or not fields[0].isdigit():
            continue
        gpus.append(
            {
                "index": int(fields[0]),
                "name": fields[1],
                "driver": fields[2],
                "bus_id": fields[3],
                "memory_mib": _int(fields[4]),
                "pcie_gen": _int(fields[5]),
                "pcie_width": _int(fields[6]),
            }
        )
    return gpus


def _int(text):
    return int(text) if text.isdigit() else None


def nvlink_speed(text):
    """(active links, GB/s per direction in all) from `nvidia-smi nvlink -s -i 0`, whose
    lines read `Link 3: 26.562 GB/s` (or `Link 3: <inactive>`); (0, 0.0) without NVLink."""
    speeds = [float(s) for s in re.findall(r"Link \d+:\s*([\d.]+)\s*GB/s", text or "")]
    return len(speeds), sum(speeds)


def pcie_speed(gen, width):
    """GB/s per direction of a PCIe link of generation `gen` with `width` lanes, or None."""
    if gen not in _PCIE_LANE_GBS or not width:
        return None
    return _PCIE_LANE_GBS[gen] * width


def infiniband_ports(root="/sys/class/infiniband"):
    """[(device:port, link layer, Gb/s)] for the active ports under `root` (sysfs)."""
    ports = []
    for port in sorted(glob.glob(os.path.join(root, "*", "ports", "*"))):
        device, number = port.split(os.sep)[-3], port.split(os.sep)[-1]
        state, rate, layer = (
            _read(os.path.join(port, name)) for name in ("state", "rate", "link_layer")
        )
        found = re.match(r"\s*([\d.]+)\s*Gb/sec", rate)
        if found and "ACTIVE" in state:
            ports.append((f"{device}:{number}", layer or "InfiniBand", float(found.group(1))))
    return ports


def infiniband_problem(ports, dev="/dev/infiniband"):
    """Why NCCL cannot use the InfiniBand `ports` this host has, or None: their devices are
    not in this container (NCCL then falls back to NET/Socket)."""
    if ports and not glob.glob(os.path.join(dev, "uverbs*")):
        return (
            f"InfiniBand ports ({', '.join(name for name, _, _ in ports)}) but no {dev}/uverbs* "
            "here: give the container the devices (`docker run --device /dev/infiniband "
            "--cap-add IPC_LOCK --ulimit memlock=-1`; on Kubernetes, an RDMA device plugin)"
        )
    return None


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def nccl_transports(log):
    """The transports NCCL reports in `NCCL_DEBUG=INFO` output, sorted: `NET/IB`,
    `NET/Socket` (from `Using network X` and `via NET/X`), `P2P`, `SHM`, `NVLS`, `CollNet`."""
    found = set()
    for name in re.findall(r"NCCL INFO Using network (\w+)", log or ""):
        found.add(f"NET/{name}")
    for via in re.findall(r"\bvia (\S+)", log or ""):
        parts = via.split("/")
        found.add("/".join(parts[:2]) if parts[0] == "NET" else parts[0])
    if re.search(r"NCCL INFO.*\bNVLS\b.*(?:enabled|comm)", log or ""):
        found.add("NVLS")
    return sorted(found)


def pinning_problems(ranks, gpus_per_host):
    """What is wrong with the GPU each rank used (`ranks` from the metrics JSON: rank,
    local_rank, hostname, gpu); empty when each used the GPU of its local rank."""
    if not gpus_per_host:
        return []
    problems, used = [], {}
    for r in ranks:
        where = (r.get("hostname"), r.get("gpu"))
        if r.get("gpu") is None:
            problems.append(f"rank {r['rank']} on {r.get('hostname')} used no GPU")
        elif r["gpu"] != r.get("local_rank"):
            problems.append(
                f"rank {r['rank']} (local rank {r.get('local_rank')}) used GPU {r['gpu']}"
            )
        elif where in used:
            problems.append(f"ranks {used[where]} and {r['rank']} share GPU {r['gpu']}")
        used.setdefault(where, r["rank"])
    return problems


def allreduce_verdict(busbw, nominal, transports, hosts, ib_ports):
    """(problem or None, note) for the sweep's largest-message bus bandwidth `busbw`
    (bytes/s) against `nominal` (bytes/s of the link that bounds it, or None)."""
    note = f"busbw {busbw / _GB:.1f} GB/s"
    if nominal:
        note += f" = {busbw / nominal:.0%} of the nominal {nominal / _GB:.1f} GB/s"
    note += f"; NCCL: {', '.join(transports) or 'not used (no GPU)'}"
    if hosts > 1 and "NET/Socket" in transports and ib_ports:
        names = ", ".join(name for name, _, _ in ib_ports)
        return (
            f"NCCL sent over NET/Socket (TCP) although this host has InfiniBand ports "
            f"({names}); see docs/docker.md on NET/Socket",
            note,
        )
    return None, note


def format_table(rows):
    """`rows` of (check, problem or None, detail) as an aligned table, then a verdict."""
    width = max(len(check) for check, _, _ in rows)
    lines = []
    for check, problem, detail in rows:
        status = "problem" if problem else "ok"
        text = f"{problem}; {detail}" if problem and detail else (problem or detail)
        lines.append(f"{check.ljust(width)}  {status.ljust(7)}  {text}")
    bad = [check for check, problem, _ in rows if problem]
    lines.append(f"doctor --gpu: problem in {', '.join(bad)}" if bad else "doctor --gpu: ok")
    return "\n".join(lines)


def _run(argv, timeout):
    """(exit code or None on timeout/missing program, stdout + stderr)."""
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else ""
        return None, out + f"\n(timed out after {timeout} s)"
    except OSError as e:
        return None, f"cannot run {argv[0]}: {e.strerror or e}"
    return done.returncode, done.stdout + done.stderr


def _last(text):
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def _driver():
    """(gpus, problem, detail)."""
    if not shutil.which("nvidia-smi"):
        return (
            [],
            (
                "no GPU visible: nvidia-smi not found; run the container with `--gpus all` "
                "(NVIDIA Container Toolkit) on a host with NVIDIA's driver"
            ),
            "",
        )
    code, out = _run(
        ["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"], 60
    )
    gpus = parse_gpus(out) if code == 0 else []
    if not gpus:
        return [], f"nvidia-smi lists no GPU: {_last(out)}", ""
    names = sorted({g["name"] for g in gpus})
    return gpus, None, f"driver {gpus[0]['driver']}, {len(gpus)} x {' + '.join(names)}"


def _link(gpus, hosts):
    """(nominal bytes/s that bounds the allreduce or None, detail, InfiniBand ports)."""
    ports = infiniband_ports()
    ib = ", ".join(f"{name} {layer} {rate:g} Gb/s" for name, layer, rate in ports) or "none"
    nominal, what = None, "no GPU"
    if gpus:
        _, out = _run(["nvidia-smi", "nvlink", "-s", "-i", str(gpus[0]["index"])], 60)
        links, speed = nvlink_speed(out)
        if links:
            nominal, what = speed * _GB, f"NVLink {links} links, {speed:.1f} GB/s per direction"
        else:
            gb = pcie_speed(gpus[0]["pcie_gen"], gpus[0]["pcie_width"])
            nominal = gb * _GB if gb else None
            what = f"PCIe gen {gpus[0]['pcie_gen']} x{gpus[0]['pcie_width']}" + (
                f", {gb:.1f} GB/s per direction" if gb else ""
            )
    if hosts > 1 and ports:
        network = sum(rate for _, _, rate in ports) / 8 * _GB
        nominal = min(nominal, network) if nominal else network
    return nominal, f"{what}; InfiniBand ports: {ib}", ports


def _tensorflow(gpus, python):
    """(report, problem, detail) from TF_PROBE run by `python`."""
    code, out = _run([python, "-c", TF_PROBE.replace("__MARKER__", MARKER)], 300)
    report = _marked(out)
    if report is None:
        return {}, f"TensorFlow did not load (exit {code}): {_last(out)}", ""
    build = f"CUDA {report['cuda']}, cuDNN {report['cudnn']}" if report["cuda_build"] else "CPU"
    nccl = f"NCCL {report['nccl']}" if report.get("nccl") else "no NCCL"
    detail = (
        f"TensorFlow {report['tensorflow']} ({build} build) sees {report['gpus']} GPU(s); "
        f"Horovod with {nccl}"
    )
    if report.get("horovod_error"):
        return report, f"Horovod did not load: {report['horovod_error']}", detail
    if gpus and not report["cuda_build"]:
        return report, "TensorFlow is a CPU build: install tensorflow[and-cuda]", detail
    if gpus and report["gpus"] < len(gpus):
        return (
            report,
            (
                f"TensorFlow sees {report['gpus']} of {len(gpus)} GPUs: its CUDA libraries did "
                "not load (run with TF_CPP_MIN_LOG_LEVEL=0 to see why)"
            ),
            detail,
        )
    if gpus and not report.get("nccl"):
        return report, "Horovod built without NCCL (HOROVOD_GPU_OPERATIONS=NCCL)", detail
    return report, None, detail


def _marked(out, marker=MARKER):
    for line in reversed((out or "").splitlines()):
        at = line.find(marker)
        if at >= 0:
            try:
                return _DECODER.raw_decode(line[at + len(marker) :])[0]
            except ValueError:
                return None
    return None


def _mnist(launch, python, timeout):
    """(metrics dict or None, problem, detail)."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-gpu-check-") as tmp:
        metrics_path = os.path.join(tmp, "metrics.json")
        command = [python, "-m", "hvdtrain.mnist", "--epochs", "1", "--metrics-json", metrics_path]
        code, out = _run(launch + ["--"] + command, timeout)
        try:
            with open(metrics_path) as f:
                metrics = json.load(f)
        except (OSError, ValueError):
            metrics = None
    if code != 0 or not metrics:
        return None, f"MNIST failed (exit {code}): {_last(out)}", ""
    rate = metrics.get("train_samples_per_sec")
    return (
        metrics,
        None,
        (
            f"{metrics['size']} ranks, test accuracy {metrics['test_accuracy']:.3f} after 1 epoch"
            + (f", {rate:,.0f} samples/s" if rate else "")
        ),
    )


def _sweep(launch, python, sizes, timeout):
    """(results, NCCL transports, problem)."""
    command = [python, "-m", "hvdtrain.bench.allreduce", "--sizes", ",".join(map(str, sizes))]
    env = ["-x", "NCCL_DEBUG=INFO", "-x", "HVDBENCH_BIND=none"]  # no core binding: NCCL's threads
    code, out = _run(launch + env + ["--"] + command, timeout)
    results = []
    for line in out.splitlines():
        at = line.find(BENCH_MARKER)
        if at >= 0:
            results.append(_DECODER.raw_decode(line[at + len(BENCH_MARKER) :])[0])
    if code != 0 or len(results) != len(sizes):
        return results, [], f"the allreduce sweep failed (exit {code}): {_last(out)}"
    return results, nccl_transports(out), None


def _size(nbytes):
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def run_gpu_check(launch, hosts=1, np=None, python=None, timeout=900, out=print):
    """Runs the checks in this module's docstring; prints the table; returns 0 or 1.

    Args:
        launch: the `hvdtrain-run` argv before `--`, without `-np` (hosts, backend, ...).
        hosts: how many hosts `launch` names; 0 when it names none (this host alone).
        np: ranks; by default all the hosts' slots, or on this host alone one per GPU (2
            on a host without GPUs).
        python: the Python the ranks run (default: this one).
    """
    python = python or sys.executable
    rows = []
    gpus, problem, detail = _driver()
    rows.append(("driver", problem, detail))
    nominal, detail, ib_ports = _link(gpus, hosts)
    rows.append(("link", infiniband_problem(ib_ports), detail))
    _, problem, detail = _tensorflow(gpus, python)
    rows.append(("tensorflow", problem, detail))
    if not np and not hosts:
        np = len(gpus) or 2
    launch = list(launch) + (["-np", str(np)] if np else []) + ["-q"]
    out(f"doctor --gpu: {shlex.join(launch)} -- ... (MNIST, then the allreduce sweep)")
    metrics, problem, detail = _mnist(launch, python, timeout)
    rows.append(("mnist", problem, detail))
    if metrics:
        problems = pinning_problems(metrics.get("ranks", []), len(gpus))
        used = ", ".join(
            f"{r['rank']}->{r.get('hostname')}:{r.get('gpu')}" for r in metrics.get("ranks", [])
        )
        detail = f"rank->host:GPU {used}" if gpus else "no GPU: every rank ran on CPU"
        rows.append(("pinning", "; ".join(problems) or None, detail))
    sizes = SIZES if gpus else CPU_SIZES
    results, transports, problem = _sweep(launch, python, sizes, timeout)
    for r in results:
        rows.append(
            (
                f"allreduce {_size(r['bytes'])}",
                None,
                f"{r['seconds'] * 1e3:.2f} ms, busbw {r['busbw'] / _GB:.2f} GB/s ({r['backend']})",
            )
        )
    if problem:
        rows.append(("allreduce", problem, ""))
    elif results:
        problem, note = allreduce_verdict(
            results[-1]["busbw"], nominal, transports, hosts, ib_ports
        )
        rows.append(("allreduce", problem, note))
    out(format_table(rows))
    return 1 if any(problem for _, problem, _ in rows) else 0
