"""The production-scale planning benchmark: one row planned in its own process, and the
report's before/after and TorchRec columns."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.search_speed_full import run_all
from benchmarks.search_speed_report import BEFORE, report

ROOT = Path(__file__).parents[1]


def _row(planner: str, commit: str, seconds: float, predicted: float | None = 10.0, **more) -> dict:
    row = {"tables": 856, "devices": 8, "planner": planner, "commit": commit, "planning_s": seconds, "cpu_s": seconds,
           "base_mb": 400.0, "peak_mb": 500.0, "status": "ok", "note": "", "predicted_ms": predicted}  # fmt: skip
    return {**row, **more}


def test_report_sets_before_after_and_torchrec_side_by_side() -> None:
    rows = [
        _row("neuroshard", BEFORE, 20.0, 40.0),
        _row("neuroshard", "abc1234", 4.0, 40.2),
        _row("torchrec_dp", "abc1234", 80.0),
        _row("torchrec_timeout", "abc1234", 300.0, status="no plan: PlannerError: no plan fits"),
    ]
    text = report(rows)
    line = next(x for x in text.splitlines() if x.startswith("| 856 | 8 |"))
    assert "20.0 s (20.0 CPU)" in line and "4.0 s (4.0 CPU)" in line
    assert "40.00 -> 40.20 (+0.50%)" in line
    assert "no plan: PlannerError" in line
    assert "20x (torchrec_dp)" in line  # the fastest configuration that returned a plan


@pytest.mark.slow
def test_one_row_is_planned_in_its_own_process_and_kept(tmp_path) -> None:
    out = tmp_path / "rows.jsonl"
    run_all([(200, 16)], ["neuroshard"], timeout=300, profile=True, out=out)  # a small row: the same code
    row = json.loads(out.read_text().splitlines()[0])
    assert row["status"] == "ok" and row["planning_s"] > 0 and row["peak_mb"] >= row["base_mb"] > 0
    assert "search" in row["profile"] and row["predicted_ms"] > 0
    run_all([(200, 16)], ["neuroshard"], timeout=300, profile=False, out=out)  # resumes: nothing new
    assert len(out.read_text().splitlines()) == 1
    shown = subprocess.run(
        [sys.executable, "-m", "benchmarks.search_speed", "--full-size", "--report-only", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    assert "| 200 | 16 |" in shown.stdout and (tmp_path / "rows.md").exists()


def test_a_plan_on_uvm_kernels_is_checked_in_host_memory_and_priced_with_the_stand_in() -> None:
    import dataclasses

    from benchmarks.fullsize import as_planned
    from torchrec_neuroshard.costmodel import cost_model_for, load_pretrained
    from torchrec_neuroshard.heuristics import baseline_plan
    from torchrec_neuroshard.kernels import ComputeKernel
    from torchrec_neuroshard.lab.torchrec_baseline import topology_for
    from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
    from torchrec_neuroshard.search import predicted_breakdown
    from torchrec_neuroshard.types import Plan, ShardingError

    task = generate_task(synthetic_pool(), 24, 8, WorkloadScale(1, 65_536), seed=0)
    topology = topology_for(task, "cuda", 8)
    model = cost_model_for(topology, load_pretrained("h200")).with_batch_size(task.batch_size)
    fused = baseline_plan("size", task)
    uvm = Plan(tuple(dataclasses.replace(p, kernel=ComputeKernel.FUSED_UVM) for p in fused.placements), fused.num_devices)
    assert as_planned(task, model, fused, topology) == (task, model)  # a fused plan as it is
    with pytest.raises(ShardingError, match="no host memory cap"):
        uvm.validate(task)
    planned, priced = as_planned(task, model, uvm, topology)
    uvm.validate(planned)
    assert predicted_breakdown(priced, planned, uvm)[0] > predicted_breakdown(model, task, fused)[0]


def test_a_plan_with_replicas_is_priced_on_the_topologys_links_and_never_reported_as_no_plan() -> None:
    import dataclasses

    from benchmarks.fullsize import priced_row, report
    from torchrec_neuroshard.costmodel import cost_model_for, load_pretrained
    from torchrec_neuroshard.heuristics import baseline_plan
    from torchrec_neuroshard.lab.torchrec_baseline import topology_for
    from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
    from torchrec_neuroshard.types import Plan, ShardingKind, TablePlacement

    task = generate_task(synthetic_pool(seed=2), 24, 8, WorkloadScale(1, 65_536), seed=0)
    model = cost_model_for(topology_for(task, "cuda", 8), load_pretrained("h200")).with_batch_size(task.batch_size)
    whole = baseline_plan("size", task)
    small = min(task.tables, key=lambda t: t.rows).name
    replicated = Plan(tuple(p if p.table != small else TablePlacement(small, kind=ShardingKind.DATA_PARALLEL) for p in whole.placements), 8)
    row = priced_row(task, model, replicated, {"note": ""})  # the task itself carries no links
    assert row["status"] == "ok" and row["predicted_ms"] > 0 and row["kinds"]["data_parallel"] == 1
    tight = dataclasses.replace(task, memory_cap_bytes=1)
    unfit = priced_row(tight, model, whole, {"note": ""})
    assert unfit["status"].startswith("does not fit")
    shown = report([{"pool_seed": 2, "devices": 8, "planner": "size", "cap_bytes": 1, "planning_s": 0.01, **unfit}])
    assert "| does not fit: " in shown and shown.rstrip().endswith(f"| - | {unfit['max_shards_per_device']} |")
