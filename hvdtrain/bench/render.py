"""The benchmark's report drawn from its summary (`hvdtrain.bench.report.summarize`): the
Markdown tables (`markdown`, pure) and the figure (`plot`, matplotlib's Agg backend: no
display needed). Nothing here measures or computes a figure."""

from hvdtrain.bench import project as project_mod
from hvdtrain.bench.report import CEILING_NEEDED, TARGET_BATCH, find_figure

__all__ = ["markdown", "plot"]


def _fmt(value, spec=",.0f", none="-"):
    return none if value is None else format(value, spec)


def _table(head, rows):
    """A Markdown table: `head` and each of `rows` are cells joined by " | "."""
    return [f"| {head} |", "|" + " --- |" * len(head.split(" | "))] + [f"| {r} |" for r in rows]


def _met(value):
    return "n/a" if value is None else ("yes" if value else "**no**")


def _section(title, text, table):
    """A titled table with its explanation (`text`, when any)."""
    return [title, "", *([text, ""] if text else []), *table]


def _header(data):
    env, m, runs = data["environment"], data["machine_at_start"], data["runs"]
    loads = [r["machine"]["load_average"][0] for r in runs if r["machine"]["load_average"]]
    return [
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
    ]


def _comparison(rows, n):
    head = (
        f"model | batch | backend | Keras fit -np 1 | hvdtrain -np 1 | hvdtrain -np {n} | eff. | "
        f"baseline -np 1 | baseline -np {n} | eff. | MWMS -np 1 | MWMS -np {n} | eff. | "
        "hvdtrain / baseline | hvdtrain / MWMS"
    )
    cells = [
        f"{r['model']} | {r['batch_size']} | {r['backend']} | "
        f"{_fmt(r['keras_plain'])} ({_fmt(r['keras_same'])}) | {_fmt(r['hvdtrain_1'])} | "
        f"{_fmt(r['hvdtrain_n'])} | {_fmt(r['hvdtrain_efficiency'], '.2f')} | "
        f"{_fmt(r['baseline_1'])} | {_fmt(r['baseline_n'])} | "
        f"{_fmt(r['baseline_efficiency'], '.2f')} | {_fmt(r['mwms_1'])} | "
        f"{_fmt(r['mwms_n'])} | {_fmt(r['mwms_efficiency'], '.2f')} | "
        f"{_fmt(r['vs_baseline'], '.2f')}x | {_fmt(r['vs_mwms'], '.2f')}x"
        for r in rows
    ]
    return [
        *_section(
            f"## Throughput (samples/s, all ranks) and scaling efficiency at -np {n}",
            "Efficiency = samples/s at N / (N x samples/s of the same variant at -np 1, one core).",
            _table(head, cells),
        ),
        "",
        "Keras fit: plain `compile` (in brackets: with hvdtrain's compile options). MWMS runs "
        "over gRPC whatever the backend column says. Baseline: Horovod's documented Keras recipe.",
    ]


def _keras3(rows, n):
    """hvdtrain's Keras 3 path against its Keras 2 path, side by side (when measured)."""
    head = (
        f"model | batch | backend | Keras 3 -np 1 | Keras 2 -np 1 | ratio | Keras 3 -np {n} | "
        f"Keras 2 -np {n} | ratio | Keras 3 eff. | Keras 3 / baseline"
    )
    cells = [
        f"{r['model']} | {r['batch_size']} | {r['backend']} | {_fmt(r['keras3_1'])} | "
        f"{_fmt(r['hvdtrain_1'])} | {_fmt(r['keras3_vs_keras2_1'], '.2f')} | "
        f"{_fmt(r['keras3_n'])} | {_fmt(r['hvdtrain_n'])} | "
        f"{_fmt(r['keras3_vs_keras2_n'], '.2f')} | {_fmt(r['keras3_efficiency'], '.2f')} | "
        f"{_fmt(r['keras3_vs_baseline'], '.2f')}x"
        for r in rows
        if r["keras3_1"] or r["keras3_n"]
    ]
    title = "## Keras 3 against Keras 2 (hvdtrain, the same models, batches and backends)"
    return _section(title, None, _table(head, cells)) if cells else []


