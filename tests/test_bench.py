"""The scaling benchmark: its smallest configuration end to end (output shape, not timing),
and the pure parts (commands, projection, summary) without processes."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, job_env

from hvdtrain.errors import HvdtrainError

BENCH_TIMEOUT = 540  # a hang fails; a loaded machine took more than 300 s (pytest: 600)


def _run_quick(module, out, *extra):
    """`python -m module --quick --out out ...` to the end; it must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", module, "--quick", "--out", str(out), *extra],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=BENCH_TIMEOUT,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def _noise(data):
    """Each job's figures with how busy the machine was in their windows: what a failed
    bound on a measured ratio is read against (another tenant slows a one-core figure)."""
    return "\n".join(
        f"{run['name']}: {r.get('samples_per_sec', 0):,.0f} samples/s, "
        f"{r.get('quiet_windows')} quiet, other cores {r.get('external_cores')}"
        for run in data["runs"]
        for r in run["results"]
        if "window_seconds" in r
    )


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # --compare-python: this same environment stands in for another stack here
    return out, _run_quick("hvdtrain.bench", out, "--compare-python", sys.executable)


@pytest.mark.slow
@pytest.mark.alone  # its ceiling is n one-core runs side by side: another test beside it skews it
def test_quick_run_writes_json_markdown_and_png(quick):
    out, proc = quick
    assert "[1/" in proc.stderr and "samples/s" in proc.stderr  # progress while it runs
    data = json.loads((out / "bench.json").read_text())
    assert data["config"]["quick"] and data["config"]["np"] >= 2
    assert all(r["ok"] for r in data["runs"]), [r["name"] for r in data["runs"] if not r["ok"]]
    for r in data["runs"]:
        assert set(r["machine"]) >= {"load_average", "busy_cores", "quiet", "waited_seconds"}
        assert os.path.isfile(out / r["log"])
    n = data["config"]["np"]
    have = {(f["variant"], f["np"], f["backend"], f["label"]) for f in data["figures"]}
    for key in [
        ("keras", 1, None, "plain"),
        ("keras", 1, None, "same compile options"),
        ("hvdtrain", 1, None, ""),
        ("hvdtrain", n, "gloo", ""),
        ("hvdtrain", n, "mpi", ""),
        ("hvdtrain-keras3", 1, None, ""),
        ("hvdtrain-keras3", n, "gloo", ""),
        ("hvdtrain-keras3", n, "mpi", ""),
        ("baseline", 1, None, ""),
        ("baseline", n, "gloo", ""),
        ("baseline", n, "mpi", ""),
        ("mwms", 1, None, ""),
        ("mwms", n, "grpc", ""),
    ]:
        assert key in have, key
    for f in data["figures"]:
        assert f["model"] == "mlp" and f["batch_size"] == 64 and f["samples_per_sec"] > 0
    rows = data["comparison"]
    assert {r["backend"] for r in rows} == {"gloo", "mpi"}
    for r in rows:
        for key in ("hvdtrain_efficiency", "baseline_efficiency", "mwms_efficiency"):
            assert 0 < r[key] < 2, f"{key} {r[key]}\n{_noise(data)}"
        assert r["vs_baseline"] > 0 and r["vs_mwms"] > 0 and r["vs_keras"] > 0
        assert r["hvdtrain_efficiency"] == pytest.approx(r["hvdtrain_n"] / (n * r["hvdtrain_1"]))
        assert r["keras3_vs_keras2_n"] == pytest.approx(r["keras3_n"] / r["hvdtrain_n"])
        assert r["keras3_vs_baseline"] > 0
        assert 0 < r["keras3_efficiency"] < 2, f"{r['keras3_efficiency']}\n{_noise(data)}"
    assert [t["target"] for t in data["targets"]][:4] == [
        "MLP scaling efficiency",
        "MLP scaling efficiency, batch 128",
        "MLP hvdtrain / baseline (every batch, both backends)",
        "MLP hvdtrain / MultiWorkerMirrored",
    ]
    # Where rank 0's core went, per step: the thread groups and the rest add up to the step.
    cores = {(c["np"], c["backend"]): c for c in data["cores"]}
    assert set(cores) == {(1, None), (n, "gloo"), (n, "mpi")}
    for c in cores.values():
        assert c["step"] > 0 and c["main"] + c["tensorflow"] > 0
        parts = c["main"] + c["tensorflow"] + c["horovod"] + c["other"] + c["rest"]
        assert parts == pytest.approx(c["step"])
    assert cores[(n, "mpi")]["horovod"] > 0  # the background thread works at -np N
    sweep = data["allreduce"]
    assert sweep["memcpy_bytes_per_sec"] > 0
    sizes = (4096, 269_322 * 4)  # 4 KB and the MLP's gradient
    assert {(r["backend"], r["bytes"]) for r in sweep["rows"]} == {
        (b, s) for b in ("gloo", "mpi") for s in sizes
    }
    for r in sweep["rows"]:
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (n - 1) / n)
        assert r["algbw"] == pytest.approx(r["bytes"] / r["seconds"])
        assert (r["backend"] == "mpi") == ("raw_mpi_seconds" in r)
    assert data["projection"]["rows"] and data["projection"]["paper_check"]
    inp = data["input"]  # the convnet from memory, from TFRecord files, the pipeline alone
    assert inp["memory"] > 0 and inp["files"] > 0 and inp["pipeline"] > 0
    assert inp["files_vs_memory"] == pytest.approx(inp["files"] / inp["memory"])
    [ceiling] = data["ceiling"]  # n unconnected one-core runs side by side, against one alone
    assert (ceiling["model"], ceiling["batch_size"], ceiling["np"]) == ("mlp", 64, n)
    assert 0 < ceiling["ceiling"] < 2 and ceiling["alone"] > 0, f"{ceiling}\n{_noise(data)}"
    assert data["targets"][0]["machine_ceiling"] == ceiling["ceiling"]
    stacks = data["stacks"]  # the other stack's jobs ran with its python, beside this one's
    assert [r["python"] for r in data["runs"] if r["group"] == "stack"] == [sys.executable] * 3
    assert [r["job"] for r in stacks["rows"]] == [
        "Keras fit, -np 1",
        "hvdtrain, -np 1",
        f"hvdtrain, -np {n} (mpi)",
    ]
    for r in stacks["rows"]:
        assert (
            r["this"] > 0 and r["other"] > 0 and r["ratio"] == pytest.approx(r["this"] / r["other"])
        )
    assert stacks["this"] == stacks["other"] and "TF 2." in stacks["this"]
    md = (out / "bench.md").read_text()
    headings = ("## Throughput", "## Keras 3 against Keras 2", "## Targets", "ceiling",
                "## Old and new stack side by side",
                "## Allreduce", "## Where rank 0's core goes", "## Projection")  # fmt: skip
    for heading in headings:
        assert heading in md
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_of_the_full_run_covers_every_variant_backend_and_batch():
    from hvdtrain.bench.cli import parse_args, plan_runs

    args = parse_args(["--np", "2", "--rounds", "2"])
    runs = plan_runs(args)
    main = [r for r in runs if r.group == "main"]
    # -np 1 shared; hvdtrain, hvdtrain-keras3, baseline x 2 backends; mwms x 2
    assert len(main) == 2 * (1 + 2 + 2 + 2 + 2)
    assert {(r.variant, r.np, r.backend) for r in main} >= {
        ("keras,hvdtrain,hvdtrain-keras3,baseline", 1, None),
        ("hvdtrain-keras3", 2, "mpi"),
        ("mwms", 1, None),
        ("hvdtrain", 2, "gloo"),
        ("hvdtrain", 2, "mpi"),
        ("baseline", 2, "mpi"),
        ("mwms", 2, None),
    }
    assert "mlp,convnet" in main[0].args and "32,64,128" in main[0].args
    singles = [r.variant for r in main if r.np == 1 and r.variant != "mwms"]
    assert singles == [  # none always first
        "keras,hvdtrain,hvdtrain-keras3,baseline",
        "baseline,hvdtrain-keras3,hvdtrain,keras",
    ]
    assert [r.group for r in runs].count("sweep") == 2
    assert not any(r.group == "stack" or r.python for r in runs)
    assert any(r.group == "tuning" for r in runs)
    assert len({r.name for r in runs}) == len(runs)


