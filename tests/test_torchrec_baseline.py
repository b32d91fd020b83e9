"""TorchRec's planner configured as its docs say: per-rank batch, pooling factors, the
task's memory, and no silent cap raising."""

import dataclasses

import pytest
import torchrec.distributed.planner as torchrec_planner
from torchrec.distributed.planner.types import PlannerError

from torchrec_neuroshard.lab.torchrec_baseline import per_rank_batch, run_torchrec, torchrec_plan
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.sharding import from_torchrec
from torchrec_neuroshard.types import ShardingError

SMALL = WorkloadScale(row_divisor=1024, batch_size=512)


@pytest.fixture
def planner_calls(monkeypatch) -> list[dict]:
    """Every EmbeddingShardingPlanner built, with its keyword arguments (the real planner runs)."""
    calls: list[dict] = []
    real = torchrec_planner.EmbeddingShardingPlanner

    def spy(**kwargs):
        calls.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(torchrec_planner, "EmbeddingShardingPlanner", spy)
    return calls


@pytest.mark.parametrize("devices", [2, 4])
def test_torchrec_gets_the_per_rank_batch_pooling_factors_and_the_task_memory(planner_calls, devices) -> None:
    # at rows / 64 the weights dominate TorchRec's storage estimate (at rows / 1024 its I/O
    # buffers alone exceed the cap and it finds no plan)
    task = generate_task(synthetic_pool(), 8, devices, WorkloadScale(), seed=3)
    plan = from_torchrec(torchrec_plan(task), devices)
    plan.validate(task)
    (kwargs,) = planner_calls
    assert kwargs["batch_size"] == task.batch_size // devices == per_rank_batch(task)
    assert {n: c.pooling_factors for n, c in kwargs["constraints"].items()} == {
        t.name: [t.pooling_factor] for t in task.tables
    }
    assert all(d.storage.ddr == task.memory_cap_bytes for d in kwargs["topology"].devices)


def test_no_plan_within_the_cap_is_torchrecs_result_and_its_default_memory_plan_is_separate() -> None:
    task = generate_task(synthetic_pool(), 8, 2, SMALL, seed=3)
    largest = max(t.size_bytes() for t in task.tables)
    tight = dataclasses.replace(task, memory_cap_bytes=largest + 1)  # the tables cannot fit on 2 ranks
    with pytest.raises(PlannerError):
        torchrec_plan(tight)
    plan = from_torchrec(torchrec_plan(tight, default_memory=True), 2)
    assert {p.table for p in plan.placements} | set(plan.data_parallel) == {t.name for t in task.tables}


def test_a_batch_that_does_not_split_over_the_ranks_is_named() -> None:
    task = dataclasses.replace(generate_task(synthetic_pool(), 4, 2, SMALL, seed=3), num_devices=3)
    with pytest.raises(ShardingError, match="does not split evenly over 3 ranks"):
        per_rank_batch(task)


def test_a_torchrec_run_reports_its_plan_kinds_and_memory_and_its_failures_as_results() -> None:
    task = generate_task(synthetic_pool(), 8, 2, WorkloadScale(), seed=3)
    run = run_torchrec(task, "cpu", timeout_seconds=600)
    assert run.status == "ok" and run.plan is not None and run.proposals > 0
    assert sum(run.kinds.values()) == sum(run.kernels.values()) == len(task.tables)
    assert 0 < run.peak_ddr_bytes <= task.memory_cap_bytes  # a CPU topology's memory is DDR
    # the dynamic-programming proposer bins HBM, which a CPU topology has none of
    failed = run_torchrec(task, "cpu", timeout_seconds=600, proposer="dynamic_programming")
    assert failed.plan is None and failed.status.startswith("failed: ZeroDivisionError")
    with pytest.raises(ValueError, match="proposer 'beam'"):
        run_torchrec(task, "cpu", timeout_seconds=None, proposer="beam")


def test_torchrecs_own_timeout_returns_its_best_plan_so_far_and_says_so(planner_calls, monkeypatch) -> None:
    """TorchRec checks its budget before each proposal: on a clock that moves 0.6 s a
    reading, the second check is past a 1 s budget, so exactly one proposal is made and
    the run says it timed out; on the real clock the same task makes several, within it."""
    import itertools
    import types

    from torchrec.distributed.planner import planners

    task = generate_task(synthetic_pool(), 8, 2, WorkloadScale(), seed=3)
    untimed = run_torchrec(task, "cpu", timeout_seconds=600)
    assert untimed.status == "ok" and untimed.proposals > 1
    readings = itertools.count()
    monkeypatch.setattr(planners, "time", types.SimpleNamespace(time=lambda: 0.6 * next(readings)))
    run = run_torchrec(task, "cpu", timeout_seconds=1)
    assert planner_calls[-1]["timeout_seconds"] == 1
    assert (run.status, run.proposals) == ("timed out: best of 1 proposals", 1)
    assert run.plan is not None and sum(run.kinds.values()) == len(task.tables)
