"""The benchmark's report: bench.json, bench.md (the tables) and bench.png (the plots).

    write(out, data, n, "mpi", TUNING_DEFAULTS, MLP_GRADIENT_BYTES)   # data: config, runs, ...

`write` adds the figures (`hvdtrain.bench.summary.summarize`, pure) and the GPU projection
to `data` (the run's config, environment and records) and writes the three files;
`markdown` and `plot` render them. `plot` draws with matplotlib's Agg backend (no display).
"""

import json
import os

from hvdtrain.bench import project as project_mod
from hvdtrain.bench.summary import CEILING_NEEDED, TARGET_BATCH, figure, projection, summarize

__all__ = ["write", "summarize", "markdown", "plot"]


def write(out, data, n, default_backend, tuning_defaults, gradient_bytes):
    """Summarises `data["runs"]` into `data`, writes bench.json, bench.md, bench.png to `out`."""
    data.update(summarize(data["runs"], n, default_backend, tuning_defaults, gradient_bytes))
    data["projection"] = projection(data)
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(markdown(data))
    plot(data, os.path.join(out, "bench.png"))
    return data


def _fmt(value, spec=",.0f", none="-"):
    return none if value is None else format(value, spec)


def _table(head, rows):
    """A Markdown table: `head`, its cells separated by " | ", then one list of cells a row."""
    return [f"| {head} |", "|" + " --- |" * len(head.split(" | "))] + [
        "| " + " | ".join(str(c) for c in cells) + " |" for cells in rows
    ]


def _keras3_table(rows, n):
    """hvdtrain's Keras 3 path against its Keras 2 path, side by side (when measured)."""
    rows = [r for r in rows if r["keras3_1"] or r["keras3_n"]]
    if not rows:
        return []
    head = (f"model | batch | backend | Keras 3 -np 1 | Keras 2 -np 1 | ratio | Keras 3 -np {n} | "
            f"Keras 2 -np {n} | ratio | Keras 3 eff. | Keras 3 / baseline")  # fmt: skip
    cells = [[r["model"], r["batch_size"], r["backend"], _fmt(r["keras3_1"]),
              _fmt(r["hvdtrain_1"]), _fmt(r["keras3_vs_keras2_1"], ".2f"), _fmt(r["keras3_n"]),
              _fmt(r["hvdtrain_n"]), _fmt(r["keras3_vs_keras2_n"], ".2f"),
              _fmt(r["keras3_efficiency"], ".2f"), _fmt(r["keras3_vs_baseline"], ".2f") + "x"]
             for r in rows]  # fmt: skip
    heading = "## Keras 3 against Keras 2 (hvdtrain, the same models, batches and backends)"
    return [heading, "", *_table(head, cells), ""]


