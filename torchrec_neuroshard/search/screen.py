"""The local search's screen of a round's candidates, block by block (issue 41). In: the
devices as the plan stands, the bottleneck device and its cheap partners. Out: the
``shortlist`` candidates of best separable estimate, exactly those ``local._estimate``
picks from ``local._candidates``' full list, in that list's order.

A round's candidates are the moves (each shard of the worst device to each cheap device)
and, per cheap device, the swaps of each of its shards with each shard of the worst: an
outer product. ``local._estimate`` gathers every candidate's parts ([n] rows, n = 8 x m x k
for m shards on the worst device and k on each other: a million at 3,000 tables); here each
block of swaps is priced by broadcasting the worst device's shards against the partner's,
the same sums in the same order, and the comm of each distinct (destination, columns
moved) taken from one table. The model is called on the same batches as there (the kernels'
changes, the comm of every distinct group in sorted order), so the estimates are the
same numbers and the shortlist the same candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from torchrec_neuroshard.search.keys import Keys
from torchrec_neuroshard.types import CostModel


@dataclass(frozen=True)
class Block:
    """Candidates sharing a destination pattern: the moves (``partner`` None: shard ``out``
    [n] to device ``dst`` [n]), or the swaps with one cheap device ``partner``: each of its
    shards ``there`` [k] against each of the worst device's ``on_worst`` [m], kept where
    ``ok`` [k, m] (memory allows)."""

    out: np.ndarray
    dst: np.ndarray | None = None
    partner: int | None = None
    there: np.ndarray | None = None
    ok: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.partner is None and (self.dst is None or len(self.dst) != len(self.out)):
            raise ValueError("a block of moves needs a destination for each shard it moves")
        if self.partner is not None and (self.there is None or self.ok is None or self.ok.shape != (len(self.there), len(self.out))):
            raise ValueError("a swap block needs its partner's shards and a [k, m] mask of them against the worst's")

    @property
    def size(self) -> int:
        return len(self.out) if self.partner is None else int(self.ok.sum())

    def triples(self, local: np.ndarray) -> np.ndarray:
        """[len(local), 3] (shard out, destination, shard back or -1) of its candidates ``local``."""
        if self.partner is None:
            return np.stack([self.out[local], self.dst[local], np.full(len(local), -1)], -1)
        pos = np.flatnonzero(self.ok)[local]  # flat [k, m] positions
        return np.stack([self.out[pos % len(self.out)], np.full(len(local), self.partner), self.there[pos // len(self.out)]], -1)


def blocks(dev: np.ndarray, size: np.ndarray, mem: np.ndarray, worst: int, cheap: np.ndarray, cap: float) -> list[Block]:
    """``local._candidates`` as blocks, in its order: the moves, then each cheap device's swaps."""
    on_worst = np.flatnonzero(dev == worst)  # [m]
    out, dst = (x.reshape(-1) for x in np.broadcast_arrays(on_worst[:, None], cheap[None]))  # [m * P]
    fits = mem[dst] + size[out] <= cap
    found = [Block(out[fits], dst[fits])]
    for d in cheap:
        there = np.flatnonzero(dev == d)  # [k]
        ok = (mem[d] + size[on_worst][None] - size[there][:, None] <= cap) & (
            mem[worst] - size[on_worst][None] + size[there][:, None] <= cap
        )  # [k, m]
        found.append(Block(on_worst, None, int(d), there, ok))
    return found


def shortlisted(
    model: CostModel, keys: Keys, key_of: np.ndarray, dev: np.ndarray, now, worst: int, cheap: np.ndarray, found: list[Block], shortlist: int
) -> np.ndarray:
    """[shortlist, 3] the candidates of least estimate, in candidate order (``local._estimate``'s
    ``np.sort(np.argpartition(estimate, shortlist)[:shortlist])`` of the full list)."""
    estimate = _estimates(model, keys, key_of, dev, now, worst, cheap, found)  # [n]
    chosen = np.sort(np.argpartition(estimate, shortlist)[:shortlist])
    starts = np.cumsum([0] + [b.size for b in found])  # [B + 1]
    owner = np.searchsorted(starts, chosen, side="right") - 1  # [shortlist] block of each
    return np.concatenate([b.triples(chosen[owner == i] - starts[i]) for i, b in enumerate(found)]).astype(np.int64)


