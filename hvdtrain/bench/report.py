"""The benchmark's figures from its jobs' records (`hvdtrain.bench.runner.execute`):
efficiencies, ratios, targets, the ceiling, the tuning, sweep and profile tables (pure).
`hvdtrain.bench.render` draws them as Markdown and PNG."""

import os
import statistics

from hvdtrain.bench import project as project_mod
from hvdtrain.bench.timeline import summarize_timeline

__all__ = ["summarize", "projection", "find_figure", "TARGETS"]

# (name, model, what, threshold, per-rank batch): checked at -np N. The efficiencies hold
# against a machine whose ceiling (N unconnected one-core runs side by side) is at least
# CEILING_NEEDED; below it, the share of the ceiling reached says more than the figure.
TARGETS = (
    ("MLP scaling efficiency", "mlp", "efficiency", 0.80, 64),
    ("MLP scaling efficiency, batch 128", "mlp", "efficiency", 0.85, 128),
    ("MLP hvdtrain / baseline (every batch, both backends)", "mlp", "min_vs_baseline", 2.0, 64),
    ("MLP hvdtrain / MultiWorkerMirrored", "mlp", "vs_mwms", 4.0, 64),
    ("convnet scaling efficiency", "convnet", "efficiency", 0.95, 64),
    (
        "convnet hvdtrain / baseline (every batch, both backends)",
        "convnet",
        "min_vs_baseline",
        1.0,
        64,
    ),
    ("MLP hvdtrain -np 1 / Keras fit (same compile options)", "mlp", "vs_keras", 1.0, 64),
    ("convnet hvdtrain -np 1 / Keras fit (same compile options)", "convnet", "vs_keras", 1.0, 64),
)
CEILING_NEEDED = 0.95
TARGET_BATCH = 64
KERAS_PLAIN, KERAS_SAME = "plain", "same compile options"


def _median(values):
    return statistics.median(values) if values else None


def _figures(records):
    """Main-group results merged over rounds: one figure per (variant, label, np, backend,
    model, batch), its samples/s the median over rounds."""
    groups = {}
    for rec in records:
        if rec["group"] != "main":
            continue
        for r in rec["results"]:
            key = (
                r["variant"],
                r.get("label", ""),
                r["np"],
                r["backend"],
                r["model"],
                r["batch_size"],
            )
            groups.setdefault(key, []).append(r)
    figures = []
    for (variant, label, np, backend, model, batch), rs in groups.items():
        sps = [r["samples_per_sec"] for r in rs]
        figures.append(
            {
                "variant": variant,
                "label": label,
                "np": np,
                "backend": backend,
                "model": model,
                "batch_size": batch,
                "samples_per_sec": _median(sps),
                "step_ms": _median([r["step_ms"] for r in rs]),
                "rounds": sps,
                "params": rs[0].get("params"),
            }
        )
    return figures


def _cores(records):
    """Where rank 0's core went, per step (ms, medians over windows and rounds), for
    hvdtrain's main-group figures: the wall step, each thread group's CPU time
    (`workers.thread_groups`) and the rest, in which the core was idle or taken from the
    process (by another process, the hypervisor)."""
    by = {}
    for rec in records:
        if rec["group"] != "main":
            continue
        for r in rec["results"]:
            windows = (r.get("rank_thread_seconds") or {}).get("0")
            if r["variant"] != "hvdtrain" or not windows:
                continue
            key = (r["model"], r["batch_size"], r["np"], r["backend"])
            per_step = {g: [w[g] * 1000 / r["steps"] for w in windows] for g in windows[0]}
            walls = [t * 1000 / r["steps"] for t in r["window_seconds"]]
            entry = by.setdefault(key, {"step": [], **{g: [] for g in per_step}})
            entry["step"] += walls
            for g, values in per_step.items():
                entry[g] += values
    out = []
    for (model, batch, np, backend), values in sorted(by.items(), key=lambda kv: str(kv[0])):
        row = {"model": model, "batch_size": batch, "np": np, "backend": backend}
        row.update({k: _median(v) for k, v in values.items()})
        row["rest"] = row["step"] - sum(row[g] for g in values if g != "step")
        out.append(row)
    return out


def find_figure(figures, variant, np, model, batch, backend=None, label=None):
    for f in figures:
        if (
            f["variant"] == variant
            and f["np"] == np
            and f["model"] == model
            and f["batch_size"] == batch
            and (backend is None or f["backend"] == backend)
            and (label is None or f["label"] == label)
        ):
            return f
    return None


def _ratio(a, b):
    if not a or not b or not a.get("samples_per_sec") or not b.get("samples_per_sec"):
        return None
    return a["samples_per_sec"] / b["samples_per_sec"]


