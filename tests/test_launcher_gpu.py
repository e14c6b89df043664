"""`hvdtrain-run doctor --gpu`: the parsers and verdicts (pure, on the output formats of
nvidia-smi, sysfs and NCCL_DEBUG=INFO), the wiring with a stand-in nvidia-smi, then a real
run on this CPU host: the driver row says what is missing, the rest runs on 2 ranks."""

import os
import subprocess
import sys

import pytest

from hvdtrain.launcher import gpu

RUN = os.path.join(os.path.dirname(sys.executable), "hvdtrain-run")

QUERY = """\
0, NVIDIA H100 80GB HBM3, 550.54.15, 00000000:18:00.0, 81559, 5, 16
1, NVIDIA H100 80GB HBM3, 550.54.15, 00000000:2A:00.0, 81559, 5, 16
"""
NVLINK = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5a1c1c3e-0000-0000-0000-000000000000)
\t Link 0: 26.562 GB/s
\t Link 1: 26.562 GB/s
\t Link 2: <inactive>
"""
NCCL_SOCKET = """\
[1,0]<stderr>:gpu01:1:1 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>
[1,0]<stderr>:gpu01:1:1 [0] NCCL INFO Using network Socket
[1,0]<stderr>:gpu01:1:9 [0] NCCL INFO Channel 00/0 : 3[3] -> 4[0] [send] via NET/Socket/0
[1,0]<stderr>:gpu01:1:9 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
[1,0]<stderr>:gpu01:1:9 [0] NCCL INFO Channel 01/0 : 1[1] -> 2[2] via SHM/direct/direct
"""


def test_parse_gpus_reads_the_query():
    gpus = gpu.parse_gpus(QUERY + "garbage line\n")
    assert [g["index"] for g in gpus] == [0, 1]
    assert gpus[0]["name"] == "NVIDIA H100 80GB HBM3" and gpus[0]["driver"] == "550.54.15"
    assert (gpus[0]["pcie_gen"], gpus[0]["pcie_width"], gpus[0]["memory_mib"]) == (5, 16, 81559)
    assert gpu.parse_gpus("") == [] and gpu.parse_gpus("No devices were found") == []


def test_link_speeds():
    assert gpu.nvlink_speed(NVLINK) == (2, pytest.approx(53.124))
    assert gpu.nvlink_speed("GPU 0: Tesla T4 (UUID: x)\n") == (0, 0.0)
    assert gpu.pcie_speed(4, 16) == pytest.approx(31.5, abs=0.1)
    assert gpu.pcie_speed(5, 16) == pytest.approx(63.0, abs=0.1)
    assert gpu.pcie_speed(None, 16) is None and gpu.pcie_speed(4, None) is None


def test_infiniband_ports_from_sysfs(tmp_path):
    def port(device, number, state, rate, layer):
        d = tmp_path / device / "ports" / str(number)
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
        (d / "rate").write_text(rate + "\n")
        (d / "link_layer").write_text(layer + "\n")

    port("mlx5_0", 1, "4: ACTIVE", "200 Gb/sec (4X HDR)", "InfiniBand")
    port("mlx5_1", 1, "1: DOWN", "10 Gb/sec (4X SDR)", "InfiniBand")
    port("mlx5_2", 1, "4: ACTIVE", "100 Gb/sec (4X EDR)", "Ethernet")
    assert gpu.infiniband_ports(str(tmp_path)) == [
        ("mlx5_0:1", "InfiniBand", 200.0),
        ("mlx5_2:1", "Ethernet", 100.0),
    ]
    assert gpu.infiniband_ports(str(tmp_path / "absent")) == []
    ports = gpu.infiniband_ports(str(tmp_path))
    dev = tmp_path / "dev-infiniband"
    dev.mkdir()
    assert "--device /dev/infiniband" in gpu.infiniband_problem(ports, str(dev))
    (dev / "uverbs0").write_text("")
    assert gpu.infiniband_problem(ports, str(dev)) is None
    assert gpu.infiniband_problem([], str(tmp_path / "absent")) is None


def test_nccl_transports():
    assert gpu.nccl_transports(NCCL_SOCKET) == ["NET/Socket", "P2P", "SHM"]
    ib = "NCCL INFO Using network IB\nNCCL INFO Channel 00/0 : 7[7] -> 8[0] [send] via NET/IB/0"
    assert gpu.nccl_transports(ib) == ["NET/IB"]
    assert gpu.nccl_transports("no NCCL here") == []


def test_pinning_problems():
    good = [
        {"rank": 0, "local_rank": 0, "hostname": "a", "gpu": 0},
        {"rank": 1, "local_rank": 1, "hostname": "a", "gpu": 1},
        {"rank": 2, "local_rank": 0, "hostname": "b", "gpu": 0},
    ]
    assert gpu.pinning_problems(good, 2) == []
    assert gpu.pinning_problems([{**r, "gpu": None} for r in good], 0) == []  # CPU host
    wrong = [good[0], {**good[1], "gpu": 0}]
    assert gpu.pinning_problems(wrong, 2) == ["rank 1 (local rank 1) used GPU 0"]
    shared = [good[0], {**good[1], "local_rank": 0, "gpu": 0}]
    assert gpu.pinning_problems(shared, 2) == ["ranks 0 and 1 share GPU 0"]
    none = [{**good[0], "gpu": None}]
    assert gpu.pinning_problems(none, 2) == ["rank 0 on a used no GPU"]


def test_allreduce_verdict():
    ib = [("mlx5_0:1", "InfiniBand", 200.0)]
    problem, note = gpu.allreduce_verdict(20e9, 25e9, ["NET/Socket", "P2P"], 2, ib)
    assert "NET/Socket" in problem and "mlx5_0:1" in problem
    assert "busbw 20.0 GB/s = 80% of the nominal 25.0 GB/s" in note
    assert gpu.allreduce_verdict(20e9, 25e9, ["NET/IB", "P2P"], 2, ib)[0] is None
    assert gpu.allreduce_verdict(20e9, 25e9, ["NET/Socket"], 2, [])[0] is None  # no IB here
    assert gpu.allreduce_verdict(1e9, None, [], 1, [])[1].endswith("not used (no GPU)")


def test_format_table():
    text = gpu.format_table([("driver", None, "driver 550, 8 x H100"), ("mnist", "failed", "")])
    lines = text.splitlines()
    assert lines[0] == "driver  ok       driver 550, 8 x H100"
    assert lines[1] == "mnist   problem  failed"
    assert lines[-1] == "doctor --gpu: problem in mnist"
    assert gpu.format_table([("a", None, "x")]).endswith("doctor --gpu: ok")


STAND_IN_SMI = f"""#!/bin/sh
case "$1" in
  nvlink) printf '%s' '{NVLINK}' ;;
  *) printf '%s' '{QUERY}' ;;