def test_plan_with_another_stack_interleaves_its_jobs_with_this_ones():
    from hvdtrain.bench.cli import parse_args, plan_runs

    other = sys.executable  # an environment's python with horovodrun beside it
    args = parse_args(["--np", "2", "--rounds", "2", "--compare-python", other, "--no-tuning"])
    main = [r for r in plan_runs(args) if r.group in ("main", "stack")]
    stack = [r for r in main if r.group == "stack"]
    assert [(r.variant, r.np, r.backend, r.python) for r in stack] == 2 * [
        ("keras,hvdtrain", 1, None, other),
        ("hvdtrain", 2, "gloo", other),
        ("hvdtrain", 2, "mpi", other),
    ]
    groups = [r.group for r in main]  # this stack first in round 1, the other in round 2
    assert groups == ["main"] * 9 + ["stack"] * 6 + ["main"] * 9
    assert not any(r.python for r in main if r.group == "main")
    # TF_USE_LEGACY_KERAS follows the other stack's TensorFlow (here this one's, >= 2.16)
    assert args.compare_tensorflow.startswith("2.")
    assert {r.env["TF_USE_LEGACY_KERAS"] for r in stack} == {"1"}


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--models", "resnet"], "--models"),
        (["--batch-sizes", "0"], "--batch-sizes"),
        (["--backends", "nccl"], "--backends"),
        (["-np", "1"], "-np"),
        (["--bogus"], "unrecognized"),
        (["--compare-python", "/nonexistent/bin/python"], "--compare-python"),
        (["--compare-python", "/bin/sh"], "horovodrun beside it"),  # not an environment's
    ],
)
def test_bad_options_are_one_clear_error(argv, match):
    from hvdtrain.bench.cli import parse_args

    with pytest.raises(HvdtrainError, match=match):
        parse_args(argv)