def _sections(data, n):
    """The report's optional sections, each a list of lines (empty when not measured)."""
    out = []
    if data.get("ceiling"):
        out.append([
            f"## This machine's ceiling: {n} unconnected one-core runs side by side", "",
            f"hvdtrain at -np 1 alone against {n} copies of it started at once, each on its "
            "own core, with nothing to exchange (samples/s per process). With every core "
            "busy, shared caches, memory bandwidth and the hypervisor slow each one down: no "
            "data-parallel software reaches a higher scaling efficiency on this machine.", "",
            *_table("model | batch | alone | side by side (each) | ceiling",
                    [[c["model"], c["batch_size"], _fmt(c["alone"]), _fmt(c["side_by_side"]),
                      _fmt(c["ceiling"], ".2f")] for c in data["ceiling"]]),
        ])  # fmt: skip
    if stacks := data.get("stacks"):
        out.append([
            "## Old and new stack side by side (`--compare-python`: the same jobs, interleaved)",
            "", f"This stack: {stacks['this']}; the other: {stacks['other']} (samples/s, all "
            "ranks; the medians over the rounds; eff. = scaling efficiency).", "",
            *_table("model | batch | job | this stack | other stack | this / other | eff. this "
                    "| eff. other",
                    [[r["model"], r["batch_size"], r["job"], _fmt(r["this"]), _fmt(r["other"]),
                      _fmt(r["ratio"], ".2f"), _fmt(r.get("efficiency_this"), ".2f", ""),
                      _fmt(r.get("efficiency_other"), ".2f", "")] for r in stacks["rows"]]),
        ])  # fmt: skip
    if inp := data.get("input"):
        met = "n/a" if inp["met"] is None else ("yes" if inp["met"] else "**no**")
        out.append([
            f"## Input pipeline: the convnet from memory and from TFRecord files (-np {n}, "
            "batch 64)", "",
            "The same samples, in memory (`ArrayData`) or in 8 TFRecord files of uneven sizes "
            "(`FileData`: read, shuffled in a buffer, parsed, batched); the pipeline alone "
            "draws the same batches on every rank at once, with no model.", "",
            *_table("training from memory | training from files | files / memory | goal | met | "
                    "pipeline alone | pipeline / training",
                    [[_fmt(inp["memory"]), _fmt(inp["files"]),
                      _fmt(inp["files_vs_memory"], ".3f"), f">= {inp['goal']:g}", met,
                      _fmt(inp["pipeline"]), _fmt(inp["pipeline_vs_training"], ".1f") + "x"]]),
        ])  # fmt: skip
    if data["tuning"]:
        out.append([
            "## Tuning: each hvdtrain default against the alternatives (batch 64)", "",
            *_table("knob | setting | model | -np | backend | samples/s | ms/step | vs default",
                    [[t["knob"], f"**{t['setting']}** (default)" if t["default"] else t["setting"],
                      t["model"] or "-", t["np"], t["backend"] or "-", _fmt(t["samples_per_sec"]),
                      _fmt(t.get("step_ms"), ".2f"), _fmt(t["vs_default"], ".2f")]
                     for t in data["tuning"]]),
        ])  # fmt: skip
    if (sweep := data["allreduce"])["rows"]:
        memcpy = sweep["memcpy_bytes_per_sec"]
        rows = []
        for r in sorted(sweep["rows"], key=lambda r: (r["bytes"], r["backend"])):
            raw, us, gbs = r.get("raw_mpi_seconds"), " us", " GB/s"
            rows.append([f"{r['bytes']:,}", r["backend"], f"{r['seconds'] * 1e6:,.0f} us",
                         f"{r['algbw'] / 1e9:.2f} GB/s", f"{r['busbw'] / 1e9:.2f} GB/s",
                         _fmt(raw and raw * 1e6, ",.0f") + (us if raw else ""),
                         _fmt(r.get("raw_mpi_busbw") and r["raw_mpi_busbw"] / 1e9, ".2f")
                         + (gbs if raw else "")])  # fmt: skip
        out.append([
            f"## Allreduce sweep (-np {n}; busbw = algbw x 2(n-1)/n)", "",
            f"Memory-copy bandwidth of one core (numpy.copyto, 64 MiB), same run: "
            f"{_fmt(memcpy and memcpy / 1e9, '.1f')} GB/s. Horovod: its TensorFlow op after "
            "`hvdtrain.init()` (queue, cycle, fusion-buffer copies, collective); raw MPI: "
            "`MPI_Allreduce` through mpi4py.", "",
            *_table("bytes | backend | time | algbw | busbw | raw MPI time | raw MPI busbw", rows),
        ])  # fmt: skip
    if data.get("profile"):
        rows = []
        for p in data["profile"]:
            t = p["timeline"] or {}
            coll = sum(v for k, v in t.items() if k.endswith("_ALLREDUCE"))
            copies = t.get("MEMCPY_IN_FUSION_BUFFER", 0) + t.get("MEMCPY_OUT_FUSION_BUFFER", 0)
            neg = t.get("wait_for_other_ranks", 0) + t.get("wait_for_cycle", 0)
            rows.append([p["settings"], p["backend"], f"{_fmt(p['step_ms_np1'], '.2f')} ms",
                         f"{p['step_ms']:.2f} ms", f"{_fmt(p.get('overhead_ms'), '.2f')} ms",
                         f"{_fmt(t.get('after_last_gradient'), '.2f')} ms", f"{neg:.2f} ms",
                         f"{copies:.2f} ms", f"{coll:.2f} ms",
                         f"{_fmt(p.get('outside_timeline_ms'), '.2f')} ms",
                         _fmt(t.get("responses"), ".0f"),
                         f"{_fmt(p['raw_mpi_allreduce_ms'], '.3f')} ms",
                         _fmt(p.get("efficiency_bound"), ".2f")])  # fmt: skip
        out.append([
            f"## Profile: where the MLP's step goes at -np {n} (batch 64, Horovod timeline)", "",
            "Overhead = step at -np N - hvdtrain's step at -np 1. From the timeline (rank 0): "
            "after the last gradient was handed to Horovod, the time until its allreduce "
            "ended: negotiation (waiting for the other ranks' gradients and the next cycle), "
            "fusion-buffer copies, the collective. The rest of the overhead is outside the "
            "timeline: before Horovod's background thread picked the tensors up (its cycle) "
            "and the background thread's CPU use on the rank's core. Bound = the best "
            "efficiency with no software overhead at all: step(-np 1) / (step(-np 1) + bare "
            "MPI_Allreduce of the gradient, from the sweep). Timelines add a little time.", "",
            *_table("settings | backend | step -np 1 | step -np N | overhead | after last "
                    "gradient | negotiate | copies in+out | collective | outside timeline | "
                    "allreduce ops/step | bare MPI allreduce | bound", rows),
        ])  # fmt: skip
    if data.get("cores"):
        groups = ("step", "main", "tensorflow", "horovod", "other", "rest")
        out.append([
            "## Where rank 0's core goes (ms per step, hvdtrain; medians over the windows)", "",
            "Each rank is bound to one core. CPU time per thread group (Linux schedstat): "
            "main = the Python thread (Keras's loop, and the ops TensorFlow runs inline on "
            "it), TF pools = TensorFlow's tf_* threads, Horovod = the threads `hvd.init` "
            "started (its background thread: negotiation every cycle, fusion copies, the "
            "collective, and waiting for the other ranks, spinning or yielding); rest = the "
            "step's time in which the process ran no thread (idle, or the core taken by "
            "another process or the hypervisor).", "",
            *_table("model | batch | -np | backend | step | main | TF pools | Horovod | other "
                    "| rest",
                    [[c["model"], c["batch_size"], c["np"], c["backend"] or "-",
                      *(_fmt(c.get(k), ".2f") for k in groups)] for c in data["cores"]]),
        ])  # fmt: skip
    return out


