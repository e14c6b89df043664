"""The benchmark's figures, from the records `hvdtrain.bench.runner.execute` returns (pure).

    summarize(records, n, "mpi", TUNING_DEFAULTS, MLP_GRADIENT_BYTES)  # the keys of bench.json

Efficiency = samples/s at N / (N x samples/s of the same variant at -np 1); the machine's
ceiling = N unconnected one-core runs side by side against one alone; the targets; the
tuning table; the allreduce sweep; the profile (Horovod timelines); where rank 0's core
goes; the input pipeline; `--compare-python`'s other stack; the GPU projection. Never
imports TensorFlow (`hvdtrain.bench.report` renders them).
"""

import itertools
import os
import statistics

from hvdtrain.bench import project as project_mod
from hvdtrain.bench.timeline import summarize_timeline

__all__ = ["summarize", "projection", "figure", "TARGETS", "CEILING_NEEDED"]

# (name, model, what, threshold, per-rank batch): checked at -np N. The efficiencies hold
# against a machine whose ceiling (N unconnected one-core runs side by side) is at least
# CEILING_NEEDED; below it, the share of the ceiling reached says more than the figure.
TARGETS = (
    ("MLP scaling efficiency", "mlp", "efficiency", 0.80, 64),
    ("MLP scaling efficiency, batch 128", "mlp", "efficiency", 0.85, 128),
    ("MLP hvdtrain / baseline (every batch, both backends)", "mlp", "min_vs_baseline", 2.0, 64),
    ("MLP hvdtrain / MultiWorkerMirrored", "mlp", "vs_mwms", 4.0, 64),
    ("convnet scaling efficiency", "convnet", "efficiency", 0.95, 64),
    ("convnet hvdtrain / baseline (every batch, both backends)", "convnet", "min_vs_baseline",
     1.0, 64),
    ("MLP hvdtrain -np 1 / Keras fit (same compile options)", "mlp", "vs_keras", 1.0, 64),
    ("convnet hvdtrain -np 1 / Keras fit (same compile options)", "convnet", "vs_keras", 1.0, 64),
)  # fmt: skip
CEILING_NEEDED = 0.95
TARGET_BATCH = 64
INPUT_GOAL = 0.95  # training from files / from memory
KERAS_PLAIN, KERAS_SAME = "plain", "same compile options"
# The comparison's columns per variant: prefix -> variant (each with _1, _n, _efficiency).
SCALED = {"hvdtrain": "hvdtrain", "baseline": "baseline", "mwms": "mwms",
          "keras3": "hvdtrain-keras3"}  # fmt: skip
_KEY = ("variant", "label", "np", "backend", "model", "batch_size")


def _median(values):
    return statistics.median(values) if values else None


def _results(records, group):
    return [r for rec in records if rec["group"] == group for r in rec["results"]]


def _sps(fig):
    return fig["samples_per_sec"] if fig else None


def _ratio(a, b):
    return a["samples_per_sec"] / b["samples_per_sec"] if _sps(a) and _sps(b) else None


def _figures(records):
    """Main-group results merged over rounds: one figure per (variant, label, np, backend,
    model, batch), its samples/s the median over rounds."""
    groups = {}
    for r in _results(records, "main"):
        groups.setdefault(tuple(r.get(k, "") for k in _KEY), []).append(r)
    return [
        {**dict(zip(_KEY, key, strict=True)), "samples_per_sec": _median(sps),
         "step_ms": _median([r["step_ms"] for r in rs]), "rounds": sps,
         "params": rs[0].get("params")}
        for key, rs in groups.items()
        for sps in [[r["samples_per_sec"] for r in rs]]
    ]  # fmt: skip


def figure(figures, variant, np, model, batch, backend=None, label=None):
    """The first of `figures` that matches (`backend` and `label` None: any), or None."""
    want = {"variant": variant, "np": np, "model": model, "batch_size": batch,
            "backend": backend, "label": label}  # fmt: skip
    return next((f for f in figures
                 if all(v is None or f[k] == v for k, v in want.items())), None)  # fmt: skip


def _scaled(prefix, one, many, n):
    """`prefix`'s samples/s at -np 1 and -np n and its scaling efficiency."""
    ratio = _ratio(many, one)
    return {f"{prefix}_1": _sps(one), f"{prefix}_n": _sps(many),
            f"{prefix}_efficiency": ratio / n if ratio else None}  # fmt: skip


