"""The choice of sharding kinds, in the role of TorchRec's sharding types. In: the tables
the caller left open, each one's choices, and the model's step parts. Out: the tables to
replicate (data-parallel) or split by rows (row-wise, table-row-wise), as placements fixed
beside the given ones; the rest go on to the column splits and the greedy placement.

Every table that may be replicated gets a score from the model alone (the load it takes
off a device minus what its replica costs every device), every table that may be split by
rows and would take half a device's fair share or more is a row-wise candidate (over
every rank; on several hosts also table-row-wise, over one host's ranks, spread over the
hosts); a grid over how many of each (best scores first) is priced by the whole step
(``stepcost.predict_step``, on the task's links) of a quick greedy placement (the costliest
tables first; a choice whose every run runs out of memory so, the largest first), and the
cheapest set is fixed; every choice weighed comes back with it (``KindChoice``: the
search's statistics). Table-column-wise is column-wise kept on one host, with the same
collectives: the search places column splits anywhere and labels them by the table's
constraints (``planner``).
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Sequence

import numpy as np

from torchrec_neuroshard.hosts import spread_over_hosts
from torchrec_neuroshard.search.config import KindChoice, SearchConfig, past
from torchrec_neuroshard.search.fixed import placed_memory, taken_memory, with_fixed
from torchrec_neuroshard.search.greedy import Keys, greedy_runs, plan_of
from torchrec_neuroshard.stepcost import Collectives, Embedder, data_parallel_ms, predict_step
from torchrec_neuroshard.types import (
    CostModel,
    Plan,
    Shard,
    ShardingKind,
    TableChoices,
    TablePlacement,
    TableSpec,
    Task,
)

logger = logging.getLogger(__name__)

Kinds = tuple[TablePlacement, ...]
"""Placements fixed before the column splits: the given ones, then the tables split by
rows, then the replicated ones."""


def choose_kinds(
    task: Task,
    model: CostModel,
    config: SearchConfig,
    choice: Mapping[str, TableChoices],
    embed: Embedder,
    given: Kinds,
) -> tuple[Kinds, tuple[KindChoice, ...]]:
    """The ``given`` placements and the tables to replicate or split by rows beside them
    (see the module docstring), with the choices weighed; ``given`` alone (and none weighed)
    when the model cannot price either, or on one device, or past the planning budget
    (``config.deadline``)."""
    collectives = Collectives.of(model, task)
    if task.num_devices == 1 or not (collectives.replicates() or collectives.splits_rows()) or past(config.deadline):
        return given, ()
    given_names = {p.table for p in given}
    open_tables = [(i, t) for i, t in enumerate(task.tables) if t.name not in given_names]
    keys = Keys(task, model, embed)
    keys.ensure([(i, t.dim) for i, t in open_tables])
    single = {t.name: float(keys.single[keys.index[(i, t.dim)]]) for i, t in open_tables}
    fair = sum(single.values()) / task.num_devices
    replicable = _replication_candidates(task, model, collectives, choice, single, open_tables)
    grid = []
    for rows in _row_choices(task, config, choice, single, fair, open_tables if collectives.splits_rows() else []):
        taken = {p.table for p in rows}
        left = [t for t in replicable if t.name not in taken][: len(open_tables) - len(rows) - 1]
        for n_dp in sorted({min(k, len(left)) for k in config.data_parallel_grid}):
            grid.append(given + rows + tuple(TablePlacement.data_parallel(t.name) for t in left[:n_dp]))
    cheapest, weighed = _cheapest(task, model, config, keys, embed, grid, given)
    return (cheapest if cheapest is not None else given), weighed


def _replication_candidates(
    task: Task,
    model: CostModel,
    collectives: Collectives,
    choice: Mapping[str, TableChoices],
    single: Mapping[str, float],
    open_tables: Sequence[tuple[int, TableSpec]],
) -> list[TableSpec]:
    """The open tables that may be replicated and whose replica fits a device, best score
    first (the load a replica takes off a device less what it costs every device); none
    when the model cannot price replication."""
    if not collectives.replicates():
        return []
    world, parts, links = task.num_devices, model.step_parts, collectives.links
    base = sum(data_parallel_ms(parts, [], task.batch_size, world, links).values())
    fair = sum(single.values()) / world
    gain = {
        t.name: single[t.name] / world + max(0.0, single[t.name] - fair)
        - (sum(data_parallel_ms(parts, [t], task.batch_size, world, links).values()) - base)
        for _, t in open_tables
    }
    return sorted(
        (
            t
            for _, t in open_tables
            if choice[t.name].data_parallel
            and Shard(t, t.dim).memory_bytes(ShardingKind.DATA_PARALLEL, task.batch_size, world) < task.memory_cap_bytes - max(task.reserved)
        ),
        key=lambda t: (-gain[t.name], t.name),
    )


def _cheapest(
    task: Task, model: CostModel, config: SearchConfig, keys: Keys, embed: Embedder, grid: Sequence[Kinds], given: Kinds
) -> tuple[Kinds | None, tuple[KindChoice, ...]]:
    """The kinds of ``grid`` (each the ``given`` placements first) whose quick
    greedy placement of the other tables (whole, in lockstep) the whole step prices
    lowest, and the choices that leave tables to the greedy (``_weighed``); None when no
    placement fits memory or the planning budget (``config.deadline``)
    runs out before the runs end (past it while pricing them: the cheapest priced). Every device starts from the bytes the
    given placements take on it; a choice's own row splits and replicas lower every
    device's cap by what they take on the fullest (a choice leaving no memory: all its
    runs die)."""
    every = {t.name for t in task.tables}
    best = _cheapest_whole([fixed for fixed in grid if {p.table for p in fixed} == every], task, model, embed)
    grid = [fixed for fixed in grid if {p.table for p in fixed} != every]  # some tables left to place
    if not grid:
        return (best[1] if best is not None else None), ()
    quick = _quick_greedy(task, model, config, keys, grid, given)
    if quick is None:  # the planning budget ran out: no kinds beyond the given
        return None, ()
    per_state, placed_by, memory_first = quick
    shortlist = None  # every choice priced
    if config.kinds_shortlist and len(grid) > config.kinds_shortlist:  # (the estimate prices row splits: not for nothing)
        estimate = per_state.min(1) + _fixed_estimate(task, model, embed, [fixed[len(given) :] for fixed in grid])  # [states]
        shortlist = set(np.argsort(estimate, kind="stable")[: config.kinds_shortlist].tolist())
    weighed = _weighed([fixed[len(given) :] for fixed in grid], per_state.min(1), shortlist, memory_first)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("kinds choices: %s", "; ".join(map(str, weighed)))
    for i, fixed in enumerate(grid):
        if best is not None and past(config.deadline):
            break
        if not np.isfinite(per_state[i].min()) or (shortlist is not None and i not in shortlist):
            continue
        placed = placed_by(i, int(per_state[i].argmin()))
        cost = predict_step(model, task, with_fixed(placed, fixed, task), embed).cost_ms
        if best is None or cost < best[0] - 1e-9:
            best = (cost, fixed)
    return (best[1] if best is not None else None), weighed


def _quick_greedy(
    task: Task, model: CostModel, config: SearchConfig, keys: Keys, grid: Sequence[Kinds], given: Kinds
) -> tuple[np.ndarray, Callable[[int, int], Plan], set[int]] | None:
    """The quick greedy placement of each choice's other tables (whole) at every kind scale:
    its embedding cost [choices, scales] (inf where the run ran out of memory), the plan of
    (choice, scale), and the choices placed memory-first: those whose every run, costliest
    table first, ran out of memory are placed again largest first (where devices hold a few
    tables, the costliest-first order leaves the large tables no room: on held-out pool 2 at
    D = 128, 50 of 52 row-split choices died so). None past the planning budget."""
    names = [{p.table for p in fixed} for fixed in grid]
    states = [tuple(() if t.name in taken else (t.dim,) for t in task.tables) for taken in names]
    caps = [task.memory_cap_bytes - placed_memory(task, fixed[len(given) :]).max() for fixed in grid]
    reserved, scales = taken_memory(task, given), config.kind_scales
    runs = greedy_runs(task, model, keys, states, scales, caps, reserved, config.deadline)
    if runs is None:
        return None
    cost = runs.cost.reshape(len(grid), len(scales)).copy()  # [choices, scales]
    dead = np.flatnonzero(~np.isfinite(cost).any(1))  # [Z]
    again = None
    if dead.size and not past(config.deadline):
        again = greedy_runs(task, model, keys, [states[i] for i in dead], scales, [caps[i] for i in dead], reserved, config.deadline, memory_first=True)
    if again is not None:
        cost[dead] = again.cost.reshape(len(dead), len(scales))
    row = {int(i): z for z, i in enumerate(dead)} if again is not None else {}

    def placed_by(choice: int, scale: int) -> Plan:
        if choice in row:
            return plan_of(task, keys, again, row[choice] * len(scales) + scale)
        return plan_of(task, keys, runs, choice * len(scales) + scale)

    return cost, placed_by, set(row)


def _weighed(chosen: Sequence[Kinds], greedy_ms: np.ndarray, shortlist: set[int] | None, memory_first: set[int]) -> tuple[KindChoice, ...]:
    """Each choice's record: its row splits and replicas, its quick greedy's ms
    (``greedy_ms``: [choices], inf where every run died), whether it was placed memory-first
    and whether the shortlist kept it to be priced whole (None: every choice kept)."""
    return tuple(
        KindChoice(
            rows=sum(p.kind.splits_rows for p in fixed),
            replicas=sum(p.kind is ShardingKind.DATA_PARALLEL for p in fixed),
            greedy_ms=float(greedy_ms[i]),
            largest_first=i in memory_first,
            shortlisted=shortlist is None or i in shortlist,
        )
        for i, fixed in enumerate(chosen)
    )


def _fixed_estimate(task: Task, model: CostModel, embed: Embedder, chosen: Sequence[Kinds]) -> np.ndarray:
    """[len(chosen)] what each choice's own placements add to the step, at most: the
    slowest device of its row splits alone (``predict_step``, once per distinct set) plus
    its replicas' ms (the same on every device)."""
    links = Collectives.of(model, task).links
    rows_ms: dict[Kinds, float] = {}
    out = np.zeros(len(chosen))
    for i, fixed in enumerate(chosen):
        rows = tuple(p for p in fixed if p.kind.splits_rows)
        if rows not in rows_ms:
            rows_ms[rows] = predict_step(model, task.subset([p.table for p in rows]), Plan(rows, task.num_devices), embed).cost_ms if rows else 0.0
        replicated = [task.table(p.table) for p in fixed if p.kind is ShardingKind.DATA_PARALLEL]
        out[i] = rows_ms[rows] + (sum(data_parallel_ms(model.step_parts, replicated, task.batch_size, task.num_devices, links).values()) if replicated else 0.0)
    return out


