"""The lent GPU's prepared session (benchmarks/gpu/session.py) works before device time is
spent on it: its CPU dry run (rows / 64, two devices a task) measures every planned device
of every plan with its prediction beside, and a second run resumes from the rows it left;
the budget and memory rules it runs by."""

from __future__ import annotations

import json
import time

import pytest

from benchmarks import scale_full
from benchmarks.gpu import session
from benchmarks.scale_report import PLANNED as SCALE_PLANNED
from benchmarks.scale_report import latest_plans
from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.judge import resident_sets
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool

DRY_RUN_TASKS = (32, 128)


@pytest.mark.slow
def test_the_dry_run_times_every_planned_device_with_its_prediction_and_resumes(tmp_path) -> None:
    assert session.main(["--device", "cpu", "--out", str(tmp_path)]) == 0, (tmp_path / "scale_full.log").read_text()[-3000:]
    steps = json.loads((tmp_path / "session.json").read_text())["steps"]
    assert [s["step"] for s in steps] == ["scale_full", "test_uvm_dmp_gpu"] and all(s["rc"] == 0 for s in steps)
    assert all(s["pythonpath"].startswith(str(session.OLDEST)) for s in steps) or not session.OLDEST.is_dir()  # the GPU's torchrec
    rows = read_rows(tmp_path / scale_full.ROWS_NAME)
    config = scale_full.DRY_RUN
    for d in DRY_RUN_TASKS:
        planned = latest_plans(read_rows(SCALE_PLANNED), 2, d)
        mine = [r for r in rows if r["devices"] == d]
        visits = {(r["planner"], r["pass"], r["device"]) for r in mine}
        wanted = {(n, p, k) for n in scale_full.PRIORITY for p in range(config.passes) for k in range(scale_full.DRY_RUN_DEVICES)}
        assert visits == wanted and len(mine) == len(wanted), f"D={d}: measured {sorted(visits)}"
        for r in mine:
            assert len(r["fused_ms"]) == config.rounds and min(r["fused_ms"]) > 0, r
            assert r["predicted_ms"] == planned[r["planner"]]["predicted_ms"][r["device"]] > 0, r
    scale_full.main(["measure", "--device", "cpu", "--dry-run", "--pool-seeds", "2", "--devices", "128", "--out", str(tmp_path), "--resume"])
    assert len(read_rows(tmp_path / scale_full.ROWS_NAME)) == len(rows), "a device already measured is measured again"


def test_a_budget_stops_before_a_visit_that_would_pass_it() -> None:
    seen = []
    for visit in scale_full.within(time.monotonic() + 0.25, range(10)):
        seen.append(visit)
        time.sleep(0.1)
    assert seen == [0, 1]  # the third would end past the budget at the longest visit's pace


def test_plans_are_built_together_at_a_device_as_far_as_the_memory_holds() -> None:
    task = generate_task(synthetic_pool(), 32, 4, WorkloadScale(), seed=0)
    plans = {n: baseline_plan(n, task) for n in ("size", "lookup", "size_lookup")}
    need = max(p.device_memory(task.tables, task.batch_size)[0] for p in plans.values())
    assert resident_sets(task, plans, 0, None) == [list(plans)]
    assert resident_sets(task, plans, 0, need) == [[n] for n in plans]
    assert sum(map(len, resident_sets(task, plans, 0, 2 * need))) == 3


def test_the_session_gives_the_leftovers_their_share_and_refuses_a_budget_too_small(tmp_path) -> None:
    names = [name for name, _, _ in session.steps("cuda", tmp_path, 300)]
    assert names == ["scale_full", "uvm_gpu", "test_uvm_dmp_gpu"]
    assert "uvm_gpu" not in [name for name, _, _ in session.steps("cpu", tmp_path, 300)]
    with pytest.raises(SystemExit):
        session.main(["--device", "cpu", "--budget-s", "30", "--out", str(tmp_path)])


def test_the_ids_are_the_same_whichever_tables_are_asked_for_and_however_many_threads() -> None:
    from torchrec_neuroshard.lab.evaluate import task_lookups

    task = generate_task(synthetic_pool(), 6, 2, WorkloadScale(), seed=0)
    whole, some = task_lookups(task, draw=1), task_lookups(task, draw=1, workers=3, only={task.tables[4].name})
    assert list(some) == [task.tables[4].name]
    assert all(a.equal(b) for a, b in zip(some[task.tables[4].name], whole[task.tables[4].name]))