def _targets(data, n):
    cells = []
    for t in data["targets"]:
        met = _met(t["met"]) + (
            f" (ceiling below {CEILING_NEEDED:g})" if t.get("ceiling_too_low") else ""
        )
        cells.append(
            f"{t['target']} | {_fmt(t['value'], '.2f')} ({t['where']}) | "
            f">= {t['threshold']:g} | {met} | {_fmt(t.get('machine_ceiling'), '.2f', '')} | "
            f"{_fmt(t.get('of_ceiling'), '.2f', '')}"
        )
    head = "target | measured | needed | met | this machine's ceiling | share of the ceiling"
    return _section(
        f"## Targets (-np {n}, hvdtrain on {data['default_backend']}, the hvdtrain-run "
        "default on one host)",
        "An efficiency target holds against a machine whose ceiling (below) is at least "
        f"{CEILING_NEEDED:g}; on a lower one, its share of the ceiling is what software can "
        "still improve.",
        _table(head, cells),
    )


def _ceiling(rows, n):
    cells = [
        f"{c['model']} | {c['batch_size']} | {_fmt(c['alone'])} | "
        f"{_fmt(c['side_by_side'])} | {_fmt(c['ceiling'], '.2f')}"
        for c in rows or ()
    ]
    return cells and _section(
        f"## This machine's ceiling: {n} unconnected one-core runs side by side",
        f"hvdtrain at -np 1 alone against {n} copies of it started at once, each on its "
        "own core, with nothing to exchange (samples/s per process). With every core "
        "busy, shared caches, memory bandwidth and the hypervisor slow each one down: no "
        "data-parallel software reaches a higher scaling efficiency on this machine.",
        _table("model | batch | alone | side by side (each) | ceiling", cells),
    )


def _stacks(stacks):
    if not stacks:
        return []
    cells = [
        f"{r['model']} | {r['batch_size']} | {r['job']} | {_fmt(r['this'])} | "
        f"{_fmt(r['other'])} | {_fmt(r['ratio'], '.2f')} | "
        f"{_fmt(r.get('efficiency_this'), '.2f', '')} | "
        f"{_fmt(r.get('efficiency_other'), '.2f', '')}"
        for r in stacks["rows"]
    ]
    return _section(
        "## Old and new stack side by side (`--compare-python`: the same jobs, interleaved)",
        f"This stack: {stacks['this']}; the other: {stacks['other']} (samples/s, all "
        "ranks; the medians over the rounds; eff. = scaling efficiency).",
        _table(
            "model | batch | job | this stack | other stack | this / other | eff. this | "
            "eff. other",
            cells,
        ),
    )


def _input(inp, n):
    if not inp:
        return []
    head = (
        "training from memory | training from files | files / memory | goal | met | "
        "pipeline alone | pipeline / training"
    )
    row = (
        f"{_fmt(inp['memory'])} | {_fmt(inp['files'])} | "
        f"{_fmt(inp['files_vs_memory'], '.3f')} | >= {inp['goal']:g} | {_met(inp['met'])} | "
        f"{_fmt(inp['pipeline'])} | {_fmt(inp['pipeline_vs_training'], '.1f')}x"
    )
    return _section(
        f"## Input pipeline: the convnet from memory and from TFRecord files (-np {n}, batch 64)",
        "The same samples, in memory (`ArrayData`) or in 8 TFRecord files of uneven sizes "
        "(`FileData`: read, shuffled in a buffer, parsed, batched); the pipeline alone "
        "draws the same batches on every rank at once, with no model.",
        _table(head, [row]),
    )


def _setting(row):
    return f"**{row['setting']}** (default)" if row["default"] else row["setting"]