def _estimates(model: CostModel, keys: Keys, key_of: np.ndarray, dev: np.ndarray, now, worst: int, cheap: np.ndarray, found: list[Block]) -> np.ndarray:
    """[n] ``local._estimate`` of every candidate of ``found``, in order: each block's two
    devices' (forward, backward) ms summed as ``local._separable`` sums them, then priced
    with comm (``_priced``)."""
    on_worst = np.flatnonzero(dev == worst)  # [m]
    leave, join_worst, joins = _kernel_changes(model, keys, key_of, dev, now, worst, cheap, on_worst, found)
    row = np.zeros(len(dev), dtype=np.int64)  # [S] a shard's row among the worst's
    row[on_worst] = np.arange(len(on_worst))
    col = np.zeros(len(now.dims), dtype=np.int64)  # [D] a cheap device's column
    col[cheap] = np.arange(len(cheap))
    worst_after = now.base[worst] + leave[on_worst]  # [m, 2]
    width = keys.width[key_of].astype(np.int64)  # [S] whole columns
    moves, i = found[0], row[found[0].out]
    new_worst = worst_after[i] + join_worst[0] * 0.0  # a move has no shard back: local._separable adds row 0 x False
    new_dst = now.base[moves.dst] + joins[i, col[moves.dst]] + leave[0] * 0.0
    pieces: list[_Moves | _Swaps] = [_Moves(new_worst, new_dst, width[moves.out], moves.dst)]
    for b in found[1:]:
        after = now.base[b.partner] + joins[:, col[b.partner]]  # [m, 2]
        pieces.append(_Swaps(worst_after, after, width[on_worst], join_worst[b.there], leave[b.there], width[b.there], b.partner, b.ok))
    return _priced(model, now, worst, pieces)


@dataclass(frozen=True)
class _Moves:
    """The moves' parts: the worst device's and the destination's (forward, backward) ms
    after each [n, 2], the columns it moves [n] (whole numbers) and its destination [n]."""

    worst: np.ndarray
    dst_ms: np.ndarray
    moved: np.ndarray
    dst: np.ndarray

    def __post_init__(self) -> None:
        if self.moved.dtype.kind != "i":
            raise ValueError("columns moved are whole numbers: give them as integers")


@dataclass(frozen=True)
class _Swaps:
    """One cheap device's swaps as their factors: of the worst's m shards, the worst's ms
    after each leaves and the partner's after each joins [m, 2] and their widths [m]; of the
    partner's k shards, what each changes joining the worst and leaving the partner [k, 2]
    and their widths [k]; the partner ``dst`` and which pairs memory allows, ``ok`` [k, m].
    A pair's parts are a row's plus a column's, as ``local._separable`` adds them."""

    worst_after: np.ndarray
    dst_after: np.ndarray
    width: np.ndarray
    joins_worst: np.ndarray
    leaves_dst: np.ndarray
    there_width: np.ndarray
    dst: int
    ok: np.ndarray

    def __post_init__(self) -> None:
        if self.width.dtype.kind != "i" or self.there_width.dtype.kind != "i":
            raise ValueError("widths are whole numbers: give them as integers")

    def parts(self, rows: slice) -> tuple[np.ndarray, ...]:
        """Of the pairs of partner shards ``rows``: worst's forward and backward, the
        partner's forward and backward, and the columns moved, [r, m] each."""
        joins, leaves = self.joins_worst[rows], self.leaves_dst[rows]  # [r, 2]
        return (
            self.worst_after[None, :, 0] + joins[:, 0, None], self.worst_after[None, :, 1] + joins[:, 1, None],
            self.dst_after[None, :, 0] + leaves[:, 0, None], self.dst_after[None, :, 1] + leaves[:, 1, None],
            self.width[None] - self.there_width[rows, None],
        )  # fmt: skip

    def most_moved(self) -> int:
        """The most columns any pair moves either way (kept or not)."""
        if not len(self.width) or not len(self.there_width):
            return 0
        return int(max(self.width.max() - self.there_width.min(), self.there_width.max() - self.width.min()))

    def distinct_moved(self) -> np.ndarray:
        """The distinct columns the kept pairs move, sorted: of a whole block, the
        differences of the two sides' distinct widths, not a sort of all k x m."""
        if not self.ok.all():
            return np.unique((self.width[None] - self.there_width[:, None])[self.ok])
        return np.unique(np.unique(self.width)[None] - np.unique(self.there_width)[:, None])


def _kernel_changes(model, keys, key_of, dev, now, worst, cheap, on_worst, found: list[Block]):
    """(leave [S, 2], join_worst [S, 2], joins [m, P, 2]): ``local._separable``'s kernel
    changes, on the very batches it prices (the shards some candidate moves, in order)."""
    from torchrec_neuroshard.search.local import _kernel_change

    moving = np.zeros(len(dev), dtype=bool)  # [S]
    coming = np.zeros(len(dev), dtype=bool)  # [S]
    moving[found[0].out] = True
    for b in found[1:]:
        moving[b.out[b.ok.any(0)]] = True
        coming[b.there[b.ok.any(1)]] = True
    moving, coming = np.flatnonzero(moving | coming), np.flatnonzero(coming)
    leave = np.zeros((len(dev), 2))  # [S, 2] its device's kernel change when it leaves
    leave[moving] = _kernel_change(model, keys, now, dev[moving], key_of[moving], -1)
    join_worst = np.zeros((len(dev), 2))  # [S, 2] worst's kernel change when it joins
    join_worst[coming] = _kernel_change(model, keys, now, np.full(len(coming), worst), key_of[coming], 1)
    shard, device = (x.reshape(-1) for x in np.broadcast_arrays(on_worst[:, None], cheap[None]))  # [m * P]
    joins = _kernel_change(model, keys, now, device, key_of[shard], 1).reshape(len(on_worst), len(cheap), 2)
    return leave, join_worst, joins


