"""Greedy placement, in TorchRec's partitioner role. In: split states (each table's shard
widths) and max-dimension scales. Out: for every (state, scale) run, the device of each
shard and the run's predicted embedding cost, or where it ran out of memory (``Runs``);
and a run's plan (``plan_of``).

Costs come from a ``CostModel`` whose compute is additive in an embedding space, so a
device's running shard set is one summed vector: adding a shard is a vector add and one
evaluation of the small head, and every greedy run of one beam step (states x scales)
advances in lockstep, vectorised over runs and devices.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from torchrec_neuroshard.search.keys import Keys, Widths, state_keys
from torchrec_neuroshard.types import CostModel, Plan, TablePlacement, Task

__all__ = ["Keys", "Placements", "Runs", "Widths", "greedy_runs", "plan_from_shards", "plan_of", "state_keys"]


@dataclass(frozen=True)
class Runs:
    """Outcome of greedy runs: per run its cost (inf if invalid), device of each ordered
    shard, the shard order's keys, and where invalid runs died."""

    cost: np.ndarray  # [R]
    assign: np.ndarray  # [R, Smax] device of k-th ordered shard
    order_keys: np.ndarray  # [R, Smax] key id, -1 padding
    died_at: np.ndarray  # [R] ordered shard index where the run failed, -1 if valid
    free_at_death: np.ndarray  # [R] most free bytes on any device when it failed


