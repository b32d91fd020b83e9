"""Local improvement, the search's last stage: moves and swaps of column shards off the
bottleneck device. In: a plan of the searched tables (every shard a key of the search's
``greedy.Keys``: its summed-embedding row, width and bytes), the model, and what the fixed
placements cost each device. Out: the plan after the best improving move or swap,
repeated while the predicted embedding cost drops (``improve_plan``).

Each round takes every shard of the most expensive device and tries it on each of the
``partners`` cheapest devices, alone (a move) or in exchange for a shard there (a swap),
memory permitting. A device of 100 shards meets 8 x 100 x 100 swaps a round; pricing each
exactly (two devices' kernels, then every device's all-to-all) is what planning time went
to. So when the candidates outnumber ``shortlist``, each is first estimated separably: a
device's kernel after losing shard i and gaining shard j is priced as its kernel now plus
what losing i alone and gaining j alone each change, 4 evaluations per shard instead of
2 per pair, and every device's comm priced for the estimate in O(candidates)
(``_two_device_cost``: exact where the comm model's forward only adds the wait for the
latest device, as the alpha-beta stand-in's does; the neural comm's other dependence on
the skews is taken as it stands); the ``shortlist`` best estimates are then priced exactly.
The rounds screen block by block (``screen``: the same estimates, broadcast over each
cheap device's swaps instead of gathered per candidate).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from torchrec_neuroshard.search.config import SearchConfig
from torchrec_neuroshard.search.greedy import Keys, plan_from_shards
from torchrec_neuroshard.search.screen import blocks, shortlisted
from torchrec_neuroshard.types import CostModel, Plan, Task

SHORTLIST = 1024
"""Candidates of a round priced exactly; more are screened by the separable estimate
(tests/test_local_search.py holds the screened search to within 2% of the exhaustive one;
benchmarks/search_speed.py --full-size compares the plans with the exhaustive search's of
commit 50a0ad0)."""


def improve_plan(task: Task, model: CostModel, keys: Keys, plan: Plan, config: SearchConfig, fixed_ms: np.ndarray) -> Plan:
    """``plan`` after ``local_improve``: moves and swaps off the bottleneck device."""
    names = {t.name: i for i, t in enumerate(task.tables)}
    shards = [(names[p.table], w, d) for p in plan.placements for w, d in zip(p.widths, p.devices)]
    stall = (config.local_window, config.local_min_gain)
    return plan_from_shards(task, local_improve(model, keys, shards, config.max_local_moves, fixed_ms, stall, config.deadline))


@dataclass(frozen=True)
class _Devices:
    """The devices as the plan stands: summed key rows [D, E], dims, bytes (the task's
    reserved bytes included) and shard counts [D], the kernels' (forward, backward) ms
    [D, 2] alone and with the fixed placements' (``base``), and the embedding cost's
    per-device total (compute + comm) [D] and max."""

    sums: np.ndarray
    dims: np.ndarray
    mem: np.ndarray
    count: np.ndarray
    kernel: np.ndarray
    base: np.ndarray
    per_dev: np.ndarray
    total: float

    @staticmethod
    def of(model: CostModel, keys: Keys, key_of: np.ndarray, dev: np.ndarray, fixed_ms: np.ndarray) -> "_Devices":
        D = len(fixed_ms)
        sums = np.zeros((D, keys.emb.shape[1]), dtype=np.float32)
        np.add.at(sums, dev, keys.emb[key_of])
        dims = np.bincount(dev, weights=keys.width[key_of], minlength=D)
        count = np.bincount(dev, minlength=D)
        kernel = kernel_ms(model, sums, count)  # [D, 2]
        base = kernel + fixed_ms
        comm, total = model.embedding_cost(base[None, :, 0], base[None, :, 1], dims[None])
        per_dev = base.sum(1) + comm[0].sum(1)
        mem = np.bincount(dev, weights=keys.size[key_of], minlength=D) + np.asarray(keys.task.reserved)
        return _Devices(sums, dims, mem, count, kernel, base, per_dev, float(total[0]))


def kernel_ms(model: CostModel, sums: np.ndarray, count: np.ndarray) -> np.ndarray:
    """(forward, backward) ms [N, 2] of N kernels of summed rows ``sums`` [N, E] and
    ``count`` [N] shards; 0 for an empty one."""
    cost = model.device_cost(sums)
    cost[count == 0] = 0.0
    return cost


def local_improve(
    model: CostModel,
    keys: Keys,
    shards: list[tuple[int, int, int]],
    max_moves: int,
    fixed_ms: np.ndarray,
    stall: tuple[int, float],
    deadline: float | None = None,
    partners: int = 8,
    shortlist: int = SHORTLIST,
) -> list[tuple[int, int, int]]:
    """(table, width, device) ``shards`` after improving moves and swaps (see the module
    docstring); ``fixed_ms`` [D, 2] the forward and backward ms the fixed placements cost
    each device, ``keys`` the search's ``Keys`` holding every shard. It stops when its
    last ``stall = (window, min_gain)`` moves together lowered the predicted embedding cost
    by less than ``min_gain`` of it; no move is started past ``deadline`` (a
    ``time.perf_counter()`` reading)."""
    key_of = np.asarray([keys.index[(t, w)] for t, w, _ in shards])
    dev = np.asarray([d for _, _, d in shards])
    cap = keys.task.memory_cap_bytes
    window, min_gain = stall
    totals: list[float] = []  # the embedding cost before each round
    for _ in range(max_moves):
        if deadline is not None and time.perf_counter() >= deadline:
            break
        now = _Devices.of(model, keys, key_of, dev, fixed_ms)
        totals.append(now.total)
        if len(totals) > window and totals[-1 - window] - now.total < min_gain * totals[-1 - window]:
            break
        worst = int(now.per_dev.argmax())
        cheap = np.asarray([d for d in np.argsort(now.per_dev) if d != worst][:partners], dtype=np.int64)
        if not len(cheap):  # one device: nowhere to move to
            break
        found = blocks(dev, keys.size[key_of], now.mem, worst, cheap, cap)  # the candidates, by block
        if sum(b.size for b in found) > shortlist:  # the ones _estimate shortlists, block by block
            cand = shortlisted(model, keys, key_of, dev, now, worst, cheap, found, shortlist)  # [shortlist, 3]
        else:
            cand = _candidates(dev, keys.size[key_of], now.mem, worst, cheap, cap)  # [n, 3]
        if not len(cand):
            break
        cost = _exact(model, keys, key_of, now, worst, cand, fixed_ms)
        best = int(cost.argmin())
        if cost[best] >= now.total - 1e-6:
            break
        i, d, j = (int(x) for x in cand[best])
        dev[i] = d
        if j >= 0:
            dev[j] = worst
    return [(t, w, int(d)) for (t, w, _), d in zip(shards, dev)]


def _candidates(dev: np.ndarray, size: np.ndarray, mem: np.ndarray, worst: int, cheap: np.ndarray, cap: float) -> np.ndarray:
    """[n, 3] (shard leaving ``worst``, destination, shard coming back or -1) within memory:
    the moves (each shard of ``worst``, each of the ``cheap`` devices), then the swaps
    (each cheap device, each shard there, each shard of ``worst``)."""
    on_worst = np.flatnonzero(dev == worst)  # [m]
    moves = np.stack(np.broadcast_arrays(on_worst[:, None], cheap[None], -1), -1).reshape(-1, 3)  # [m * P, 3]
    moves = moves[mem[moves[:, 1]] + size[moves[:, 0]] <= cap]
    swaps = []
    for d in cheap:
        there = np.flatnonzero(dev == d)  # [k]
        i, j = np.broadcast_arrays(on_worst[None], there[:, None])  # [k, m] each
        ok = (mem[d] + size[i] - size[j] <= cap) & (mem[worst] - size[i] + size[j] <= cap)
        swaps.append(np.stack([i[ok], np.full(ok.sum(), d), j[ok]], -1))
    return np.concatenate([moves, *swaps]).astype(np.int64)


def _estimate(
    model: CostModel, keys: Keys, key_of: np.ndarray, dev: np.ndarray, now: _Devices, worst: int, cheap: np.ndarray, cand: np.ndarray
) -> np.ndarray:
    """[n] each candidate's embedding cost, its two devices' kernels estimated separably
    (see the module docstring), every device's comm priced by ``_two_device_cost``."""
    new_worst, new_dst, delta_w = _separable(model, keys, key_of, dev, now, worst, cheap, cand)
    return _two_device_cost(model, now, worst, cand[:, 1], new_worst, new_dst, delta_w)