CHUNK = 32_768
"""Pairs a block of swaps is priced in at once: its arrays stay in cache (at 10,000 tables a
block is 1.5 million pairs; whole, its dozen temporaries were memory-bound)."""


def _priced(model: CostModel, now, worst: int, pieces: list) -> np.ndarray:
    """[n] ``local._two_device_cost`` of the pieces' kept candidates, concatenated: the comm
    of the same groups (``_comm_groups``), each candidate's read from a table of its
    destination by columns moved, the swaps priced ``CHUNK`` pairs at a time."""
    groups, span = _comm_groups(model, now, worst, pieces)
    fwd = now.base[:, 0].copy()  # [D]
    fwd[worst] = -np.inf
    order = np.argsort(fwd)[::-1]  # the latest forward first
    second = np.append(fwd[order], -np.inf)[1]
    out = []
    for p in pieces:
        others = np.where(p.dst == order[0], second, fwd[order[0]])
        if isinstance(p, _Moves):  # one destination each
            group = groups.rank[p.dst * span + p.moved + span // 2]  # [n]
            tables = (groups.comm[group, worst], groups.comm[group, p.dst], groups.latest[group])
            out.append(_estimate(p.worst[:, 0], p.worst[:, 1], p.dst_ms[:, 0], p.dst_ms[:, 1], others, *tables))
            continue
        group = groups.rank[p.dst * span : (p.dst + 1) * span]  # [span] by columns moved + span // 2
        by_moved = (groups.comm[group, worst], groups.comm[group, p.dst], groups.latest[group])  # [span] each
        step = max(1, CHUNK // max(1, len(p.width)))
        for start in range(0, len(p.there_width), step):
            rows = slice(start, start + step)
            worst_fwd, worst_bwd, dst_fwd, dst_bwd, moved = p.parts(rows)  # [r, m] each
            at = moved + span // 2
            estimate = _estimate(worst_fwd, worst_bwd, dst_fwd, dst_bwd, others, *(t[at] for t in by_moved))
            ok = p.ok[rows]
            out.append(estimate.reshape(-1) if ok.all() else estimate[ok])
    return np.concatenate([e.reshape(-1) for e in out])


def _estimate(worst_fwd, worst_bwd, dst_fwd, dst_bwd, others, worst_comm, dst_comm, latest) -> np.ndarray:
    """``local._two_device_cost``'s last line: the latest forward plus the latest backward
    with comm, of the two devices and the others (all arrays alike in shape)."""
    back = np.maximum(np.maximum(worst_bwd + worst_comm, dst_bwd + dst_comm), latest)
    return np.maximum(np.maximum(worst_fwd, dst_fwd), others) + back


@dataclass(frozen=True)
class _Groups:
    """The distinct (destination, columns moved) of a round's kept candidates: each
    code's group ``rank`` [D * span], each group's comm on every device [G, D] and the
    latest backward + comm of the devices it leaves alone [G]."""

    rank: np.ndarray
    comm: np.ndarray
    latest: np.ndarray


def _comm_groups(model: CostModel, now, worst: int, pieces: list) -> tuple[_Groups, int]:
    """``local._two_device_cost``'s groups and their comm: found without a sort of all the
    candidates (the same groups in the same order, so the comm model prices the same
    batch), and the span of their codes (any span over all the columns moved orders the
    groups alike)."""
    from torchrec_neuroshard.search.local import group_comm

    most = [int(np.abs(p.moved).max(initial=0)) if isinstance(p, _Moves) else p.most_moved() for p in pieces]
    span = 2 * max(most) + 1
    present = np.zeros(len(now.dims) * span, dtype=bool)  # [D * span] (destination, columns moved + span // 2) kept
    for p in pieces:  # the moves: each its own destination; a block of swaps: one
        present[(p.dst * span + (p.moved if isinstance(p, _Moves) else p.distinct_moved())) + span // 2] = True
    codes = np.flatnonzero(present)  # [G] sorted, as np.unique gives them
    comm, late = group_comm(model, now, worst, codes // span, codes % span - span // 2)
    return _Groups(np.cumsum(present) - 1, comm, late), span
