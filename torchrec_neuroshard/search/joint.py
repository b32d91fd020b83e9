"""One task's tables planned together, the search's main line. In: a task, the placements
given before the search, and the search's context. Out: the cheapest of the beam's plans
and the heuristics' plans (the whole step pricing each, around the chosen kinds and around
the given placements alone), improved locally, with its fixed placements; and the number
of split states scored. Raises ``InfeasibleError`` naming the table short of memory when
no plan fits.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from torchrec_neuroshard.heuristics import BASELINES, baseline_plan, memory_shortfall_error
from torchrec_neuroshard.search.config import KindChoice, SearchConfig, SearchContext, past
from torchrec_neuroshard.search.fixed import fixed_ms, rest_task, with_fixed
from torchrec_neuroshard.search.greedy import Keys, Widths, greedy_runs, state_keys
from torchrec_neuroshard.search.kinds import Kinds, choose_kinds
from torchrec_neuroshard.search.local import improve_plan
from torchrec_neuroshard.search.splits import split_and_place
from torchrec_neuroshard.stepcost import Embedder, predict_step
from torchrec_neuroshard.types import CostModel, InfeasibleError, Plan, TableChoices, TablePlacement, Task


def joint_plan(task: Task, given: tuple[TablePlacement, ...], context: SearchContext) -> tuple[Plan, int, tuple[KindChoice, ...]]:
    """The best plan of the tables ``given`` leaves, all placed together (kinds chosen,
    placed, seeded with the heuristics' plans, improved locally), with ``given``; the
    states evaluated; and the choices of kinds weighed."""
    model, config, choices, embed = context.model, context.config, context.choices, context.embed
    choice = {t.name: choices.get(t.name, TableChoices()) for t in task.tables}
    if config.deadline is not None:
        _fallback_first(task, given, context, choice)
    fixed, weighed = _kinds(task, given, context, choice)
    placed_all = len(fixed) == len(task.tables)  # the kinds placed every table (split by rows, replicated)
    searched, evaluated = ([Plan((), task.num_devices)], 0) if placed_all else split_and_place(task, model, config, choice, fixed, embed, context.memo)
    candidates = [(p, fixed) for p in searched]
    if config.seed_with_baselines and fixed != given and not placed_all:  # around the chosen kinds too
        candidates += [(p, fixed) for p in _feasible_baselines(rest_task(task, fixed), context.memo)]
    if config.seed_with_baselines:
        candidates += [(p, given) for p in _feasible_baselines(rest_task(task, given), context.memo)]
    if not candidates:
        raise _shortfall(rest_task(task, given), model, config, embed)
    costs = [predict_step(model, task, with_fixed(p, f, task), embed).cost_ms for p, f in candidates]
    plan, fixed = candidates[int(np.argmin(costs))]
    if config.local_search and len(task.modules) < 2 and plan.placements:  # it balances devices' totals; several modules: modules.improve_modules
        rest = rest_task(task, fixed)
        keys = Keys(rest, model, embed)
        index = {t.name: i for i, t in enumerate(rest.tables)}
        keys.ensure([(index[p.table], w) for p in plan.placements for w in p.widths])
        plan = improve_plan(rest, model, keys, plan, config, fixed_ms(model, task, fixed, embed))
    return with_fixed(plan, fixed, task), evaluated, weighed


def _fallback_first(task: Task, given: tuple[TablePlacement, ...], context: SearchContext, choice: dict[str, TableChoices]) -> None:
    """Under a planning budget, the plans that need no kind choice, made before it and kept
    in ``context.memo``: the greedy run of the whole tables the given placements leave and
    the heuristics' plans of them. The search reads them from there as it would have made
    them, so the plan is the same; but a budget that runs out during the kind choice finds
    its fallback made, not still to make."""
    config = replace(context.config, max_steps=0)  # the root's greedy runs alone
    split_and_place(task, context.model, config, choice, given, context.embed, context.memo)
    if config.seed_with_baselines:
        _feasible_baselines(rest_task(task, given), context.memo)


def _kinds(task: Task, given: tuple[TablePlacement, ...], context: SearchContext, choice: dict[str, TableChoices]) -> tuple[Kinds, tuple[KindChoice, ...]]:
    """``choose_kinds``' answer (the kinds and the choices weighed), kept in
    ``context.memo`` under all it reads but the model: the task, the given placements, the
    choices and the kind-choice knobs; one the planning budget cut short is not kept."""
    config = context.config
    key = ("kinds", task, given, tuple(sorted(choice.items())), config.kind_scales, config.data_parallel_grid, config.row_wise_grid, config.kinds_shortlist)
    if key not in context.memo:
        answer = choose_kinds(task, context.model, config, choice, context.embed, given)
        if past(config.deadline):
            return answer
        context.memo[key] = answer
    return context.memo[key]


def _feasible_baselines(task: Task, memo: dict) -> list[Plan]:
    """The plans of the heuristics (``heuristics.BASELINES``) that fit the task's memory,
    kept in ``memo`` (they read the task alone)."""
    if ("baselines", task) not in memo:
        plans = []
        for name in BASELINES:
            try:
                plans.append(baseline_plan(name, task))
            except InfeasibleError:
                continue
        memo["baselines", task] = plans
    return memo["baselines", task]


def _shortfall(task: Task, model: CostModel, config: SearchConfig, embed: Embedder) -> InfeasibleError:
    """The memory error of the root greedy run that placed the most shards."""
    keys = Keys(task, model, embed)
    root: Widths = tuple((t.dim,) for t in task.tables)
    keys.ensure(state_keys(root))
    runs = greedy_runs(task, model, keys, [root], config.scales)
    r = int(np.argmax(runs.died_at))
    inverse = {i: k for k, i in keys.index.items()}
    t, _ = inverse[int(runs.order_keys[r, runs.died_at[r]])]
    return memory_shortfall_error(task, task.tables[t], [int(runs.free_at_death[r])])