def _separable(model: CostModel, keys: Keys, key_of: np.ndarray, dev: np.ndarray, now: _Devices, worst: int, cheap: np.ndarray, cand: np.ndarray):
    """Each candidate's (forward, backward) ms on ``worst`` and on its destination [n, 2]
    each, estimated separably, and the columns it moves off ``worst`` [n]. Per shard s
    (of S, on device ``dev[s]``): what leaving its device and joining ``worst`` change
    there; per shard of ``worst`` and cheap device, what joining that device changes."""
    out, dst, back = cand[:, 0], cand[:, 1], cand[:, 2]
    has_back = back >= 0
    moving, coming = np.zeros(len(dev), dtype=bool), np.zeros(len(dev), dtype=bool)
    moving[out], coming[back[has_back]] = True, True
    moving, coming = np.flatnonzero(moving | coming), np.flatnonzero(coming)  # the shards candidates move
    leave = np.zeros((len(dev), 2))  # [S, 2] its device's kernel change when it leaves
    leave[moving] = _kernel_change(model, keys, now, dev[moving], key_of[moving], -1)
    join_worst = np.zeros((len(dev), 2))  # [S, 2] worst's kernel change when it joins
    join_worst[coming] = _kernel_change(model, keys, now, np.full(len(coming), worst), key_of[coming], 1)
    on_worst = np.flatnonzero(dev == worst)  # [m]
    row, col = np.zeros(len(dev), dtype=np.int64), np.zeros(len(now.dims), dtype=np.int64)
    row[on_worst], col[cheap] = np.arange(len(on_worst)), np.arange(len(cheap))
    shard, device = (x.reshape(-1) for x in np.broadcast_arrays(on_worst[:, None], cheap[None]))  # [m * P]
    joins = _kernel_change(model, keys, now, device, key_of[shard], 1).reshape(len(on_worst), len(cheap), 2)
    joins = joins[row[out], col[dst]]  # [n, 2] the destination's change when the shard joins
    new_worst = now.base[worst] + leave[out] + join_worst[np.where(has_back, back, 0)] * has_back[:, None]
    new_dst = now.base[dst] + joins + leave[np.where(has_back, back, 0)] * has_back[:, None]
    delta_w = keys.width[key_of[out]] - np.where(has_back, keys.width[key_of[np.where(has_back, back, 0)]], 0.0)
    return new_worst, new_dst, delta_w


