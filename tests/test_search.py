"""NeuroShard's search and the baselines, scored with the shipped cost model."""

import itertools

import numpy as np
import pytest

from torchrec_neuroshard.heuristics import BASELINES, baseline_plan
from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.search import SearchConfig, predicted_breakdown, search
from torchrec_neuroshard.types import InfeasibleError, Plan, TableChoices, TablePlacement, TableSpec, Task
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool


@pytest.fixture(scope="module")
def model():
    return load_pretrained()


@pytest.mark.parametrize("tables,devices,seed", [(20, 2, 0), (40, 4, 1), (60, 4, 2), (80, 8, 3)])
def test_plans_are_valid_and_never_predicted_worse_than_a_baseline(model, tables, devices, seed) -> None:
    task = generate_task(synthetic_pool(), tables, devices, WorkloadScale(), seed=seed)
    result = search(task, model)
    result.plan.validate(task)  # widths multiples of 4 summing to dim, memory under the cap
    assert result.predicted_cost_ms == pytest.approx(predicted_breakdown(model, task, result.plan)[0])
    for name in BASELINES:
        base = predicted_breakdown(model, task, baseline_plan(name, task))[0]
        assert result.predicted_cost_ms <= base + 1e-6, name


def test_search_is_deterministic(model) -> None:
    task = generate_task(synthetic_pool(), 30, 4, WorkloadScale(), seed=5)
    assert search(task, model).plan == search(task, model).plan


def test_beam_search_splits_tables_when_that_pays(model) -> None:
    # Two wide, heavy tables on four devices: whole tables leave two devices idle.
    pool = synthetic_pool()
    heavy = sorted(pool, key=lambda t: -t.pooling_factor)[:2]
    from torchrec_neuroshard.lab.workloads import table_spec

    tables = tuple(table_spec(t, 128, WorkloadScale(), name=f"heavy{i}") for i, t in enumerate(heavy))
    task = Task(tables, 4, 10 * sum(t.size_bytes() for t in tables), 4096)
    result = search(task, model)
    whole = search(task, model, SearchConfig(max_steps=0))
    assert any(len(p.widths) > 1 for p in result.plan.placements)
    assert result.predicted_cost_ms < whole.predicted_cost_ms


def test_tables_restricted_to_table_wise_are_never_split(model) -> None:
    task = generate_task(synthetic_pool(), 12, 4, WorkloadScale(), seed=9)
    result = search(task, model, choices={t.name: TableChoices(min_width=t.dim) for t in task.tables})
    assert all(len(p.widths) == 1 for p in result.plan.placements)


def test_tiny_tasks_match_brute_force(model) -> None:
    """Six whole tables on two devices (64 placements): the search without splits finds the
    brute-force optimum of the predicted cost on most seeds, and is never more than 3% off
    (seed 2 stops 2.97% above it with the fp16 + sequence cpu.pt: one move or swap off the
    bottleneck does not reach the optimum there)."""
    exact = 0
    for seed in range(6):
        task = generate_task(synthetic_pool(), 6, 2, WorkloadScale(), seed=seed, memory_slack=2.0)
        best = np.inf
        for assign in itertools.product(range(2), repeat=6):
            p = Plan(tuple(TablePlacement(t.name, (t.dim,), (d,)) for t, d in zip(task.tables, assign)), 2)
            best = min(best, predicted_breakdown(model, task, p)[0])
        got = search(task, model, SearchConfig(max_steps=0)).predicted_cost_ms
        assert got <= best * 1.03 + 1e-9
        exact += got <= best + 1e-6
    assert exact >= 5


def test_infeasible_task_names_table_shortfall_and_cap(model) -> None:
    hist = (1.0,) + (0.0,) * 16
    tables = (TableSpec("big", 100_000, 128, 2.0, hist), TableSpec("small", 1000, 8, 2.0, hist))
    task = Task(tables, 2, memory_cap_bytes=20_000_000, batch_size=4096)
    with pytest.raises(InfeasibleError) as e:
        search(task, model, choices={"big": TableChoices(min_width=128, data_parallel=False, row_wise=False)})
    msg = str(e.value)
    # memory as TorchRec counts it: weights 51,200,000 + the global batch's indices
    # (4096 x 2 x 8 bytes) + its pooled output (4096 x 128 x 4 bytes)
    assert "'big' (53,362,688 bytes) fits no device" in msg
    assert "33,362,688 short" in msg and "a cap of at least 53,362,688 bytes" in msg
    # allowed to split, the same table fits as four 32-wide column shards... on two devices
    # it still does not (51.2 MB > 2 x 20 MB): the error stays
    with pytest.raises(InfeasibleError, match="'big'"):
        search(task, model)


