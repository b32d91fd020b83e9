"""The beam search over column splits, in TorchRec's proposer role. In: the tables left
by the fixed placements, each one's least width. Out: the best plan of every depth that
improved on the shallower ones (each split state placed by ``greedy``), and the number of
states scored.

The greedy runs price a device's shards as one kernel and one all-to-all, but TorchRec
runs a lookup group (kernel, input distribution, all-to-all) per sharding kind, so a
column-wise split adds a group. The caller prices the beam's best plan of every depth with
the whole step beside the heuristics' plans, and the cheapest goes on.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from torchrec_neuroshard.search.config import SearchConfig, past
from torchrec_neuroshard.search.fixed import rest_task
from torchrec_neuroshard.search.greedy import Keys, Runs, Widths, greedy_runs, plan_of, state_keys
from torchrec_neuroshard.stepcost import Embedder
from torchrec_neuroshard.types import WIDTH_ALIGNMENT, CostModel, Plan, TableChoices, TablePlacement, Task


def split_and_place(
    task: Task,
    model: CostModel,
    config: SearchConfig,
    choice: Mapping[str, TableChoices],
    fixed: Sequence[TablePlacement],
    embed: Embedder,
    memo: dict | None = None,
) -> tuple[list[Plan], int]:
    """The beam search over column splits of the tables not in ``fixed``: the best plan of
    those tables at every depth that improved on the shallower ones (no split first; [] if
    no run fit memory), and the number of split states scored. The caller re-prices each
    depth's best with the whole step (see the module docstring). The greedy runs of the
    root and of its children, the same for every beam width, are kept in ``memo`` (None:
    not kept): a search of the same tables with a wider beam starts from them."""
    task = rest_task(task, fixed)
    memo = {} if memo is None else memo
    min_w = [max(WIDTH_ALIGNMENT, choice[t.name].min_width) for t in task.tables]
    keys = Keys(task, model, embed)
    root: Widths = tuple((t.dim,) for t in task.tables)
    keys.ensure(state_keys(root))
    runs = _kept_runs(memo, task, model, keys, [root], config.scales)
    best_cost = float(runs.cost.min())
    plans = [plan_of(task, keys, runs, int(runs.cost.argmin()))] if math.isfinite(best_cost) else []
    beam, beam_scales = [root], [int(runs.cost.argmin())]  # each beam state's best scale, of config.scales
    seen = {root}
    evaluated, stale = 1, 0  # stale: depths in a row without the least gain
    for depth in range(config.max_steps):
        if past(config.deadline):
            break
        children = [c for st in beam for c in _split_children(st, keys, config.top_k, min_w) if c not in seen]
        children = list(dict.fromkeys(children))
        if not children:
            break
        seen.update(children)
        keys.ensure([k for c in children for k in state_keys(c)])
        used = _near_scales(len(config.scales), beam_scales, config.scale_window)  # indices into config.scales
        scales = tuple(config.scales[j] for j in used)
        if depth == 0:  # the root's children, the same at every beam width
            runs = _kept_runs(memo, task, model, keys, children, scales, config.deadline)
        else:
            runs = greedy_runs(task, model, keys, children, scales, deadline=config.deadline)
        if runs is None:  # the planning budget ran out before these runs ended
            break
        evaluated += len(children)
        per_state = runs.cost.reshape(len(children), len(scales))
        ranked = np.argsort(per_state.min(1), kind="stable")
        beam, beam_scales = [children[i] for i in ranked[: config.beam_width]], [used[int(per_state[i].argmin())] for i in ranked[: config.beam_width]]
        i = int(ranked[0])
        cost = float(per_state[i].min())
        gained = not math.isfinite(best_cost) or cost < best_cost * (1.0 - config.min_gain)  # nothing fits yet: deeper
        if cost < best_cost:
            best_cost = cost
            plans.append(plan_of(task, keys, runs, i * len(scales) + int(per_state[i].argmin())))
        stale = 0 if gained else stale + 1
        if stale >= config.patience:
            break
    return plans, evaluated


def _near_scales(n_scales: int, best: Sequence[int], window: int | None) -> list[int]:
    """The scales (indices of ``n_scales``) a depth's children run at: each beam state's
    best (``best``) and ``window`` on either side, and the last (no limit, the last resort);
    every one when ``window`` is None."""
    if window is None:
        return list(range(n_scales))
    return sorted({n_scales - 1} | {j for b in best for j in range(max(0, b - window), min(n_scales, b + window + 1))})


def _kept_runs(
    memo: dict, task: Task, model: CostModel, keys: Keys, states: list[Widths], scales: tuple[float, ...], deadline: float | None = None
) -> Runs | None:
    """``greedy_runs`` of ``states``, kept in ``memo`` by the task, states and scales. Runs
    name shards by their ``keys`` ids, so a kept one is reused only where ``keys`` gave
    every shard the same id (the same shards ensured in the same order). None (nothing
    kept) when ``deadline`` passes first."""
    key = ("greedy", task, tuple(states), tuple(scales))
    ids = tuple(keys.index)  # [K] (table, width) of each id
    if key not in memo or memo[key][0] != ids:
        runs = greedy_runs(task, model, keys, states, scales, deadline=deadline)
        if runs is None:
            return None
        memo[key] = (ids, runs)
    return memo[key][1]


def _split_children(state: Widths, keys: Keys, top_k: int, min_width: Sequence[int]) -> list[Widths]:
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
