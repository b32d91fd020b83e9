"""The moves measured refinement (``lab.refine``) tries, and how it picks the next one.

Every move starts from the slowest measured device and goes to one of the least-measured
ones: a table-wise or column shard moved whole, its widest shard there halved and one half
or a quarter moved, two tables moved whole together, or one moved whole in exchange for
one of the target's (a swap). The last three even two devices out where each of the slow
one's shards is too small to pay the refiner's margin or too large to fit the target.
``best_move`` prices each candidate by the model, corrected per device by measured /
predicted, and offers the one that leaves the two devices least.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Collection, Mapping, NamedTuple, Sequence

import numpy as np

from torchrec_neuroshard.search.modules import MOVABLE
from torchrec_neuroshard.stepcost import predict_step
from torchrec_neuroshard.types import WIDTH_ALIGNMENT, CostModel, Plan, Shard, ShardingKind, TableChoices, TablePlacement, Task

PAIRS = 64
"""Moves of two tables (a swap, or two tables to one device) priced exactly per
``best_move``: the best of all such pairs by their shards' marginal cost."""
FRACTIONS = (2, 4)
"""A shard too heavy to move whole may have a half or a quarter of its columns moved."""


class Move(NamedTuple):
    """A table's shards on ``source`` (``columns`` of them) moved to ``target``; with them,
    table ``also``'s ``also_columns`` there, or, in a swap, table ``swapped``'s
    ``swapped_columns`` on ``target`` moved to ``source``."""

    table: str
    source: int
    target: int
    columns: int
    swapped: str | None = None
    swapped_columns: int = 0
    also: str | None = None
    also_columns: int = 0

    def arrivals(self) -> list[tuple[str, int]]:
        """(table, device) of every table the move puts on a device."""
        return [(self.table, self.target)] + [(t, d) for t, d in ((self.also, self.target), (self.swapped, self.source)) if t]

    def leaves(self) -> list[tuple[str, int]]:
        """(table, device) of every table the move takes off a device."""
        return [(self.table, self.source)] + [(t, d) for t, d in ((self.also, self.source), (self.swapped, self.target)) if t]

    def allowed(self, barred: Collection[tuple[str, int]]) -> bool:
        """Whether no table goes to a device ``barred`` pairs it with."""
        return not set(self.arrivals()) & set(barred)

    def describe(self) -> str:
        """What moves beside the first table (for the refiner's log)."""
        if self.also:
            return f", with table {self.also}'s {self.also_columns} columns"
        return f", for table {self.swapped}'s {self.swapped_columns} columns back" if self.swapped else ""


def device_compute(model: CostModel, task: Task, plan: Plan) -> np.ndarray:
    """Predicted compute ms [D] of each device: its table-wise and column shards' kernels
    (one per kind, as the judge times them) and its row blocks' and replicas' as
    ``predict_step`` prices them."""
    step = predict_step(model, task, plan)
    return np.asarray([d.compute for d in step.devices])