def test_launch_commands_per_variant():
    from hvdtrain.bench.runner import Run, launch

    env = {"PATH": "/usr/bin"}
    py = "/venv/bin/python"
    [(argv, extra)] = launch(Run("a", "hvdtrain", 1, None, ("--models", "mlp")), py, env, 1000)
    assert argv == [py, "-m", "hvdtrain.bench.workers", "--variant", "hvdtrain", "--models", "mlp"]
    assert extra == {"HVDBENCH_LOCAL_RANK": "0"}
    [(argv, extra)] = launch(Run("b", "hvdtrain", 2, "mpi"), py, env, 1000)
    assert argv[:6] == ["/venv/bin/horovodrun", "--mpi", "-np", "2", "-H", "localhost:2"]
    assert extra["PATH"].startswith("/venv/bin")  # hvdtrain-run's own command builder
    assert extra.get("TF_USE_LEGACY_KERAS") == "1"  # Keras 2 for tf.keras on TF >= 2.16
    other = Run("b2", "hvdtrain", 2, "mpi", env={"TF_USE_LEGACY_KERAS": "0"})  # TF 2.15's
    [(argv, extra)] = launch(other, "/old/bin/python", env, 1000)
    assert argv[0] == "/old/bin/horovodrun" and "TF_USE_LEGACY_KERAS" not in extra
    [(argv, _)] = launch(Run("c", "baseline", 2, "gloo"), py, env, 1000)
    assert argv[:6] == ["/venv/bin/horovodrun", "-np", "2", "-H", "localhost:2", "--gloo"]
    procs = launch(Run("d", "mwms", 2, None), py, env, 1000, ports=[5001, 5002])
    assert [p[1]["HVDBENCH_LOCAL_RANK"] for p in procs] == ["0", "1"]
    configs = [json.loads(p[1]["TF_CONFIG"]) for p in procs]
    assert configs[1] == {
        "cluster": {"worker": ["localhost:5001", "localhost:5002"]},
        "task": {"type": "worker", "index": 1},
    }
    [(argv, _)] = launch(Run("e", "allreduce", 2, "gloo", ("--sizes", "4096")), py, env, 1000)
    assert "hvdtrain.bench.allreduce" in argv and "--variant" not in argv
    [(argv, _)] = launch(Run("f", "floor", 2, "mpi", ("--exchange", "mpi")), py, env, 1000)
    assert argv[:2] == ["/venv/bin/horovodrun", "--mpi"]
    assert argv[-5:] == [py, "-m", "hvdtrain.bench.floor", "--exchange", "mpi"]
    procs = launch(Run("f2", "floor", 2, "independent", ("--exchange", "none")), py, env, 1000)
    assert [p[1]["HVDBENCH_LOCAL_RANK"] for p in procs] == ["0", "1"]
    assert procs[0][0] == [py, "-m", "hvdtrain.bench.floor", "--exchange", "none"]
    procs = launch(Run("f", "hvdtrain", 2, "independent", ("--models", "mlp")), py, env, 1000)
    assert [p[0][:3] for p in procs] == [[py, "-m", "hvdtrain.bench.workers"]] * 2  # no launcher
    assert [p[1] for p in procs] == [{"HVDBENCH_LOCAL_RANK": "0"}, {"HVDBENCH_LOCAL_RANK": "1"}]


