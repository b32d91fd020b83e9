"""Placements decided before a stage (the caller's, or the kinds chosen) and what they
leave. In: a task and its fixed placements. Out: the memory per device they leave
(``free_memory``), the task of the tables still to place (``rest_task``), a plan of those
with them (``with_fixed``), and what they cost each device (``fixed_ms``)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from torchrec_neuroshard.stepcost import Embedder, predict_step
from torchrec_neuroshard.types import CostModel, Plan, TablePlacement, Task


def free_memory(task: Task, fixed: Sequence[TablePlacement]) -> int:
    """Bytes per device the fixed placements leave of the cap (at most; <= 0: none)."""
    if not fixed:
        return task.memory_cap_bytes
    used = Plan(tuple(fixed), task.num_devices).device_memory([task.table(p.table) for p in fixed], task.batch_size)
    return task.memory_cap_bytes - max(used)


def rest_task(task: Task, fixed: Sequence[TablePlacement]) -> Task:
    """The tables the placement search places, in the memory the fixed ones leave."""
    if not fixed:
        return task
    names = {p.table for p in fixed}
    return task.subset([t.name for t in task.tables if t.name not in names], free_memory(task, fixed))


def with_fixed(plan: Plan, fixed: Sequence[TablePlacement], task: Task) -> Plan:
    """``plan`` of the rest of ``task``'s tables with the fixed placements after it."""
    return Plan(tuple(plan.placements) + tuple(fixed), task.num_devices)


def fixed_ms(model: CostModel, task: Task, fixed: Sequence[TablePlacement], embed: Embedder) -> np.ndarray:
    """(forward, backward) ms [D, 2] the fixed placements cost each device."""
    if not fixed:
        return np.zeros((task.num_devices, 2))
    alone = predict_step(model, task.subset([p.table for p in fixed]), Plan(tuple(fixed), task.num_devices), embed)
    return np.asarray([[d.fwd_compute + d.fwd_comm, d.bwd_compute + d.bwd_comm] for d in alone.devices])
