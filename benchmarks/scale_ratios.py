"""Ratios of judged plans as ``benchmarks/scale.md`` prints them, and its table of the shipped
model's plans against TorchRec's and the best heuristic's on every held-out task (issue 43's
targets): per task its last judged run, the passes and the final round, and per D the
geometric mean over the pools with its interval (``runs_ratio_interval``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from torchrec_neuroshard.heuristics import BASELINES
from torchrec_neuroshard.lab.judgement import Judged, ratio_interval, runs_ratio_interval, wins

TORCHREC = "torchrec_timeout"


def interval_text(interval: tuple[float, float, float]) -> str:
    """A (ratio, low, high) of ``lab.judge``'s intervals as the reports print it."""
    ratio, low, high = interval
    return f"{ratio:.3f} ({low:.3f}-{high:.3f})"


def ratio_text(a: Judged, b: Judged | None) -> str:
    """``a`` over ``b`` with its interval (``ratio_interval``), or "-" without ``b``."""
    return "-" if b is None else interval_text(ratio_interval(a, b))


def best_heuristic(judged: Mapping[str, Judged]) -> str | None:
    """The heuristic (``heuristics.BASELINES``) whose plan measured fastest; None without one."""
    return min((n for n in judged if n in BASELINES), key=lambda n: judged[n].compute_ms, default=None)


@dataclass(frozen=True)
class TaskRun:
    """One task's last judged run: its plans' passes and final round (empty without one),
    the draws of ids it timed, and TorchRec's planning status there ("ok" or its failure)."""

    passes: Mapping[str, Judged]
    final: Mapping[str, Judged]
    draws: range
    torchrec_status: str


def versus_lines(shipped: str, runs: Mapping[tuple[int, int], TaskRun]) -> list[str]:
    """The section on the plans of the shipped model (planner ``shipped``), for the tasks
    (pool seed, D) -> their last run, where that run judged them."""
    rows = []
    for devices in sorted({d for _, d in runs}):
        pooled: dict[tuple[str, str], list[tuple[Judged, Judged]]] = {}
        for pool_seed in sorted(p for p, d in runs if d == devices):
            run = runs[pool_seed, devices]
            if shipped in run.passes:
                rows.append(_task_row(pool_seed, devices, shipped, run, pooled))
        if any(len(pairs) > 1 for pairs in pooled.values()):
            cells = [_pooled_text(pooled.get((against, stage), [])) for against in (TORCHREC, "best") for stage in ("passes", "final")]
            rows.append(f"| {devices} | pooled | | " + " | ".join(cells) + " | | |")
    if not rows:
        return []
    return [
        "", "## The shipped model's plans against TorchRec's and the best heuristic's (held-out pools)", "",
        f"`{shipped}`: the plans of the shipped `cpu.pt`. Per task its last judged run (the draws of ids it timed), "
        "the passes and the final round (where the run held one); per D the geometric mean over the pools that timed "
        "both, every run's units resampled (`runs_ratio_interval`). Units fastest: of all the plans the run timed. "
        "Slowest / mean device: the shipped model's plan / TorchRec's.", "",
        "| D | pool | draws | / TorchRec, passes | final round | / best heuristic, passes | final round | units fastest "
        "| slowest / mean |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]  # fmt: skip


def _task_row(pool_seed: int, devices: int, shipped: str, run: TaskRun, pooled: dict) -> str:
    """One task's row; its ratios' pairs appended to ``pooled`` by (against, stage)."""
    cells = []
    for against in (TORCHREC, "best"):
        for stage, judged in (("passes", run.passes), ("final", run.final)):
            ours, theirs = judged.get(shipped), judged.get(TORCHREC if against == TORCHREC else best_heuristic(judged))
            cells.append(ratio_text(ours, theirs) if ours is not None else "-")
            if ours is not None and theirs is not None:
                pooled.setdefault((against, stage), []).append((ours, theirs))
    if run.torchrec_status != "ok":
        cells[:2] = [f"no plan ({run.torchrec_status.removeprefix('no plan: ').split(':')[0]})", "-"]
    ours, theirs = run.passes[shipped], run.passes.get(TORCHREC)
    imbalance = f"{ours.imbalance:.2f} / {f'{theirs.imbalance:.2f}' if theirs else '-'}"
    units = f"{wins(run.passes)[shipped]} of {ours.times.shape[0]}"
    return f"| {devices} | {pool_seed} | {run.draws[0]}-{run.draws[-1]} | " + " | ".join(cells) + f" | {units} | {imbalance} |"


def _pooled_text(pairs: list[tuple[Judged, Judged]]) -> str:
    """The geometric mean over pools of a ratio with its interval and the pools it pools."""
    return f"{interval_text(runs_ratio_interval(pairs))}, {len(pairs)} pools" if len(pairs) > 1 else "-"