def _comparison(figures, n):
    """One row per (model, batch, backend) at -np n: throughput, efficiency and ratios."""
    rows = []
    keys = sorted(
        {(f["model"], f["batch_size"]) for f in figures}, key=lambda k: (k[0] != "mlp", k)
    )
    backends = sorted({f["backend"] for f in figures if f["variant"] == "hvdtrain" and f["np"] > 1})
    for model, batch in keys:
        variants = ("hvdtrain", "hvdtrain-keras3", "baseline", "mwms")
        one = {v: find_figure(figures, v, 1, model, batch) for v in variants}
        keras_plain = find_figure(figures, "keras", 1, model, batch, label=KERAS_PLAIN)
        keras_same = find_figure(figures, "keras", 1, model, batch, label=KERAS_SAME)
        mwms = find_figure(figures, "mwms", n, model, batch)
        for backend in backends or [None]:
            hvt = find_figure(figures, "hvdtrain", n, model, batch, backend)
            base = find_figure(figures, "baseline", n, model, batch, backend)
            k3 = find_figure(figures, "hvdtrain-keras3", n, model, batch, backend)

            def eff(fig, variant, one=one):
                ratio = _ratio(fig, one[variant])
                return ratio / n if ratio else None

            rows.append(
                {
                    "model": model,
                    "batch_size": batch,
                    "backend": backend,
                    "np": n,
                    "keras_plain": _sps(keras_plain),
                    "keras_same": _sps(keras_same),
                    "hvdtrain_1": _sps(one["hvdtrain"]),
                    "hvdtrain_n": _sps(hvt),
                    "hvdtrain_efficiency": eff(hvt, "hvdtrain"),
                    "baseline_1": _sps(one["baseline"]),
                    "baseline_n": _sps(base),
                    "baseline_efficiency": eff(base, "baseline"),
                    "mwms_1": _sps(one["mwms"]),
                    "mwms_n": _sps(mwms),
                    "mwms_efficiency": eff(mwms, "mwms"),
                    "vs_baseline": _ratio(hvt, base),
                    "vs_mwms": _ratio(hvt, mwms),
                    "vs_keras": _ratio(one["hvdtrain"], keras_same),
                    "vs_keras_plain": _ratio(one["hvdtrain"], keras_plain),
                    "keras3_1": _sps(one["hvdtrain-keras3"]),
                    "keras3_n": _sps(k3),
                    "keras3_efficiency": eff(k3, "hvdtrain-keras3"),
                    "keras3_vs_keras2_1": _ratio(one["hvdtrain-keras3"], one["hvdtrain"]),
                    "keras3_vs_keras2_n": _ratio(k3, hvt),
                    "keras3_vs_baseline": _ratio(k3, base),
                }
            )
    return rows


def _sps(fig):
    return fig["samples_per_sec"] if fig else None


def _targets(rows, default_backend, ceiling=()):
    out = []
    for name, model, what, threshold, batch in TARGETS:
        at = [r for r in rows if r["model"] == model and r["batch_size"] == batch]
        if what == "min_vs_baseline":
            values = [r["vs_baseline"] for r in rows if r["model"] == model and r["vs_baseline"]]
            value, where = (min(values), "min over batches and backends") if values else (None, "")
        else:
            row = next((r for r in at if r["backend"] == default_backend), at[0] if at else None)
            key = "hvdtrain_efficiency" if what == "efficiency" else what
            value = row[key] if row else None
            where = f"batch {batch}, {row['backend']}" if row else ""
        limit = None
        if what == "efficiency":
            limit = next(
                (c["ceiling"] for c in ceiling
                 if c["model"] == model and c["batch_size"] == batch),
                None,
            )  # fmt: skip
        out.append(
            {
                "target": name,
                "threshold": threshold,
                "value": value,
                "where": where,
                "met": None if value is None else value >= threshold,
                "machine_ceiling": limit,
                # efficiency / ceiling: how much of what this machine allows was reached
                "of_ceiling": value / limit if value is not None and limit else None,
                "ceiling_too_low": limit is not None and limit < CEILING_NEEDED,
            }
        )
    return out


