"""What the evaluator prices: the collectives and kernels of a DMP step, per lookup group."""

import pytest
import torch

from torchrec_neuroshard.lab.evaluate import evaluate_plans, lookup_groups, step_exchanges, task_lookups
from torchrec_neuroshard.lab.measure_compute import measure_replicated_compute
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.types import Plan, ShardingKind, TablePlacement

pytestmark = pytest.mark.measure  # real timings of kernels and collectives

SMALL = WorkloadScale(row_divisor=1024, batch_size=512)


def _task_and_plans():
    task = generate_task(synthetic_pool(), 4, 2, SMALL, seed=5, memory_slack=3.0, dims=(32,))
    a, b, c, d = (t.name for t in task.tables)
    whole = Plan(tuple(TablePlacement(n, (32,), (i % 2,)) for i, n in enumerate((a, b, c, d))), 2)
    split = Plan(
        (TablePlacement(a, (16, 16), (0, 1)), *(TablePlacement(n, (32,), (i % 2,)) for i, n in enumerate((b, c, d)))), 2
    )
    replicated = Plan(
        (*(TablePlacement(n, (32,), (i % 2,)) for i, n in enumerate((a, b, c))), TablePlacement.data_parallel(d)), 2
    )
    return task, whole, split, replicated


def test_a_split_table_sends_its_indices_to_every_column_shard_and_runs_its_own_group() -> None:
    task, whole, split, _ = _task_and_plans()
    lookups = task_lookups(task)
    modules = [[t.name for t in task.tables]]
    local = task.batch_size // 2
    a = task.tables[0].name
    a_from = [int(lookups[a][1][(r + 1) * local] - lookups[a][1][r * local]) for r in range(2)]

    groups, _ = lookup_groups(task, split, modules)
    assert sorted(g.kind for g in groups) == ["column_wise", "table_wise"]
    cw = next(g for g in groups if g.kind == "column_wise")
    rows = task.tables[0].rows
    assert cw.shards == (((a, 16, 0, rows),), ((a, 16, 0, rows),))
    input_, fwd, bwd = step_exchanges(task, groups, [[]], lookups)
    assert len(input_) == 3 * len(groups) and len(fwd) == len(bwd) == len(groups)
    values = input_[3 * groups.index(cw) + 2]
    assert values.dtype == "int64"
    # rank r sends its samples' indices of table a to BOTH shards' ranks
    assert values.counts == tuple((a_from[r], a_from[r]) for r in range(2))
    lengths = input_[3 * groups.index(cw) + 1]
    assert lengths.dtype == "int32" and lengths.counts == ((local, local), (local, local))
    # pooled all-to-all: rank r sends every rank (local x its width); backward reversed
    assert fwd[groups.index(cw)].counts == ((16 * local, 16 * local), (16 * local, 16 * local))

    whole_in, _, _ = step_exchanges(task, *lookup_groups(task, whole, modules), lookups)
    total = lambda ex: sum(sum(row) for e in ex if e.dtype == "int64" and e.counts[0][0] > 2 for row in e.counts)  # noqa: E731
    assert total(input_) == total(whole_in) + sum(a_from)  # the split doubles table a's input


def test_data_parallel_tables_are_replicated_kernels_and_an_all_reduce() -> None:
    task, _, _, replicated = _task_and_plans()
    d = task.tables[3]
    groups, rep = lookup_groups(task, replicated, [[t.name for t in task.tables]])
    assert rep == [[d.name]] and all(d.name != s[0] for g in groups for dev in g.shards for s in dev)
    _, _, bwd = step_exchanges(task, groups, rep, task_lookups(task))
    assert bwd[-1].op == "all_reduce" and bwd[-1].counts == ((d.rows * d.dim,),)
    m = measure_replicated_compute([d], {d.name: task_lookups(task)[d.name]}, torch.device("cpu"), 1, 2)
    assert m.fwd.median_ms > 0 and m.bwd.median_ms > 0


def test_row_wise_blocks_get_their_bucket_of_indices_and_reduce_scatter_outputs() -> None:
    task, whole, _, _ = _task_and_plans()
    a = task.tables[0]
    row_wise = Plan((TablePlacement.row_blocks(a, (0, 1)), *whole.placements[1:]), 2)
    row_wise.validate(task)
    lookups = task_lookups(task)
    groups, rep = lookup_groups(task, row_wise, [[t.name for t in task.tables]])
    rw = next(g for g in groups if g.kind is ShardingKind.ROW_WISE)
    block = -(-a.rows // 2)
    assert rw.shards == (((a.name, a.dim, 0, block),), ((a.name, a.dim, block, a.rows - block),))
    input_, fwd, bwd = step_exchanges(task, groups, rep, lookups)
    k = groups.index(rw)
    idx, off = lookups[a.name]
    local = task.batch_size // 2
    # every index of table a goes to exactly one block's rank
    assert sum(map(sum, input_[3 * k + 2].counts)) == int(off[-1])
    mine = idx[: int(off[local])]
    assert input_[3 * k + 2].counts[0] == (int((mine < block).sum()), int((mine >= block).sum()))
    assert fwd[k].op == "reduce_scatter" and fwd[k].counts == ((local * a.dim, local * a.dim),)
    assert bwd[k].op == "all_gather"


def test_the_evaluator_prices_input_comm_row_wise_and_two_ebcs() -> None:
    task, whole, split, replicated = _task_and_plans()
    row_wise = Plan((TablePlacement.row_blocks(task.tables[0], (0, 1)), *whole.placements[1:]), 2)
    names = [t.name for t in task.tables]
    plans = [whole, split, replicated, row_wise]
    results = evaluate_plans(task, plans, rounds=1, warmup=1, repeats=2, modules=[names[::2], names[1::2]])
    for m in results:
        assert len(m.input_comm_ms) == 2 and all(i > 0 for i in m.input_comm_ms)
        assert all(d.fwd_comm >= i for d, i in zip(m.devices, m.input_comm_ms))
        assert m.cost_ms > 0
