"""The tables of ``benchmarks.search_speed_full``'s rows: NeuroShard's ``plan()`` on the
held-out pools (the last commit's rows), and on the training pool before and after the
planning-speed work (by commit), TorchRec's planner beside, and NeuroShard's profiles."""

from __future__ import annotations

BEFORE = "50a0ad0"
"""The commit before the planning-speed work (issue 26): its rows are the "before" column."""


def _latest(rows: list[dict], planner: str, before: bool) -> dict[tuple[int, int], dict]:
    """Per (tables, devices), the last row of ``planner`` at ``BEFORE`` (or at any other commit)."""
    out = {}
    for r in rows:
        if r["planner"] == planner and (r["commit"] == BEFORE) == before:
            out[(r["tables"], r["devices"])] = r
    return out


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["status"] != "ok":
        return f"{row['planning_s']} s, {row['status']}" if "planning_s" in row else row["status"]
    note = f"; {row['note']}" if row.get("note") else ""
    return f"{row['planning_s']} s ({row['cpu_s']} CPU){note}"


def _fastest_torchrec(rows: list[dict | None]) -> dict | None:
    planned = [r for r in rows if r is not None and r["status"] == "ok"]
    return min(planned, key=lambda r: r["cpu_s"]) if planned else None


def report(rows: list[dict]) -> str:
    held_out = [r for r in rows if r.get("pool_seed", 0) != 0]
    training = [r for r in rows if r.get("pool_seed", 0) == 0]
    parts = [held_out_table(held_out)] if held_out else []
    return "\n\n".join(parts + ["## The training pool (seed 0)\n\n" + training_table(training)])


def held_out_table(rows: list[dict]) -> str:
    """NeuroShard's ``plan()`` seconds per task (rows) and held-out pool (columns), the
    newest commit's rows; the plans' predicted steps and peak memory beside."""
    mine = [r for r in rows if r["planner"] == "neuroshard"]
    newest = mine[-1]["commit"]
    last = {(r["tables"], r["devices"], r["pool_seed"]): r for r in mine if r["commit"] == newest}
    pools = sorted({p for _, _, p in last})
    lines = [
        f"## Held-out pools: `NeuroShardPlanner.plan()` end to end (commit {newest})",
        "",
        "Each cell: wall seconds of the first `plan()` of a fresh process (CPU seconds), the cost model loaded inside it.",
        "",
        "| T | D | " + " | ".join(f"pool {p}" for p in pools) + " | predicted ms (our model) | peak MB |",
        "|---" * (len(pools) + 4) + "|",
    ]
    for tables, devices in sorted({(t, d) for t, d, _ in last}):
        cells = [last.get((tables, devices, p)) for p in pools]
        ok = [r for r in cells if r is not None and r["status"] == "ok"]
        pred = " / ".join(f"{r['predicted_ms']:.2f}" for r in ok) or "-"
        peak = f"{max(r['peak_mb'] for r in ok):.0f}" if ok else "-"
        lines.append(f"| {tables} | {devices} | " + " | ".join(_cell(r) for r in cells) + f" | {pred} | {peak} |")
    return "\n".join(lines)


def training_table(rows: list[dict]) -> str:
    before, after = _latest(rows, "neuroshard", True), _latest(rows, "neuroshard", False)
    dp, timed = _latest(rows, "torchrec_dp", False), _latest(rows, "torchrec_timeout", False)
    commits = sorted({r["commit"] for r in after.values()})
    lines = [
        f"NeuroShard before ({BEFORE}) and after ({', '.join(commits)}); TorchRec 1.8 beside. Planning seconds: wall "
        "(CPU); the ratio is of CPU seconds, which other processes on the machine inflate less than wall time.",
        "",
        "| T | D | NeuroShard before s | after s | peak MB before / after (RSS before planning) "
        "| predicted ms before -> after (our model) | TorchRec DynamicProgramming | TorchRec default, timeout_seconds | fastest TorchRec plan / NeuroShard, CPU s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(set(before) | set(after) | set(dp) | set(timed)):
        b, a = before.get(key), after.get(key)
        fast = _fastest_torchrec([dp.get(key), timed.get(key)])
        ok = lambda r: r is not None and r["status"] == "ok"  # noqa: E731
        mem = " / ".join(f"{r['peak_mb']:.0f}" if r else "-" for r in (b, a)) + (f" ({a['base_mb']:.0f})" if a else "")
        pred = "-"
        if ok(b) and ok(a):
            pred = f"{b['predicted_ms']:.2f} -> {a['predicted_ms']:.2f} ({100 * (a['predicted_ms'] / b['predicted_ms'] - 1):+.2f}%)"
        elif ok(a):
            pred = f"- -> {a['predicted_ms']:.2f}"
        ratio = f"{fast['cpu_s'] / a['cpu_s']:.0f}x ({fast['planner']})" if fast and ok(a) else "-"
        lines.append(
            f"| {key[0]} | {key[1]} | {_cell(b)} | {_cell(a)} | {mem} | {pred} | {_cell(dp.get(key))} | {_cell(timed.get(key))} | {ratio} |"
        )
    for title, side in (("after", after), ("before", before)):
        for key, r in sorted(side.items()):
            if r.get("profile"):
                lines += ["", f"NeuroShard's cumulative profile, {title}, T = {key[0]}, D = {key[1]} (top entries):", "", "```", r["profile"], "```"]
    return "\n".join(lines)