def _kernel_change(model: CostModel, keys: Keys, now: _Devices, devices: np.ndarray, key: np.ndarray, sign: int) -> np.ndarray:
    """[N, 2]: what adding (``sign`` 1) or removing (-1) keys [N] changes devices' [N] kernels."""
    new = kernel_ms(model, now.sums[devices] + sign * keys.emb[key], now.count[devices] + sign)
    return new - now.kernel[devices]


def _embedding_cost(
    model: CostModel, now: _Devices, worst: int, dst: np.ndarray, new_worst: np.ndarray, new_dst: np.ndarray, delta_w: np.ndarray
) -> np.ndarray:
    """[n] the embedding cost of n candidates that give ``worst`` and devices ``dst`` [n]
    the (forward, backward) ms ``new_worst`` and ``new_dst`` [n, 2] and move ``delta_w``
    [n] columns from the one to the other."""
    n = len(dst)
    fwd = np.repeat(now.base[None, :, 0], n, 0)  # [n, D]
    bwd = np.repeat(now.base[None, :, 1], n, 0)
    dims = np.repeat(now.dims[None], n, 0)
    rows = np.arange(n)
    fwd[:, worst], bwd[:, worst] = new_worst[:, 0], new_worst[:, 1]
    fwd[rows, dst], bwd[rows, dst] = new_dst[:, 0], new_dst[:, 1]
    dims[:, worst] -= delta_w
    dims[rows, dst] += delta_w
    return model.embedding_cost(fwd, bwd, dims)[1]