def _comparison(figures, n):
    """One row per (model, batch, backend) at -np n: throughput, efficiency and ratios."""
    keys = {(f["model"], f["batch_size"]) for f in figures}
    keys = sorted(keys, key=lambda k: (k[0] != "mlp", k))
    backends = sorted({f["backend"] for f in figures if f["variant"] == "hvdtrain" and f["np"] > 1})
    rows = []
    for (model, batch), backend in itertools.product(keys, backends or [None]):
        at = {p: (figure(figures, v, 1, model, batch),
                  figure(figures, v, n, model, batch, None if v == "mwms" else backend))
              for p, v in SCALED.items()}  # fmt: skip
        plain, same = (figure(figures, "keras", 1, model, batch, label=label)
                       for label in (KERAS_PLAIN, KERAS_SAME))  # fmt: skip
        (one, hvt), base, (k3_one, k3) = at["hvdtrain"], at["baseline"][1], at["keras3"]
        rows.append({
            "model": model, "batch_size": batch, "backend": backend, "np": n,
            "keras_plain": _sps(plain), "keras_same": _sps(same),
            **_scaled("hvdtrain", *at["hvdtrain"], n), **_scaled("baseline", *at["baseline"], n),
            **_scaled("mwms", *at["mwms"], n),
            "vs_baseline": _ratio(hvt, base), "vs_mwms": _ratio(hvt, at["mwms"][1]),
            "vs_keras": _ratio(one, same), "vs_keras_plain": _ratio(one, plain),
            **_scaled("keras3", k3_one, k3, n),
            "keras3_vs_keras2_1": _ratio(k3_one, one), "keras3_vs_keras2_n": _ratio(k3, hvt),
            "keras3_vs_baseline": _ratio(k3, base),
        })  # fmt: skip
    return rows


def _targets(rows, default_backend, ceiling=()):
    out = []
    for name, model, what, threshold, batch in TARGETS:
        at = [r for r in rows if r["model"] == model and r["batch_size"] == batch]
        if what == "min_vs_baseline":
            values = [r["vs_baseline"] for r in rows if r["model"] == model and r["vs_baseline"]]
            value, where = (min(values), "min over batches and backends") if values else (None, "")
        else:
            row = next((r for r in at if r["backend"] == default_backend), at[0] if at else None)
            value = row["hvdtrain_efficiency" if what == "efficiency" else what] if row else None
            where = f"batch {batch}, {row['backend']}" if row else ""
        limit = None
        if what == "efficiency":
            limit = next((c["ceiling"] for c in ceiling
                          if (c["model"], c["batch_size"]) == (model, batch)), None)  # fmt: skip
        out.append({
            "target": name, "threshold": threshold, "value": value, "where": where,
            "met": None if value is None else value >= threshold, "machine_ceiling": limit,
            # efficiency / ceiling: how much of what this machine allows was reached
            "of_ceiling": value / limit if value is not None and limit else None,
            "ceiling_too_low": limit is not None and limit < CEILING_NEEDED,
        })  # fmt: skip
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
        alone, side = figure(figures, "hvdtrain", 1, model, batch), _median(per_round)
        rows.append({"model": model, "batch_size": batch, "np": n, "alone": _sps(alone),
                     "side_by_side": side, "rounds": per_round,
                     "ceiling": side / alone["samples_per_sec"] if alone else None})  # fmt: skip
    return rows


def _tuning(records, defaults):
    """One row per (knob, setting), its figure, and its ratio to the knob's default setting
    on the same -np, backend and model."""
    rows = []
    for rec in (rec for rec in records if rec["group"] == "tuning"):
        r = rec["results"][0] if rec["results"] else {}
        for knob, setting in rec["tags"]:
            rows.append({
                "knob": knob, "setting": setting, "default": defaults.get(knob) == setting,
                "np": rec["np"], "backend": rec["backend"],
                **{k: r.get(k) for k in ("model", "batch_size", "samples_per_sec", "step_ms",
                                         "noisy")},
                "env": rec["env"], "job": rec["name"],
            })  # fmt: skip
    same = ("knob", "np", "backend", "model")
    for row in rows:
        base = next((b for b in rows if b["default"]
                     and all(b[k] == row[k] for k in same)), None)  # fmt: skip
        row["vs_default"] = _ratio(row, base) if base else None
    return rows


def _sweep(records):
    rows = _results(records, "sweep")
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
        one = figure(figures, "hvdtrain", 1, r["model"], r["batch_size"])
        path = rec["env"].get("HOROVOD_TIMELINE")
        summary = None
        if path and os.path.isfile(path):
            with open(path) as f:
                summary = summarize_timeline(f.read())
        op = next((x["seconds"] * 1000 for x in sweep["rows"]
                   if (x["bytes"], x["backend"]) == (gradient_bytes, rec["backend"])),
                  None)  # fmt: skip
        # The bare MPI_Allreduce of the gradient: the tightest upper estimate from the sweep.
        # A message of s >= g bytes costs at least what g costs, and one of s < g at least
        # s/g of it (the cost per byte only falls with size). Open MPI at times picks a slow
        # algorithm for one odd size (8 ms for the MLP's 1,077,288 bytes, 0.12 ms for 1 MiB).
        raw = min((x["raw_mpi_seconds"] * 1000 * max(1.0, gradient_bytes / x["bytes"])
                   for x in sweep["rows"] if x.get("raw_mpi_seconds") and gradient_bytes),
                  default=None)  # fmt: skip
        row = {"job": rec["name"], "settings": dict(rec["tags"]).get("settings"),
               "backend": rec["backend"], "np": rec["np"], "step_ms": r["step_ms"],
               "step_ms_np1": one["step_ms"] if one else None, "timeline": summary,
               "timeline_file": path, "horovod_allreduce_ms": op,
               "raw_mpi_allreduce_ms": raw}  # fmt: skip
        if one:
            row["overhead_ms"] = r["step_ms"] - one["step_ms"]
            if summary:
                row["outside_timeline_ms"] = row["overhead_ms"] - summary["after_last_gradient"]
            if raw:
                row["efficiency_bound"] = one["step_ms"] / (one["step_ms"] + raw)
        out.append(row)
    return out


