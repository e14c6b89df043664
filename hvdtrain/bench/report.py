"""The benchmark's figures: summary (efficiencies, ratios, targets), Markdown and PNG.

Pure functions of the records `hvdtrain.bench.runner.execute` returns, except `plot`,
which draws with matplotlib's Agg backend (no display needed).
"""

import os
import statistics

from hvdtrain.bench import project as project_mod
from hvdtrain.bench.timeline import summarize_timeline

__all__ = ["summarize", "projection", "markdown", "plot", "TARGETS"]

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


def _get(figures, variant, np, model, batch, backend=None, label=None):
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
        one = {v: _get(figures, v, 1, model, batch) for v in variants}
        keras_plain = _get(figures, "keras", 1, model, batch, label=KERAS_PLAIN)
        keras_same = _get(figures, "keras", 1, model, batch, label=KERAS_SAME)
        mwms = _get(figures, "mwms", n, model, batch)
        for backend in backends or [None]:
            hvt = _get(figures, "hvdtrain", n, model, batch, backend)
            base = _get(figures, "baseline", n, model, batch, backend)
            k3 = _get(figures, "hvdtrain-keras3", n, model, batch, backend)

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
        alone = _get(figures, "hvdtrain", 1, model, batch)
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
        one = _get(figures, "hvdtrain", 1, r["model"], r["batch_size"])
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


def _fmt(value, spec=",.0f", none="-"):
    return none if value is None else format(value, spec)


def _keras3_table(rows, n):
    """hvdtrain's Keras 3 path against its Keras 2 path, side by side (when measured)."""
    rows = [r for r in rows if r["keras3_1"] or r["keras3_n"]]
    if not rows:
        return []
    lines = [
        "## Keras 3 against Keras 2 (hvdtrain, the same models, batches and backends)",
        "",
        f"| model | batch | backend | Keras 3 -np 1 | Keras 2 -np 1 | ratio | Keras 3 -np {n} | "
        f"Keras 2 -np {n} | ratio | Keras 3 eff. | Keras 3 / baseline |",
        "|" + " --- |" * 11,
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch_size']} | {r['backend']} | {_fmt(r['keras3_1'])} | "
            f"{_fmt(r['hvdtrain_1'])} | {_fmt(r['keras3_vs_keras2_1'], '.2f')} | "
            f"{_fmt(r['keras3_n'])} | {_fmt(r['hvdtrain_n'])} | "
            f"{_fmt(r['keras3_vs_keras2_n'], '.2f')} | {_fmt(r['keras3_efficiency'], '.2f')} | "
            f"{_fmt(r['keras3_vs_baseline'], '.2f')}x |"
        )
    return lines + [""]