esac
"""


@pytest.mark.timeout(120)
def test_driver_link_and_tensorflow_rows(tmp_path, monkeypatch):
    """With a stand-in nvidia-smi on PATH (two H100s on NVLink), the driver and link rows
    read it; the real TensorFlow probe then says this TensorFlow cannot use them."""
    (tmp_path / "nvidia-smi").write_text(STAND_IN_SMI)
    (tmp_path / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    gpus, problem, detail = gpu._driver()
    assert problem is None and detail == "driver 550.54.15, 2 x NVIDIA H100 80GB HBM3"
    nominal, detail, _ = gpu._link(gpus, hosts=1)
    assert nominal == pytest.approx(53.124e9)
    assert detail.startswith("NVLink 2 links, 53.1 GB/s per direction")
    report, problem, detail = gpu._tensorflow(gpus, sys.executable)
    assert report["gpus"] == 0 and "TensorFlow 2." in detail
    assert problem == "TensorFlow is a CPU build: install tensorflow[and-cuda]"


@pytest.mark.timeout(600)
def test_gpu_check_for_real_on_cpu():
    """`hvdtrain-run doctor --gpu -H localhost:2 --backend gloo` on this host: the driver
    row is the one problem (exit 1), MNIST and the sweep ran on 2 ranks under Gloo."""
    proc = subprocess.run(
        [RUN, "doctor", "--gpu", "-H", "localhost:2", "--backend", "gloo"],
        capture_output=True,
        text=True,
        timeout=580,
    )
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "Traceback" not in out + proc.stderr
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "nvidia-smi not found; run the container with `--gpus all`" in rows["driver"]
    assert "problem" not in rows["tensorflow"] and "CPU build" in rows["tensorflow"]
    assert rows["mnist"].split()[1] == "ok" and "2 ranks, test accuracy 0." in rows["mnist"]
    assert "no GPU: every rank ran on CPU" in rows["pinning"]
    sweep = [line for line in out.splitlines() if line.startswith("allreduce ")]
    assert len(sweep) == len(gpu.CPU_SIZES) + 1 and all(" ok " in line for line in sweep)
    assert all("(gloo)" in line for line in sweep[:-1]), sweep
    assert out.splitlines()[-1] == "doctor --gpu: problem in driver"
