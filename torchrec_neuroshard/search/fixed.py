"""Placements decided before a stage (the caller's, or the kinds chosen) and what they
leave. In: a task and its fixed placements. Out: the bytes they take on each device
(``placed_memory``; with the task's reserved bytes, ``taken_memory``), the task of the tables still to place, each device holding what they
leave it (``rest_task``), a plan of those with them (``with_fixed``), and what they cost
each device (``fixed_ms``)."""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from torchrec_neuroshard.stepcost import Embedder, predict_step
from torchrec_neuroshard.types import CostModel, Plan, TablePlacement, TableSpec, Task


def placed_memory(task: Task, placements: Sequence[TablePlacement]) -> np.ndarray:
    """Bytes [D] the placements (of ``task``'s tables) take on each device."""
    used = np.zeros(task.num_devices, dtype=np.int64)
    for p in placements:
        used += _placement_memory(p, task.table(p.table), task.batch_size, task.num_devices)
    return used


@functools.lru_cache(maxsize=4096)
def _placement_memory(placement: TablePlacement, table: TableSpec, batch_size: int, world: int) -> np.ndarray:
    """Bytes [D] one placement takes on each device (kept: the kinds stage counts the
    memory of a hundred choices, most sharing their row splits over every device)."""
    used = np.asarray(Plan((placement,), world).device_memory([table], batch_size), dtype=np.int64)
    used.flags.writeable = False
    return used


def taken_memory(task: Task, placements: Sequence[TablePlacement]) -> np.ndarray:
    """Bytes [D] taken on each device: the task's reserved bytes and the placements'."""
    return np.asarray(task.reserved, dtype=np.int64) + placed_memory(task, placements)


def rest_task(task: Task, fixed: Sequence[TablePlacement]) -> Task:
    """The tables the placement search places, each device holding what the fixed ones
    (and the task's reserved bytes) leave of its memory."""
    if not fixed:
        return task
    names = {p.table for p in fixed}
    taken = taken_memory(task, fixed)
    return task.subset([t.name for t in task.tables if t.name not in names], tuple(int(b) for b in taken))


def with_fixed(plan: Plan, fixed: Sequence[TablePlacement], task: Task) -> Plan:
    """``plan`` of the rest of ``task``'s tables with the fixed placements after it."""
    return Plan(tuple(plan.placements) + tuple(fixed), task.num_devices)


def fixed_ms(model: CostModel, task: Task, fixed: Sequence[TablePlacement], embed: Embedder) -> np.ndarray:
    """(forward, backward) ms [D, 2] the fixed placements cost each device."""
    if not fixed:
        return np.zeros((task.num_devices, 2))
    alone = predict_step(model, task.subset([p.table for p in fixed]), Plan(tuple(fixed), task.num_devices), embed)
    return np.asarray([[d.fwd_compute + d.fwd_comm, d.bwd_compute + d.bwd_comm] for d in alone.devices])