def markdown(data):
    """The whole report as Markdown."""
    n = data["config"]["np"]
    env = data["environment"]
    m = data["machine_at_start"]
    loads = [r["machine"]["load_average"][0] for r in data["runs"] if r["machine"]["load_average"]]
    lines = [
        "# hvdtrain scaling benchmark",
        "",
        f"`{data['command']}` on {env.get('cpu_model') or env['platform']} "
        f"({env['cpus']} cores), {data['created']}; TensorFlow "
        f"{env.get('tensorflow-cpu') or env.get('tensorflow', '?')}, "
        f"Horovod {env.get('horovod', '?')}. "
        f"One core per rank; every figure the median of {data['config']['repeats']} timed "
        f"windows after a warm-up window (x {data['config']['rounds']} round(s)). "
        f"1-minute load average at the start {m['load_average']}, before the jobs "
        f"{min(loads, default=0):.2f}-{max(loads, default=0):.2f} "
        f"(jobs that found the machine busy: "
        f"{sum(1 for r in data['runs'] if not r['machine']['quiet'])} of {len(data['runs'])}).",
        "",
        f"## Throughput (samples/s, all ranks) and scaling efficiency at -np {n}",
        "",
        "Efficiency = samples/s at N / (N x samples/s of the same variant at -np 1, one core).",
        "",
        f"| model | batch | backend | Keras fit -np 1 | hvdtrain -np 1 | hvdtrain -np {n} | eff. | "
        f"baseline -np 1 | baseline -np {n} | eff. | MWMS -np 1 | MWMS -np {n} | eff. | "
        "hvdtrain / baseline | hvdtrain / MWMS |",
        "|" + " --- |" * 15,
    ]
    for r in data["comparison"]:
        lines.append(
            f"| {r['model']} | {r['batch_size']} | {r['backend']} | "
            f"{_fmt(r['keras_plain'])} ({_fmt(r['keras_same'])}) | {_fmt(r['hvdtrain_1'])} | "
            f"{_fmt(r['hvdtrain_n'])} | {_fmt(r['hvdtrain_efficiency'], '.2f')} | "
            f"{_fmt(r['baseline_1'])} | {_fmt(r['baseline_n'])} | "
            f"{_fmt(r['baseline_efficiency'], '.2f')} | {_fmt(r['mwms_1'])} | "
            f"{_fmt(r['mwms_n'])} | {_fmt(r['mwms_efficiency'], '.2f')} | "
            f"{_fmt(r['vs_baseline'], '.2f')}x | {_fmt(r['vs_mwms'], '.2f')}x |"
        )
    lines += [
        "",
        "Keras fit: plain `compile` (in brackets: with hvdtrain's compile options). MWMS runs "
        "over gRPC whatever the backend column says. Baseline: Horovod's documented Keras recipe.",
        "",
        *_keras3_table(data["comparison"], n),
        f"## Targets (-np {n}, hvdtrain on {data['default_backend']}, the hvdtrain-run "
        "default on one host)",
        "",
        "An efficiency target holds against a machine whose ceiling (below) is at least "
        f"{CEILING_NEEDED:g}; on a lower one, its share of the ceiling is what software can "
        "still improve.",
        "",
        "| target | measured | needed | met | this machine's ceiling | share of the ceiling |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for t in data["targets"]:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
        if t.get("ceiling_too_low"):
            met += f" (ceiling below {CEILING_NEEDED:g})"
        lines.append(
            f"| {t['target']} | {_fmt(t['value'], '.2f')} ({t['where']}) | "
            f">= {t['threshold']:g} | {met} | {_fmt(t.get('machine_ceiling'), '.2f', '')} | "
            f"{_fmt(t.get('of_ceiling'), '.2f', '')} |"
        )
    if data.get("ceiling"):
        lines += [
            "",
            f"## This machine's ceiling: {n} unconnected one-core runs side by side",
            "",
            f"hvdtrain at -np 1 alone against {n} copies of it started at once, each on its "
            "own core, with nothing to exchange (samples/s per process). With every core "
            "busy, shared caches, memory bandwidth and the hypervisor slow each one down: no "
            "data-parallel software reaches a higher scaling efficiency on this machine.",
            "",
            "| model | batch | alone | side by side (each) | ceiling |",
            "| --- | --- | --- | --- | --- |",
        ]
        for c in data["ceiling"]:
            lines.append(
                f"| {c['model']} | {c['batch_size']} | {_fmt(c['alone'])} | "
                f"{_fmt(c['side_by_side'])} | {_fmt(c['ceiling'], '.2f')} |"
            )
    stacks = data.get("stacks")
    if stacks:
        lines += [
            "",
            "## Old and new stack side by side (`--compare-python`: the same jobs, interleaved)",
            "",
            f"This stack: {stacks['this']}; the other: {stacks['other']} (samples/s, all "
            "ranks; the medians over the rounds; eff. = scaling efficiency).",
            "",
            "| model | batch | job | this stack | other stack | this / other | eff. this | "
            "eff. other |",
            "|" + " --- |" * 8,
        ]
        for r in stacks["rows"]:
            lines.append(
                f"| {r['model']} | {r['batch_size']} | {r['job']} | {_fmt(r['this'])} | "
                f"{_fmt(r['other'])} | {_fmt(r['ratio'], '.2f')} | "
                f"{_fmt(r.get('efficiency_this'), '.2f', '')} | "
                f"{_fmt(r.get('efficiency_other'), '.2f', '')} |"
            )
    inp = data.get("input")
    if inp:
        met = "n/a" if inp["met"] is None else ("yes" if inp["met"] else "**no**")
        lines += [
            "",
            f"## Input pipeline: the convnet from memory and from TFRecord files (-np {n}, "
            "batch 64)",
            "",
            "The same samples, in memory (`ArrayData`) or in 8 TFRecord files of uneven sizes "
            "(`FileData`: read, shuffled in a buffer, parsed, batched); the pipeline alone "
            "draws the same batches on every rank at once, with no model.",
            "",
            "| training from memory | training from files | files / memory | goal | met | "
            "pipeline alone | pipeline / training |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            f"| {_fmt(inp['memory'])} | {_fmt(inp['files'])} | "
            f"{_fmt(inp['files_vs_memory'], '.3f')} | >= {inp['goal']:g} | {met} | "
            f"{_fmt(inp['pipeline'])} | {_fmt(inp['pipeline_vs_training'], '.1f')}x |",
        ]
    if data["tuning"]:
        lines += [
            "",
            "## Tuning: each hvdtrain default against the alternatives (batch 64)",
            "",
            "| knob | setting | model | -np | backend | samples/s | ms/step | vs default |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for t in data["tuning"]:
            setting = f"**{t['setting']}** (default)" if t["default"] else t["setting"]
            lines.append(
                f"| {t['knob']} | {setting} | {t['model'] or '-'} | {t['np']} | "
                f"{t['backend'] or '-'} | {_fmt(t['samples_per_sec'])} | "
                f"{_fmt(t.get('step_ms'), '.2f')} | {_fmt(t['vs_default'], '.2f')} |"
            )
    sweep = data["allreduce"]
    if sweep["rows"]:
        memcpy = sweep["memcpy_bytes_per_sec"]
        lines += [
            "",
            f"## Allreduce sweep (-np {n}; busbw = algbw x 2(n-1)/n)",
            "",
            f"Memory-copy bandwidth of one core (numpy.copyto, 64 MiB), same run: "
            f"{_fmt(memcpy and memcpy / 1e9, '.1f')} GB/s. Horovod: its TensorFlow op after "
            "`hvdtrain.init()` (queue, cycle, fusion-buffer copies, collective); raw MPI: "
            "`MPI_Allreduce` through mpi4py.",
            "",
            "| bytes | backend | time | algbw | busbw | raw MPI time | raw MPI busbw |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in sorted(sweep["rows"], key=lambda r: (r["bytes"], r["backend"])):
            raw = r.get("raw_mpi_seconds")
            lines.append(
                f"| {r['bytes']:,} | {r['backend']} | {r['seconds'] * 1e6:,.0f} us | "
                f"{r['algbw'] / 1e9:.2f} GB/s | {r['busbw'] / 1e9:.2f} GB/s | "
                f"{_fmt(raw and raw * 1e6, ',.0f')}{' us' if raw else ''} | "
                f"{_fmt(r.get('raw_mpi_busbw') and r['raw_mpi_busbw'] / 1e9, '.2f')}"
                f"{' GB/s' if raw else ''} |"
            )
    if data.get("profile"):
        lines += [
            "",
            f"## Profile: where the MLP's step goes at -np {n} (batch 64, Horovod timeline)",
            "",
            "Overhead = step at -np N - hvdtrain's step at -np 1. From the timeline (rank 0): "
            "after the last gradient was handed to Horovod, the time until its allreduce "
            "ended: negotiation (waiting for the other ranks' gradients and the next cycle), "
            "fusion-buffer copies, the collective. The rest of the overhead is outside the "
            "timeline: before Horovod's background thread picked the tensors up (its cycle) "
            "and the background thread's CPU use on the rank's core. Bound = the best "
            "efficiency with no software overhead at all: step(-np 1) / (step(-np 1) + bare "
            "MPI_Allreduce of the gradient, from the sweep). Timelines add a little time.",
            "",
            "| settings | backend | step -np 1 | step -np N | overhead | after last gradient "
            "| negotiate | copies in+out | collective | outside timeline | allreduce ops/step "
            "| bare MPI allreduce | bound |",
            "|" + " --- |" * 13,
        ]
        for p in data["profile"]:
            t = p["timeline"] or {}
            coll = sum(v for k, v in t.items() if k.endswith("_ALLREDUCE"))
            copies = t.get("MEMCPY_IN_FUSION_BUFFER", 0) + t.get("MEMCPY_OUT_FUSION_BUFFER", 0)
            neg = t.get("wait_for_other_ranks", 0) + t.get("wait_for_cycle", 0)
            lines.append(
                f"| {p['settings']} | {p['backend']} | {_fmt(p['step_ms_np1'], '.2f')} ms | "
                f"{p['step_ms']:.2f} ms | {_fmt(p.get('overhead_ms'), '.2f')} ms | "
                f"{_fmt(t.get('after_last_gradient'), '.2f')} ms | {neg:.2f} ms | "
                f"{copies:.2f} ms | {coll:.2f} ms | {_fmt(p.get('outside_timeline_ms'), '.2f')} ms"
                f" | {_fmt(t.get('responses'), '.0f')} | "
                f"{_fmt(p['raw_mpi_allreduce_ms'], '.3f')} ms | "
                f"{_fmt(p.get('efficiency_bound'), '.2f')} |"
            )
    if data.get("cores"):
        lines += [
            "",
            "## Where rank 0's core goes (ms per step, hvdtrain; medians over the windows)",
            "",
            "Each rank is bound to one core. CPU time per thread group (Linux schedstat): "
            "main = the Python thread (Keras's loop, and the ops TensorFlow runs inline on "
            "it), TF pools = TensorFlow's tf_* threads, Horovod = the threads `hvd.init` "
            "started (its background thread: negotiation every cycle, fusion copies, the "
            "collective, and waiting for the other ranks, spinning or yielding); rest = the "
            "step's time in which the process ran no thread (idle, or the core taken by "
            "another process or the hypervisor).",
            "",
            "| model | batch | -np | backend | step | main | TF pools | Horovod | other | rest |",
            "|" + " --- |" * 10,
        ]
        for c in data["cores"]:
            lines.append(
                f"| {c['model']} | {c['batch_size']} | {c['np']} | {c['backend'] or '-'} | "
                + " | ".join(
                    f"{_fmt(c.get(k), '.2f')}"
                    for k in ("step", "main", "tensorflow", "horovod", "other", "rest")
                )
                + " |"
            )
    proj = data["projection"]
    lines += [
        "",
        "## Projection to GPU clusters (`hvdtrain.bench.project`)",
        "",
        project_mod.markdown(proj["rows"], proj["paper_check"]),
        "",
        "## Jobs",
        "",
        "| job | ok | seconds | load average before | cores busy before |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in data["runs"]:
        mach = r["machine"]
        lines.append(
            f"| {r['name']} | {'yes' if r['ok'] else '**no**'} | {r['seconds']:.0f} | "
            f"{mach['load_average'][0] if mach['load_average'] else '-'} | {mach['busy_cores']} |"
        )
    return "\n".join(lines) + "\n"


def plot(data, path):
    """Throughput and efficiency against -np and batch size, the sweep, the projection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = data["figures"]
    n = data["config"]["np"]
    models = [m for m in ("mlp", "convnet") if any(f["model"] == m for f in figures)] or ["mlp"]
    cols = max(2, len(models))
    fig, axes = plt.subplots(3, cols, figsize=(6 * cols, 13), squeeze=False)
    series = [
        ("hvdtrain", "mpi", "tab:blue", "-"),
        ("hvdtrain", "gloo", "tab:cyan", "-"),
        ("baseline", "mpi", "tab:red", "--"),
        ("baseline", "gloo", "tab:orange", "--"),
        ("mwms", None, "tab:green", ":"),
    ]
    for c, model in enumerate(models):
        ax = axes[0][c]
        batch = TARGET_BATCH
        for variant, backend, color, style in series:
            one = _get(figures, variant, 1, model, batch)
            many = _get(figures, variant, n, model, batch, backend)
            if one and many:
                label = variant + (f" ({backend})" if backend else "")
                ax.plot([1, n], [one["samples_per_sec"], many["samples_per_sec"]], style,
                        color=color, marker="o", label=label)  # fmt: skip
        one = _get(figures, "hvdtrain", 1, model, batch)
        if one:
            ax.plot([1, n], [one["samples_per_sec"], n * one["samples_per_sec"]], color="gray",
                    linewidth=0.8, label="linear (hvdtrain)")  # fmt: skip
        ax.set_title(f"{model}: samples/s against -np (batch {batch}/rank)")
        ax.set_xlabel("-np (one core per rank)")
        ax.set_xticks([1, n])
        ax.set_ylabel("samples/s")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        ax = axes[1][c]
        rows = [r for r in data["comparison"] if r["model"] == model]
        for variant, backend, color, style in series:
            pts = sorted(
                (r["batch_size"], r[f"{variant}_efficiency"])
                for r in rows
                if (backend is None or r["backend"] == backend) and r[f"{variant}_efficiency"]
            )
            pts = sorted(dict(pts).items())
            if pts:
                label = variant + (f" ({backend})" if backend else "")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, marker="o",
                        label=label)  # fmt: skip
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_title(f"{model}: scaling efficiency at -np {n} against batch size")
        ax.set_xlabel("per-rank batch size")
        ax.set_xscale("log", base=2)
        ax.set_ylabel("efficiency")
        ax.set_ylim(0, 1.1)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax = axes[2][0]
    sweep = data["allreduce"]
    for backend, color in (("gloo", "tab:cyan"), ("mpi", "tab:blue")):
        pts = sorted((r["bytes"], r["busbw"], r.get("raw_mpi_busbw")) for r in sweep["rows"]
                     if r["backend"] == backend)  # fmt: skip
        if pts:
            ax.plot([p[0] for p in pts], [p[1] / 1e9 for p in pts], marker="o", color=color,
                    label=f"Horovod {backend}")  # fmt: skip
            if pts[0][2]:
                ax.plot([p[0] for p in pts], [p[2] / 1e9 for p in pts], "--", marker=".",
                        color=color, label="raw MPI_Allreduce")  # fmt: skip
    if sweep["memcpy_bytes_per_sec"]:
        ax.axhline(sweep["memcpy_bytes_per_sec"] / 1e9, color="gray", linestyle=":",
                   label="memcpy, one core")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(f"allreduce bus bandwidth, -np {n}")
    ax.set_xlabel("bytes")
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[2][1]
    for row in data["projection"]["rows"]:
        if row["bandwidth_gbit"] != 25:
            continue
        gpus = sorted(row["efficiency"], key=int)
        ax.plot([int(g) for g in gpus], [row["efficiency"][g] for g in gpus], marker="o",
                label=row["name"])  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_title("projected efficiency, 25 Gbit/s ring allreduce (no overlap)")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("efficiency")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    for c in range(2, cols):
        axes[2][c].axis("off")
    for c in range(len(models), cols):
        axes[0][c].axis("off")
        axes[1][c].axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