def _tuning(rows):
    cells = [
        f"{t['knob']} | {_setting(t)} | "
        f"{t['model'] or '-'} | {t['np']} | {t['backend'] or '-'} | "
        f"{_fmt(t['samples_per_sec'])} | {_fmt(t.get('step_ms'), '.2f')} | "
        f"{_fmt(t['vs_default'], '.2f')}"
        for t in rows
    ]
    head = "knob | setting | model | -np | backend | samples/s | ms/step | vs default"
    title = "## Tuning: each hvdtrain default against the alternatives (batch 64)"
    return cells and _section(title, None, _table(head, cells))


def _sweep(sweep, n):
    cells = []
    for r in sorted(sweep["rows"], key=lambda r: (r["bytes"], r["backend"])):
        raw = r.get("raw_mpi_seconds")
        cells.append(
            f"{r['bytes']:,} | {r['backend']} | {r['seconds'] * 1e6:,.0f} us | "
            f"{r['algbw'] / 1e9:.2f} GB/s | {r['busbw'] / 1e9:.2f} GB/s | "
            f"{_fmt(raw and raw * 1e6, ',.0f')}{' us' if raw else ''} | "
            f"{_fmt(r.get('raw_mpi_busbw') and r['raw_mpi_busbw'] / 1e9, '.2f')}"
            f"{' GB/s' if raw else ''}"
        )
    memcpy = sweep["memcpy_bytes_per_sec"]
    return cells and _section(
        f"## Allreduce sweep (-np {n}; busbw = algbw x 2(n-1)/n)",
        f"Memory-copy bandwidth of one core (numpy.copyto, 64 MiB), same run: "
        f"{_fmt(memcpy and memcpy / 1e9, '.1f')} GB/s. Horovod: its TensorFlow op after "
        "`hvdtrain.init()` (queue, cycle, fusion-buffer copies, collective); raw MPI: "
        "`MPI_Allreduce` through mpi4py.",
        _table("bytes | backend | time | algbw | busbw | raw MPI time | raw MPI busbw", cells),
    )


def _profile(rows, n):
    cells = []
    for p in rows or ():
        t = p["timeline"] or {}
        coll = sum(v for k, v in t.items() if k.endswith("_ALLREDUCE"))
        copies = t.get("MEMCPY_IN_FUSION_BUFFER", 0) + t.get("MEMCPY_OUT_FUSION_BUFFER", 0)
        neg = t.get("wait_for_other_ranks", 0) + t.get("wait_for_cycle", 0)
        cells.append(
            f"{p['settings']} | {p['backend']} | {_fmt(p['step_ms_np1'], '.2f')} ms | "
            f"{p['step_ms']:.2f} ms | {_fmt(p.get('overhead_ms'), '.2f')} ms | "
            f"{_fmt(t.get('after_last_gradient'), '.2f')} ms | {neg:.2f} ms | "
            f"{copies:.2f} ms | {coll:.2f} ms | {_fmt(p.get('outside_timeline_ms'), '.2f')} ms"
            f" | {_fmt(t.get('responses'), '.0f')} | "
            f"{_fmt(p['raw_mpi_allreduce_ms'], '.3f')} ms | "
            f"{_fmt(p.get('efficiency_bound'), '.2f')}"
        )
    head = (
        "settings | backend | step -np 1 | step -np N | overhead | after last gradient | "
        "negotiate | copies in+out | collective | outside timeline | allreduce ops/step | "
        "bare MPI allreduce | bound"
    )
    return cells and _section(
        f"## Profile: where the MLP's step goes at -np {n} (batch 64, Horovod timeline)",
        "Overhead = step at -np N - hvdtrain's step at -np 1. From the timeline (rank 0): "
        "after the last gradient was handed to Horovod, the time until its allreduce "
        "ended: negotiation (waiting for the other ranks' gradients and the next cycle), "
        "fusion-buffer copies, the collective. The rest of the overhead is outside the "
        "timeline: before Horovod's background thread picked the tensors up (its cycle) "
        "and the background thread's CPU use on the rank's core. Bound = the best "
        "efficiency with no software overhead at all: step(-np 1) / (step(-np 1) + bare "
        "MPI_Allreduce of the gradient, from the sweep). Timelines add a little time.",
        _table(head, cells),
    )