def _cores(records):
    """Where rank 0's core went, per step (ms, medians over windows and rounds), for
    hvdtrain's main-group figures: the wall step, each thread group's CPU time
    (`timing.thread_groups`) and the rest, in which the core was idle or taken from the
    process (by another process, the hypervisor)."""
    by = {}
    for r in _results(records, "main"):
        windows = (r.get("rank_thread_seconds") or {}).get("0")
        if r["variant"] != "hvdtrain" or not windows:
            continue
        entry = by.setdefault((r["model"], r["batch_size"], r["np"], r["backend"]),
                              {"step": [], **{g: [] for g in windows[0]}})  # fmt: skip
        entry["step"] += [t * 1000 / r["steps"] for t in r["window_seconds"]]
        for g in windows[0]:
            entry[g] += [w[g] * 1000 / r["steps"] for w in windows]
    out = []
    for (model, batch, np, backend), values in sorted(by.items(), key=lambda kv: str(kv[0])):
        row = {"model": model, "batch_size": batch, "np": np, "backend": backend}
        row.update({k: _median(v) for k, v in values.items()})
        row["rest"] = row["step"] - sum(row[g] for g in values if g != "step")
        out.append(row)
    return out


def _input(records):
    """The input-pipeline comparison: per variant the median samples/s over the rounds."""
    by = {}
    for r in _results(records, "input"):
        by.setdefault(r["variant"], []).append(r["samples_per_sec"])
    if not by:
        return None
    variants = ("hvdtrain", "hvdtrain-tfrecord", "input-tfrecord")
    memory, files, pipeline = (_median(by.get(v, [])) for v in variants)
    ratio = files / memory if files and memory else None
    return {"memory": memory, "files": files, "pipeline": pipeline, "rounds": by,
            "files_vs_memory": ratio,
            "pipeline_vs_training": pipeline / files if pipeline and files else None,
            "goal": INPUT_GOAL, "met": None if ratio is None else ratio >= INPUT_GOAL}  # fmt: skip


def _stack_name(results):
    tf, py = ({(r.get("stack") or {}).get(k) for r in results} - {None}
              for k in ("tensorflow", "python"))  # fmt: skip
    return f"TF {'/'.join(sorted(tf)) or '?'}, Python {'/'.join(sorted(py)) or '?'}"


def _stacks(records, n, backend):
    """This stack against `--compare-python`'s, job for job (the same rounds, interleaved):
    Keras `fit`, hvdtrain at -np 1 and at -np n, the medians over the rounds; None when
    the run had no other stack."""
    other = _results(records, "stack")
    if not other:
        return None
    this = _results(records, "main")
    jobs = (("Keras fit, -np 1", "keras", KERAS_SAME, 1, None),
            ("hvdtrain, -np 1", "hvdtrain", "", 1, None),
            (f"hvdtrain, -np {n} ({backend})", "hvdtrain", "", n, backend))  # fmt: skip

    def median(results, model, batch, variant, label, np, job_backend):
        return _median([r["samples_per_sec"] for r in results
                        if (r["model"], r["batch_size"], r["variant"], r.get("label", ""), r["np"])
                        == (model, batch, variant, label, np)
                        and job_backend in (None, r["backend"])])  # fmt: skip

    rows = []
    for model, batch in sorted({(r["model"], r["batch_size"]) for r in other}):
        group = []
        for job, *how in jobs:
            a, b = (median(rs, model, batch, *how) for rs in (this, other))
            group.append({"model": model, "batch_size": batch, "job": job, "this": a,
                          "other": b, "ratio": a / b if a and b else None})  # fmt: skip
        _, one, many = group
        for side in ("this", "other"):
            eff = many[side] / (n * one[side]) if one[side] and many[side] else None
            many[f"efficiency_{side}"] = eff
        rows += group
    used = [r for r in this if r["variant"] in ("keras", "hvdtrain")]
    return {"this": _stack_name(used), "other": _stack_name(other), "rows": rows}


def summarize(records, n, default_backend="mpi", tuning_defaults=None, gradient_bytes=None):
    """{figures, comparison, ceiling, targets, tuning, allreduce, profile, cores, input,
    stacks} from the job records."""
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
    conv = figure(data.get("figures", []), "hvdtrain", 1, "convnet", TARGET_BATCH)
    params = conv["params"] if conv else 1_199_882
    compute = conv["step_ms"] / 1000 if conv else None
    return {
        "model": "step = compute + 2(n-1)/n x gradient bytes / link bandwidth; no overlap",
        "rows": project_mod.project(project_mod.default_workloads(compute, params)),
        "paper_check": project_mod.paper_check(),
    }