@dataclass
class Placements:
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
    def empty(n: int, devices: int, width: int, reserved: np.ndarray | None = None) -> "Placements":
        """N placements of nothing, each device holding ``reserved`` [D] bytes (default none)."""
        sums = np.zeros((n * devices, width), dtype=np.float32)
        fwd, bwd, load, mem = (np.zeros((n, devices)) for _ in range(4))
        mem_max = np.zeros(n)
        if reserved is not None:
            mem[:], mem_max[:] = reserved, np.max(reserved)
        return Placements(sums, fwd, bwd, load, np.zeros((n, devices), dtype=np.int32), mem, mem_max)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Placements ``dst`` [M] become copies of placements ``src`` [M]."""
        D = self.fwd.shape[1]
        sums = self.sums.reshape(-1, D, self.sums.shape[1])  # [N, D, E]
        sums[dst] = sums[src]
        for a in (self.fwd, self.bwd, self.load, self.dims, self.mem, self.mem_max):
            a[dst] = a[src]

    def place(self, model: CostModel, cells: np.ndarray, emb: np.ndarray, width: np.ndarray, size: np.ndarray) -> None:
        """Add a shard (embedding ``emb`` [M, E], ``width`` and ``size`` [M]) to one device
        of each of M distinct placements, ``cells`` [M] (placement * D + device), and
        re-predict them."""
        placed = np.take(self.sums, cells, axis=0)  # [M, E] (take: faster than fancy indexing here)
        placed += emb
        self.sums[cells] = placed
        self.dims.reshape(-1)[cells] += width.astype(np.int32, copy=False)
        mem = self.mem.reshape(-1)
        mem[cells] += size
        p = cells // self.fwd.shape[1]
        self.mem_max[p] = np.maximum(self.mem_max[p], mem[cells])
        cost = model.device_cost(placed).astype(np.float64, copy=False)  # [M, 2]
        fwd, bwd = cost[:, 0], cost[:, 1]
        self.fwd.reshape(-1)[cells], self.bwd.reshape(-1)[cells] = fwd, bwd
        self.load.reshape(-1)[cells] = fwd + bwd

    def fits(self, p: np.ndarray, device: np.ndarray, dim_room: np.ndarray, mem_room: np.ndarray) -> np.ndarray:
        """[M]: whether device ``device`` of placement ``p`` has dims <= ``dim_room`` and
        bytes <= ``mem_room`` (all [M])."""
        cell = p * self.fwd.shape[1] + device
        return (self.dims.reshape(-1)[cell] <= dim_room) & (self.mem.reshape(-1)[cell] <= mem_room)


def greedy_runs(
    task: Task,
    model: CostModel,
    keys: Keys,
    states: Sequence[Widths],
    scales: Sequence[float],
    caps: Sequence[float] | None = None,
    reserved: np.ndarray | None = None,
    deadline: float | None = None,
    memory_first: bool = False,
) -> Runs | None:
    """Greedy placement for every (state, scale) pair in lockstep: shards sorted by
    predicted single-shard cost (``memory_first``: by bytes, largest first, ties by cost),
    each to the feasible device of least predicted compute so far (ties to less memory of
    its own); feasible = memory fits (``caps`` per state, default
    the task's cap, less ``reserved`` [D], default the task's) and the device's dim sum
    stays within scale x (total width / D). None if ``deadline`` (a ``time.perf_counter()``
    reading, the planning budget's) passes before every run has ended.

    Runs that placed the same shards on the same devices share one placement until they
    part (a state's scales, states alike up to their first difference): placed once."""
    D = task.num_devices
    cap = np.repeat(np.asarray(caps if caps is not None else [task.memory_cap_bytes] * len(states), dtype=np.float64), len(scales))
    order, dim_cap, length = _run_orders(keys, states, scales, D, memory_first)
    dim_cap = _whole_columns(dim_cap)  # [R] int64: the int32 dim sums compare as whole numbers
    width = keys.width.astype(np.int32)  # [K] whole columns, as the dim sums hold them
    smax, R = order.shape
    reserved = np.asarray(task.reserved if reserved is None else reserved, dtype=np.float64)  # [D]
    # placement 0: the start of every run; runs parting from their placement take new ones (<= R)
    held, n_held = Placements.empty(R, D, keys.emb.shape[1], reserved), 1
    placement = np.zeros(R, dtype=np.int64)  # [R] the placement holding run r's
    shared = True  # some active runs may share a placement
    end_fwd, end_bwd, end_dims = np.zeros((R, D)), np.zeros((R, D)), np.zeros((R, D))
    assign = np.full((smax, R), -1, dtype=np.int64)
    died_at = np.full(R, -1, dtype=np.int64)  # -1: alive
    free_at_death = np.zeros(R)
    ends = set(length.tolist())  # the steps at which some runs have placed all their shards
    a = np.arange(R)  # [A] the active runs: alive, shards left to place
    for k in range(smax + 1):
        if deadline is not None and time.perf_counter() >= deadline:
            return None
        if k in ends:
            a = _finish_runs(held, placement, a, length[a] == k, (end_fwd, end_bwd, end_dims))
        if not a.size:
            break
        p, kk = placement[a], order[k, a]
        dim_room, mem_room = dim_cap[a] - width[kk], cap[a] - keys.size[kk]
        device, decided = _choose_devices(held, n_held, p, kk, dim_room, mem_room, shared, reserved)
        dead = device < 0
        if dead.any():
            died_at[a[dead]] = k
            free_at_death[a[dead]] = cap[a[dead]] - held.mem[p[dead]].min(1)
            a, p, kk, device, decided = (x[~dead] for x in (a, p, kk, device, decided))
        assign[k, a] = device
        if shared:
            n_held = _part(held, n_held, placement, a, p, kk * D + device, decided)
            p, kk, device = _one_run_per_placement(n_held, placement[a], kk, device)
            shared = len(p) < len(a)
        held.place(model, p * D + device, keys.emb[kk], width[kk], keys.size[kk])
    return Runs(_totals(model, died_at < 0, end_fwd, end_bwd, end_dims), assign.T, order.T, died_at, free_at_death)


def _finish_runs(held: Placements, placement: np.ndarray, active: np.ndarray, finished: np.ndarray, ends: tuple[np.ndarray, ...]) -> np.ndarray:
    """The ``active`` runs [A] that ``finished`` ([A] bool: placed their last shard) have their
    per-device totals (fwd, bwd, dims: each [R, D]) copied out of their placements into
    ``ends``; the active runs still placing returned."""
    done = active[finished]
    for end, totals in zip(ends, (held.fwd, held.bwd, held.dims)):
        end[done] = totals[placement[done]]
    return active[~finished]


def _totals(model: CostModel, alive: np.ndarray, fwd: np.ndarray, bwd: np.ndarray, dims: np.ndarray) -> np.ndarray:
    """[R] the embedding cost of each run that placed every shard (``alive`` [R]; the
    devices' forward and backward ms and dims at its end [R, D]), inf for the others."""
    total = np.full(len(alive), np.inf)
    if alive.any():
        _, total[alive] = model.embedding_cost(fwd[alive], bwd[alive], dims[alive])
    return total


_NO_ROOM = np.iinfo(np.int64).min
"""Room of a placement no run is on, for integer dim rooms (-inf for float ones)."""


def _filled(n: int, value: float, dtype: type | np.dtype) -> np.ndarray:
    """[n] of ``value``: ``np.full``, without its Python-level overhead (five a greedy step)."""
    out = np.empty(n, dtype=dtype)
    out.fill(value)
    return out


def _whole_columns(room: np.ndarray, within: type | np.dtype = np.int32) -> np.ndarray:
    """int64 ``room`` [N] rounded down, clipped to ``within``'s range (the dim sums' type): a
    dim sum of whole columns fits ``room`` exactly when it fits ``floor(room)``, so the
    greedy's rooms are integer subtractions and comparisons."""
    info = np.iinfo(within)
    return np.minimum(np.maximum(np.floor(room), info.min), info.max).astype(np.int64)


def _one_run_per_placement(
    n_held: int, placement: np.ndarray, shard: np.ndarray, device: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of A runs on placements ``placement`` [A] placing ``shard`` on ``device`` [A]: each
    placement in use once, in order [P], and the shard and device of one of its runs [P],
    which places the shard for all of them."""
    run_of = _filled(n_held, -1, np.int64)  # [n_held]
    run_of[placement] = np.arange(len(placement))
    p = (run_of >= 0).nonzero()[0]
    return p, shard[run_of[p]], device[run_of[p]]


def _run_orders(
    keys: Keys, states: Sequence[Widths], scales: Sequence[float], devices: int, memory_first: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per run (R = states x scales, a state's scales together): the key of the shard it
    places at each step [Smax, R] (-1 past its last; costliest first, or largest first),
    its dim cap (scale x total width / devices, plus a tolerance) [R] and its number of
    shards [R]."""
    per_state = []
    for st in states:
        ids = keys.ids(st)
        by_cost = ids[np.argsort(-keys.single[ids], kind="stable")]
        per_state.append(by_cost[np.argsort(-keys.size[by_cost], kind="stable")] if memory_first else by_cost)
    n_scales = len(scales)
    order = np.full((max(len(ids) for ids in per_state), len(states) * n_scales), -1, dtype=np.int64)  # [Smax, R]
    for i, ids in enumerate(per_state):
        order[: len(ids), i * n_scales : (i + 1) * n_scales] = ids[:, None]
    total_width = np.asarray([keys.width[ids].sum() for ids in per_state])  # [states]
    limit = (np.asarray(scales, dtype=np.float64)[None, :] * total_width[:, None] / devices).reshape(-1)  # [R]
    length = np.repeat(np.asarray([len(ids) for ids in per_state], dtype=np.int64), n_scales)  # [R]
    return order, limit + 1e-9, length


def _choose_devices(
    held: Placements,
    n_held: int,
    p: np.ndarray,
    shard: np.ndarray,
    dim_room: np.ndarray,
    mem_room: np.ndarray,
    shared: bool,
    reserved: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``_least_loaded_with_room`` for A runs on placements ``p`` [A] (of ``held``'s first
    ``n_held``) placing ``shard`` [A] with ``dim_room`` and ``mem_room`` [A], scanning each
    placement's devices once; and whether each run took its placement's decision [A].

    Where runs share a placement (``shared``), it decides for the shard one of them
    places, with the most room any run placing that shard has; a run with less room makes
    the same choice when both the chosen device and the first least-loaded one fit it (the
    least load and its ties among the devices the run may use are then the same); any
    other run decides alone."""
    most_dim = _filled(n_held, _NO_ROOM if dim_room.dtype.kind == "i" else -np.inf, dim_room.dtype)  # [n_held]; least: placement not in use
    most_mem = _filled(n_held, -np.inf, np.float64)
    if not shared:  # one run per placement
        most_dim[p], most_mem[p] = dim_room, mem_room
        device, _ = _least_loaded_with_room(
            held.load[:n_held], held.dims[:n_held], held.mem[:n_held], most_dim, most_mem, held.mem_max[:n_held], reserved
        )
        return device[p], np.ones(len(p), dtype=bool)
    deciding = _filled(n_held, -1, np.int64)  # [n_held] the shard each placement decides for
    deciding[p] = shard
    same = shard == deciding[p]  # [A]
    np.maximum.at(most_dim, p[same], dim_room[same])
    np.maximum.at(most_mem, p[same], mem_room[same])
    chosen, least = _least_loaded_with_room(
        held.load[:n_held], held.dims[:n_held], held.mem[:n_held], most_dim, most_mem, held.mem_max[:n_held], reserved
    )
    device, least = chosen[p], least[p]  # [A]
    decided = same & (
        ((dim_room == most_dim[p]) & (mem_room == most_mem[p]))
        | ((device >= 0) & held.fits(p, np.maximum(device, 0), dim_room, mem_room) & held.fits(p, least, dim_room, mem_room))
    )
    alone = (~decided).nonzero()[0]
    if alone.size:
        q = p[alone]
        device[alone], _ = _least_loaded_with_room(
            held.load[q], held.dims[q], held.mem[q], dim_room[alone], mem_room[alone], held.mem_max[q], reserved
        )
    return device, decided


def _part(
    held: Placements, n_held: int, placement: np.ndarray, a: np.ndarray, p: np.ndarray, move: np.ndarray, decided: np.ndarray
) -> int:
    """Runs ``a`` [A] on placements ``p`` [A] make ``move``s [A] (shard and device): those
    making the move their placement decided on (``decided`` [A]: the runs that took its
    decision) go on sharing it; the others, grouped by placement and move, move to copies
    of it, but for the first such group of a placement no run kept, which takes the
    placement itself. Sets ``placement`` [R] of the runs; returns how many are held."""
    kept = _filled(n_held, -1, np.int64)  # [n_held] the move each placement makes, -1: none yet
    kept[p[decided]] = move[decided]
    other = (kept[p] != move).nonzero()[0]
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
    reserved: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The greedy's device on each of G placements, [G]: of the devices with dims <=
    dim_room and mem <= mem_room, the one of least load; ties (within 1e-9) to less memory
    (of its own: less ``reserved`` [D], the bytes every device started from), then to the
    lower index; -1 where no device has room or the least load is not finite.
    Also the first device of least load, [G] (the same but for ties).

    load, dims, mem: [G, D] per placement and device; dim_room, mem_room: [G], the caps
    less the shard's width and bytes. Dims and bytes are whole numbers, so ``dims > cap -
    w`` is exactly ``dims + w > cap``, and for integer ``dims`` (the greedy's int32) it is
    ``dims > floor(cap - w)``, compared in their own type. ``mem_max`` [G], each
    placement's fullest device (default: computed), spares the placements whose every
    device has room the memory comparison (where they are most, all compare at once). One
    argmin finds the least device, a second one whether another is within the tolerance;
    only those placements compare memory."""
    rows = np.arange(len(load))
    if dims.dtype.kind in "iu":  # rooms in the dims' own type (an int64 room would widen every dim)
        dim_room = _whole_columns(dim_room, dims.dtype).astype(dims.dtype)
    blocked = dims > dim_room[:, None]  # [G, D]
    full = ((mem.max(1) if mem_max is None else mem_max) > mem_room).nonzero()[0]
    if 4 * full.size > len(load):  # most placements: one pass over all beats gathering them
        blocked |= mem > mem_room[:, None]
    elif full.size:
        blocked[full] |= mem[full] > mem_room[full, None]
    masked = blocked * _BLOCKED  # [G, D]: a multiply and an add, where putmask branches on every device
    masked += load
    first = masked.argmin(1)
    least = masked[rows, first]
    masked[rows, first] = np.inf
    tied = masked[rows, masked.argmin(1)] <= least + 1e-9  # argmin: far faster than min over short rows
    device = first.copy()
    if tied.any():
        t = rows[tied]
        masked[t, first[t]] = least[t]
        tie = masked[t] <= least[t, None] + 1e-9  # [T, D]
        own = mem[t] if reserved is None else mem[t] - reserved  # [T, D] the placement's own bytes
        device[t] = np.where(tie, own, np.inf).argmin(1)
    device[~(least < _BLOCKED)] = -1  # (also a load not finite)
    return device, first


_BLOCKED = 1e300
"""The load a device without room scans at: above any load (1e300 + load is 1e300)."""


def plan_of(task: Task, keys: Keys, runs: Runs, r: int) -> Plan:
    """The plan of run ``r``: each shard it placed on its device."""
    inverse = {i: k for k, i in keys.index.items()}
    shards = []
    for key, dev in zip(runs.order_keys[r], runs.assign[r]):
        if key < 0:
            break
        t, w = inverse[int(key)]
        shards.append((t, w, int(dev)))
    return plan_from_shards(task, shards)


def plan_from_shards(task: Task, shards: Sequence[tuple[int, int, int]]) -> Plan:
    """Plan from (table index, width, device) triples; a table's shards narrowest first,
    each table on its spec's compute kernel.

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
        widths, devices = tuple(w for w, _ in ordered), tuple(d for _, d in ordered)
        placements.append(TablePlacement(table.name, widths, devices, kernel=table.kernel, cache_load_factor=table.cache_load_factor))
    return Plan(tuple(placements), task.num_devices)