def best_move(
    model: CostModel,
    task: Task,
    plan: Plan,
    predicted: np.ndarray,
    measured: np.ndarray,
    targets: int,
    tried: Collection[Move],
    choices: Mapping[str, TableChoices] | None = None,
    barred: Collection[tuple[str, int]] = (),
    margin: float = 0.0,
    pairs: int = PAIRS,
) -> tuple[Plan, Move] | None:
    """(plan, move) of the move off the slowest measured device (``one_move_away`` and up to
    ``pairs`` of ``pairs_away``; none in ``tried``, nor one taking a table to a device
    ``barred`` pairs it with) whose prediction (``predicted`` [D], the plan's compute),
    corrected per device by measured / predicted, leaves the two devices least, if that is
    below the slowest's measured ms less ``margin`` of it (what the move must pay by to be
    kept), of the moves the plan stays valid after; None if none."""
    slow = int(np.argmax(measured))
    fasts = [int(d) for d in np.argsort(measured, kind="stable") if d != slow][:targets]
    ratio = np.where(predicted > 0, measured / np.maximum(predicted, 1e-12), 1.0)  # [D] measured / predicted
    candidates = one_move_away(task, plan, slow, fasts, choices or {}) + pairs_away(model, task, plan, slow, fasts, predicted, ratio, pairs)
    moves = [(c, m) for c, m in candidates if m not in tried and m.allowed(barred)]
    if not moves:
        return None
    involved = [slow, *fasts]
    kernels_now = dict(zip(involved, _kernels_ms(model, [_groups(task, plan, d) for d in involved])))  # the devices' kernels now
    to = np.asarray([m.target for _, m in moves])  # [moves] each move's target
    after = _kernels_ms(model, [_groups(task, c, d) for c, m in moves for d in (slow, m.target)]).reshape(-1, 2)  # [moves, 2]
    # the devices' row blocks and replicas stay: what the move changes is their kernels
    new_slow = (predicted[slow] - kernels_now[slow] + after[:, 0]) * ratio[slow]
    new_fast = (predicted[to] - np.asarray([kernels_now[f] for f in to]) + after[:, 1]) * ratio[to]
    score = np.maximum(new_slow, new_fast)  # [moves]
    for best in np.argsort(score, kind="stable"):  # the best move the plan stays valid after (validated in turn: 6 ms a plan)
        if score[best] >= measured[slow] * (1 - margin):
            return None
        if moves[best][0].fits(task):
            return moves[best]
    return None


