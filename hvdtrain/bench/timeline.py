"""Where a training step's time goes, from a Horovod timeline (HOROVOD_TIMELINE).

Horovod's timeline (rank 0 writes it, Chrome-trace JSON) has one "process" per tensor; each
gradient allreduce is a NEGOTIATE_ALLREDUCE span (from the moment this rank submitted the
tensor until every rank had it and the background thread's cycle picked it up; marks "0",
"1", ... say when each rank was ready) followed by an ALLREDUCE span with its phases
(MEMCPY_IN_FUSION_BUFFER, MPI_ALLREDUCE or GLOO_ALLREDUCE, MEMCPY_OUT_FUSION_BUFFER ...).

`summarize_timeline` turns it into per-step medians (milliseconds):

- `period`: from one step's first gradient submitted to the next step's;
- `after_last_gradient`: from the last gradient submitted on rank 0 until its allreduce
  ended, the communication on the step's critical path, split into
  `wait_for_other_ranks` (the slowest rank's last gradient came later),
  `wait_for_cycle` (all were ready; the background thread's next cycle had not come),
  `to_start` (negotiated, not yet started) and each ALLREDUCE phase;
- `compute`: period - after_last_gradient (forward, backward, update, Keras' loop);
- `responses`: allreduce operations per step (1 when all gradients fused into one).

Pure: reads a file or text, never imports TensorFlow.
"""

import json
import statistics

__all__ = ["load_events", "allreduce_instances", "summarize_timeline"]


def load_events(text):
    """The events of a timeline's text, also when Horovod did not close the JSON array."""
    text = text.strip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)


def allreduce_instances(events):
    """{tensor name: [one dict per allreduce of that tensor, in order]} for every tensor
    whose name mentions Allreduce or hvdtrain.gradient (the gradients, on Keras 2 or 3)."""
    names = {
        e["pid"]: e.get("args", {}).get("name", "")
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    open_spans = {}  # pid -> stack of (name, ts)
    current = {}  # pid -> the instance being built
    out = {}
    for e in events:
        pid, ph = e.get("pid"), e.get("ph")
        name = names.get(pid, "")
        if "Allreduce" not in name and "hvdtrain.gradient" not in name:
            continue
        stack = open_spans.setdefault(pid, [])
        if ph == "B":
            stack.append((e["name"], e["ts"]))
            if e["name"] == "NEGOTIATE_ALLREDUCE":
                current[pid] = {"submit": e["ts"], "ready": {}, "phases": {}}
                out.setdefault(name, []).append(current[pid])
        elif ph == "X" and pid in current and str(e.get("name", "")).isdigit():
            current[pid]["ready"][int(e["name"])] = e["ts"]
        elif ph == "E" and stack:
            span, start = stack.pop()
            inst = current.get(pid)
            if inst is None:
                continue
            if span == "NEGOTIATE_ALLREDUCE":
                inst["negotiated"] = e["ts"]
            elif span == "ALLREDUCE":
                inst["start"], inst["end"] = start, e["ts"]
            else:
                inst["phases"][span] = (start, e["ts"])
    return out


def _clusters(times, gap=50):
    """How many groups `times` (sorted, microseconds) form, a new one after each `gap`."""
    return sum(1 for a, b in zip([None, *times], times, strict=False) if a is None or b - a > gap)


def _union_ms(intervals):
    total, last = 0.0, None
    for start, end in sorted(intervals):
        if last is not None and start < last:
            start = last
        if end > start:
            total += end - start
        last = end if last is None else max(last, end)
    return total / 1000


def summarize_timeline(text, skip_steps=5):
    """Per-step medians (ms) of where the time goes; see the module docstring. The first
    `skip_steps` steps (warm-up, the broadcast) are left out."""
    instances = allreduce_instances(load_events(text))
    complete = {k: [i for i in v if "end" in i] for k, v in instances.items()}
    if not complete:
        return None
    steps = min(len(v) for v in complete.values())
    rows = []
    for k in range(steps):
        group = [v[k] for v in complete.values()]
        first = min(i["submit"] for i in group)
        last = max(i["submit"] for i in group)
        ready = max([max(i["ready"].values()) for i in group if i["ready"]] or [last])
        negotiated = max(i.get("negotiated", i["start"]) for i in group)
        start = min(i["start"] for i in group if i["start"] >= negotiated - 1) if group else 0
        end = max(i["end"] for i in group)
        phases = {}
        for i in group:
            for name, span in i["phases"].items():
                phases.setdefault(name, set()).add(span)
        rows.append(
            {
                "first": first,
                "after_last_gradient": (end - last) / 1000,
                "wait_for_other_ranks": max(0, ready - last) / 1000,
                "wait_for_cycle": max(0, negotiated - max(ready, last)) / 1000,
                "to_start": max(0, start - negotiated) / 1000,
                "backward_spread": (last - first) / 1000,
                "responses": _clusters(sorted(i["start"] for i in group)),
                **{name: _union_ms(spans) for name, spans in phases.items()},
            }
        )
    for a, b in zip(rows, rows[1:], strict=False):
        a["period"] = (b["first"] - a["first"]) / 1000
    rows = [r for r in rows[skip_steps:] if "period" in r]
    if not rows:
        return None
    keys = sorted({k for r in rows for k in r} - {"first"})
    summary = {
        k: round(statistics.median(r.get(k, 0.0) for r in rows), 4) for k in keys if k != "first"
    }
    summary["compute"] = round(summary["period"] - summary["after_last_gradient"], 4)
    summary["steps"] = len(rows)
    summary["tensors"] = len(complete)
    return summary
