"""The comparison benchmark end to end on two tiny tasks: plan, measure, report, plot."""

from benchmarks.compare import PLANNERS, make_suite, plot, run, summarize, write_report
from torchrec_neuroshard.lab.workloads import WorkloadScale


def test_compare_runs_end_to_end_on_two_tiny_tasks(tmp_path) -> None:
    tasks = make_suite(1, sizes=((6, 2), (8, 2)), scale=WorkloadScale(row_divisor=1024, batch_size=512))
    rows = run(tasks, tmp_path / "r.jsonl", rounds=1, progress=False)
    assert len(rows) == 2 * len(PLANNERS)
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["planner"] for r in ok} >= {"neuroshard", "torchrec", "size"}
    for r in ok:
        assert r["cost_ms"] > 0 and len(r["per_device"]) == 2
    # resuming finds both tasks done and measures nothing again
    assert run(tasks, tmp_path / "r.jsonl", rounds=1, progress=False) == rows
    table, headline = summarize(rows)
    assert "| 6, 2 | NeuroShard |" in table and headline["tasks"] == 2
    assert headline["neuroshard_over_torchrec_geomean"] > 0
    assert "tasks where TorchRec's plan fit the memory cap" in write_report(rows, tmp_path)
    assert all(p.stat().st_size > 1000 for p in plot(rows, tmp_path))