def _ceiling(records, figures, n):
    """The machine's own limit on scaling efficiency, per model and batch: N unconnected
    one-core runs side by side (each process's samples/s, median over its windows, then
    the mean over processes and the median over rounds) against hvdtrain at -np 1 alone.
    Shared caches, memory bandwidth and the hypervisor slow each core down when all are
    busy: no data-parallel software can scale better than this here."""
    groups = {}
    for rec in records:
        if rec["group"] == "ceiling" and rec["results"]:
            by_key = {}
            for r in rec["results"]:
                by_key.setdefault((r["model"], r["batch_size"]), []).append(r["samples_per_sec"])
            for key, values in by_key.items():
                groups.setdefault(key, []).append(sum(values) / len(values))
    rows = []
    for (model, batch), per_round in sorted(groups.items()):
        alone = find_figure(figures, "hvdtrain", 1, model, batch)
        side = _median(per_round)
        rows.append(
            {
                "model": model,
                "batch_size": batch,
                "np": n,
                "alone": _sps(alone),
                "side_by_side": side,
                "rounds": per_round,
                "ceiling": side / alone["samples_per_sec"] if alone else None,
            }
        )
    return rows


def _tuning(records, defaults):
    """One row per (knob, setting), its figure, and its ratio to the knob's default setting
    on the same -np, backend and model."""
    rows = []
    for rec in records:
        if rec["group"] != "tuning":
            continue
        r = rec["results"][0] if rec["results"] else {}
        for knob, setting in rec["tags"]:
            rows.append(
                {
                    "knob": knob,
                    "setting": setting,
                    "default": defaults.get(knob) == setting,
                    "np": rec["np"],
                    "backend": rec["backend"],
                    "model": r.get("model"),
                    "batch_size": r.get("batch_size"),
                    "samples_per_sec": r.get("samples_per_sec"),
                    "step_ms": r.get("step_ms"),
                    "noisy": r.get("noisy"),
                    "env": rec["env"],
                    "job": rec["name"],
                }
            )
    for row in rows:
        base = next(
            (
                b
                for b in rows
                if b["knob"] == row["knob"] and b["default"] and b["np"] == row["np"]
                and b["backend"] == row["backend"] and b["model"] == row["model"]
            ),
            None,
        )  # fmt: skip
        row["vs_default"] = _ratio(row, base) if base else None
    return rows


def _sweep(records):
    rows = [r for rec in records if rec["group"] == "sweep" for r in rec["results"]]
    memcpy = [r["memcpy_bytes_per_sec"] for r in rows if r.get("memcpy_bytes_per_sec")]
    return {"memcpy_bytes_per_sec": _median(memcpy), "rows": rows}


def _profiles(records, figures, sweep, gradient_bytes):
    """Where the MLP's step time goes at -np N (from each profile job's Horovod timeline),
    against hvdtrain's -np 1 step and the allreduce's own cost from the sweep; and the best
    efficiency any software could reach: compute / (compute + bare MPI allreduce)."""
    out = []
    for rec in records:
        if rec["group"] != "profile" or not rec["results"]:
            continue
        r = rec["results"][0]
        one = find_figure(figures, "hvdtrain", 1, r["model"], r["batch_size"])
        path = rec["env"].get("HOROVOD_TIMELINE")
        summary = None
        if path and os.path.isfile(path):
            with open(path) as f:
                summary = summarize_timeline(f.read())
        at = [x for x in sweep["rows"] if x["bytes"] == gradient_bytes]
        op = next((x["seconds"] * 1000 for x in at if x["backend"] == rec["backend"]), None)
        # The bare MPI_Allreduce of the gradient: the tightest upper estimate from the sweep.
        # A message of s >= g bytes costs at least what g costs, and one of s < g at least
        # s/g of it (the cost per byte only falls with size). Open MPI at times picks a slow
        # algorithm for one odd size (8 ms for the MLP's 1,077,288 bytes, 0.12 ms for 1 MiB).
        raws = [
            x["raw_mpi_seconds"] * 1000 * max(1.0, gradient_bytes / x["bytes"])
            for x in sweep["rows"]
            if x.get("raw_mpi_seconds") and gradient_bytes
        ]
        raw = min(raws) if raws else None
        row = {
            "job": rec["name"],
            "settings": dict(rec["tags"]).get("settings"),
            "backend": rec["backend"],
            "np": rec["np"],
            "step_ms": r["step_ms"],
            "step_ms_np1": one["step_ms"] if one else None,
            "timeline": summary,
            "timeline_file": path,
            "horovod_allreduce_ms": op,
            "raw_mpi_allreduce_ms": raw,
        }
        if one:
            row["overhead_ms"] = r["step_ms"] - one["step_ms"]
            if summary:
                row["outside_timeline_ms"] = row["overhead_ms"] - summary["after_last_gradient"]
            if raw:
                row["efficiency_bound"] = one["step_ms"] / (one["step_ms"] + raw)
        out.append(row)
    return out


INPUT_GOAL = 0.95  # training from files / from memory


