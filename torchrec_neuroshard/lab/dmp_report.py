"""The DMP harness's figures and report, from its rows (``lab.dmp_measure``): NeuroShard
fastest of all planners, / TorchRec and / best heuristic (geomean of median step times),
their spread under a paired bootstrap of the timed steps, and how the predicted step ranks
the plans against how the step does.
"""

from __future__ import annotations

import statistics
from typing import Sequence

from torchrec_neuroshard.heuristics import BASELINES
from torchrec_neuroshard.lab.planners import CALIBRATED, RIVALS, calibrated_files, geomean

def within_task_spearman(figure: dict[tuple[str, str], float], step: dict[tuple[str, str], float]) -> dict[str, float]:
    """Per task of more than two plans: the Spearman of ``figure`` vs ``step``, both keyed
    by (task, planner)."""
    from scipy.stats import spearmanr

    tasks = sorted({t for t, _ in figure})
    return {t: spearmanr([figure[k] for k in keys], [step[k] for k in keys]).statistic
            for t in tasks for keys in [[k for k in figure if k[0] == t]] if len(keys) > 2}  # fmt: skip

def _fastest_other(plans: dict[str, dict], name: str) -> dict:
    """The fastest row of a task's plans but ``name`` and its rival variant (``RIVALS``)."""
    return min((r for p, r in plans.items() if p not in (name, RIVALS[name])), key=lambda r: r["step_ms"])


def _variant(tasks: dict[str, dict[str, dict]], name: str) -> dict:
    """A NeuroShard variant's figures over the tasks where it and TorchRec both ran: tasks,
    fastest of all planners but its rival variant (``RIVALS``), / TorchRec and / best
    heuristic (geomean of median step times)."""
    both = [v for v in tasks.values() if name in v and "torchrec" in v]
    fastest = [v[name]["step_ms"] < _fastest_other(v, name)["step_ms"] for v in both]
    vs_torchrec = [v[name]["step_ms"] / v["torchrec"]["step_ms"] for v in both]
    vs_heuristic = [v[name]["step_ms"] / min(v[b]["step_ms"] for b in BASELINES if b in v) for v in both if any(b in v for b in BASELINES)]
    return {
        "tasks": len(both),
        "fastest": sum(fastest),
        "over_torchrec": geomean(vs_torchrec),
        "over_best_heuristic": geomean(vs_heuristic),
    }


def ok_by_task(rows: Sequence[dict]) -> dict[str, dict[str, dict]]:
    """task -> planner -> row, of the plans that ran."""
    tasks: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["status"] == "ok":
            tasks.setdefault(r["task"], {})[r["planner"]] = r
    return tasks