def one_move_away(
    task: Task, plan: Plan, slow: int, fasts: Sequence[int], choices: Mapping[str, TableChoices]
) -> list[tuple[Plan, Move]]:
    """Every plan one move from ``plan``: for each table-wise or column-wise table with a
    shard on ``slow`` and each of ``fasts`` holding none of it, its shards on ``slow`` moved
    there whole, and, where its choices allow the part's width (``TableChoices.min_width``,
    a multiple of ``WIDTH_ALIGNMENT``), a half or a quarter (``FRACTIONS``) of its widest
    shard on ``slow`` split off and moved there (a table-wise table becomes column-wise).
    Memory is not checked."""
    out: list[tuple[Plan, Move]] = []
    for i, p in enumerate(plan.placements):
        if p.kind not in MOVABLE or slow not in p.devices:
            continue
        j = max((k for k, d in enumerate(p.devices) if d == slow), key=lambda k: p.widths[k])  # the widest shard on slow
        width, narrowest = p.widths[j], choices.get(p.table, TableChoices()).min_width
        parts = [width // n for n in FRACTIONS if width % n == 0 and (width // n) % WIDTH_ALIGNMENT == 0 and width // n >= narrowest]
        for fast in (f for f in fasts if f not in p.devices):
            out.append((_with(plan, {i: _moved(p, slow, fast)}), Move(p.table, slow, fast, _columns(p, slow))))
            for part in parts:
                split = replace(
                    p, widths=p.widths[:j] + (width - part, part) + p.widths[j + 1 :], devices=p.devices[:j] + (slow, fast) + p.devices[j + 1 :],
                    kind=ShardingKind.COLUMN_WISE,
                )  # fmt: skip
                out.append((_with(plan, {i: split}), Move(p.table, slow, fast, part)))
    return out


def pairs_away(
    model: CostModel, task: Task, plan: Plan, slow: int, fasts: Sequence[int], predicted: np.ndarray, ratio: np.ndarray, limit: int
) -> list[tuple[Plan, Move]]:
    """Up to ``limit`` plans two tables from ``plan``: two of ``slow``'s tables moved whole
    to one of ``fasts``, or one moved whole there and one of that device's moved whole to
    ``slow`` in exchange (tables on one of the two devices only). The pairs whose estimate
    leaves the two devices least, each table costing its marginal ms on the device it holds
    now (the device's kernels with it less without it), the devices scaled by their
    ``ratio`` [D] (measured / predicted). Memory is not checked."""
    if limit < 1:
        return []
    pairs: list[tuple[float, int, int, int, bool]] = []  # (estimate, fast, a table of slow, a table of slow or fast, swapped)
    on_slow = _marginals(model, task, plan, slow)  # {placement index: marginal ms on slow}, priced once for every target
    for fast in fasts:
        mine = {i: ms for i, ms in on_slow.items() if fast not in plan.placements[i].devices}
        theirs = {i: ms for i, ms in _marginals(model, task, plan, fast).items() if slow not in plan.placements[i].devices}
        ours, others = np.asarray(list(mine.values())), np.asarray(list(theirs.values()))  # [S], [F]
        for swapped, net in ((True, ours[:, None] - others[None, :]), (False, np.triu(ours[:, None] + ours[None, :], 1))):  # [S, F], [S, S]
            if not net.size:
                continue
            estimate = np.maximum((predicted[slow] - net) * ratio[slow], (predicted[fast] + net) * ratio[fast])
            if not swapped:
                estimate[np.tril_indices(len(ours))] = np.inf  # each pair of slow's tables once
            rows, cols = list(mine), (list(theirs) if swapped else list(mine))
            for flat in np.argsort(estimate, axis=None, kind="stable")[:limit]:
                a, b = np.unravel_index(flat, estimate.shape)
                if np.isfinite(estimate[a, b]):
                    pairs.append((float(estimate[a, b]), fast, rows[a], cols[b], swapped))
    out = []
    for _, fast, i, k, swapped in sorted(pairs)[:limit]:
        p, q = plan.placements[i], plan.placements[k]
        if swapped:
            move = Move(p.table, slow, fast, _columns(p, slow), swapped=q.table, swapped_columns=_columns(q, fast))
            out.append((_with(plan, {i: _moved(p, slow, fast), k: _moved(q, fast, slow)}), move))
        else:
            move = Move(p.table, slow, fast, _columns(p, slow), also=q.table, also_columns=_columns(q, slow))
            out.append((_with(plan, {i: _moved(p, slow, fast), k: _moved(q, slow, fast)}), move))
    return out


def _marginals(model: CostModel, task: Task, plan: Plan, device: int) -> dict[int, float]:
    """{placement index: predicted ms its shards add to ``device``'s kernels} of the
    table-wise and column tables with shards there."""
    movable = [i for i, p in enumerate(plan.placements) if p.kind in MOVABLE and device in p.devices]
    groups = _groups(task, plan, device)
    without = [{kind: [s for s in shards if s.table.name != plan.placements[i].table] for kind, shards in groups.items()} for i in movable]
    ms = _kernels_ms(model, [groups, *without])  # [1 + movable]
    return {i: float(ms[0] - m) for i, m in zip(movable, ms[1:])}


def _moved(p: TablePlacement, source: int, target: int) -> TablePlacement:
    """``p`` with its shards on ``source`` on ``target`` instead."""
    return replace(p, devices=tuple(target if d == source else d for d in p.devices))


def _columns(p: TablePlacement, device: int) -> int:
    return sum(w for w, d in zip(p.widths, p.devices) if d == device)


def _groups(task: Task, plan: Plan, device: int) -> dict[ShardingKind, list[Shard]]:
    """The table-wise and column shards on ``device``, by kind."""
    out: dict[ShardingKind, list[Shard]] = {}
    for p in plan.placements:
        if p.kind in MOVABLE:
            out.setdefault(p.kind, []).extend(shard for shard, d in p.shards(task.table(p.table)) if d == device)
    return out


def _kernels_ms(model: CostModel, groups: Sequence[Mapping[ShardingKind, list[Shard]]]) -> np.ndarray:
    """Predicted ms [N] of N devices' shard groups, each kind one kernel."""
    lists = [(i, shards) for i, g in enumerate(groups) for shards in g.values() if shards]
    out = np.zeros(len(groups))
    if lists:
        cost = np.asarray(model.compute_cost([shards for _, shards in lists]), dtype=np.float64).sum(1)  # [lists]
        np.add.at(out, [i for i, _ in lists], cost)
    return out


def _with(plan: Plan, placements: Mapping[int, TablePlacement]) -> Plan:
    """``plan`` with its placements at the given indices replaced."""
    return Plan(tuple(placements.get(i, p) for i, p in enumerate(plan.placements)), plan.num_devices)
