"""The chaos run's report (pure): a line per fault, the table at the end, the totals of
`--json` and the verdict on the final weights (`hvdtrain.launcher.chaos` runs the faults)."""

from hvdtrain.launcher.faults import target

__all__ = ["fault_record", "totals", "progress_line", "table", "digest_line", "last_line"]


def fault_record(fault, promised):
    """The record of `fault` (a `faults.Fault`) before it strikes: what `totals`, `table`
    and `--json` read, `promised` its promised seconds to the end (pure)."""
    record = {
        "index": fault.index,
        "kind": fault.kind,
        "rank": fault.rank,
        "injected": False,
        "when": None,
        "exit_status": None,
        "line": "",
        "seconds_to_end": 0.0,
        "promise": promised,
        "hang": False,
        "processes_left": 0,
        "traceback": False,
        "checkpoint_lost": False,
        "survived": False,
    }
    if fault.seconds:  # a link kind's time slowed
        record["link_seconds"] = fault.seconds
    return record


def totals(records, digests_equal):
    """The run's totals from the fault `records` (dicts) (pure)."""
    injected = [r for r in records if r["injected"]]
    return {
        "faults": len(injected),
        "not_injected": len(records) - len(injected),
        "survived": sum(1 for r in injected if r["survived"]),
        "digests_equal": bool(digests_equal),
        "hangs": sum(1 for r in injected if r["hang"]),
        "left_behind": sum(r["processes_left"] for r in injected),
        "tracebacks": sum(1 for r in injected if r["traceback"]),
        "checkpoints_lost": sum(1 for r in injected if r["checkpoint_lost"]),
        "failed_alone": sum(1 for r in records if r.get("failed_alone")),
    }


def progress_line(record, total):
    """`fault 3/7 kill-rank (rank 1) at epoch 2 step 4 (training): ended in 6.1 s, exit 1:
    <its line>` (pure)."""
    who = f" ({target(record)})" if target(record) != "-" else ""
    head = f"fault {record['index']}/{total} {record['kind']}{who}"
    if not record["injected"]:
        return f"{head}: not injected ({record['line']})"
    when = record["when"]
    at = f"at epoch {when['epoch']} step {when['step']} ({when['phase']})"
    problems = [
        p
        for p, bad in (
            (f"HANG (over {record['promise']:g} s)", record["hang"]),
            (f"{record['processes_left']} process(es) left behind", record["processes_left"]),
            ("a traceback printed", record["traceback"]),
            ("a checkpoint lost", record["checkpoint_lost"]),
        )
        if bad
    ]
    verdict = "; ".join(problems) if problems else "ok"
    line = f": {record['line']}" if record["line"] else ""
    slower = record.get("slower_seconds")
    slower = "" if slower is None else f" ({slower:+.1f} s against the uninterrupted run)"
    return (
        f"{head} {at}: ended in {record['seconds_to_end']:.1f} s{slower}, exit "
        f"{record['exit_status']}, {verdict}{line}"
    )


def table(records):
    """The faults as a fixed-width table (pure)."""
    rows = [("#", "kind", "hit", "epoch", "step", "phase", "exit", "s to end", "left", "tb",
             "lost", "result")]  # fmt: skip
    for r in records:
        when = r.get("when") or {}
        rows.append(
            (
                str(r["index"]),
                r["kind"],
                target(r).removeprefix("rank "),
                str(when.get("epoch", "-")),
                str(when.get("step", "-")),
                when.get("phase", "-"),
                str(r["exit_status"]),
                f"{r['seconds_to_end']:.1f}" if r["injected"] else "-",
                str(r["processes_left"]),
                "yes" if r["traceback"] else "no",
                "yes" if r["checkpoint_lost"] else "no",
                ("survived" if r["survived"] else "FAILED")
                if r["injected"]
                else ("FAILED ALONE" if r.get("failed_alone") else "not injected"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def digest_line(reference, final):
    """The verdict on the final weights, one line (pure)."""
    if final is None:
        return "the run with faults did not finish: no final weights to compare"
    if final == reference:
        return f"final weights digest equal to the uninterrupted run's ({final[:16]})"
    return (
        f"final weights digest {final[:16]} differs from the uninterrupted run's "
        f"{(reference or '?')[:16]}: the script does not resume exactly (unseeded random "
        "numbers, state outside the model and optimizer, or data order of its own)"
    )


def last_line(text):
    """The job's one line about how it ended: its last hvdtrain line."""
    lines = [line.strip() for line in text.splitlines()]
    ours = [line for line in lines if line.startswith(("hvdtrain-run", "hvdtrain:"))]
    return (ours or [""])[-1][:300]