def paired_bootstrap(rows: Sequence[dict], name: str = "neuroshard", draws: int = 2000, level: float = 0.9, seed: int = 0) -> dict:
    """How sure ``name``'s target figures are, from the spread of the timed steps.

    A task's plans ran their k-th timed step in the same round (interleaved), so one draw
    of step indices, with replacement, resamples every plan of the task alike (a paired
    bootstrap); each draw recomputes the median step times and ``_variant``'s figures.
    Returns each figure's interval at ``level`` (``*_interval``: low, high) and per task
    ``name`` / the fastest other planner (median steps) with its interval and the share of
    draws in which ``name`` was the fastest (``per_task``). Tasks whose rows lack
    ``step_samples_ms`` are left out."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tasks = {
        label: plans
        for label, plans in ok_by_task(rows).items()
        if name in plans and "torchrec" in plans and all(r.get("step_samples_ms") for r in plans.values())
    }
    medians = {}  # task -> planner -> (draws,) median step ms of each draw
    for label, plans in tasks.items():
        steps = min(len(r["step_samples_ms"]) for r in plans.values())
        picks = rng.integers(0, steps, (draws, steps))  # step indices, shared by the task's plans
        medians[label] = {p: np.median(np.asarray(r["step_samples_ms"][:steps])[picks], axis=1) for p, r in plans.items()}
    figures: dict[str, list[float]] = {"fastest": [], "over_torchrec": [], "over_best_heuristic": []}
    per_task: dict[str, list[tuple[float, bool]]] = {label: [] for label in tasks}
    for draw in range(draws):
        drawn = {}
        for label, plans in medians.items():
            drawn[label] = {p: {"planner": p, "step_ms": float(m[draw])} for p, m in plans.items()}
            other = _fastest_other(drawn[label], name)["step_ms"]
            per_task[label].append((drawn[label][name]["step_ms"] / other, drawn[label][name]["step_ms"] < other))
        for figure, value in _variant(drawn, name).items():
            if figure in figures:
                figures[figure].append(value)
    tail = 100 * (1 - level) / 2
    interval = lambda xs: tuple(float(q) for q in np.percentile(xs, [tail, 100 - tail]))  # noqa: E731
    out: dict = {f"{k}_interval": interval(v) for k, v in figures.items() if v}
    out["per_task"] = {
        label: {
            "fastest_other": (other := _fastest_other(tasks[label], name))["planner"],
            "ratio": tasks[label][name]["step_ms"] / other["step_ms"],
            "ratio_interval": interval([r for r, _ in drawn_pairs]),
            "fastest_share": sum(f for _, f in drawn_pairs) / len(drawn_pairs),
        }
        for label, drawn_pairs in per_task.items()
    }
    return {"draws": draws, "level": level, **out}


def summary(rows: Sequence[dict]) -> dict:
    """The targets' figures over tasks where NeuroShard and TorchRec both ran: NeuroShard
    fastest of all planners (tasks), NeuroShard / TorchRec and / best heuristic (geomean of
    median step times), and the Spearman of predicted vs measured step over (task, plan)
    pairs, overall and within a task (median), beside the measurement's own within-task
    Spearman (odd vs even timed steps, median over tasks). With calibrated rows, the same figures of
    ``neuroshard_calibrated`` (``neuroshard_calibrated_...``) and its step time over
    NeuroShard's (geomean over the tasks both ran)."""
    from scipy.stats import spearmanr

    tasks = ok_by_task(rows)
    out = {("tasks" if k == "tasks" else f"neuroshard_{k}"): v for k, v in _variant(tasks, "neuroshard").items()}
    if any(CALIBRATED in v for v in tasks.values()):
        out.update({f"{CALIBRATED}_{k}": v for k, v in _variant(tasks, CALIBRATED).items()})
        pairs = [v[CALIBRATED]["step_ms"] / v["neuroshard"]["step_ms"] for v in tasks.values() if CALIBRATED in v and "neuroshard" in v]
        out[f"{CALIBRATED}_over_neuroshard"] = geomean(pairs)
    pairs = [(r["predicted_ms"], r["step_ms"]) for v in tasks.values() for r in v.values() if "predicted_ms" in r]

    def figure(of, keep=lambda r: True) -> dict[tuple[str, str], float]:
        """(task, planner) -> ``of(row)``, over the tasks whose every row passes ``keep``."""
        return {(label, p): of(r) for label, v in tasks.items() if all(map(keep, v.values())) for p, r in v.items()}

    step = figure(lambda r: r["step_ms"])
    within = list(within_task_spearman(figure(lambda r: r["predicted_ms"], lambda r: "predicted_ms" in r), step).values())
    split = lambda r: len(r.get("step_samples_ms", ())) >= 2  # noqa: E731
    odd = figure(lambda r: statistics.median(r["step_samples_ms"][0::2]), split)
    halves = list(within_task_spearman(odd, figure(lambda r: statistics.median(r["step_samples_ms"][1::2]), split)).values())
    return {
        **out,
        "spearman_predicted_vs_step": spearmanr(*zip(*pairs)).statistic if len(pairs) > 2 else float("nan"),
        "spearman_within_task_median": statistics.median(within) if within else float("nan"),
        "spearman_split_half_median": statistics.median(halves) if halves else float("nan"),
    }


def _calibrated_line(rows: Sequence[dict], s: dict) -> list[str]:
    """The summary's line of NeuroShard with the calibrated model and the file it planned with."""
    if f"{CALIBRATED}_tasks" not in s:
        return []
    return [
        f"- NeuroShard with the calibrated model ({calibrated_files([r for r in rows if r['planner'] == CALIBRATED])}) "
        f"fastest of all planners (shipped-model NeuroShard left out) on **{s[f'{CALIBRATED}_fastest']} of "
        f"{s[f'{CALIBRATED}_tasks']}** tasks; / TorchRec **{s[f'{CALIBRATED}_over_torchrec']:.3f}**, / best heuristic "
        f"**{s[f'{CALIBRATED}_over_best_heuristic']:.3f}**, / NeuroShard (shipped model) "
        f"**{s[f'{CALIBRATED}_over_neuroshard']:.3f}** (geomean of median step times)."
    ]


