"""Real measurements at small sizes: fused TBE compute, gloo all-to-all, the plan evaluator,
and resumable data collection."""

import json
import math
import os

import pytest
import torch

from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.torchrec_baseline import torchrec_plan
from torchrec_neuroshard.lab.collect import collect_comm, collect_compute, read_rows
from torchrec_neuroshard.lab.evaluate import evaluate_plans, format_breakdown, task_lookups
from torchrec_neuroshard.lab.launch import rank_context, spawn, start_process
from torchrec_neuroshard.lab.measure_comm import measure_comm
from torchrec_neuroshard.lab.measure_compute import measure_compute
from torchrec_neuroshard.types import Plan, Shard, TablePlacement
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool, table_spec

pytestmark = pytest.mark.measure  # real timings of kernels and collectives

CPU = torch.device("cpu")
SMALL = WorkloadScale(row_divisor=1024, batch_size=512)


def test_compute_is_positive_and_grows_with_tables() -> None:
    pool = synthetic_pool()
    specs = [table_spec(pool[i], 64, SMALL) for i in range(6)]
    lookups = {s.name: pool[i].lookups(SMALL, seed=i) for i, s in enumerate(specs)}
    ratios = []  # six tables' kernel over one table's, each pair measured back to back
    for _ in range(3):
        one = measure_compute([Shard(specs[0], 64)], lookups, CPU)
        six = measure_compute([Shard(s, 64) for s in specs], lookups, CPU)
        for m in (one, six):
            assert all(math.isfinite(x) and x > 0 for x in (m.fwd.median_ms, m.bwd.median_ms))
            assert len(m.fwd.samples_ms) == 10 and m.fwd.iqr_ms >= 0
        ratios.append(six.total_ms / one.total_ms)
    assert sorted(ratios)[1] > 1.0
    assert measure_compute([], lookups, CPU).total_ms == 0.0


def _comm(rank: int, world_size: int) -> tuple:
    dims = [64 * (r + 1) for r in range(world_size)]
    skews = [0.0] * (world_size - 1) + [20.0]
    m = measure_comm(dims, skews, 256, CPU, warmup=1, repeats=3)
    return m.fwd_ms, m.bwd_ms


@pytest.mark.dmp
@pytest.mark.parametrize("world_size", [2, 4])
def test_comm_runs_on_gloo_groups(world_size: int) -> None:
    results = spawn(_comm, world_size)
    fwd, bwd = results[0]
    assert results[1] == results[0]  # gathered to every rank
    assert len(fwd) == len(bwd) == world_size
    assert all(math.isfinite(x) and x >= 0 for x in fwd + bwd)
    # the ranks that entered early wait for the late one (20 ms skew) beyond the late
    # rank's own exchange, timed in the same call: a difference, whatever the machine's speed
    assert min(fwd[:-1]) > fwd[-1] + 10.0


def _seen_by_rank(rank: int, world_size: int) -> tuple[str | None, str]:
    import os

    return os.environ.get("NEUROSHARD_TEST_MARK"), os.getcwd()


@pytest.mark.dmp
def test_ranks_see_the_callers_environment_and_directory_as_it_is_at_the_call(tmp_path, monkeypatch) -> None:
    spawn(_seen_by_rank, 2)  # the fork server (CPU) is started before the change below
    monkeypatch.setenv("NEUROSHARD_TEST_MARK", "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)
    seen = spawn(_seen_by_rank, 2)
    assert seen == [("set-after-the-server-started", str(tmp_path))] * 2


def _report_seen(queue) -> None:
    queue.put(_seen_by_rank(0, 1))


@pytest.mark.dmp
def test_any_process_started_for_ranks_sees_the_callers_environment_at_its_start(tmp_path, monkeypatch) -> None:
    # calibrate's busy neighbours start this way, not through spawn
    ctx = rank_context()
    queue = ctx.SimpleQueue()
    start_process(ctx, _report_seen, queue).join()  # the fork server (CPU) is started before the change
    assert queue.get() == (None, os.getcwd())
    monkeypatch.setenv("NEUROSHARD_TEST_MARK", "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)
    start_process(ctx, _report_seen, queue, daemon=True).join()
    assert queue.get() == ("set-after-the-server-started", str(tmp_path))


def test_evaluator_measures_our_plan_and_torchrecs_plan_for_the_same_task() -> None:
    task = generate_task(synthetic_pool(), 8, 2, SMALL, seed=1)
    ours = baseline_plan("size", task)
    first = task.tables[0]
    # a hand-made split of the first table across both devices (uneven when possible)
    widths = (first.dim - 4, 4) if first.dim > 4 else (4,)
    hand = Plan(
        tuple(TablePlacement(t.name, widths, (0, 1)[: len(widths)]) if t is first else ours.placement(t.name) for t in task.tables),
        2,
    )
    tr = torchrec_plan(task)
    results = evaluate_plans(task, [ours, hand, tr], rounds=2, warmup=1, repeats=3, lookups=task_lookups(task))
    for m in results:
        assert len(m.devices) == 2 and len(m.round_costs_ms) == 2
        assert m.cost_ms == max(d.total for d in m.devices) > 0
        for d in m.devices:
            assert min(d.fwd_compute, d.bwd_compute, d.fwd_comm, d.bwd_comm) >= 0
        assert "embedding cost" in format_breakdown(m)


def test_compute_collection_resumes_and_drops_a_cut_line(tmp_path) -> None:
    out = tmp_path / "compute.jsonl"
    collect_compute(out, 3, CPU, scale=SMALL, warmup=1, repeats=2, progress=False)
    first = read_rows(out)
    assert len(first) == 3 and [r["group"] for r in first] == [0, 1, 2]
    with open(out, "a") as f:
        f.write('{"kind": "compute", "gro')  # an interrupted write
    collect_compute(out, 5, CPU, scale=SMALL, warmup=1, repeats=2, progress=False)
    rows = read_rows(out)
    assert [r["group"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[:3] == first
    r = rows[4]
    assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["hardware"]["threads"] == 1
    assert all(len(s["access_hist"]) == 17 for s in r["shards"])


@pytest.mark.dmp
def test_comm_collection_appends_per_world_size(tmp_path) -> None:
    out = tmp_path / "comm.jsonl"
    collect_comm(out, 2, 3, batch_size=256, progress=False)
    collect_comm(out, 2, 4, batch_size=256, progress=False)
    rows = read_rows(out)
    assert [r["group"] for r in rows] == [0, 1, 2, 3]
    assert all(len(r["fwd_ms"]) == len(r["dims"]) == len(r["skews_ms"]) == 2 for r in rows)
    assert json.loads(json.dumps(rows[0]))["hardware"]["backend"] == "gloo"
