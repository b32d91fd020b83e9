"""The classic greedy heuristics: the baselines the search is seeded with and compared to.

Every heuristic is the same greedy: sort tables by a cost key, descending; each table goes
whole to the device with the smallest accumulated key that has memory room (ties to the
device with less memory used by them; a task's reserved bytes count against the room).
``random`` picks a uniform device with room instead.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from torchrec_neuroshard.types import InfeasibleError, Plan, TablePlacement, TableSpec, Task

CostKey = Callable[[TableSpec], float]

HEURISTIC_KEYS: dict[str, CostKey] = {
    "size": lambda t: float(t.size_bytes()),
    "dim": lambda t: float(t.dim),
    "lookup": lambda t: t.dim * t.pooling_factor,
    "size_lookup": lambda t: t.dim * t.pooling_factor * math.log10(max(t.rows, 2)),
}
BASELINES = ("random", *HEURISTIC_KEYS)


def memory_shortfall_error(task: Task, table: TableSpec, free: list[int]) -> InfeasibleError:
    """The error for a table that fits no device: names it, the bytes missing, and the
    smallest per-device cap that could hold the largest table and the total (memory as
    TorchRec counts it: ``TableSpec.memory_bytes``)."""
    memory = {t.name: _memory(task, t) for t in task.tables}
    total, reserved = sum(memory.values()), task.reserved
    needed = max(max(memory.values()) + min(reserved), math.ceil((total + sum(reserved)) / task.num_devices))
    taken = f", {sum(reserved):,} of them taken by tables placed before" if any(reserved) else ""
    return InfeasibleError(
        f"table {table.name!r} ({memory[table.name]:,} bytes) fits no device: the most free "
        f"memory left is {max(free):,} bytes, {memory[table.name] - max(free):,} short. "
        f"Total {total:,} bytes over {task.num_devices} devices of {task.memory_cap_bytes:,}{taken}; "
        f"a cap of at least {needed:,} bytes per device is needed (more devices, a larger "
        "cap, or column/row splits of the largest tables)."
    )


def greedy_plan(task: Task, key: CostKey) -> Plan:
    """Whole tables, heaviest key first, each to the lightest device with room."""
    load = np.zeros(task.num_devices)
    reserved = np.asarray(task.reserved, dtype=np.int64)
    used = reserved.copy()
    placements = []
    for t in sorted(task.tables, key=key, reverse=True):
        size = _memory(task, t)
        room = np.where(used + size <= task.memory_cap_bytes, load, np.inf)  # [D] load of the devices with room
        least = room.min()
        if least == np.inf:
            raise memory_shortfall_error(task, t, [task.memory_cap_bytes - int(u) for u in used])
        lightest = (room == least).nonzero()[0]  # ties: less memory, then the lower index
        d = int(lightest[np.argmin(used[lightest] - reserved[lightest])])
        load[d] += key(t)
        used[d] += size
        placements.append(TablePlacement.whole(t, d))
    return Plan(tuple(placements), task.num_devices)


def random_plan(task: Task, seed: int = 0) -> Plan:
    """Each table, largest first, to a uniformly random device that has room."""
    rng = np.random.default_rng(seed)
    used = list(task.reserved)
    placements = []
    for t in sorted(task.tables, key=lambda t: t.size_bytes(), reverse=True):
        size = _memory(task, t)
        fits = [d for d in range(task.num_devices) if used[d] + size <= task.memory_cap_bytes]
        if not fits:
            raise memory_shortfall_error(task, t, [task.memory_cap_bytes - u for u in used])
        d = int(rng.choice(fits))
        used[d] += size
        placements.append(TablePlacement.whole(t, d))
    return Plan(tuple(placements), task.num_devices)


def _memory(task: Task, table: TableSpec) -> int:
    return table.memory_bytes(task.batch_size, task.num_devices)


def baseline_plan(name: str, task: Task, seed: int = 0) -> Plan:
    """One of ``BASELINES`` by name."""
    if name == "random":
        return random_plan(task, seed)
    if name not in HEURISTIC_KEYS:
        raise ValueError(f"unknown baseline {name!r}; choose from {list(BASELINES)}")
    return greedy_plan(task, HEURISTIC_KEYS[name])