def group_comm(model: CostModel, now: _Devices, worst: int, g_dst: np.ndarray, g_moved: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each of G groups (a destination, the columns moved there from ``worst``): every
    device's wait-free comm [G, D] after the move, and the latest backward + comm [G] of the
    devices the move leaves alone."""
    rows = np.arange(len(g_dst))
    dims = np.repeat(now.dims[None], len(rows), 0)  # [G, D]
    dims[:, worst] -= g_moved
    dims[rows, g_dst] += g_moved
    comm = _comm_without_wait(model, dims, now.base[:, 0]).sum(2)  # [G, D]
    late = now.base[None, :, 1] + comm  # [G, D] backward + comm
    late[:, worst] = -np.inf
    late[rows, g_dst] = -np.inf
    return comm, late.max(1)


def _two_device_cost(
    model: CostModel, now: _Devices, worst: int, dst: np.ndarray, new_worst: np.ndarray, new_dst: np.ndarray, delta_w: np.ndarray
) -> np.ndarray:
    """[n] ``_embedding_cost`` in O(n + G D), comm as a wait-free cost plus the forward's wait
    for the latest device. A device's total is then the latest forward + its backward + its
    wait-free comm, so a candidate costs the latest forward plus the largest backward +
    comm of its two devices and the others'; comm is priced once for each of the G
    distinct (destination, columns moved). Exact for a model whose comm has that form
    (``CostModel.wait_free_comm``); for one whose skews enter otherwise (the neural comm),
    the rest of the comm is priced at the skews as they stand (``_comm_without_wait``)."""
    span = 2 * int(np.abs(delta_w).max()) + 1  # columns moved are whole numbers
    codes, inverse = np.unique(dst * span + (delta_w.astype(np.int64) + span // 2), return_inverse=True)  # [G], [n]
    comm, late = group_comm(model, now, worst, codes // span, codes % span - span // 2)
    back = np.maximum(np.maximum(new_worst[:, 1] + comm[inverse, worst], new_dst[:, 1] + comm[inverse, dst]), late[inverse])
    fwd = now.base[:, 0].copy()  # [D]
    fwd[worst] = -np.inf
    order = np.argsort(fwd)[::-1]  # the latest forward first
    others = np.where(dst == order[0], np.append(fwd[order], -np.inf)[1], fwd[order[0]])  # [n] untouched devices' latest
    return np.maximum(np.maximum(new_worst[:, 0], new_dst[:, 0]), others) + back


def _comm_without_wait(model: CostModel, dims: np.ndarray, fwd: np.ndarray) -> np.ndarray:
    """(forward, backward) comm [G, D, 2] of G plans of dim sums ``dims`` [G, D] without the
    forward's wait for the latest device: the model's wait-free comm where it has one, else
    its comm at the skews of the forward times ``fwd`` [D] with that wait taken off."""
    free = model.wait_free_comm(dims)
    if free is not None:
        return free
    skews = np.broadcast_to(fwd - fwd.min(), dims.shape)  # [G, D]
    comm = np.array(model.comm_cost_array(dims, skews), dtype=np.float64)
    comm[:, :, 0] -= skews.max(1, keepdims=True) - skews  # the comm model's forward includes the wait
    return comm


def _exact(
    model: CostModel, keys: Keys, key_of: np.ndarray, now: _Devices, worst: int, cand: np.ndarray, fixed_ms: np.ndarray
) -> np.ndarray:
    """[n] the embedding cost of each candidate, its two devices re-predicted, with comm."""
    n = len(cand)
    out_k = key_of[cand[:, 0]]
    has_back = cand[:, 2] >= 0
    back_k = key_of[np.where(has_back, cand[:, 2], 0)]
    delta_e = keys.emb[out_k] - np.where(has_back[:, None], keys.emb[back_k], 0.0).astype(np.float32)  # [n, E]
    delta_w = keys.width[out_k] - np.where(has_back, keys.width[back_k], 0.0)  # [n]
    delta_c = 1 - has_back.astype(np.int64)  # [n]
    dst = cand[:, 1]
    touched = np.concatenate([now.sums[worst][None] - delta_e, now.sums[dst] + delta_e])  # [2n, E]
    touched_count = np.concatenate([np.full(n, now.count[worst]) - delta_c, now.count[dst] + delta_c])
    new = kernel_ms(model, touched, touched_count)  # [2n, 2]
    return _embedding_cost(model, now, worst, dst, new[:n] + fixed_ms[worst], new[n:] + fixed_ms[dst], delta_w)
