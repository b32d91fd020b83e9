"""README.md's and docs/results.md's figures are those of the committed rows they cite
(benchmarks/results/): planning time at production scale, planning beside TorchRec at scale
and beyond HBM."""

from __future__ import annotations

from pathlib import Path

from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.workloads import HELD_OUT_POOL_SEEDS

ROOT = Path(__file__).parents[1]
ROWS = ROOT / "benchmarks" / "results"


def _words(text: str) -> str:
    """``text`` with every run of whitespace (line breaks too) one space."""
    return " ".join(text.split())


README = _words((ROOT / "README.md").read_text())
RESULTS_MD = (ROOT / "docs" / "results.md").read_text()


def _section(title: str) -> str:
    """results.md's section ``## title``, whitespace folded."""
    return _words(RESULTS_MD.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0])


def _range(values: list[float], digits: int) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def test_planning_time_is_the_last_production_scale_runs() -> None:
    """plan() on the held-out pools, the newest commit's rows: 856 tables at every D, and
    5,000 tables on 1,024 GPUs, each a range over the pools."""
    rows = [r for r in read_rows(ROWS / "search_speed_full.jsonl") if r["planner"] == "neuroshard" and r.get("pool_seed") in HELD_OUT_POOL_SEEDS]
    newest = rows[-1]["commit"]
    last = {(r["tables"], r["devices"], r["pool_seed"]): r for r in rows if r["commit"] == newest}
    tables_856 = _range([r["planning_s"] for (t, _, _), r in last.items() if t == 856], 1)
    big = _range([r["planning_s"] for (t, d, _), r in last.items() if (t, d) == (5000, 1024)], 1)
    row = f"| planning 856 full-size tables on 8-128 GPUs, one core, held-out pools | **{tables_856} s** (5,000 tables on 1,024 GPUs: {big} s) |"
    assert row in README
    section = _section("Planning time")
    assert f"**{tables_856} s** at {newest}" in section and f"**{big} s**" in section


def test_planning_beyond_hbm_beside_torchrec_is_the_committed_runs() -> None:
    rows = read_rows(ROWS / "uvm.jsonl")
    ours, theirs = _range([r["neuroshard_s"] for r in rows], 2), _range([r["torchrec_s"] for r in rows], 1)
    ratio = _range([r["neuroshard_ours_ms"] / r["torchrec_ours_ms"] for r in rows], 2)
    section = _section("Models beyond HBM (UVM kernels)")
    assert f"ours in {ours} s, TorchRec's in {theirs} s" in section
    assert f"its own kernels: ours {ratio}x TorchRec's" in section


def test_planning_at_scale_is_the_committed_plans() -> None:
    """The shipped model's search and TorchRec's plan() per D, over the held-out pools' last plans."""
    from benchmarks.scale_report import shipped_planner

    last = {}  # (pool, D, planner) -> row
    for r in read_rows(ROWS / "scale_planned.jsonl.gz"):
        if r.get("pool_seed") in HELD_OUT_POOL_SEEDS:
            last[r["pool_seed"], r["devices"], r["planner"]] = r
    seconds = lambda name, d=None: [r["planning_s"] for (_, dd, n), r in last.items() if n == name and d in (None, dd)]  # noqa: E731
    by_task: dict[tuple, dict[str, dict]] = {}
    for (pool_seed, devices, name), r in last.items():
        by_task.setdefault((pool_seed, devices), {})[name] = r
    ours = _range(seconds(shipped_planner(by_task)), 1)
    per_d = ", ".join(f"{_range(seconds('torchrec_timeout', d), 0)} s at D = {d}" for d in (8, 16, 32, 128))
    assert f"NeuroShard's search {ours} s" in README and f"vs TorchRec's planner {_range(seconds('torchrec_timeout'), 0)} s" in README
    section = _section("At scale, measured")
    assert f"NeuroShard's search {ours} s" in section and f"TorchRec's `plan()` {per_d}." in section
    assert not seconds("torchrec_timeout", 64)  # not planned at D = 64: the sentence leaves it out