def _spread_lines(rows: Sequence[dict]) -> list[str]:
    """The summary's spread: NeuroShard's figures under ``paired_bootstrap``, and per task
    NeuroShard against the fastest other planner."""
    b = paired_bootstrap(rows)
    if "fastest_interval" not in b:
        return []
    pct = f"{100 * b['level']:.0f}%"
    lines = [
        f"- Spread ({b['draws']} paired bootstrap draws of the timed steps, {pct} intervals): NeuroShard / TorchRec "
        f"**{b['over_torchrec_interval'][0]:.3f}-{b['over_torchrec_interval'][1]:.3f}**, / best heuristic "
        f"**{b['over_best_heuristic_interval'][0]:.3f}-{b['over_best_heuristic_interval'][1]:.3f}**, fastest on "
        f"**{b['fastest_interval'][0]:.0f}-{b['fastest_interval'][1]:.0f}** tasks.",
        "",
        f"| task | fastest other planner | NeuroShard / it | {pct} interval | NeuroShard fastest in (share of draws) |",
        "|---|---|---|---|---|",
    ]
    for label, t in b["per_task"].items():
        low, high = t["ratio_interval"]
        lines.append(f"| {label} | {t['fastest_other']} | {t['ratio']:.3f} | {low:.3f}-{high:.3f} | {100 * t['fastest_share']:.0f}% |")
    return lines


def report(rows: Sequence[dict]) -> str:
    """Markdown: the summary, then per task every planner's step time, IQR, embedding share,
    ratio to TorchRec and the model's predicted step."""
    s = summary(rows)
    lines = [
        f"- NeuroShard fastest of all planners{' (the calibrated variant left out)' if f'{CALIBRATED}_tasks' in s else ''} "
        f"on **{s['neuroshard_fastest']} of {s['tasks']}** tasks; "
        f"NeuroShard / TorchRec **{s['neuroshard_over_torchrec']:.3f}**, NeuroShard / best heuristic "
        f"**{s['neuroshard_over_best_heuristic']:.3f}** (geomean of median step times).",
        *_calibrated_line(rows, s),
        f"- Predicted (shipped model, whole step) vs measured step time: Spearman **{s['spearman_predicted_vs_step']:.3f}** "
        f"over all (task, plan) pairs, **{s['spearman_within_task_median']:.3f}** within a task (median). "
        f"The measurement against itself within a task (median step of the odd vs the even timed steps, "
        f"interleaved alike): Spearman **{s['spearman_split_half_median']:.3f}** (median), the agreement that "
        f"half the steps allow.",
        *_spread_lines(rows),
        "",
        "| task | planner | step ms (median) | IQR ms | embedding ms | embedding share | step CPU ms | / TorchRec | predicted ms | DP / RW / splits | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label in dict.fromkeys(r["task"] for r in rows):
        task_rows = [r for r in rows if r["task"] == label]
        tr = next((r for r in task_rows if r["planner"] == "torchrec" and r["status"] == "ok"), None)
        for r in task_rows:
            if r["status"] != "ok":
                lines.append(f"| {label} | {r['planner']} | | | | | | | | | {r['status'][:120]} |")
                continue
            ratio = f"{r['step_ms'] / tr['step_ms']:.3f}" if tr else ""
            cap = "" if r["fits_cap"] else " (over the task's cap)"
            lines.append(
                f"| {label} | {r['planner']} | {r['step_ms']:.1f} | {r['step_iqr_ms']:.1f} | {r['embedding_ms']:.1f} | "
                f"{100 * r['embedding_share']:.0f}% | {r['step_cpu_ms']:.1f} | {ratio} | {r.get('predicted_ms', float('nan')):.1f} | "
                f"{r['data_parallel']} / {r.get('row_wise', 0)} / {r['splits']} | ok{cap} |"
            )
    return "\n".join(lines)


