"""A task of several sharded modules (EBCs), planned and improved module by module. In:
the task, the placements given before the search (``plan_by_module``) or the plan the
joint and by-module plans left (``improve_modules``). Out: a plan of every table.

Each sharded module's collectives hold every rank until its slowest arrives, so a model
of several pays each module's slowest device, and a plan balanced only in its per-device
totals can still wait on every module. Such a task is also planned module by module
(largest first, each in the memory the others leave); the plan the whole step prices
lower is kept, then its shards are moved or swapped off each module's slowest device.
"""

from __future__ import annotations

import itertools
import time
from collections import ChainMap
from dataclasses import dataclass, replace
from typing import Iterator, Mapping

import numpy as np

from torchrec_neuroshard.search.config import SearchContext
from torchrec_neuroshard.search.fixed import taken_memory
from torchrec_neuroshard.search.joint import joint_plan
from torchrec_neuroshard.stepcost import CachedEmbedder, StepPrediction, predict_step
from torchrec_neuroshard.types import (
    CostModel,
    InfeasibleError,
    Plan,
    Shard,
    ShardingKind,
    TablePlacement,
    TableSpec,
    Task,
)

MIN_GAIN = 1e-3
"""A move ``improve_modules`` makes must save this share of the step at least."""

MOVABLE = (ShardingKind.TABLE_WISE, ShardingKind.COLUMN_WISE)
"""The kinds whose shards ``improve_modules`` moves: one device per shard."""

PlacementsByTable = Mapping[str, TablePlacement]
"""Every table's placement, by table name."""


def plan_by_module(task: Task, given: tuple[TablePlacement, ...], context: SearchContext) -> tuple[Plan, int]:
    """Each module's tables searched as a task of their own, since the step pays each
    module's slowest device (``stepcost``): the largest module first, each in the memory
    that every given placement and the modules before it leave."""
    bytes_of = {t.name: Shard(t, t.dim).memory_bytes(ShardingKind.TABLE_WISE, task.batch_size, task.num_devices) for t in task.tables}
    fixed = {p.table for p in given}
    order = sorted(task.modules, key=lambda m: (-sum(bytes_of[n] for n in m), m))
    placements, evaluated = list(given), 0
    for k, names in enumerate(order):
        searched = [n for n in names if n not in fixed]
        if not searched:
            continue
        taken = taken_memory(task, [p for p in placements if p.table not in names])  # [D]
        free = np.maximum(task.memory_cap_bytes - taken, 0).sum()
        for later in order[k:]:  # fail before searching when a module's tables cannot fit what is left
            if sum(bytes_of[n] for n in later if n not in fixed) > free:
                raise InfeasibleError(f"the modules before {later[0]}'s leave it too little memory")
        mine = tuple(p for p in given if p.table in names)
        plan, n, _ = joint_plan(task.subset(names, tuple(int(b) for b in taken)), mine, context)
        placements += [p for p in plan.placements if p.table in searched]
        evaluated += n
    return Plan(tuple(placements), task.num_devices), evaluated


def improve_modules(
    task: Task, model: CostModel, plan: Plan, embed: CachedEmbedder, max_moves: int, deadline: float | None = None
) -> Plan:
    """Moves of one column shard off a module's slowest device onto one of the module's
    three least loaded devices, or swaps of it with a shard there (of the same module, or
    one of the three of another module nearest it in bytes), while the step (each module
    at its slowest device) gets cheaper by ``MIN_GAIN`` or more; each device's memory
    checked as it is, so a tight cap that stops the by-module search does not stop this."""
    modules = _Modules.of(task, model, embed)
    placements = {p.table: p for p in plan.placements}
    used = np.asarray(plan.device_memory(task.tables, task.batch_size), dtype=np.float64) + task.reserved  # [D]
    priced = [modules.predict(placements, k) for k in range(len(task.modules))]  # each module's prediction as the plan stands
    made, swaps = 0, False  # swaps are tried only when no move pays
    while made < max_moves and (deadline is None or time.perf_counter() < deadline):
        best = _best_change(modules, placements, used, priced, swaps)
        if best is None or best[0] < MIN_GAIN * sum(p.cost_ms for p in priced):
            if swaps:
                break
            swaps = True
            continue
        change = best[1]
        placements.update(change.placements)
        used += change.delta
        made, swaps = made + 1, False
        for k in {modules.module_of[n] for n in change.placements}:
            priced[k] = modules.predict(placements, k)
    return Plan(tuple(placements[p.table] for p in plan.placements), task.num_devices)


@dataclass(frozen=True)
class _Modules:
    """A task's modules as ``improve_modules`` prices them: the model at the task's batch,
    the embedding cache, each table's spec and module, and each module's own task."""

    task: Task
    model: CostModel
    embed: CachedEmbedder
    tables: Mapping[str, TableSpec]
    module_of: Mapping[str, int]
    subtasks: tuple[Task, ...]

    @staticmethod
    def of(task: Task, model: CostModel, embed: CachedEmbedder) -> "_Modules":
        module_of = {n: k for k, names in enumerate(task.modules) for n in names}
        subtasks = tuple(task.subset(m) for m in task.modules)
        return _Modules(task, model, embed, task.by_name, module_of, subtasks)

    def predict(self, placements: PlacementsByTable, k: int) -> StepPrediction:
        """Module ``k``'s step as ``placements`` place it."""
        plan = Plan(tuple(placements[n] for n in self.task.modules[k]), self.task.num_devices)
        return predict_step(self.model, self.subtasks[k], plan, self.embed)

    def shard_bytes(self, placement: TablePlacement, i: int) -> float:
        """The bytes shard ``i`` of ``placement`` takes on its device."""
        shard = Shard(self.tables[placement.table], placement.widths[i])
        return shard.memory_bytes(placement.kind, self.task.batch_size, self.task.num_devices)