def test_memory_cap_forces_a_split_when_splits_are_allowed(model) -> None:
    hist = (1.0,) + (0.0,) * 16
    tables = (TableSpec("big", 100_000, 128, 2.0, hist), TableSpec("small", 1000, 8, 2.0, hist))
    task = Task(tables, 2, memory_cap_bytes=30_000_000, batch_size=4096)
    result = search(task, model)  # every kind allowed: split by rows or by columns
    result.plan.validate(task)
    big = result.plan.placement("big")
    assert len(big.widths) >= 2 or len(big.rows) == 2
    columns = search(task, model, choices={"big": TableChoices(row_wise=False)})
    columns.plan.validate(task)
    assert len(columns.plan.placement("big").widths) >= 2


def test_replication_is_chosen_by_the_whole_step_and_constraints_still_hold(model) -> None:
    """A 64-row, 16-column table read 500 times per sample: the whole-step prediction
    replicates it (its replica costs each rank less than distributing its ids and pooled
    embeddings); forbidden to replicate or split, it is placed table-wise; the rest of the
    plan never breaks its min widths. (A 64-column table read 20 times, replicated while
    the compute net priced its kernel at 55 s far outside its training data, is table-wise
    at its bounded price of about a millisecond.)"""
    from torchrec_neuroshard.access import uniform_access_histogram
    from torchrec_neuroshard.stepcost import predict_step
    from torchrec_neuroshard.tables import sharder_choices

    base = generate_task(synthetic_pool(), 8, 2, WorkloadScale(), seed=3, memory_slack=3.0)
    hot = TableSpec("hot", 64, 16, 500.0, tuple(uniform_access_histogram(64, 500.0 * base.batch_size)))
    task = Task(base.tables + (hot,), 2, base.memory_cap_bytes, base.batch_size)
    choices = sharder_choices(task.tables, "cpu")
    free = search(task, model, choices=choices)
    assert free.plan.placement("hot").kind.value == "data_parallel"
    assert free.predicted_cost_ms == pytest.approx(predict_step(model.with_batch_size(task.batch_size), task, free.plan).cost_ms)
    pinned = {t.name: TableChoices(min_width=t.dim, data_parallel=False, row_wise=False) for t in task.tables}
    kept = search(task, model, choices=pinned)
    assert kept.plan.placement("hot").kind.value == "table_wise"
    assert {p.kind.value for p in kept.plan.placements} == {"table_wise"}  # min width = dim: never split
    assert kept.predicted_cost_ms > free.predicted_cost_ms


def test_a_column_split_is_priced_as_a_second_lookup_group(model) -> None:
    """TorchRec runs one kernel and one set of collectives per sharding kind: halving a
    table by columns onto the same device leaves every device's load as it was but adds a
    column-wise group, whose input distribution and all-to-alls every device pays."""
    from torchrec_neuroshard.stepcost import predict_step

    task = generate_task(synthetic_pool(), 8, 2, WorkloadScale(), seed=4, memory_slack=2.0)
    whole = baseline_plan("size", task)
    widest = max(whole.placements, key=lambda p: p.widths[0])
    half = widest.widths[0] // 2
    split = Plan(
        tuple(TablePlacement(p.table, (half, half), p.devices * 2) if p is widest else p for p in whole.placements), 2
    )
    scaled = model.with_batch_size(task.batch_size)
    one, two = predict_step(scaled, task, whole).parts, predict_step(scaled, task, split).parts
    assert all(b > a for a, b in zip(one["input_dist"], two["input_dist"]))
    a2a = lambda parts: sum(parts["a2a_fwd"]) + sum(parts["a2a_bwd"])  # noqa: E731
    assert a2a(two) > a2a(one)
    assert predict_step(scaled, task, split).cost_ms > predict_step(scaled, task, whole).cost_ms


def test_placements_fixed_before_the_search_are_kept_and_priced(model) -> None:
    task = generate_task(synthetic_pool(), 10, 2, WorkloadScale(), seed=6, memory_slack=2.0)
    pinned = TablePlacement.data_parallel(task.tables[0].name)
    result = search(task, model, fixed=(pinned,))
    assert result.plan.placement(pinned.table) == pinned
    assert {p.table for p in result.plan.placements} == {t.name for t in task.tables}
    assert result.predicted_cost_ms == pytest.approx(predicted_breakdown(model, task, result.plan)[0])
    with pytest.raises(ValueError, match=r"\['nope'\] that are not in the task"):
        search(task, model, fixed=(TablePlacement.data_parallel("nope"),))
