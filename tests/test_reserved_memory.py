"""Placements fixed before the search take memory device by device: the search places
the other tables in the room each device has left (``Task.reserved_bytes``), not in the
room the fullest one has; and a table larger than a rank is split by rows the way that
takes fewer bytes over all ranks."""

import dataclasses

import numpy as np
import pytest

from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.errors import ShardingError
from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.search import search
from torchrec_neuroshard.search.fixed import rest_task
from torchrec_neuroshard.tables import ModuleTable
from torchrec_neuroshard.triage import row_split, triage
from torchrec_neuroshard.types import InfeasibleError, Links, Plan, ShardingKind, TableChoices, TablePlacement, Task

MB = 1_000_000


def _two_hosts() -> tuple[Task, TablePlacement]:
    """Six tables on 2 hosts of 2 ranks, the largest (79 MB) fixed table-row-wise on host
    0: its ranks keep about 10 MB each of a 50 MB cap, too little for the next largest
    (15 MB), which ranks 2 and 3 hold with room to spare."""
    task = generate_task(synthetic_pool(), 6, 4, WorkloadScale(), seed=0)
    task = dataclasses.replace(task, memory_cap_bytes=50 * MB, links=Links(2, 1e6, 1e5))
    largest = max(task.tables, key=lambda t: t.memory_bytes(task.batch_size, 4))
    return task, TablePlacement.row_blocks(largest, (0, 1), ShardingKind.TABLE_ROW_WISE)


def test_the_search_places_tables_in_the_room_each_device_has_left() -> None:
    task, fixed = _two_hosts()
    taken = Plan((fixed,), 4).device_memory([task.table(fixed.table)], task.batch_size)
    rest = rest_task(task, [fixed])
    assert rest.reserved_bytes == tuple(taken) and taken[2] == taken[3] == 0
    biggest = max(t.memory_bytes(task.batch_size, 4) for t in rest.tables)
    assert task.memory_cap_bytes - max(taken) < biggest  # the fullest device's room fits it not
    whole = {t.name: TableChoices(min_width=t.dim, data_parallel=False) for t in task.tables}  # no splits
    result = search(task, load_pretrained(), choices=whole, fixed=(fixed,))
    result.plan.validate(task)
    assert result.plan.placement(fixed.table) == fixed
    used = result.plan.device_memory(task.tables, task.batch_size)
    assert max(used) <= task.memory_cap_bytes and min(used[2:]) > 0


def test_the_baselines_count_the_reserved_bytes() -> None:
    task, fixed = _two_hosts()
    rest = rest_task(task, [fixed])
    for name in ("size", "lookup"):
        plan = baseline_plan(name, rest)
        plan.validate(rest)  # within the room each device has left
        Plan(plan.placements + (fixed,), 4).validate(task)
    squeezed = dataclasses.replace(rest, reserved_bytes=(task.memory_cap_bytes - MB,) * 4)
    with pytest.raises(InfeasibleError, match="taken by tables placed before"):
        baseline_plan("size", squeezed)


def test_a_task_s_reserved_bytes_are_checked_kept_and_counted() -> None:
    task, fixed = _two_hosts()
    rest = rest_task(task, [fixed])
    assert Task.from_json(rest.to_json()) == rest
    assert rest.subset([rest.tables[0].name]).reserved_bytes == rest.reserved_bytes
    for wrong in ((1, 2), (0, 0, 0, -1), "1234"):
        with pytest.raises(ShardingError, match="reserved_bytes"):
            dataclasses.replace(rest, reserved_bytes=wrong)
    one = max(rest.tables, key=lambda t: t.memory_bytes(task.batch_size, 4))
    on_full_device = Plan((TablePlacement.whole(one, 0),), 4)
    on_full_device.validate(task.subset([one.name]))  # the cap alone holds it
    with pytest.raises(InfeasibleError, match="reserved bytes included"):
        on_full_device.validate(rest.subset([one.name]))


def test_ties_go_to_the_device_of_fewer_bytes_of_its_own() -> None:
    from torchrec_neuroshard.search.greedy import _least_loaded_with_room

    load = np.zeros((1, 3))
    mem = np.asarray([[5.0, 1.0, 3.0]])  # with the reserved bytes
    reserved = np.asarray([5.0, 0.0, 0.0])  # device 0 holds none of its own
    device, _ = _least_loaded_with_room(load, np.zeros((1, 3)), mem, np.asarray([10.0]), np.asarray([10.0]), None, reserved)
    assert device[0] == 0
    device, _ = _least_loaded_with_room(load, np.zeros((1, 3)), mem, np.asarray([10.0]), np.asarray([4.0]), None, reserved)
    assert device[0] == 1  # device 0 has no room for the shard


def _full_size(world: int) -> tuple[ModuleTable, int]:
    """The largest full-size pool table, allowed every row split, and the global batch."""
    task = generate_task(synthetic_pool(), 48, world, WorkloadScale(1, 65_536), seed=3)
    spec = max(task.tables, key=lambda t: t.rows * t.dim)
    kinds = frozenset({ShardingKind.ROW_WISE, ShardingKind.TABLE_ROW_WISE, ShardingKind.TABLE_WISE})
    return ModuleTable("ebc", spec, kinds, spec.dim), task.batch_size


def test_a_table_larger_than_a_rank_is_split_over_a_host_where_that_takes_fewer_bytes() -> None:
    table, batch = _full_size(64)
    splits = {}
    for kind, ranks in ((ShardingKind.ROW_WISE, 64), (ShardingKind.TABLE_ROW_WISE, 8)):
        used = Plan((TablePlacement.row_blocks(table.spec, range(ranks), kind),), 64).device_memory([table.spec], batch)
        splits[kind] = (sum(used), max(used))
    rw, trw = splits[ShardingKind.ROW_WISE], splits[ShardingKind.TABLE_ROW_WISE]
    assert trw[0] < rw[0] and trw[1] > rw[1]  # each row-wise block holds the whole batch's output
    assert row_split(table, 64, 8, batch)[0] is ShardingKind.TABLE_ROW_WISE
    assert row_split(table, 64, 8, batch, cap_bytes=trw[1])[0] is ShardingKind.TABLE_ROW_WISE
    assert row_split(table, 64, 8, batch, cap_bytes=trw[1] - 1)[0] is ShardingKind.ROW_WISE  # the host's blocks fit not
    decided = triage([table], 64, 8, trw[1] - 1, batch)
    assert decided.decided[0].kind is ShardingKind.ROW_WISE and len(decided.decided[0].devices) == 64
    assert row_split(table, 8, 8, batch)[0] is ShardingKind.ROW_WISE  # one host: the same blocks, row-wise