def test_the_report_gives_each_plans_slowest_device_its_ratio_to_torchrec_and_the_prediction_beside(tmp_path) -> None:
    from torchrec_neuroshard.lab.collect import append_rows

    def row(planner: str, device: int, ms: float, predicted: float) -> dict:
        return {"pool_seed": 2, "devices": 2, "plans_sha": "s", "hardware": "NVIDIA H200", "passes": 1, "draws": 1, "rounds": 2,
                "repeats": 1, "pass": 0, "draw": 0, "device": device, "planner": planner, "fused_ms": [ms, ms],
                "replicas_ms": [0.0, 0.0], "predicted_ms": predicted}  # fmt: skip

    rows = [row("torchrec_timeout", 0, 4.0, 4.0), row("torchrec_timeout", 1, 2.0, 2.0), row("neuroshard", 0, 3.0, 1.5), row("neuroshard", 1, 2.0, 2.0)]
    rows += [row("size_lookup", 0, 5.0, 5.0), row("size_lookup", 1, 1.0, 1.0)]
    append_rows(tmp_path / "rows.jsonl", rows + [{**row("lookup", 0, 1.0, 1.0), "devices": 16}])
    text = scale_full.report([tmp_path / "rows.jsonl"])
    assert "| NVIDIA H200 | 2 | 2 | neuroshard | 3.00 | 1.20 | 0.750 (0.750-0.750) | 0.600 (0.600-0.600) | 2 of 2 | 2.00 | 25.0% | -1.00 |" in text, text
    assert "Not measured in full: NVIDIA H200 pool 2 D=16 lookup: 1 of 16 devices" in text


def test_a_set_of_plans_the_gpu_cannot_hold_together_is_timed_plan_by_plan(monkeypatch) -> None:
    import torch

    from torchrec_neuroshard.lab import judge

    tried = []

    def time_set(task, plans, device, draws, config, rotation, on, set_id, reference):
        tried.append(sorted(plans))
        if len(plans) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return [{"planner": n} for n in plans]

    monkeypatch.setattr(judge, "_time_set", time_set)
    task = generate_task(synthetic_pool(), 32, 4, WorkloadScale(), seed=0)
    plans = {n: baseline_plan(n, task) for n in ("size", "lookup")}
    rows = judge.time_device(task, plans, 0, [{}], judge.JudgeConfig(draws=1))
    assert tried == [["lookup", "size"], ["size"], ["lookup"]] and [r["planner"] for r in rows] == ["size", "lookup"]


@pytest.mark.slow
def test_the_stored_full_size_plans_fit_their_tasks_and_carry_a_prediction_per_device() -> None:
    from benchmarks.fullsize import as_planned, topology_for
    from torchrec_neuroshard.types import Plan

    rows = read_rows(scale_full.PLANNED)
    tasks = sorted({(r["pool_seed"], r["devices"]) for r in rows})
    assert (2, 16) in tasks and (2, 32) in tasks and (2, 128) in tasks, tasks
    for pool_seed, d in tasks:
        task = scale_full.full_task(d, pool_seed)
        planned = latest_plans(rows, pool_seed, d)
        assert set(scale_full.PRIORITY) <= set(planned), (pool_seed, d, sorted(planned))
        for name, r in planned.items():
            if r["status"] != "ok":
                assert r["status"].startswith("no plan: "), r["status"]  # how it failed, kept
                continue
            plan = Plan.from_dict(r["plan"])
            plan.validate(as_planned(task, None, plan, topology_for(task))[0])
            assert len(r["predicted_ms"]) == d and min(r["predicted_ms"]) > 0, (pool_seed, d, name)


def test_what_a_device_call_sends_is_the_tracked_and_the_unignored_files(tmp_path, monkeypatch) -> None:
    import subprocess

    from benchmarks.gpu.bundle import travelling_bytes

    monkeypatch.chdir(tmp_path)
    subprocess.run(["git", "init", "-q"], check=True)
    (tmp_path / ".gitignore").write_text("/.gpu/\n")
    (tmp_path / "code.py").write_text("x" * 100)
    (tmp_path / ".gpu").mkdir()
    (tmp_path / ".gpu" / "bundle.tar.xz").write_bytes(b"0" * 1000)  # carried, not sent as the tree
    assert travelling_bytes() == 100 + len("/.gpu/\n")