def test_each_rank_gets_its_own_cores():
    from hvdtrain.bench.workers import local_rank_from_env
    from hvdtrain.runtime.tuning import bind_to_cores

    assert bind_to_cores(0, 1, {0, 1}) == {0}
    assert bind_to_cores(1, 1, {0, 1}) == {1}
    assert bind_to_cores(2, 1, {0, 1}) == {0}  # more ranks than cores: wrap around
    assert bind_to_cores(1, 2, {4, 5, 6, 7}) == {6, 7}
    assert local_rank_from_env({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == 1
    assert local_rank_from_env({"HOROVOD_LOCAL_RANK": "3"}) == 3
    assert local_rank_from_env({}) == 0


def test_projection_follows_the_ring_model_and_the_paper():
    from hvdtrain.bench import project

    assert project.ring_allreduce_seconds(1e9, 1, 1e9) == 0
    assert project.ring_allreduce_seconds(1e9, 2, 1e9) == pytest.approx(1.0)
    assert project.ring_allreduce_seconds(1e9, 512, 1e9) == pytest.approx(2 * 511 / 512)
    assert project.efficiency(1.0, 1e9, 2, 1e9) == pytest.approx(0.5)
    for row in project.paper_check():
        assert 0.80 <= row["predicted"][128] <= 0.92  # published: 0.88-0.90
    rows = project.project(project.default_workloads(0.1, 1.2e6))
    assert {r["bandwidth_gbit"] for r in rows} == {25, 100}
    for r in rows:
        effs = [r["efficiency"][n] for n in sorted(r["efficiency"])]
        assert effs == sorted(effs, reverse=True)  # more GPUs, never better


def test_bus_bandwidth_is_nccl_tests_definition():
    from hvdtrain.bench.allreduce import bus_bandwidth

    assert bus_bandwidth(1000, 1.0, 4) == (1000, 1500)
    assert bus_bandwidth(1000, 0.5, 1) == (2000, 2000)


def _result(variant, np, backend, sps, label="", model="mlp", batch=64):
    return {
        "variant": variant,
        "label": label,
        "np": np,
        "backend": backend,
        "model": model,
        "batch_size": batch,
        "samples_per_sec": sps,
        "step_ms": 1.0,
    }


def _report(summary, rounds):
    """What `markdown` reads: a summary with the run's config and environment around it."""
    return {
        **summary,
        "config": {"np": 2, "repeats": 5, "rounds": rounds},
        "environment": {"platform": "x", "cpus": 2},
        "machine_at_start": {"load_average": [0.1, 0.1, 0.1]},
        "created": "now",
        "command": "python -m hvdtrain.bench",
        "runs": [],
        "projection": {"rows": [], "paper_check": []},
    }


def test_summary_efficiency_ratios_and_targets():
    from hvdtrain.bench.render import markdown
    from hvdtrain.bench.report import summarize

    results = [
        _result("keras", 1, None, 1000, "plain"),
        _result("keras", 1, None, 1000, "same compile options"),
        _result("hvdtrain", 1, None, 1000),
        _result("hvdtrain", 2, "mpi", 1900),
        _result("hvdtrain-keras3", 1, None, 900),
        _result("hvdtrain-keras3", 2, "mpi", 1710),
        _result("baseline", 1, None, 900),
        _result("baseline", 2, "mpi", 1000),
        _result("mwms", 1, None, 400),
        _result("mwms", 2, "grpc", 400),
    ]
    records = [{"group": "main", "results": results}]
    s = summarize(records, 2, default_backend="mpi")
    [row] = s["comparison"]
    assert row["hvdtrain_efficiency"] == pytest.approx(0.95)
    assert row["baseline_efficiency"] == pytest.approx(1000 / 1800)
    assert row["vs_baseline"] == pytest.approx(1.9)
    assert row["vs_mwms"] == pytest.approx(4.75)
    assert row["vs_keras"] == pytest.approx(1.0)
    assert row["keras3_vs_keras2_n"] == pytest.approx(0.9)
    assert row["keras3_efficiency"] == pytest.approx(0.95)
    met = {t["target"]: t["met"] for t in s["targets"]}
    assert met["MLP scaling efficiency"]  # 0.95 >= 0.80
    assert met["MLP hvdtrain / baseline (every batch, both backends)"] is False  # 1.9 < 2
    assert met["convnet scaling efficiency"] is None  # not measured
    assert met["MLP scaling efficiency, batch 128"] is None
    # Against a machine's ceiling: the share of it reached, and whether it is too low.
    ceiling = [{"model": "mlp", "batch_size": 64, "ceiling": 0.75}]
    [mlp] = [
        t
        for t in summarize(records, 2, "mpi")["targets"]
        if t["target"] == "MLP scaling efficiency"
    ]
    assert mlp["of_ceiling"] is None and not mlp["ceiling_too_low"]
    from hvdtrain.bench.report import _targets

    [mlp] = [
        t
        for t in _targets(s["comparison"], "mpi", ceiling)
        if t["target"] == "MLP scaling efficiency"
    ]
    assert mlp["of_ceiling"] == pytest.approx(0.95 / 0.75) and mlp["ceiling_too_low"]
    data = _report(s, rounds=1)
    assert "| mlp | 64 | mpi |" in markdown(data)
    assert data["stacks"] is None and "Old and new stack" not in markdown(data)
    assert "| mlp | 64 | mpi | 900 | 1,000 | 0.90 | 1,710 | 1,900 | 0.90 | 0.95 | 1.71x |" in (
        markdown(data)
    )


def test_log_results_get_every_process_cpu_so_the_ceiling_is_not_noise(tmp_path):
    from hvdtrain.bench.runner import read_log
    from hvdtrain.bench.workers import CPU_MARKER, MARKER

    def result(np):
        return {
            "variant": "hvdtrain", "label": "", "np": np, "model": "mlp", "batch_size": 64,
            "steps": 100, "window_seconds": [1.0, 1.0, 1.0], "samples_per_sec": 1.0,
            "machine_busy_seconds": [2.0, 2.0, 2.0],
        }  # fmt: skip

    def cpu(rank):
        return {"rank": rank, "key": "hvdtrain/mlp/64/", "cpu": [1.0, 1.0, 1.0]}

    # Two unconnected processes (np 1 each) on two busy cores: nobody else on the machine.
    log = tmp_path / "ceiling.log"
    lines = [MARKER + json.dumps(result(1)), CPU_MARKER + json.dumps(cpu(0))]
    lines += [MARKER + json.dumps(result(1)), CPU_MARKER + json.dumps(cpu(1))]
    log.write_text("\n".join(lines) + "\n")
    results = read_log(log)
    assert len(results) == 2
    for r in results:
        assert r["external_cores"] == [0.0, 0.0, 0.0] and not r["noisy"]
        assert r["samples_per_sec"] == 64 * 100 / 1.0
    # One 2-rank job whose ranks used 1.5 of the 2 busy cores: 0.5 core was someone else's.
    log = tmp_path / "job.log"
    busy = {**result(2), "machine_busy_seconds": [2.0, 2.0, 2.0]}
    lines = [MARKER + json.dumps(busy)]
    lines += [CPU_MARKER + json.dumps({**cpu(r), "cpu": [0.75] * 3}) for r in (0, 1)]
    log.write_text("\n".join(lines) + "\n")
    [r] = read_log(log)
    assert r["external_cores"] == [0.5, 0.5, 0.5] and r["noisy"]


@pytest.mark.parametrize(
    "names",
    [
        ["DistributedAdam_Allreduce/cond/HorovodAllreduce_grads_0", "HorovodAllreduce_grads_1_0"],
        ["while/cond/hvdtrain.gradients_1of2", "while/cond/hvdtrain.gradients_2of2"],
    ],
    ids=["keras2", "keras3"],
)
def test_timeline_summary_reads_both_keras_gradient_names(names):
    """Per step (every 10 ms): both gradients submitted 1 ms apart, negotiated and reduced in
    one response that ends 3 ms after the last one was submitted."""
    from hvdtrain.bench.timeline import summarize_timeline

    events = [{"ph": "M", "name": "process_name", "pid": p, "args": {"name": n}}
              for p, n in enumerate(names, 1)]  # fmt: skip
    for step in range(8):
        t = step * 10_000
        for pid in (1, 2):
            submit = t + (pid - 1) * 1_000
            events += [
                {"ph": "B", "pid": pid, "name": "NEGOTIATE_ALLREDUCE", "ts": submit},
                {"ph": "E", "pid": pid, "ts": t + 1_500},
                {"ph": "B", "pid": pid, "name": "ALLREDUCE", "ts": t + 1_600},
                {"ph": "E", "pid": pid, "ts": t + 4_000},
            ]
    summary = summarize_timeline(json.dumps(events), skip_steps=2)
    assert summary["tensors"] == 2 and summary["responses"] == 1
    assert summary["period"] == 10 and summary["after_last_gradient"] == 3


def test_thread_groups_split_a_process_cpu_time_by_thread():
    from hvdtrain.bench.workers import thread_cpu_seconds, thread_groups

    before = {1: ("python", 1.0), 2: ("tf_Compute", 2.0), 3: ("python", 0.5), 4: ("x", 0.0)}
    after = {1: ("python", 1.5), 2: ("tf_Compute", 4.0), 3: ("python", 0.75), 4: ("x", 0.1),
             5: ("tf_Compute", 0.2)}  # fmt: skip
    # 1 is the main thread, 3 one Horovod started; 5 began in the window
    groups = thread_groups(before, after, horovod_tids={3, 5}, main_tid=1)
    assert groups == {"main": 0.5, "tensorflow": 2.2, "horovod": 0.25, "other": 0.1}
    mine = thread_cpu_seconds()  # this process, for real
    assert os.getpid() in mine and all(seconds >= 0 for _, seconds in mine.values())


def test_old_and_new_stack_side_by_side():
    from hvdtrain.bench.render import markdown
    from hvdtrain.bench.report import summarize

    def on(stack, results):
        for r in results:
            r["stack"] = {"python": stack[0], "tensorflow": stack[1]}
        return results

    new = on(("3.13.0", "2.21.0"), [
        _result("keras", 1, None, 1100, "same compile options"),
        _result("keras", 1, None, 900, "plain"),
        _result("hvdtrain", 1, None, 1000),
        _result("hvdtrain", 2, "mpi", 1600),
        _result("hvdtrain", 2, "gloo", 1200),
        _result("baseline", 1, None, 500),
    ])  # fmt: skip
    old = on(("3.11.7", "2.15.1"), [
        _result("keras", 1, None, 1000, "same compile options"),
        _result("hvdtrain", 1, None, 800),
        _result("hvdtrain", 2, "mpi", 1440),
    ])  # fmt: skip
    round2 = on(("3.11.7", "2.15.1"), [_result("hvdtrain", 1, None, 1200)])
    records = [
        {"group": "main", "results": new},
        {"group": "stack", "results": old},
        {"group": "stack", "results": round2},
    ]
    s = summarize(records, 2, default_backend="mpi")
    stacks = s["stacks"]
    assert stacks["this"] == "TF 2.21.0, Python 3.13.0"
    assert stacks["other"] == "TF 2.15.1, Python 3.11.7"
    keras, one, two = stacks["rows"]
    assert (keras["this"], keras["other"], keras["ratio"]) == (1100, 1000, 1.1)
    assert (one["this"], one["other"]) == (1000, 1000)  # the other's median over 2 rounds
    assert (two["this"], two["other"]) == (1600, 1440)  # MPI, hvdtrain-run's default
    assert two["efficiency_this"] == pytest.approx(0.8)
    assert two["efficiency_other"] == pytest.approx(0.72)
    assert len(s["figures"]) == 6  # the other stack's figures stay out of this one's tables
    data = _report(s, rounds=2)
    md = markdown(data)
    assert "This stack: TF 2.21.0, Python 3.13.0; the other: TF 2.15.1, Python 3.11.7" in md
    assert "| mlp | 64 | hvdtrain, -np 2 (mpi) | 1,600 | 1,440 | 1.11 | 0.80 | 0.72 |" in md


def test_floor_bounds_the_step_by_the_wait_and_the_transfer():
    from hvdtrain.bench.floor import JOBS, decompose, markdown

    ms = {"alone": 2.0, "side-by-side": 2.1, "copy": 2.4, "sync": 2.8, "mpi": 3.4, "horovod": 3.2}
    assert [job for job, *_ in JOBS] == list(ms)
    inside = {"copy": 0.1, "sync": 0.3, "sync_together": 0.004, "mpi": 0.9,
              "mpi_together": 0.4, "scale": 0.05}  # fmt: skip
    parts = decompose(ms, inside)
    assert parts["bound_step_ms"] == pytest.approx(2.8)  # side by side + wait + together
    assert parts["bound_efficiency"] == pytest.approx(2.0 / 2.8)
    assert parts["bare_step_ms"] == pytest.approx(3.05)  # side by side + call + / n
    assert parts["horovod_added_ms"] == pytest.approx(1.1)
    assert parts["efficiency"]["horovod"] == pytest.approx(2.0 / 3.2)
    assert parts["ceiling"] == pytest.approx(2.0 / 2.1)
    text = markdown(ms, parts)
    assert "| horovod | 3.20 | 0.62 | 0.66 |" in text and "at the lower bound 0.71" in text
    assert "| the same 4 bytes, the ranks arriving together | 0.004 |" in text
    assert parts["local"] == {}

    # A local SGD job: its local steps (the step less the exchange / H) and its bound
    ms["local-16-gloo"] = 2.3
    inside["local-16-gloo"] = {"exchange": 3.2, "together": 1.6, "together_cpu": 0.8,
                               "overlap_cpu": 3.2}  # fmt: skip
    parts = decompose(ms, inside)
    local = parts["local"]["local-16-gloo"]
    assert local["local_step"] == pytest.approx(2.1)  # 2.3 - 3.2 / 16
    assert local["bound_of_ceiling"] == pytest.approx(2.1 / 2.2)  # the exchange together / 16
    assert local["overlap_bound_of_ceiling"] == pytest.approx(2.1 / 2.15)  # its CPU / 16
    assert local["overlapped_bound_of_ceiling"] == pytest.approx(2.1 / 2.3)  # the overlap's
    assert "| local-16-gloo | 3.20 | 1.60 | 0.80 | 2.100 | 0.91 | 0.95 | 0.98 | 3.20 | 0.91 |" in (
        markdown(ms, parts)
    )


def test_floor_sync_axis_adds_local_sgd_jobs_per_backend():
    from hvdtrain.bench.floor import sync_jobs

    assert sync_jobs([4, 16], ["mpi", "gloo"]) == (
        ("local-4", "local-4", 2, "mpi"),
        ("local-16", "local-16", 2, "mpi"),
        ("horovod-gloo", "horovod", 2, "gloo"),
        ("local-4-gloo", "local-4", 2, "gloo"),
        ("local-16-gloo", "local-16", 2, "gloo"),
    )


@pytest.mark.slow
@pytest.mark.alone
def test_floor_quick_run_times_every_job(tmp_path):
    proc = _run_quick("hvdtrain.bench.floor", tmp_path, "--sync", "4", "--backends", "mpi,gloo")
    data = json.loads((tmp_path / "floor.json").read_text())
    assert list(data["ms_per_step"]) == [
        "alone",
        "side-by-side",
        "copy",
        "sync",
        "mpi",
        "horovod",
        "local-4",
        "horovod-gloo",
        "local-4-gloo",
    ]
    assert 0 < data["of_ceiling"]["local-4"] < 2
    assert all(v > 0 for v in data["ms_per_step"].values())
    # Both unconnected processes and every -np 2 job ran (the logs hold each rank's command)
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == sorted(f"floor-{job}-r0.log" for job in data["ms_per_step"])
    assert "| horovod |" in (tmp_path / "floor.md").read_text()
    inside = data["inside_ms"]
    # Timed on both ranks; the gradient's allreduce moves and sums more than 4 bytes
    assert len(data["inside_rounds"]["mpi"][0]["call_by_rank"]) == 2
    assert inside["mpi_together"] > inside["sync_together"] > 0
    assert inside["scale"] > 0 and inside["copy"] > 0
    # The exchange of local SGD timed apart, on both ranks, in the loop and together
    for job in ("local-4", "local-4-gloo"):
        local = data["local"][job]
        assert local["exchange"] > 0 and local["together"] > 0 and local["together_cpu"] > 0
        assert local["overlap_cpu"] > 0
        assert len(data["inside_rounds"][job][0]["exchange_by_rank"]) == 2
    assert "ms per step" in proc.stderr  # progress as each job ends


def test_floor_rejects_bad_counts_before_starting(capsys):
    from hvdtrain.bench import floor

    for argv in (["--rounds", "0"], ["--exchange", "none", "--calls", "0"]):
        with pytest.raises(SystemExit) as done:
            floor.main(argv)
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert "Invalid value for `--" in err and "Traceback" not in err


def test_the_loading_benchmark_compares_each_job_with_plain_keras():
    from hvdtrain.bench import loading

    assert loading.command("keras-1", 1, False)[1:4] == ["-m", "hvdtrain.bench.loading", "--job"]
    assert loading.command("pydataset-2", 2, True)[:6] == ["horovodrun", "--gloo", "-np", "2",
                                                         "-H", "localhost:2"]  # fmt: skip
    assert loading.figure([100.0, 8.0, 10.0, 12.0]) == 10.0  # the first epoch left out
    table = loading.markdown({"keras-1": [10, 10], "pydataset-2": [12, 13], "arrays-2": [20, 20]},
                             "python -m hvdtrain.bench.loading")  # fmt: skip
    assert "| pydataset-2 | 12, 13 | 12 | 1.25 |" in table


def test_projection_of_exchanging_less_moves_the_weights_every_h_steps():
    from hvdtrain.bench.project import GBIT, efficiency, exchange_less

    work = [{"name": "w", "params": 1e6, "compute_seconds": 0.01}]
    rows = exchange_less(work, every=(16,), bandwidths=(25 * GBIT,), gpus=(8,))
    step, h16, overlapped = rows
    assert step["mode"] == "step" and h16["mode"] == "H=16"
    assert overlapped["mode"] == "H=16, overlapped"
    # 16 steps of 10 ms hide the 2.24 ms exchange whole; a 1 s exchange gets 0.16 of 1 s
    assert overlapped["efficiency"][8] == 1.0
    assert efficiency(0.01, 8e9 / 14, 8, 1e9, 16, overlap=True) == pytest.approx(0.16)
    assert step["efficiency"][8] == pytest.approx(efficiency(0.01, 4e6, 8, 25 * GBIT))
    # the weights, 4 MB every 16 steps (the optimizer's state at epoch ends only)
    assert h16["efficiency"][8] == pytest.approx(efficiency(0.01, 4e6, 8, 25 * GBIT, 16))
    assert h16["efficiency"][8] > step["efficiency"][8]


def test_accuracy_study_plans_every_mode_and_h_and_tables_the_seeds():
    from hvdtrain.bench.accuracy import plan, table

    assert plan([4, 16]) == [
        ("step", []),
        ("local H=4", ["--sync", "local", "--sync-every", "4"]),
        ("local H=16", ["--sync", "local", "--sync-every", "16"]),
        ("diloco H=4", ["--sync", "diloco", "--sync-every", "4"]),
        ("diloco H=16", ["--sync", "diloco", "--sync-every", "16"]),
    ]
    assert plan([16], ["diloco"], [("1", "0.5")]) == [
        ("step", []),
        ("diloco H=16 outer 1/0.5", ["--sync", "diloco", "--sync-every", "16", "--outer-lr",
                                     "1", "--outer-momentum", "0.5"]),
    ]  # fmt: skip
    assert plan([16], ["local"], overlaps=(False, True)) == [
        ("step", []),
        ("local H=16", ["--sync", "local", "--sync-every", "16"]),
        ("local H=16 overlapped", ["--sync", "local", "--sync-every", "16", "--sync-overlap"]),
    ]
    assert plan([16], ["diloco"], balances=(False, True))[1:] == [
        ("diloco H=16", ["--sync", "diloco", "--sync-every", "16"]),
        ("diloco H=16 balanced", ["--sync", "diloco", "--sync-every", "16", "--sync-balance"]),
    ]
    assert plan([64], ["local"], overlaps=(True,), halves=(False, True))[1:] == [
        ("local H=64 overlapped", ["--sync", "local", "--sync-every", "64", "--sync-overlap"]),
        ("local H=64 overlapped fp16", ["--sync", "local", "--sync-every", "64",
                                        "--sync-overlap", "--fp16-allreduce"]),
    ]  # fmt: skip
    from hvdtrain.bench.accuracy import _outers
    from hvdtrain.errors import HvdtrainError

    assert _outers("0.7:0.9,1:0") == [("0.7", "0.9"), ("1", "0")] and _outers("") == []
    for bad in ("1", "1:1", "0:0.5", "a:b", "1:0.5:2"):
        with pytest.raises(HvdtrainError, match="--outer"):
            _outers(bad)
    text = table({"step": [0.97, 0.98], "local H=4": [0.975, 0.965]})
    assert "| step | 2 | 97.50 % | 1.00 |  |" in text
    assert "| local H=4 | 2 | 97.00 % | 1.00 | -0.50 |" in text


def test_accuracy_study_reuses_a_finished_run_made_with_the_same_arguments(tmp_path):
    from hvdtrain.bench.accuracy import _done

    metrics = str(tmp_path / "local_H=4-seed0.json")
    args = ["-m", "hvdtrain.mnist", "--seed", "0", "--sync", "local", "--sync-every", "4"]
    assert _done(metrics, args) is None  # never ran
    (tmp_path / "local_H=4-seed0.json").write_text(json.dumps({"status": "finished"}))
    assert _done(metrics, args) is None  # no record of its arguments: run again
    (tmp_path / "local_H=4-seed0.json.args").write_text(json.dumps(args))
    assert _done(metrics, args) == {"status": "finished"}
    assert _done(metrics, args[:-1] + ["16"]) is None  # another H
    (tmp_path / "local_H=4-seed0.json").write_text(json.dumps({"status": "stopped"}))
    assert _done(metrics, args) is None  # killed or stopped: run again
    (tmp_path / "local_H=4-seed0.json").write_text("{")
    assert _done(metrics, args) is None  # cut short


def test_modes_benchmark_plans_the_ceiling_first_and_reads_rank_0s_epoch_lines():
    from hvdtrain.bench.modes import CEILING, epoch_rates, markdown, plan, ratios, steady

    jobs = plan([16], ["mpi"], ["local"])
    assert jobs == [
        (CEILING, None, []),
        ("step mpi", "mpi", []),
        ("local H=16 mpi", "mpi", ["--sync", "local", "--sync-every", "16"]),
        ("local H=16 overlap mpi", "mpi", ["--sync", "local", "--sync-every", "16",
                                           "--sync-overlap"]),
    ]  # fmt: skip
    assert len(plan([4, 16], ["mpi", "gloo"], overlap=False)) == 1 + 2 * (1 + 2 * 2)
    balanced = plan([16], ["gloo"], ["diloco"], balance=True)[2:]
    assert [label for label, _, _ in balanced] == [
        "diloco H=16 gloo", "diloco H=16 overlap gloo", "diloco H=16 balanced gloo",
        "diloco H=16 overlap balanced gloo"]  # fmt: skip
    assert balanced[3][2][-2:] == ["--sync-overlap", "--sync-balance"]
    text = (
        "[1,0]<stderr>:hvdtrain: epoch 1/3: 452 steps after the first 16 in 4.0 s, 14,585 "
        "samples/s; loss 0.2568\n[1,0]<stderr>:hvdtrain: epoch 1/3: step 100/468 (21%), "
        "9,000 samples/s, ETA 3 s\nhvdtrain: epoch 2/3: 468 steps in 3.2 s, 18,858 samples/s;"
        " loss 0.08\nhvdtrain: epoch 3/3: 468 steps in 3.0 s, 20,000 samples/s; loss 0.07\n"
    )  # a progress line within an epoch is not an epoch's figure
    assert epoch_rates(text) == {1: 14585.0, 2: 18858.0, 3: 20000.0}
    assert steady(epoch_rates(text)) == 19429.0  # the first epoch left out
    assert steady({1: 5.0}) == 5.0 and steady({}) is None
    rounds = [{CEILING: 40000.0, "step mpi": 30000.0}, {CEILING: 50000.0, "step mpi": 40000.0}]
    assert ratios(rounds) == {"step mpi": [0.75, 0.8]}
    table = markdown(rounds)
    assert "| step mpi | 35,000 | 0.75, 0.80 | 0.78 |" in table
    assert "| ceiling | 45,000 |  |  |" in table


@pytest.mark.parametrize(
    "argv, match",
    [(["--modes", "step"], "--modes"), (["--backends", "nccl"], "--backends"),
     (["--every", "0"], "--every"), (["--rounds", "0"], "--rounds"),
     (["--samples", "100"], "--samples"), (["--data-dir", "/nonexistent"], "--data-dir")],
)  # fmt: skip
def test_modes_benchmark_rejects_bad_options_before_starting(argv, match, capsys):
    from hvdtrain.bench import modes

    with pytest.raises(SystemExit) as done:
        modes.main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and f"Invalid value for `{match}`" in err
    assert "Traceback" not in err


def test_links_benchmark_plans_sizes_and_projects_each_job():
    """bench.links' pure parts: the jobs of a cell (the ceiling first), an epoch's samples
    in whole rounds, the bytes per sample from the metrics JSON, and the projection with the
    epoch's shape: the whole exchange at its end (the weights: no checkpoint follows, so not
    Adam's moments), in-flight rounds that wait only for what their steps did not cover."""
    from hvdtrain.bench.links import (
        PARAMS,
        markdown,
        plan,
        projected,
        samples_for,
        wire_bytes_per_sample,
    )

    labels = [label for label, _ in plan([16], ["local"])]
    assert labels == ["ceiling", "step", "step fp16", "local H=16", "local H=16 overlap",
                      "local auto", "local auto overlap", "local auto overlap fp16"]  # fmt: skip
    assert dict(plan([16], ["local"]))["local auto"][-1] == "--no-sync-overlap"
    assert dict(plan([16], ["local"]))["local auto overlap"][-3:] == ["--sync-every", "auto",
                                                                      "--sync-overlap"]  # fmt: skip
    assert samples_for(1e6, 10, 2, 16) == 60_000 // 2048 * 2048  # capped, whole rounds
    assert samples_for(10, 1, 2, 256) == 2 * 64 * 256  # one round at least
    assert samples_for(1e6, 10, 2, 256) == 60_000 // 2048 * 2048  # and a shorter last one
    assert wire_bytes_per_sample({"mode": "step"}, "mlp", 2, 0, 0) == PARAMS["mlp"] * 4 / 64
    sync = {"mode": "local", "bytes_sent": 1000}
    assert wire_bytes_per_sample(sync, "mlp", 2, 100, 2) == pytest.approx(10.0)

    step, mb = 0.001, PARAMS["mlp"] * 4 / (100e6 / 8)  # a step; the weights over 100 Mbit/s
    rates = [64 / step] * 2  # each host's samples/s alone
    samples = 2 * 64 * 64 * 4  # 4 rounds of H=64 an epoch
    assert projected("step", "mlp", 100, rates, samples) == pytest.approx(step / (step + mb))
    blocking = projected("local H=64", "mlp", 100, rates, samples)
    assert blocking == pytest.approx(256 * step / (256 * step + 3 * mb + mb))
    overlapped = projected("local H=64 overlap", "mlp", 100, rates, samples)
    assert mb > 64 * step  # 86 ms against a round's 64: 22 ms a round not hidden
    assert overlapped == pytest.approx(256 * step / (256 * step + 3 * (mb - 0.064) + mb))
    assert projected("local H=64 overlap fp16", "mlp", 100, rates, samples) > overlapped
    one_round = projected("local H=256 overlap", "mlp", 100, rates, samples)
    assert one_round == projected("local H=256", "mlp", 100, rates, samples)  # nothing hidden
    # An epoch of a round and a shorter one: an exchange at its 256th step and its last.
    longer = projected("local H=256", "mlp", 100, rates, 2 * 64 * 464)
    assert longer == pytest.approx(464 * step / (464 * step + 2 * mb))
    # Hosts of unequal pace: the job steps at the slower one's, of their summed ceiling.
    slow = projected("local H=256", "mlp", 100, [64 / step, 64 / (1.5 * step)], 2 * 64 * 464)
    work = 464 * 1.5 * step
    assert slow == pytest.approx(2 / 2.5 * work / (work + 2 * mb))
    # The tables give the link's own allreduce beside the model, and the hosts' pace.
    cell = {"hosts": 2, "model": "mlp", "mbit": 100, "ceiling": 100.0, "ceilings": [100.0],
            "hosts_rates": [[60.0, 40.0]], "wire": {"float32": {"measured": 0.09,
                                                                "modelled": 0.086}},
            "jobs": [{"label": "step", "rate": 10.0, "of_ceiling": 0.1, "predicted": 0.1,
                      "bytes_per_sample": 5.0}]}  # fmt: skip
    md = markdown([cell])
    assert "| the weights' allreduce, ms: measured (modelled) | 90.0 (86.0) |" in md
    assert "| hosts' pace: the slowest x hosts, of the ceiling: median | 0.80 |" in md


def test_links_benchmark_needs_the_whole_mnist_but_for_its_smoke_run(capsys):
    """Without --data-dir its jobs trained the embedded 4,500 digits, 35 steps an epoch, so
    every H past that exchanged at the epoch's end: one line, exit 2, before any host."""
    from hvdtrain.bench import links

    with pytest.raises(SystemExit) as e:
        links.main(["--hosts", "2", "--links", "1000", "--models", "mlp"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Invalid value for `--data-dir`: received None" in err and "--quick" in err, err
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.alone  # its ceiling is the hosts' one-core runs side by side
def test_links_quick_run_measures_the_jobs_over_a_shaped_link(tmp_path):
    from hvdtrain.bench.netns import cannot_make_namespaces

    why = cannot_make_namespaces()
    if why:
        pytest.skip(f"namespace hosts: {why}")
    _run_quick("hvdtrain.bench.links", tmp_path)
    [cell] = json.loads((tmp_path / "links.json").read_text())["cells"]
    assert (cell["hosts"], cell["mbit"], cell["model"]) == (2, 100, "mlp") and cell["ceiling"] > 0
    # The link's own allreduce of the weights: the wire the projection models (5-13 % over
    # it here), not the CPU.
    wire = cell["wire"]["float32"]
    assert 0.8 < wire["measured"] / wire["modelled"] < 2.0, wire
    assert all(len(rates) == 2 for rates in cell["hosts_rates"])
    jobs = {j["label"]: j for j in cell["jobs"]}
    assert not [j for j in jobs.values() if "error" in j], jobs
    assert jobs["local auto overlap"]["auto"]["chosen"] in (16, 32, 64, 128, 256)
    # 100 Mbit/s: the gradient every step is the slowest; fp16 halves its bytes
    assert jobs["step"]["rate"] < jobs["local H=16"]["rate"]
    assert jobs["step fp16"]["bytes_per_sample"] == pytest.approx(
        jobs["step"]["bytes_per_sample"] / 2
    )
    assert "| local H=16 overlap |" in (tmp_path / "links.md").read_text()