def markdown(data):
    """The whole report as Markdown."""
    n, env, m, runs = (data[k] for k in ("config", "environment", "machine_at_start", "runs"))
    n = n["np"]
    loads = [r["machine"]["load_average"][0] for r in runs if r["machine"]["load_average"]]
    cells = [[r["model"], r["batch_size"], r["backend"],
              f"{_fmt(r['keras_plain'])} ({_fmt(r['keras_same'])})",
              *(_fmt(r[f"{v}{k}"], spec) for v in ("hvdtrain", "baseline", "mwms")
                for k, spec in (("_1", ",.0f"), ("_n", ",.0f"), ("_efficiency", ".2f"))),
              _fmt(r["vs_baseline"], ".2f") + "x", _fmt(r["vs_mwms"], ".2f") + "x"]
             for r in data["comparison"]]  # fmt: skip
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
        f"{sum(1 for r in runs if not r['machine']['quiet'])} of {len(runs)}).",
        "",
        f"## Throughput (samples/s, all ranks) and scaling efficiency at -np {n}",
        "",
        "Efficiency = samples/s at N / (N x samples/s of the same variant at -np 1, one core).",
        "",
        *_table(f"model | batch | backend | Keras fit -np 1 | hvdtrain -np 1 | hvdtrain -np {n} | "
                f"eff. | baseline -np 1 | baseline -np {n} | eff. | MWMS -np 1 | MWMS -np {n} | "
                "eff. | hvdtrain / baseline | hvdtrain / MWMS", cells),
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
    ]  # fmt: skip
    targets = []
    for t in data["targets"]:
        met = "n/a" if t["met"] is None else ("yes" if t["met"] else "**no**")
        met += f" (ceiling below {CEILING_NEEDED:g})" if t.get("ceiling_too_low") else ""
        targets.append([t["target"], f"{_fmt(t['value'], '.2f')} ({t['where']})",
                        f">= {t['threshold']:g}", met, _fmt(t.get("machine_ceiling"), ".2f", ""),
                        _fmt(t.get("of_ceiling"), ".2f", "")])  # fmt: skip
    lines += _table("target | measured | needed | met | this machine's ceiling | share of the "
                    "ceiling", targets)  # fmt: skip
    for section in _sections(data, n):
        lines += ["", *section]
    proj = data["projection"]
    jobs = [[r["name"], "yes" if r["ok"] else "**no**", f"{r['seconds']:.0f}",
             r["machine"]["load_average"][0] if r["machine"]["load_average"] else "-",
             r["machine"]["busy_cores"]] for r in runs]  # fmt: skip
    head = "job | ok | seconds | load average before | cores busy before"
    lines += ["", "## Projection to GPU clusters (`hvdtrain.bench.project`)", "",
              project_mod.markdown(proj["rows"], proj["paper_check"]), "", "## Jobs", "",
              *_table(head, jobs)]  # fmt: skip
    return "\n".join(lines) + "\n"