def _cheapest_whole(grid: Sequence[Kinds], task: Task, model: CostModel, embed: Embedder) -> tuple[float, Kinds] | None:
    """Of the kinds in ``grid`` that place every table (nothing left to the greedy), the
    one the whole step prices lowest among those fitting memory, with its ms; None if none."""
    best: tuple[float, Kinds] | None = None
    for fixed in grid:
        if taken_memory(task, fixed).max() > task.memory_cap_bytes:
            continue
        cost = predict_step(model, task, Plan(fixed, task.num_devices), embed).cost_ms
        if best is None or cost < best[0] - 1e-9:
            best = (cost, fixed)
    return best


def _row_choices(
    task: Task,
    config: SearchConfig,
    choice: Mapping[str, TableChoices],
    single: Mapping[str, float],
    fair: float,
    open_tables: Sequence[tuple[int, TableSpec]],
) -> list[Kinds]:
    """The row splits ``choose_kinds`` tries: none, and the costliest 1, 2, 4, ... tables
    that take half a device's fair share or more (``config.row_wise_grid``) and all of them,
    split row-wise over every rank, or, on a topology of
    several hosts, table-row-wise over one host each (the least loaded host first, so
    several spread over the hosts)."""
    world, links = task.num_devices, task.links
    hosts = world // links.local_world_size if links is not None else 1  # full hosts
    kinds = [ShardingKind.ROW_WISE] + ([ShardingKind.TABLE_ROW_WISE] if hosts > 1 else [])
    out: list[Kinds] = [()]
    for kind in kinds:
        blocks = world if kind is ShardingKind.ROW_WISE else links.local_world_size
        candidates = sorted(
            (t for _, t in open_tables if choice[t.name].allows(kind) and t.rows >= blocks and single[t.name] >= fair / 2),
            key=lambda t: (-single[t.name], t.name),
        )
        for n in sorted({min(k, len(candidates)) for k in (*config.row_wise_grid, len(candidates))} - {0}):
            if kind is ShardingKind.ROW_WISE:
                out.append(tuple(TablePlacement.row_blocks(t, range(world)) for t in candidates[:n]))
            else:
                out.append(spread_over_hosts(candidates[:n], lambda t: single[t.name], world, links.local_world_size))
    return out
