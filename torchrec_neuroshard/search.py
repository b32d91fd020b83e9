"""NeuroShard's search: greedy placement inside a grid search over a max-dimension
constraint, inside a beam search over column splits, then a local-improvement pass; before
it, the choice of which tables to replicate (data-parallel) or split by rows (row-wise).

Kinds first: every table that may be replicated gets a score from the model alone (the
load it takes off a device minus what its replica costs every device), every table that
may be split by rows and would take half a device's fair share or more is a row-wise
candidate (over every rank; on several hosts also table-row-wise, over one host's ranks,
spread over the hosts); a grid over how many of each (best scores first) is priced by the
whole step (``stepcost.predict_step``, on the task's links) of a quick greedy placement,
and the cheapest set is fixed. Table-column-wise is column-wise kept on one host, with the
same collectives: the search places column splits anywhere and labels them by the table's
constraints (``planner``).

Column splits: the greedy runs price a device's shards as one kernel and one all-to-all,
but TorchRec runs a lookup group (kernel, input distribution, all-to-all) per sharding
kind, so a column-wise split adds a group. The beam's best plan of every depth is priced
with the whole step beside the heuristics' plans, and the cheapest goes on.

Modules: each sharded module's collectives hold every rank until its slowest arrives, so
a model of several (EBCs) pays each module's slowest device, and a plan balanced only in
its per-device totals can still wait on every module. Such a task is also planned module
by module (largest first, each in the memory the others leave); the plan the whole step
prices lower is kept.

Costs come from a ``CostModel`` whose compute is additive in an embedding space, so a
device's running shard set is one summed vector: adding a shard is a vector add and one
evaluation of the small head, and every greedy run of one beam step (states x scales)
advances in lockstep, vectorised over runs and devices.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np
from threadpoolctl import threadpool_limits

from torchrec_neuroshard.local_search import local_improve
from torchrec_neuroshard.heuristics import BASELINES, baseline_plan, memory_shortfall_error
from torchrec_neuroshard.hosts import spread_over_hosts
from torchrec_neuroshard.stepcost import (
    CachedEmbedder,
    Collectives,
    Embedder,
    data_parallel_ms,
    predict_step,
)
from torchrec_neuroshard.types import (
    WIDTH_ALIGNMENT,
    CostModel,
    DeviceCost,
    InfeasibleError,
    Plan,
    Shard,
    ShardingKind,
    TableChoices,
    TablePlacement,
    TableSpec,
    Task,
)

Widths = tuple[tuple[int, ...], ...]
"""A split state: the shard widths of each table, in task table order; () for a table the
state leaves out (replicated or split by rows)."""


def default_scales() -> tuple[float, ...]:
    """linspace(1.0, 1.5, 11) as published, plus no dimension limit as a last resort."""
    return tuple(float(x) for x in np.linspace(1.0, 1.5, 11)) + (math.inf,)


@dataclass(frozen=True)
class SearchConfig:
    """Knobs of the search; defaults are the published ones."""

    scales: tuple[float, ...] = field(default_factory=default_scales)
    beam_width: int = 3
    top_k: int = 10
    max_steps: int = 10
    local_search: bool = True
    """A final move/swap pass off the bottleneck device (beyond the prototype). Measured over
    two runs of the 20-task suite: 0.998 and 0.985 geomean cost ratio to the search without
    it, lower on 26 of 40 paired tasks (benchmarks/compare.py)."""
    max_local_moves: int = 100
    seed_with_baselines: bool = True
    """Also score the heuristic baselines' plans and start from the best plan overall, so
    the result is never predicted worse than any baseline."""
    data_parallel_grid: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    """How many of the best-scored replication candidates to try replicating."""
    row_wise_grid: tuple[int, ...] = (0, 1, 2, 4)
    """How many of the costliest row-wise candidates to try splitting by rows."""
    kind_scales: tuple[float, ...] = (1.05, 1.25, math.inf)
    """The max-dimension scales of the quick greedy placement that prices each kind choice."""
    deadline: float | None = None
    """A ``time.perf_counter()`` reading past which the beam search splits no deeper and
    the local searches move no more shards, so the plan is the best found by then (the
    planner's ``timeout_seconds``); None: no limit."""


@dataclass(frozen=True)
class SearchResult:
    """The best plan found, its predicted per-device costs (ms) and search statistics."""

    plan: Plan
    predicted_cost_ms: float
    devices: tuple[DeviceCost, ...]
    states_evaluated: int
    seconds: float


@dataclass
class _Keys:
    """The distinct (table, width) shards met during one search call, with their
    embeddings, single-shard costs and sizes; grows as splits create new widths."""

    task: Task
    model: CostModel
    embed: Embedder
    index: dict[tuple[int, int], int] = field(default_factory=dict)
    emb: np.ndarray | None = None
    single: np.ndarray | None = None
    width: np.ndarray | None = None
    size: np.ndarray | None = None

    def ensure(self, keys: Sequence[tuple[int, int]]) -> None:
        new = [k for k in dict.fromkeys(keys) if k not in self.index]
        if not new:
            return
        shards = [Shard(self.task.tables[t], w) for t, w in new]
        kind = ShardingKind.COLUMN_WISE  # table-wise shards take the same memory
        emb = self.embed(shards).astype(np.float32)
        single = np.asarray(self.model.compute_cost([[s] for s in shards], self.embed)).sum(1)  # refuses inf / NaN
        for k in new:
            self.index[k] = len(self.index)
        cat = lambda a, b: b if a is None else np.concatenate([a, b])  # noqa: E731
        self.emb = cat(self.emb, emb)
        self.single = cat(self.single, single)
        self.width = cat(self.width, np.asarray([w for _, w in new], dtype=np.float64))
        memory = [s.memory_bytes(kind, self.task.batch_size, self.task.num_devices) for s in shards]
        self.size = cat(self.size, np.asarray(memory, dtype=np.float64))


@dataclass(frozen=True)
class _Runs:
    """Outcome of greedy runs: per run its cost (inf if invalid), device of each ordered
    shard, the shard order's keys, and where invalid runs died."""

    cost: np.ndarray  # [R]
    assign: np.ndarray  # [R, Smax] device of k-th ordered shard
    order_keys: np.ndarray  # [R, Smax] key id, -1 padding
    died_at: np.ndarray  # [R] ordered shard index where the run failed, -1 if valid
    free_at_death: np.ndarray  # [R] most free bytes on any device when it failed


def _state_keys(state: Widths) -> list[tuple[int, int]]:
    return [(t, w) for t, ws in enumerate(state) for w in ws]


@dataclass
class _Placements:
    """N partial placements on D devices, per device: its shards' summed embeddings,
    predicted forward and backward ms and their sum, dim sum (whole columns, int32: the
    device scan compares it at half the bytes) and bytes; per placement its fullest
    device's bytes. Placement p's device d is row p * D + d of ``sums`` and of the flat
    views of the [N, D] arrays."""

    sums: np.ndarray  # [N * D, E]
    fwd: np.ndarray  # [N, D]
    bwd: np.ndarray  # [N, D]
    load: np.ndarray  # [N, D] fwd + bwd
    dims: np.ndarray  # [N, D] int32
    mem: np.ndarray  # [N, D]
    mem_max: np.ndarray  # [N]

    @staticmethod
    def empty(n: int, devices: int, width: int) -> "_Placements":
        sums = np.zeros((n * devices, width), dtype=np.float32)
        fwd, bwd, load, mem = (np.zeros((n, devices)) for _ in range(4))
        return _Placements(sums, fwd, bwd, load, np.zeros((n, devices), dtype=np.int32), mem, np.zeros(n))

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Placements ``dst`` [M] become copies of placements ``src`` [M]."""
        D = self.fwd.shape[1]
        sums = self.sums.reshape(-1, D, self.sums.shape[1])  # [N, D, E]
        sums[dst] = sums[src]
        for a in (self.fwd, self.bwd, self.load, self.dims, self.mem, self.mem_max):
            a[dst] = a[src]

    def place(self, model: CostModel, cells: np.ndarray, emb: np.ndarray, width: np.ndarray, size: np.ndarray) -> None:
        """Add a shard (embedding ``emb`` [M, E], ``width`` and ``size`` [M]) to each of M
        distinct devices ``cells`` [M] (placement * D + device) and re-predict them."""
        placed = self.sums[cells] + emb  # [M, E]
        self.sums[cells] = placed
        self.dims.reshape(-1)[cells] += width.astype(np.int32)
        self.mem.reshape(-1)[cells] += size
        np.maximum.at(self.mem_max, cells // self.fwd.shape[1], self.mem.reshape(-1)[cells])
        cost = model.device_cost(placed)  # [M, 2]
        fwd, bwd, load = (a.reshape(-1) for a in (self.fwd, self.bwd, self.load))
        fwd[cells], bwd[cells] = cost[:, 0], cost[:, 1]
        load[cells] = fwd[cells] + bwd[cells]

    def fits(self, p: np.ndarray, device: np.ndarray, dim_room: np.ndarray, mem_room: np.ndarray) -> np.ndarray:
        """[M]: whether device ``device`` of placement ``p`` has dims <= ``dim_room`` and
        bytes <= ``mem_room`` (all [M])."""
        cell = p * self.fwd.shape[1] + device
        return (self.dims.reshape(-1)[cell] <= dim_room) & (self.mem.reshape(-1)[cell] <= mem_room)


def _greedy_runs(
    task: Task,
    model: CostModel,
    keys: _Keys,
    states: Sequence[Widths],
    scales: Sequence[float],
    caps: Sequence[float] | None = None,
) -> _Runs:
    """Greedy placement for every (state, scale) pair in lockstep: shards sorted by
    predicted single-shard cost, each to the feasible device with the lowest predicted
    compute so far (ties to less memory); feasible = memory fits (``caps``, per state:
    default the task's cap) and the device's dim sum stays within scale x (total width / D).

    Runs that have placed the same shards on the same devices share one placement until
    they part: the scales of a state, and states alike up to their first difference in
    shard order, place their first shards alike, and that is placed and predicted once."""
    D = task.num_devices
    cap = np.repeat(np.asarray(caps if caps is not None else [task.memory_cap_bytes] * len(states), dtype=np.float64), len(scales))
    per_state = []
    for st in states:
        ids = np.asarray([keys.index[k] for k in _state_keys(st)])
        per_state.append(ids[np.argsort(-keys.single[ids], kind="stable")])
    smax = max(len(p) for p in per_state)
    R = len(states) * len(scales)
    order = np.full((smax, R), -1, dtype=np.int64)  # [Smax, R]: step k's shard of every run
    limit = np.empty(R)
    length = np.empty(R, dtype=np.int64)
    for i, ids in enumerate(per_state):
        total_width = keys.width[ids].sum()
        for j, sc in enumerate(scales):
            r = i * len(scales) + j
            order[: len(ids), r] = ids
            limit[r] = sc * total_width / D
            length[r] = len(ids)
    dim_cap = limit + 1e-9
    # placement 0 is the empty one every run starts from; a group of runs parting from
    # the others of its placement takes a new one (at most R in all)
    held = _Placements.empty(R, D, keys.emb.shape[1])
    n_held = 1
    placement = np.zeros(R, dtype=np.int64)  # [R] the placement holding run r's
    shared = True  # some active runs may share a placement
    end_fwd, end_bwd, end_dims = np.zeros((R, D)), np.zeros((R, D)), np.zeros((R, D))
    assign = np.full((smax, R), -1, dtype=np.int64)
    alive = np.ones(R, dtype=bool)
    died_at = np.full(R, -1, dtype=np.int64)
    free_at_death = np.zeros(R)
    for k in range(smax + 1):
        done = np.flatnonzero(alive & (length == k))
        p = placement[done]
        end_fwd[done], end_bwd[done], end_dims[done] = held.fwd[p], held.bwd[p], held.dims[p]
        if k == smax:
            break
        a = np.flatnonzero(alive & (length > k))  # [A] the active runs
        if not a.size:
            break
        p, kk = placement[a], order[k, a]
        dim_room, mem_room = dim_cap[a] - keys.width[kk], cap[a] - keys.size[kk]
        device, decided = _choose_devices(held, n_held, p, kk, dim_room, mem_room, shared)
        dead = device < 0
        if dead.any():
            gone = a[dead]
            alive[gone] = False
            died_at[gone] = k
            free_at_death[gone] = cap[gone] - held.mem[p[dead]].min(1)
            a, p, kk, device, decided = (x[~dead] for x in (a, p, kk, device, decided))
        assign[k, a] = device
        if shared:
            n_held = _part(held, n_held, placement, a, p, kk * D + device, decided)
            # one run of each placement places the shard for all of its runs
            run_of = np.full(n_held, -1)
            run_of[placement[a]] = np.arange(len(a))
            p = np.flatnonzero(run_of >= 0)
            shared = len(p) < len(a)
            kk, device = kk[run_of[p]], device[run_of[p]]
        held.place(model, p * D + device, keys.emb[kk], keys.width[kk], keys.size[kk])
    total = np.full(R, np.inf)
    if alive.any():
        _, total[alive] = model.embedding_cost(end_fwd[alive], end_bwd[alive], end_dims[alive])
    return _Runs(total, assign.T, order.T, died_at, free_at_death)


def _choose_devices(
    held: _Placements,
    n_held: int,
    p: np.ndarray,
    shard: np.ndarray,
    dim_room: np.ndarray,
    mem_room: np.ndarray,
    shared: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """``_least_loaded_with_room`` for A runs on placements ``p`` [A] (of ``held``'s first
    ``n_held``) placing ``shard`` [A] with ``dim_room`` and ``mem_room`` [A], scanning each
    placement's devices once; and whether each run took its placement's decision [A].

    Where runs share a placement (``shared``), it decides for the shard one of them
    places, with the most room any run placing that shard has; a run with less room makes
    the same choice when both the chosen device and the first least-loaded one fit it (the
    least load and its ties among the devices the run may use are then the same); any
    other run decides alone."""
    most_dim = np.full(n_held, -np.inf)  # [n_held]; -inf: placement not in use
    most_mem = np.full(n_held, -np.inf)
    if not shared:  # one run per placement
        most_dim[p], most_mem[p] = dim_room, mem_room
        device, _ = _least_loaded_with_room(
            held.load[:n_held], held.dims[:n_held], held.mem[:n_held], most_dim, most_mem, held.mem_max[:n_held]
        )
        return device[p], np.ones(len(p), dtype=bool)
    deciding = np.full(n_held, -1)  # [n_held] the shard each placement decides for
    deciding[p] = shard
    same = shard == deciding[p]  # [A]
    np.maximum.at(most_dim, p[same], dim_room[same])
    np.maximum.at(most_mem, p[same], mem_room[same])
    chosen, least = _least_loaded_with_room(
        held.load[:n_held], held.dims[:n_held], held.mem[:n_held], most_dim, most_mem, held.mem_max[:n_held]
    )
    device, least = chosen[p], least[p]  # [A]
    decided = same & (
        ((dim_room == most_dim[p]) & (mem_room == most_mem[p]))
        | ((device >= 0) & held.fits(p, np.maximum(device, 0), dim_room, mem_room) & held.fits(p, least, dim_room, mem_room))
    )
    alone = np.flatnonzero(~decided)
    if alone.size:
        q = p[alone]
        device[alone], _ = _least_loaded_with_room(
            held.load[q], held.dims[q], held.mem[q], dim_room[alone], mem_room[alone], held.mem_max[q]
        )
    return device, decided


def _part(
    held: _Placements, n_held: int, placement: np.ndarray, a: np.ndarray, p: np.ndarray, move: np.ndarray, decided: np.ndarray
) -> int:
    """Runs ``a`` [A] on placements ``p`` [A] make ``move``s [A] (shard and device): those
    making the move their placement decided on (``decided`` [A]: the runs that took its
    decision) go on sharing it; the others, grouped by placement and move, move to copies
    of it, but for the first such group of a placement no run kept, which takes the
    placement itself. Sets ``placement`` [R] of the runs; returns how many are held."""
    kept = np.full(n_held, -1)  # [n_held] the move each placement makes, -1: none yet
    kept[p[decided]] = move[decided]
    other = np.flatnonzero(kept[p] != move)
    if not other.size:
        return n_held
    _, first, group = np.unique(p[other] * (move.max() + 1) + move[other], return_index=True, return_inverse=True)
    src = p[other[first]]  # [G] in placement order
    take = kept[src] < 0
    take[1:] &= src[1:] != src[:-1]
    dst = src.copy()
    new = np.flatnonzero(~take)
    dst[new] = n_held + np.arange(len(new))
    held.copy(dst[new], src[new])
    placement[a[other]] = dst[group]
    return n_held + len(new)


def _least_loaded_with_room(
    load: np.ndarray,
    dims: np.ndarray,
    mem: np.ndarray,
    dim_room: np.ndarray,
    mem_room: np.ndarray,
    mem_max: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The greedy's device on each of G placements, [G]: of the devices with dims <=
    dim_room and mem <= mem_room, the one of least load; ties (within 1e-9) to less memory,
    then to the lower index; -1 where no device has room or the least load is not finite.
    Also the first device of least load, [G] (the same but for ties).

    load, dims, mem: [G, D] per placement and device; dim_room, mem_room: [G], the caps
    less the shard's width and bytes. Dims and bytes are whole numbers, so ``dims > cap -
    w`` is exactly ``dims + w > cap``, and for integer ``dims`` (the greedy's int32) it is
    ``dims > floor(cap - w)``, compared in their own type. ``mem_max`` [G], each
    placement's fullest device (default: computed), spares the placements whose every
    device has room the memory comparison. One argmin finds the least device, a second one
    whether another is within the tolerance; only those placements compare memory."""
    rows = np.arange(len(load))
    if np.issubdtype(dims.dtype, np.integer):
        dim_room = np.clip(np.floor(dim_room), np.iinfo(dims.dtype).min, np.iinfo(dims.dtype).max).astype(dims.dtype)
    masked = np.where(dims > dim_room[:, None], np.inf, load)  # [G, D]
    full = np.flatnonzero((mem.max(1) if mem_max is None else mem_max) > mem_room)
    if full.size:
        masked[full] = np.where(mem[full] > mem_room[full, None], np.inf, masked[full])
    first = masked.argmin(1)
    least = masked[rows, first]
    masked[rows, first] = np.inf
    tied = masked[rows, masked.argmin(1)] <= least + 1e-9
    device = first.copy()
    if tied.any():
        t = rows[tied]
        masked[t, first[t]] = least[t]
        tie = masked[t] <= least[t, None] + 1e-9  # [T, D]
        device[t] = np.where(tie, mem[t], np.inf).argmin(1)
    device[~np.isfinite(least)] = -1
    return device, first


def _split_children(state: Widths, keys: _Keys, top_k: int, min_width: Sequence[int]) -> list[Widths]:
    """States one halving away: candidates are the union of the top-k shards by size and
    by predicted cost, halved only if the half is a multiple of 4 and >= the table's min."""
    shards = [(t, j, w) for t, ws in enumerate(state) for j, w in enumerate(ws)]
    ok = [
        (t, j, w)
        for t, j, w in shards
        if (w // 2) % WIDTH_ALIGNMENT == 0 and w % 2 == 0 and w // 2 >= min_width[t]
    ]
    by_size = sorted(ok, key=lambda s: -keys.size[keys.index[(s[0], s[2])]])[:top_k]
    by_cost = sorted(ok, key=lambda s: -keys.single[keys.index[(s[0], s[2])]])[:top_k]
    children = []
    for t, j, w in dict.fromkeys(by_size + by_cost):
        ws = list(state[t])
        ws[j : j + 1] = [w // 2, w // 2]
        child = list(state)
        child[t] = tuple(sorted(ws, reverse=True))
        children.append(tuple(child))
    return list(dict.fromkeys(children))


def _plan_of(task: Task, keys: _Keys, runs: _Runs, r: int) -> Plan:
    inverse = {i: k for k, i in keys.index.items()}
    shards = []
    for key, dev in zip(runs.order_keys[r], runs.assign[r]):
        if key < 0:
            break
        t, w = inverse[int(key)]
        shards.append((t, w, int(dev)))
    return _plan_from_shards(task, shards)


def _local_improve(
    task: Task, model: CostModel, keys: _Keys, plan: Plan, config: SearchConfig, fixed_ms: np.ndarray
) -> Plan:
    """``plan`` after ``local_search.local_improve``: moves and swaps off the bottleneck device."""
    names = {t.name: i for i, t in enumerate(task.tables)}
    shards = [(names[p.table], w, d) for p in plan.placements for w, d in zip(p.widths, p.devices)]
    return _plan_from_shards(task, local_improve(model, keys, shards, config.max_local_moves, fixed_ms, config.deadline))


def _plan_from_shards(task: Task, shards: Sequence[tuple[int, int, int]]) -> Plan:
    """Plan from (table index, width, device) triples; a table's shards narrowest first.

    Column order matters to DMP: with a rank holding a wider shard of a table before a
    narrower one (e.g. widths 64, 32, 32 on ranks 0, 1, 0), the 2-EBC dmp_step model's
    ranks disagreed on a collective's size and gloo aborted (TorchRec 1.8, found by
    benchmarks.dmp_step --quick); narrowest first, every rank's shards ascend."""
    per_table: dict[int, list[tuple[int, int]]] = {}
    for t, w, d in shards:
        per_table.setdefault(t, []).append((w, d))
    placements = []
    for t, table in enumerate(task.tables):
        if t not in per_table:  # left out of the state: the caller places it
            continue
        ordered = sorted(per_table[t])
        placements.append(TablePlacement(table.name, tuple(w for w, _ in ordered), tuple(d for _, d in ordered)))
    return Plan(tuple(placements), task.num_devices)


def _feasible_baselines(task: Task) -> list[Plan]:
    plans = []
    for name in BASELINES:
        try:
            plans.append(baseline_plan(name, task))
        except InfeasibleError:
            continue
    return plans


def predicted_breakdown(model: CostModel, task: Task, plan: Plan) -> tuple[float, tuple[DeviceCost, ...]]:
    """Predicted embedding cost (ms) of a plan's whole step and its per-device breakdown,
    at the task's batch (``stepcost.predict_step``)."""
    prediction = predict_step(model.with_batch_size(task.batch_size), task, plan)
    return prediction.cost_ms, prediction.devices


def search(
    task: Task,
    model: CostModel,
    config: SearchConfig = SearchConfig(),
    choices: Mapping[str, TableChoices] | None = None,
    fixed: Sequence[TablePlacement] = (),
) -> SearchResult:
    """Find a low-cost plan for ``task`` under ``model``'s predictions, scaled to the
    task's batch. A task of several sharded modules (``Task.modules``) is priced as the
    step pays it, each module at its slowest device, and planned both whole and module by
    module; the cheaper plan is kept.

    Args:
        choices: per table, what the search may do with it (``TableChoices``; e.g. from
            TorchRec constraints); a table not named gets everything TorchRec's default
            sharder offers. Replication and row splits are only chosen when the model has
            the step parts to price them (``stepcost``).
        fixed: placements decided before the search (e.g. a table its constraints only let
            replicate, or one larger than a rank split by rows over all ranks): kept as they
            are, the rest placed in the memory they leave, all priced in the whole step.

    Raises:
        InfeasibleError: no split and placement fits the memory cap; names the table.
    """
    # The search's matrices are small: one BLAS thread is faster than several, and
    # far faster when the other cores are busy.
    with threadpool_limits(limits=1, user_api="blas"):
        return _search(task, model.with_batch_size(task.batch_size).for_tables(task.tables), config, choices or {}, tuple(fixed))


def _search(
    task: Task, model: CostModel, config: SearchConfig, choices: Mapping[str, TableChoices], given: tuple[TablePlacement, ...]
) -> SearchResult:
    t0 = time.perf_counter()
    embed = CachedEmbedder(model)
    unknown = sorted({p.table for p in given} - {t.name for t in task.tables})
    if unknown:
        raise ValueError(f"fixed placements name tables {unknown} that are not in the task")
    if len(given) == len(task.tables):  # nothing left to place
        plan, evaluated = Plan(given, task.num_devices), 0
    else:
        plan, evaluated = _searched_plan(task, given, _Stage(model, config, choices, embed))
    plan.validate(task)
    prediction = predict_step(model, task, plan, embed)
    return SearchResult(plan, prediction.cost_ms, prediction.devices, evaluated, time.perf_counter() - t0)


@dataclass(frozen=True)
class _Stage:
    """What every stage of one search shares: the model (at the task's batch), the
    configuration, each table's choices, and the embedding cache."""

    model: CostModel
    config: SearchConfig
    choices: Mapping[str, TableChoices]
    embed: CachedEmbedder


def _searched_plan(task: Task, given: tuple[TablePlacement, ...], stage: _Stage) -> tuple[Plan, int]:
    """The best plan of the tables ``given`` leaves, with ``given``; and the states
    evaluated. A task of several modules is also planned module by module, and the plan
    the whole step prices lower is kept."""
    model, config, embed = stage.model, stage.config, stage.embed
    plan, evaluated = _joint_plan(task, given, stage)
    if len(task.modules) < 2:
        return plan, evaluated
    candidates = [plan]
    try:
        by_module, more = _plan_by_module(task, given, stage)
        candidates, evaluated = [plan, by_module], evaluated + more
    except InfeasibleError:  # the modules do not fit set apart (each is given the memory
        pass  # the others leave on their fullest device): the joint plan alone goes on
    costs = [predict_step(model, task, p, embed).cost_ms for p in candidates]
    plan = candidates[int(np.argmin(costs))]
    if config.local_search:
        plan = _improve_modules(task, model, plan, embed, config.max_local_moves, config.deadline)
    return plan, evaluated


MIN_GAIN = 1e-3
"""A move ``_improve_modules`` makes must save this share of the step at least."""


def _improve_modules(
    task: Task, model: CostModel, plan: Plan, embed: CachedEmbedder, max_moves: int, deadline: float | None = None
) -> Plan:
    """Moves of one column shard off a module's slowest device onto one of the module's
    three least loaded devices, or swaps of it with a shard there (of the same module, or
    one of the three of another module nearest it in bytes), while the step (each module
    at its slowest device) gets cheaper by ``MIN_GAIN`` or more; each device's memory
    checked as it is, so a tight cap that stops the by-module search does not stop this."""
    world, movable = task.num_devices, (ShardingKind.TABLE_WISE, ShardingKind.COLUMN_WISE)
    by_name = {t.name: t for t in task.tables}
    module_of = {n: k for k, names in enumerate(task.modules) for n in names}
    placements = {p.table: p for p in plan.placements}
    used = np.asarray(plan.device_memory(task.tables, task.batch_size), dtype=np.float64)  # [D]
    subtasks = [task.subset(m) for m in task.modules]

    def predict(k: int):
        return predict_step(model, subtasks[k], Plan(tuple(placements[n] for n in task.modules[k]), world), embed)

    def size(n: str, i: int) -> float:
        p = placements[n]
        return Shard(by_name[n], p.widths[i]).memory_bytes(p.kind, task.batch_size, world)

    def moved(n: str, i: int, device: int) -> TablePlacement:
        p = placements[n]
        return replace(p, devices=p.devices[:i] + (device,) + p.devices[i + 1 :])

    priced = [predict(k) for k in range(len(task.modules))]  # each module's prediction as the plan stands
    made, swaps = 0, False  # swaps are tried only when no move pays
    while made < max_moves and (deadline is None or time.perf_counter() < deadline):
        best: tuple[float, dict[str, TablePlacement], np.ndarray] | None = None
        for k, names in enumerate(task.modules):
            totals = [d.total for d in priced[k].devices]
            slow = int(np.argmax(totals))
            targets = [int(d) for d in np.argsort(totals, kind="stable") if d != slow][:3]
            shards = [(n, i) for n in names if placements[n].kind in movable and not placements[n].kernel.in_host_memory  # UVM: placed by offload
                      for i, d in enumerate(placements[n].devices) if d == slow]  # fmt: skip
            for (n, i), d in itertools.product(shards, targets):
                if d in placements[n].devices:
                    continue
                there = [(m, j) for m, p in placements.items() if swaps and m != n and p.kind in movable and slow not in p.devices and not p.kernel.in_host_memory
                         for j, e in enumerate(p.devices) if e == d]  # fmt: skip
                others = sorted((x for x in there if module_of[x[0]] != k), key=lambda x: (abs(size(*x) - size(n, i)), x))[:3]
                for partner in [*(x for x in there if module_of[x[0]] == k), *others] if swaps else [None]:
                    change, delta = {n: moved(n, i, d)}, np.zeros(world)
                    delta[slow], delta[d] = -size(n, i), size(n, i)
                    if partner is not None:
                        change[partner[0]] = moved(*partner, slow)
                        delta[slow], delta[d] = delta[slow] + size(*partner), delta[d] - size(*partner)
                    if np.any(used + delta > task.memory_cap_bytes):
                        continue
                    touched = sorted({module_of[x] for x in change})
                    before = {x: placements[x] for x in change}
                    placements.update(change)
                    gain = sum(priced[t].cost_ms - predict(t).cost_ms for t in touched)
                    placements.update(before)
                    if gain > 1e-9 and (best is None or gain > best[0]):
                        best = (gain, change, delta)
        if best is None or best[0] < MIN_GAIN * sum(p.cost_ms for p in priced):
            if swaps:
                break
            swaps = True
            continue
        _, change, delta = best
        placements.update(change)
        used += delta
        made, swaps = made + 1, False
        for t in {module_of[x] for x in change}:
            priced[t] = predict(t)
    return Plan(tuple(placements[p.table] for p in plan.placements), world)


def _plan_by_module(task: Task, given: tuple[TablePlacement, ...], stage: _Stage) -> tuple[Plan, int]:
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
        cap = _free_memory(task, [p for p in placements if p.table not in names])
        for later in order[k:]:  # fail before searching when a module's tables cannot fit what is left
            if sum(bytes_of[n] for n in later if n not in fixed) > task.num_devices * cap:
                raise InfeasibleError(f"the modules before {later[0]}'s leave it too little memory")
        mine = tuple(p for p in given if p.table in names)
        plan, n = _joint_plan(task.subset(names, cap), mine, stage)
        placements += [p for p in plan.placements if p.table in searched]
        evaluated += n
    return Plan(tuple(placements), task.num_devices), evaluated


def _joint_plan(task: Task, given: tuple[TablePlacement, ...], stage: _Stage) -> tuple[Plan, int]:
    """The best plan of the tables ``given`` leaves, all placed together (kinds chosen,
    placed, seeded with the heuristics' plans, improved locally), with ``given``; and the
    states evaluated."""
    model, config, choices, embed = stage.model, stage.config, stage.choices, stage.embed
    choice = {t.name: choices.get(t.name, TableChoices()) for t in task.tables}
    fixed = _choose_kinds(task, model, config, choice, embed, given)
    searched, evaluated = _place(task, model, config, choice, fixed, embed)
    candidates = [(p, fixed) for p in searched]
    if config.seed_with_baselines and fixed != given:  # around the chosen kinds too
        candidates += [(p, fixed) for p in _feasible_baselines(_rest_task(task, fixed))]
    if config.seed_with_baselines:
        candidates += [(p, given) for p in _feasible_baselines(_rest_task(task, given))]
    if not candidates:
        raise _shortfall(_rest_task(task, given), model, config, embed)
    costs = [predict_step(model, task, _with_fixed(p, f, task), embed).cost_ms for p, f in candidates]
    plan, fixed = candidates[int(np.argmin(costs))]
    rest = _rest_task(task, fixed)
    if config.local_search and len(task.modules) < 2:  # it balances devices' totals; modules: _improve_modules
        keys = _Keys(rest, model, embed)
        index = {t.name: i for i, t in enumerate(rest.tables)}
        keys.ensure([(index[p.table], w) for p in plan.placements for w in p.widths])
        plan = _local_improve(rest, model, keys, plan, config, _fixed_ms(model, task, fixed, embed))
    return _with_fixed(plan, fixed, task), evaluated


def _free_memory(task: Task, fixed: Sequence[TablePlacement]) -> int:
    """Bytes per device the fixed placements leave of the cap (at most; <= 0: none)."""
    if not fixed:
        return task.memory_cap_bytes
    used = Plan(tuple(fixed), task.num_devices).device_memory([task.table(p.table) for p in fixed], task.batch_size)
    return task.memory_cap_bytes - max(used)


def _rest_task(task: Task, fixed: Sequence[TablePlacement]) -> Task:
    """The tables the placement search places, in the memory the fixed ones leave."""
    if not fixed:
        return task
    names = {p.table for p in fixed}
    return task.subset([t.name for t in task.tables if t.name not in names], _free_memory(task, fixed))


def _with_fixed(plan: Plan, fixed: Sequence[TablePlacement], task: Task) -> Plan:
    return Plan(tuple(plan.placements) + tuple(fixed), task.num_devices)


def _fixed_ms(model: CostModel, task: Task, fixed: Sequence[TablePlacement], embed: Embedder) -> np.ndarray:
    """(forward, backward) ms [D, 2] the fixed placements cost each device."""
    if not fixed:
        return np.zeros((task.num_devices, 2))
    alone = predict_step(model, task.subset([p.table for p in fixed]), Plan(tuple(fixed), task.num_devices), embed)
    return np.asarray([[d.fwd_compute + d.fwd_comm, d.bwd_compute + d.bwd_comm] for d in alone.devices])


def _shortfall(task: Task, model: CostModel, config: SearchConfig, embed: Embedder) -> InfeasibleError:
    """The memory error of the root greedy run that placed the most shards."""
    keys = _Keys(task, model, embed)
    root: Widths = tuple((t.dim,) for t in task.tables)
    keys.ensure(_state_keys(root))
    runs = _greedy_runs(task, model, keys, [root], config.scales)
    r = int(np.argmax(runs.died_at))
    inverse = {i: k for k, i in keys.index.items()}
    t, _ = inverse[int(runs.order_keys[r, runs.died_at[r]])]
    return memory_shortfall_error(task, task.tables[t], [int(runs.free_at_death[r])])


def _choose_kinds(
    task: Task,
    model: CostModel,
    config: SearchConfig,
    choice: Mapping[str, TableChoices],
    embed: Embedder,
    given: tuple[TablePlacement, ...],
) -> tuple[TablePlacement, ...]:
    """The ``given`` placements and the tables to replicate or split by rows beside them
    (see the module docstring); ``given`` alone when the model cannot price either, or on
    one device."""
    world = task.num_devices
    parts = model.step_parts
    collectives = Collectives.of(model, task)
    if world == 1 or not (collectives.replicates() or collectives.splits_rows()):
        return given
    given_names = {p.table for p in given}
    open_tables = [(i, t) for i, t in enumerate(task.tables) if t.name not in given_names]
    keys = _Keys(task, model, embed)
    keys.ensure([(i, t.dim) for i, t in open_tables])
    single = {t.name: float(keys.single[keys.index[(i, t.dim)]]) for i, t in open_tables}
    fair = sum(single.values()) / world
    dp: list[TableSpec] = []
    if collectives.replicates():
        links = collectives.links
        base = sum(data_parallel_ms(parts, [], task.batch_size, world, links).values())
        gain = {
            t.name: single[t.name] / world - (sum(data_parallel_ms(parts, [t], task.batch_size, world, links).values()) - base)
            for _, t in open_tables
        }
        dp = sorted(
            (
                t
                for _, t in open_tables
                if choice[t.name].data_parallel
                and Shard(t, t.dim).memory_bytes(ShardingKind.DATA_PARALLEL, task.batch_size, world) < task.memory_cap_bytes
            ),
            key=lambda t: (-gain[t.name], t.name),
        )
    grid = []
    for rows in _row_choices(task, config, choice, single, fair, open_tables if collectives.splits_rows() else []):
        taken = {p.table for p in rows}
        replicable = [t for t in dp if t.name not in taken][: len(open_tables) - len(rows) - 1]
        for n_dp in sorted({min(k, len(replicable)) for k in config.data_parallel_grid}):
            grid.append(given + rows + tuple(TablePlacement.data_parallel(t.name) for t in replicable[:n_dp]))
    # one greedy placement of the whole tables around every choice, in lockstep
    # (a choice whose fixed tables leave no memory has a cap <= 0: all its runs die)
    states = []
    for fixed in grid:
        names = {p.table for p in fixed}
        states.append(tuple(() if t.name in names else (t.dim,) for t in task.tables))
    runs = _greedy_runs(task, model, keys, states, config.kind_scales, [_free_memory(task, f) for f in grid])
    per_state = runs.cost.reshape(len(grid), len(config.kind_scales))
    best: tuple[float, tuple[TablePlacement, ...]] | None = None
    for i, fixed in enumerate(grid):
        if not np.isfinite(per_state[i].min()):
            continue
        placed = _plan_of(task, keys, runs, i * len(config.kind_scales) + int(per_state[i].argmin()))
        cost = predict_step(model, task, _with_fixed(placed, fixed, task), embed).cost_ms
        if best is None or cost < best[0] - 1e-9:
            best = (cost, fixed)
    return best[1] if best is not None else given


def _row_choices(
    task: Task,
    config: SearchConfig,
    choice: Mapping[str, TableChoices],
    single: Mapping[str, float],
    fair: float,
    open_tables: Sequence[tuple[int, TableSpec]],
) -> list[tuple[TablePlacement, ...]]:
    """The row splits ``_choose_kinds`` tries: none, and the costliest 1, 2, 4, ... tables
    that take half a device's fair share or more (``config.row_wise_grid``; one table of
    ``open_tables`` stays sharded), split row-wise over every rank, or, on a topology of
    several hosts, table-row-wise over one host each (the least loaded host first, so
    several spread over the hosts)."""
    world, links = task.num_devices, task.links
    hosts = world // links.local_world_size if links is not None else 1  # full hosts
    kinds = [ShardingKind.ROW_WISE] + ([ShardingKind.TABLE_ROW_WISE] if hosts > 1 else [])
    out: list[tuple[TablePlacement, ...]] = [()]
    for kind in kinds:
        blocks = world if kind is ShardingKind.ROW_WISE else links.local_world_size
        candidates = sorted(
            (t for _, t in open_tables if choice[t.name].allows(kind) and t.rows >= blocks and single[t.name] >= fair / 2),
            key=lambda t: (-single[t.name], t.name),
        )
        for n in sorted({min(k, len(candidates), len(open_tables) - 1) for k in config.row_wise_grid} - {0}):
            if kind is ShardingKind.ROW_WISE:
                out.append(tuple(TablePlacement.row_blocks(t, range(world)) for t in candidates[:n]))
            else:
                out.append(spread_over_hosts(candidates[:n], lambda t: single[t.name], world, links.local_world_size))
    return out


def _place(
    task: Task,
    model: CostModel,
    config: SearchConfig,
    choice: Mapping[str, TableChoices],
    fixed: Sequence[TablePlacement],
    embed: Embedder,
) -> tuple[list[Plan], int]:
    """The beam search over column splits of the tables not in ``fixed``: the best plan of
    those tables at every depth that improved on the shallower ones (no split first; [] if
    no run fit memory), and the number of split states scored.

    The greedy runs price a device's shards as one kernel and one all-to-all, but every
    column-wise table adds a lookup group (a second kernel and set of collectives), so the
    caller re-prices each depth's best with the whole step."""
    task = _rest_task(task, fixed)
    min_w = [max(WIDTH_ALIGNMENT, choice[t.name].min_width) for t in task.tables]
    keys = _Keys(task, model, embed)
    root: Widths = tuple((t.dim,) for t in task.tables)
    keys.ensure(_state_keys(root))
    runs = _greedy_runs(task, model, keys, [root], config.scales)
    best_cost = float(runs.cost.min())
    plans = [_plan_of(task, keys, runs, int(runs.cost.argmin()))] if math.isfinite(best_cost) else []
    beam = [root]
    seen = {root}
    evaluated = 1
    for _ in range(config.max_steps):
        if config.deadline is not None and time.perf_counter() >= config.deadline:
            break
        children = [c for st in beam for c in _split_children(st, keys, config.top_k, min_w) if c not in seen]
        children = list(dict.fromkeys(children))
        if not children:
            break
        seen.update(children)
        keys.ensure([k for c in children for k in _state_keys(c)])
        runs = _greedy_runs(task, model, keys, children, config.scales)
        evaluated += len(children)
        per_state = runs.cost.reshape(len(children), len(config.scales))
        state_cost = per_state.min(1)
        ranked = np.argsort(state_cost, kind="stable")
        beam = [children[i] for i in ranked[: config.beam_width]]
        i = int(ranked[0])
        if state_cost[i] < best_cost:
            best_cost = float(state_cost[i])
            plans.append(_plan_of(task, keys, runs, i * len(config.scales) + int(per_state[i].argmin())))
    return plans, evaluated