def _axes(ax, title, xlabel, ylabel, fontsize=8):
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=fontsize)
    ax.grid(alpha=0.3)


def plot(data, path):
    """Throughput and efficiency against -np and batch size, the sweep, the projection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures, n = data["figures"], data["config"]["np"]
    models = [m for m in ("mlp", "convnet") if any(f["model"] == m for f in figures)] or ["mlp"]
    cols = max(2, len(models))
    fig, axes = plt.subplots(3, cols, figsize=(6 * cols, 13), squeeze=False)
    series = [("hvdtrain", "mpi", "tab:blue", "-"), ("hvdtrain", "gloo", "tab:cyan", "-"),
              ("baseline", "mpi", "tab:red", "--"), ("baseline", "gloo", "tab:orange", "--"),
              ("mwms", None, "tab:green", ":")]  # fmt: skip
    for c, model in enumerate(models):
        ax, batch = axes[0][c], TARGET_BATCH
        for variant, backend, color, style in series:
            one = figure(figures, variant, 1, model, batch)
            many = figure(figures, variant, n, model, batch, backend)
            if one and many:
                label = variant + (f" ({backend})" if backend else "")
                ax.plot([1, n], [one["samples_per_sec"], many["samples_per_sec"]], style,
                        color=color, marker="o", label=label)  # fmt: skip
        if one := figure(figures, "hvdtrain", 1, model, batch):
            ax.plot([1, n], [one["samples_per_sec"], n * one["samples_per_sec"]], color="gray",
                    linewidth=0.8, label="linear (hvdtrain)")  # fmt: skip
        ax.set_xticks([1, n])
        _axes(ax, f"{model}: samples/s against -np (batch {batch}/rank)",
              "-np (one core per rank)", "samples/s")  # fmt: skip
        ax = axes[1][c]
        rows = [r for r in data["comparison"] if r["model"] == model]
        for variant, backend, color, style in series:
            pts = sorted(dict(sorted(
                (r["batch_size"], r[f"{variant}_efficiency"]) for r in rows
                if (backend is None or r["backend"] == backend) and r[f"{variant}_efficiency"]
            )).items())  # fmt: skip
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=color, marker="o",
                        label=variant + (f" ({backend})" if backend else ""))  # fmt: skip
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.1)
        _axes(ax, f"{model}: scaling efficiency at -np {n} against batch size",
              "per-rank batch size", "efficiency")  # fmt: skip
    ax, sweep = axes[2][0], data["allreduce"]
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
    _axes(ax, f"allreduce bus bandwidth, -np {n}", "bytes", "GB/s")
    ax = axes[2][1]
    for row in data["projection"]["rows"]:
        if row["bandwidth_gbit"] == 25:
            gpus = sorted(row["efficiency"], key=int)
            ax.plot([int(g) for g in gpus], [row["efficiency"][g] for g in gpus], marker="o",
                    label=row["name"])  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    _axes(ax, "projected efficiency, 25 Gbit/s ring allreduce (no overlap)", "GPUs",
          "efficiency", fontsize=7)  # fmt: skip
    for ax in [axes[2][c] for c in range(2, cols)] + [
        axes[r][c] for r in (0, 1) for c in range(len(models), cols)
    ]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