def _cores(rows):
    groups = ("step", "main", "tensorflow", "horovod", "other", "rest")
    cells = [
        f"{c['model']} | {c['batch_size']} | {c['np']} | {c['backend'] or '-'} | "
        + " | ".join(_fmt(c.get(k), ".2f") for k in groups)
        for c in rows or ()
    ]
    return cells and _section(
        "## Where rank 0's core goes (ms per step, hvdtrain; medians over the windows)",
        "Each rank is bound to one core. CPU time per thread group (Linux schedstat): "
        "main = the Python thread (Keras's loop, and the ops TensorFlow runs inline on "
        "it), TF pools = TensorFlow's tf_* threads, Horovod = the threads `hvd.init` "
        "started (its background thread: negotiation every cycle, fusion copies, the "
        "collective, and waiting for the other ranks, spinning or yielding); rest = the "
        "step's time in which the process ran no thread (idle, or the core taken by "
        "another process or the hypervisor).",
        _table(
            "model | batch | -np | backend | step | main | TF pools | Horovod | other | rest", cells
        ),
    )


def _jobs(runs):
    cells = [
        f"{r['name']} | {'yes' if r['ok'] else '**no**'} | {r['seconds']:.0f} | "
        f"{r['machine']['load_average'][0] if r['machine']['load_average'] else '-'} | "
        f"{r['machine']['busy_cores']}"
        for r in runs
    ]
    head = "job | ok | seconds | load average before | cores busy before"
    return _section("## Jobs", None, _table(head, cells))


def markdown(data):
    """The whole report as Markdown: its sections one empty line apart."""
    n = data["config"]["np"]
    proj = data["projection"]
    sections = [
        _header(data),
        _comparison(data["comparison"], n),
        _keras3(data["comparison"], n),
        _targets(data, n),
        _ceiling(data.get("ceiling"), n),
        _stacks(data.get("stacks")),
        _input(data.get("input"), n),
        _tuning(data["tuning"]),
        _sweep(data["allreduce"], n),
        _profile(data.get("profile"), n),
        _cores(data.get("cores")),
        _section(
            "## Projection to GPU clusters (`hvdtrain.bench.project`)",
            None,
            [project_mod.markdown(proj["rows"], proj["paper_check"])],
        ),
        _jobs(data["runs"]),
    ]
    return "\n\n".join("\n".join(s) for s in sections if s) + "\n"


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
            one = find_figure(figures, variant, 1, model, batch)
            many = find_figure(figures, variant, n, model, batch, backend)
            if one and many:
                label = variant + (f" ({backend})" if backend else "")
                ax.plot(
                    [1, n],
                    [one["samples_per_sec"], many["samples_per_sec"]],
                    style,
                    color=color,
                    marker="o",
                    label=label,
                )
        one = find_figure(figures, "hvdtrain", 1, model, batch)
        if one:
            ax.plot(
                [1, n],
                [one["samples_per_sec"], n * one["samples_per_sec"]],
                color="gray",
                linewidth=0.8,
                label="linear (hvdtrain)",
            )
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
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    style,
                    color=color,
                    marker="o",
                    label=label,
                )
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
        pts = sorted(
            (r["bytes"], r["busbw"], r.get("raw_mpi_busbw"))
            for r in sweep["rows"]
            if r["backend"] == backend
        )
        if pts:
            ax.plot(
                [p[0] for p in pts],
                [p[1] / 1e9 for p in pts],
                marker="o",
                color=color,
                label=f"Horovod {backend}",
            )
            if pts[0][2]:
                ax.plot(
                    [p[0] for p in pts],
                    [p[2] / 1e9 for p in pts],
                    "--",
                    marker=".",
                    color=color,
                    label="raw MPI_Allreduce",
                )
    if sweep["memcpy_bytes_per_sec"]:
        ax.axhline(
            sweep["memcpy_bytes_per_sec"] / 1e9,
            color="gray",
            linestyle=":",
            label="memcpy, one core",
        )
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
        ax.plot(
            [int(g) for g in gpus],
            [row["efficiency"][g] for g in gpus],
            marker="o",
            label=row["name"],
        )
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