@dataclass(frozen=True)
class _Change:
    """A move or a swap: the new placements of the tables it moves, and the bytes it adds to
    each device [D] (negative where it frees them)."""

    placements: dict[str, TablePlacement]
    delta: np.ndarray  # [D]


def _best_change(
    modules: _Modules, placements: PlacementsByTable, used: np.ndarray, priced: list[StepPrediction], swaps: bool
) -> tuple[float, _Change] | None:
    """The change within memory (``used`` [D] bytes now) of most gain over every module's
    moves (``swaps``: its swaps) off its slowest device, and its gain; None if none gains."""
    best: tuple[float, _Change] | None = None
    for k in range(len(modules.task.modules)):
        for change in _changes(modules, placements, priced[k], k, swaps):
            if np.any(used + change.delta > modules.task.memory_cap_bytes):
                continue
            gain = _gain(modules, placements, priced, change)
            if gain > 1e-9 and (best is None or gain > best[0]):
                best = (gain, change)
    return best


def _changes(modules: _Modules, placements: PlacementsByTable, prediction: StepPrediction, k: int, swaps: bool) -> Iterator[_Change]:
    """Module ``k``'s moves of a shard off its slowest device (in ``prediction``) to one
    of its three least loaded devices not holding the shard's table; with ``swaps``,
    its swaps of such a shard with one on that device instead."""
    totals = [d.total for d in prediction.devices]
    slow = int(np.argmax(totals))
    targets = [int(d) for d in np.argsort(totals, kind="stable") if d != slow][:3]
    shards = [(n, i) for n in modules.task.modules[k] if _movable(placements[n])
              for i, d in enumerate(placements[n].devices) if d == slow]  # fmt: skip
    for (n, i), device in itertools.product(shards, targets):
        if device in placements[n].devices:
            continue
        partners = _swap_partners(modules, placements, (n, i), slow, device, k) if swaps else [None]
        for partner in partners:
            yield _change(modules, placements, (n, i), slow, device, partner)


def _swap_partners(
    modules: _Modules, placements: PlacementsByTable, shard: tuple[str, int], slow: int, device: int, k: int
) -> list[tuple[str, int]]:
    """The shards on ``device`` that ``shard`` (table, index) of module ``k`` may swap with,
    of tables with no shard on ``slow``: all of module ``k``'s, then the three of other modules
    nearest it in bytes."""
    name, i = shard
    there = [(m, j) for m, p in placements.items() if m != name and _movable(p) and slow not in p.devices
             for j, e in enumerate(p.devices) if e == device]  # fmt: skip
    size = modules.shard_bytes(placements[name], i)
    others = sorted(
        (x for x in there if modules.module_of[x[0]] != k),
        key=lambda x: (abs(modules.shard_bytes(placements[x[0]], x[1]) - size), x),
    )[:3]
    return [*(x for x in there if modules.module_of[x[0]] == k), *others]


def _change(
    modules: _Modules, placements: PlacementsByTable, shard: tuple[str, int], slow: int, device: int, partner: tuple[str, int] | None
) -> _Change:
    """``shard`` (table, index) moved from ``slow`` to ``device``, and ``partner`` (if any)
    from ``device`` to ``slow``."""
    name, i = shard
    size = modules.shard_bytes(placements[name], i)
    moved, delta = {name: _moved(placements[name], i, device)}, np.zeros(modules.task.num_devices)
    delta[slow], delta[device] = -size, size
    if partner is not None:
        back = modules.shard_bytes(placements[partner[0]], partner[1])
        moved[partner[0]] = _moved(placements[partner[0]], partner[1], slow)
        delta[slow], delta[device] = delta[slow] + back, delta[device] - back
    return _Change(moved, delta)


def _gain(modules: _Modules, placements: PlacementsByTable, priced: list[StepPrediction], change: _Change) -> float:
    """What ``change`` saves the modules it touches, each priced at its slowest device."""
    changed = ChainMap(change.placements, placements)
    touched = sorted({modules.module_of[n] for n in change.placements})
    return sum(priced[k].cost_ms - modules.predict(changed, k).cost_ms for k in touched)


def _movable(placement: TablePlacement) -> bool:
    """Whether ``improve_modules`` moves the placement's shards (UVM tables: placed by ``offload``)."""
    return placement.kind in MOVABLE and not placement.kernel.in_host_memory


def _moved(placement: TablePlacement, i: int, device: int) -> TablePlacement:
    """``placement`` with its shard ``i`` on ``device``."""
    return replace(placement, devices=placement.devices[:i] + (device,) + placement.devices[i + 1 :])
