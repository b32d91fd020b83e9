"""The comparison benchmark end to end on two tiny tasks: plan, measure, report, plot."""

from dataclasses import replace

from benchmarks.compare import PLANNERS, make_suite, plot, run, summarize, write_report
from torchrec_neuroshard.lab.workloads import WorkloadScale


def test_compare_runs_end_to_end_on_two_tiny_tasks(tmp_path) -> None:
    tasks = make_suite(1, sizes=((6, 2), (8, 2)), scale=WorkloadScale(row_divisor=1024, batch_size=512))
    # the second task's cap holds 0.9 x an even share of its memory (as TorchRec counts it):
    # no whole-table plan fits, TorchRec's planner finds none, and its plan at its default
    # topology memory is recorded beside that result
    memory = [t.memory_bytes(tasks[1].batch_size, 2) for t in tasks[1].tables]
    tasks[1] = replace(tasks[1], memory_cap_bytes=int(max(1.01 * max(memory), 0.9 * sum(memory) / 2)))
    rows = run(tasks, tmp_path / "r.jsonl", rounds=1, progress=False)
    assert len(rows) == 2 * len(PLANNERS) + 1
    by = {(r["task"], r["planner"]): r for r in rows}
    assert by[0, "torchrec"]["status"] == "ok"
    assert by[1, "torchrec"]["status"].startswith("invalid: PlannerError")
    assert (1, "torchrec_default_memory") in by and (0, "torchrec_default_memory") not in by
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


def test_dmp_step_quick_mode_runs_every_plan_under_dmp(tmp_path) -> None:
    from benchmarks.dmp_step import PLANNERS, QUICK_CONFIG, QUICK_SCALE, QUICK_TABLES, generated_tasks, report, run

    tasks = generated_tasks(QUICK_TABLES, [0], 2, QUICK_SCALE)
    rows = run(tasks, QUICK_CONFIG, out=tmp_path / "steps.jsonl", progress=False)
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == len(rows)
    for label in ("T6_D2_pool0", "T10_D2_pool0"):
        by_planner = {r["planner"]: r for r in rows if r["task"] == label}
        assert set(PLANNERS) <= set(by_planner)
        ran = [r for r in by_planner.values() if r["status"] == "ok"]
        # every planner's plan ran; TorchRec's may be "no plan within the cap", then its
        # default-memory plan ran instead
        assert {r["planner"] for r in ran} >= set(PLANNERS) - {"torchrec"}
        assert "torchrec" in {r["planner"] for r in ran} or by_planner["torchrec_default_memory"]["status"] == "ok"
        for r in ran:
            assert r["sharded_modules"] == QUICK_CONFIG.num_ebcs  # both EBCs sharded by DMP
            assert r["steps"] == QUICK_CONFIG.steps
            assert r["step_ms"] > 0 and r["step_iqr_ms"] >= 0
            assert 0 < r["embedding_ms"] <= r["step_ms"] and 0 < r["embedding_share"] <= 1
    assert "| T10_D2_pool0 | neuroshard |" in report(rows)
