"""The search's entry point, in the role of TorchRec's ``EmbeddingShardingPlanner.plan``.
In: a task, a cost model, the configuration, each table's choices and the placements fixed
before the search. Out: a ``SearchResult``: the plan the whole step prices lowest, its
predicted per-device costs and the search's statistics. A task of one module is planned
whole (``joint``); one of several also module by module (``modules``), the cheaper kept.
"""

from __future__ import annotations

import time
from typing import Mapping, Sequence

import numpy as np
from threadpoolctl import threadpool_limits

from torchrec_neuroshard.search.config import KindChoice, SearchConfig, SearchContext, SearchResult, past
from torchrec_neuroshard.search.joint import joint_plan
from torchrec_neuroshard.search.modules import improve_modules, plan_by_module
from torchrec_neuroshard.stepcost import CachedEmbedder, predict_step
from torchrec_neuroshard.types import CostModel, DeviceCost, InfeasibleError, Plan, TableChoices, TablePlacement, Task


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
    memo: dict | None = None,
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
            replicate, or one larger than a rank split by rows): kept as they are, the
            rest placed in the memory they leave on each device, all priced in the whole step.
        memo: the answers earlier searches' stages computed (the kinds ``kinds.choose_kinds``
            chose, the heuristics' plans, the split search's first greedy runs), by all each
            reads but the model, read and added to: pass one dict only to searches of one
            model (the planner's offload screens and the full search of the chosen
            proposal). None: a fresh one.

    Raises:
        InfeasibleError: no split and placement fits the memory cap; names the table.
    """
    # The search's matrices are small: one BLAS thread is faster than several, and
    # far faster when the other cores are busy.
    with threadpool_limits(limits=1, user_api="blas"):
        model = model.with_batch_size(task.batch_size).for_tables(task.tables)
        context = SearchContext(model, config, choices or {}, CachedEmbedder(model), {} if memo is None else memo)
        return _search(task, tuple(fixed), context)


def _search(task: Task, given: tuple[TablePlacement, ...], context: SearchContext) -> SearchResult:
    t0 = time.perf_counter()
    model, embed = context.model, context.embed
    unknown = sorted({p.table for p in given} - {t.name for t in task.tables})
    if unknown:
        raise ValueError(f"fixed placements name tables {unknown} that are not in the task")
    if len(given) == len(task.tables):  # nothing left to place
        plan, evaluated, weighed = Plan(given, task.num_devices), 0, ()
    else:
        plan, evaluated, weighed = _searched_plan(task, given, context)
    plan.validate(task)
    prediction = predict_step(model, task, plan, embed)
    return SearchResult(plan, prediction.cost_ms, prediction.devices, evaluated, time.perf_counter() - t0, weighed)


def _searched_plan(task: Task, given: tuple[TablePlacement, ...], context: SearchContext) -> tuple[Plan, int, tuple[KindChoice, ...]]:
    """The best plan of the tables ``given`` leaves, with ``given``; the states evaluated;
    and the kinds step's choices for all its tables placed together. A task of several
    modules is also planned module by module (not past the planning budget,
    ``SearchConfig.deadline``), and the plan the whole step prices lower is kept."""
    model, config, embed = context.model, context.config, context.embed
    plan, evaluated, weighed = joint_plan(task, given, context)
    if len(task.modules) < 2 or past(config.deadline):
        return plan, evaluated, weighed
    candidates = [plan]
    try:
        by_module, more = plan_by_module(task, given, context)
        candidates, evaluated = [plan, by_module], evaluated + more
    except InfeasibleError:  # the modules do not fit set apart (each is given the memory
        pass  # the others leave on their fullest device): the joint plan alone goes on
    costs = [predict_step(model, task, p, embed).cost_ms for p in candidates]
    plan = candidates[int(np.argmin(costs))]
    if config.local_search:
        plan = improve_modules(task, model, plan, embed, config.max_local_moves, config.deadline)
    return plan, evaluated, weighed
