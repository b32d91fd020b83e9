"""studies.slowest_devices: the slowest devices of a plan and what they hold."""

import numpy as np

from studies.slowest_devices import device_text, slowest, split_tables
from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.types import Plan, TablePlacement


def test_the_slowest_devices_come_first_ties_by_device() -> None:
    assert slowest(np.array([3.0, 9.0, 5.0, 9.0]), 3) == [1, 3, 2]


def test_a_devices_text_names_its_tables_and_the_split_ones_heaviest_first() -> None:
    task = generate_task(synthetic_pool(), 8, 2, WorkloadScale(), seed=0)
    plan = baseline_plan("size", task)
    (device,) = plan.placement(task.tables[0].name).devices
    assert task.tables[0].name in device_text(task, plan, device)
    assert split_tables(task, plan) == []
    light, heavy = sorted(task.tables[:2], key=lambda t: t.pooling_factor * t.dim)
    split = Plan(tuple(TablePlacement.row_blocks(t, range(2)) if t in (light, heavy) else p
                       for t, p in zip(task.tables, (plan.placement(t.name) for t in task.tables))), 2)
    assert split_tables(task, split) == [f"{heavy.name} row_wise", f"{light.name} row_wise"]