def _input(records):
    """The input-pipeline comparison: per variant the median samples/s over the rounds."""
    by = {}
    for rec in records:
        if rec["group"] == "input":
            for r in rec["results"]:
                by.setdefault(r["variant"], []).append(r["samples_per_sec"])
    if not by:
        return None
    memory, files = _median(by.get("hvdtrain", [])), _median(by.get("hvdtrain-tfrecord", []))
    pipeline = _median(by.get("input-tfrecord", []))
    ratio = files / memory if files and memory else None
    return {
        "memory": memory,
        "files": files,
        "pipeline": pipeline,
        "rounds": by,
        "files_vs_memory": ratio,
        "pipeline_vs_training": pipeline / files if pipeline and files else None,
        "goal": INPUT_GOAL,
        "met": None if ratio is None else ratio >= INPUT_GOAL,
    }


def _stack_name(results):
    stacks = {(r.get("stack") or {}).get("tensorflow") for r in results} - {None}
    pythons = {(r.get("stack") or {}).get("python") for r in results} - {None}
    return f"TF {'/'.join(sorted(stacks)) or '?'}, Python {'/'.join(sorted(pythons)) or '?'}"


def _stacks(records, n, backend):
    """This stack against `--compare-python`'s, job for job (the same rounds, interleaved):
    Keras `fit`, hvdtrain at -np 1 and at -np n, the medians over the rounds; None when
    the run had no other stack."""
    other = [r for rec in records if rec["group"] == "stack" for r in rec["results"]]
    if not other:
        return None
    this = [r for rec in records if rec["group"] == "main" for r in rec["results"]]
    jobs = (
        ("Keras fit, -np 1", "keras", KERAS_SAME, 1, None),
        ("hvdtrain, -np 1", "hvdtrain", "", 1, None),
        (f"hvdtrain, -np {n} ({backend})", "hvdtrain", "", n, backend),
    )

    def median(results, model, batch, variant, label, np, job_backend):
        return _median(
            [
                r["samples_per_sec"]
                for r in results
                if (r["model"], r["batch_size"], r["variant"], r.get("label", ""), r["np"])
                == (model, batch, variant, label, np)
                and (job_backend is None or r["backend"] == job_backend)
            ]
        )

    rows = []
    for model, batch in sorted({(r["model"], r["batch_size"]) for r in other}):
        group = []
        for job, variant, label, np, job_backend in jobs:
            a = median(this, model, batch, variant, label, np, job_backend)
            b = median(other, model, batch, variant, label, np, job_backend)
            group.append(
                {
                    "model": model,
                    "batch_size": batch,
                    "job": job,
                    "this": a,
                    "other": b,
                    "ratio": a / b if a and b else None,
                }
            )
        _, one, many = group
        for side in ("this", "other"):
            eff = many[side] / (n * one[side]) if one[side] and many[side] else None
            many[f"efficiency_{side}"] = eff
        rows += group
    used = [r for r in this if r["variant"] in ("keras", "hvdtrain")]
    return {"this": _stack_name(used), "other": _stack_name(other), "rows": rows}


def summarize(records, n, default_backend="mpi", tuning_defaults=None, gradient_bytes=None):
    """{figures, comparison, targets, tuning, allreduce} from the job records."""
    figures = _figures(records)
    rows = _comparison(figures, n)
    sweep = _sweep(records)
    ceiling = _ceiling(records, figures, n)
    return {
        "default_backend": default_backend,
        "figures": figures,
        "comparison": rows,
        "ceiling": ceiling,
        "targets": _targets(rows, default_backend, ceiling),
        "tuning": _tuning(records, tuning_defaults or {}),
        "allreduce": sweep,
        "profile": _profiles(records, figures, sweep, gradient_bytes),
        "cores": _cores(records),
        "input": _input(records),
        "stacks": _stacks(records, n, default_backend),
    }


def projection(data):
    """The GPU-cluster projection, fed with the convnet's measured compute time (hvdtrain at
    -np 1, batch 64) when the run has it."""
    conv = next(
        (
            f
            for f in data.get("figures", [])
            if f["variant"] == "hvdtrain" and f["np"] == 1 and f["model"] == "convnet"
            and f["batch_size"] == TARGET_BATCH
        ),
        None,
    )  # fmt: skip
    params = conv["params"] if conv else 1_199_882
    compute = conv["step_ms"] / 1000 if conv else None
    rows = project_mod.project(project_mod.default_workloads(compute, params))
    return {
        "model": "step = compute + 2(n-1)/n x gradient bytes / link bandwidth; no overlap",
        "rows": rows,
        "paper_check": project_mod.paper_check(),
    }
