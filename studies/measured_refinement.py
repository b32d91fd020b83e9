"""Does measured refinement at plan time (``lab.refine.MeasuredRefiner``) make NeuroShard's
plan faster on the hardware? One held-out task of ``benchmarks.scale``, judged.

    taskset -c 1 python -m studies.measured_refinement refine --devices 16 --pool-seed 4 --seconds 600
    taskset -c 1 python -m studies.measured_refinement measure --devices 16 --pool-seed 4 --rounds 2 --reference
    taskset -c 1 python -m studies.measured_refinement measure --devices 16 --pool-seed 4 --rounds 2 --reference --first-draw 0
    taskset -c 1 python -m studies.measured_refinement measure --devices 8 --pool-seed 4 --rounds 2 --reference --copy --first-draw 6
    taskset -c 1 python -m studies.measured_refinement measure --devices 16 --pool-seed 4 --rounds 2 --reference --copy --first-draw 4 --plans-sha fa035adbcc68
    taskset -c 1 python -m studies.measured_refinement final --devices 16 --pool-seed 4 --plans-sha fa035adbcc68
    taskset -c 1 python -m studies.measured_refinement refine --devices 32 --pool-seed 4 --seconds 600 --base neuroshard_shift
    python -m studies.measured_refinement report

(the results' tasks: D = 8 and 16 on pools 2-4, D = 32 on pools 2 and 4). ``measure`` judges on
ids the refiner never timed unless ``--first-draw 0`` (its own: a selection on the noise);
``--copy`` times NeuroShard's plan a second time, built again: the run's A/A check;
``--plans-sha`` judges an earlier run's plans again (an earlier refined plan); ``final``
holds the last run's final round (``lab.final_round``: each plan's slowest devices side by side).

``refine``: the stored NeuroShard plan of the task (``benchmarks/results/scale_planned``, the
one the scale benchmark judged; ``--base neuroshard_LABEL``: that model's plan) refined on this machine as ``NeuroShardPlanner(refiner=
MeasuredRefiner(seconds=...))`` refines it, the refiner's log printed, the plan appended
to ``results/measured_refinement_planned.jsonl.gz`` with its log lines (``log``: every device
measured against predicted, every move tried). ``measure``: the refined plan beside
the task's stored plans of ``PLANNERS`` by the judge of ``benchmarks.scale`` (``lab.judge``:
passes of opposite device order, draws of ids, interleaved rounds), rows appended to
``results/measured_refinement_measured.jsonl.gz`` (``benchmarks.scale.judge_task``: resumable,
each with the judge's configuration and this machine's CPU).
``report``: ``results/measured_refinement.md``, with the shipped model's error on every judged
device (each plan priced by ``planning_model``: 38 s for the 15 committed runs on a 2-core Intel Xeon).
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from threadpoolctl import threadpool_limits

from benchmarks.scale import final_round, judge_task, planning_model, plans_sha, stored_plans, task_draws
from benchmarks.scale_report import PLANNED as SCALE_PLANNED
from benchmarks.scale_ratios import best_heuristic, ratio_text
from benchmarks.scale_report import copy_text, latest_plans
from torchrec_neuroshard.lab.collect import append_rows, read_rows
from torchrec_neuroshard.lab.judge import COPY, JudgeConfig
from torchrec_neuroshard.lab.judgement import Judged, final_judgements, judgements, rank_correlation, wins
from torchrec_neuroshard.lab.measure_compute import cpu_threads
from torchrec_neuroshard.lab.refine import MeasuredRefiner
from torchrec_neuroshard.lab.refine_moves import device_compute
from torchrec_neuroshard.types import CostModel, Plan, Task

RESULTS = Path(__file__).parent / "results"
PLANNED = RESULTS / "measured_refinement_planned.jsonl.gz"
MEASURED = RESULTS / "measured_refinement_measured.jsonl.gz"
REPORT = RESULTS / "measured_refinement.md"
PLANNERS = ("neuroshard", "neuroshard_measured_comm", "torchrec_timeout", "lookup", "size_lookup")
"""The scale benchmark's judged plans, timed beside the refined one."""
REFINED = "neuroshard_refined"
MOVE_TIMED = "measured refinement: table "
"""How the refiner's log line of a move it timed begins."""


def refine(devices: int, pool_seed: int, seconds: float, base_name: str = "neuroshard") -> None:
    """The task's stored plan of ``base_name`` refined with the shipped model (a user's
    ``NeuroShardPlanner(refiner=...)`` refines the plan of the model shipped now: a base
    planned by another model file is refined as that plan, priced by the shipped one)."""
    stored = latest_plans(read_rows(SCALE_PLANNED), pool_seed, devices)
    if stored.get(base_name, {}).get("status") != "ok":
        raise ValueError(f"--base {base_name}: no stored plan of pool {pool_seed}, D = {devices} in {SCALE_PLANNED}; plan it first (python -m benchmarks.scale plan --devices {devices} --pool-seeds {pool_seed} --planners {base_name})")
    base = Plan.from_dict(stored[base_name]["plan"])
    task, model = planning_model(devices, pool_seed)
    refiner = MeasuredRefiner(seconds=seconds)
    log = _Lines()
    logging.getLogger("torchrec_neuroshard").addHandler(log)
    try:
        plan = refiner.refine(task, model, base, "cpu")
    finally:
        logging.getLogger("torchrec_neuroshard").removeHandler(log)
    moved = sorted(p.table for p, q in zip(base.placements, plan.placements) if p != q)
    row = {
        "pool_seed": pool_seed, "devices": devices, "planner": REFINED, "base": base_name, "seconds": seconds, "draws": refiner.draws,
        "rounds": refiner.rounds, "steady": refiner.steady, "early_stop": True, "pairs": refiner.pairs, "checks": refiner.checks, "moved": moved, "log": log.lines, "plan": plan.to_dict(),
    }  # fmt: skip
    append_rows(PLANNED, [row])
    print(json.dumps({k: v for k, v in row.items() if k not in ("plan", "log")}))


class _Lines(logging.Handler):
    """The refiner's log lines, kept for its row (the refiner's measurements and moves)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("measured refinement"):
            self.lines.append(record.getMessage())


def _plans(devices: int, pool_seed: int, refined: dict | None = None) -> dict[str, Plan]:
    """The stored plans of ``PLANNERS`` and the refined plan of ``refined`` (a row of
    ``PLANNED``; None: the task's last)."""
    refined = refined or _refined_rows(pool_seed, devices)[-1]
    planners = dict.fromkeys((*PLANNERS, _base_of(refined)))
    return {**stored_plans(devices, pool_seed, list(planners)), REFINED: Plan.from_dict(refined["plan"])}


def _base_of(refined: dict) -> str:
    """The stored plan a refine step's row refined (rows before 2026-12-07 name none: neuroshard's)."""
    return refined.get("base", "neuroshard")


def _refined_rows(pool_seed: int, devices: int) -> list[dict]:
    return [r for r in read_rows(PLANNED) if r["pool_seed"] == pool_seed and r["devices"] == devices]


def _refined_row(pool_seed: int, devices: int, sha: str) -> dict:
    """The refine step's row whose plan the measured rows of ``sha`` timed (beside the stored plans)."""
    for row in reversed(_refined_rows(pool_seed, devices)):
        if plans_sha(_plans(devices, pool_seed, row)) == sha:
            return row
    raise ValueError(f"no refined plan of pool {pool_seed}, D = {devices} in {PLANNED} gives the measured plans {sha}: was it re-planned?")


def measure(devices: int, pool_seed: int, config: JudgeConfig, sha: str | None = None) -> None:
    """The judge over the task's last refined plan beside the stored ones, or over the
    plans of an earlier judged run ``sha`` (its refined plan judged again)."""
    draws = task_draws(devices, pool_seed, config.draws, config.first_draw)
    refined = _refined_row(pool_seed, devices, sha) if sha else None
    judge_task(devices, pool_seed, _plans(devices, pool_seed, refined), config, draws, MEASURED)


@dataclass(frozen=True)
class _Run:
    """One judged run: its task, judge's configuration and measurements, the refine step's
    row whose plan it timed, and the plans it timed (each read once for the report)."""

    pool_seed: int
    devices: int
    sha: str
    cpu: str
    config: JudgeConfig
    judged: dict[str, Judged]
    refined: dict
    plans: dict[str, Plan]
    check: str | None
    final: dict[str, Judged]

    @staticmethod
    def of(pool_seed: int, devices: int, sha: str, rows: list[dict]) -> "_Run | None":
        """The run of ``rows`` (one run's); None while its refined plan is still being measured."""
        config = JudgeConfig.of(rows[0])
        judged = judgements(rows, devices, config)
        if REFINED not in judged:
            return None
        refined = _refined_row(pool_seed, devices, sha)
        plans = _plans(devices, pool_seed, refined)
        final = final_judgements(rows, config)
        return _Run(pool_seed, devices, sha, rows[0]["cpu"], config, judged, refined, plans, copy_text(rows, devices), final)

    @property
    def base(self) -> str:
        """The stored plan the run's refined plan was refined from."""
        return _base_of(self.refined)

    @property
    def ids(self) -> str:
        """Which ids the run timed: the refiner's own (it timed draws 0 on, of the same seed) or others."""
        return "the refiner's own" if self.config.first_draw < self.refined.get("draws", 1) else "unseen by the refiner"


def report() -> str:
    rows = read_rows(MEASURED)
    lines = [
        "# Measured refinement at plan time, judged", "",
        "`python -m studies.measured_refinement refine`, `measure`, `report` (see the study's docstring). Compute: the "
        "slowest device's median over units (pass x draw x round) as `lab.judge` times it; ratios of compute with a 90% "
        "paired bootstrap interval over units; units fastest: those in which the plan's slowest device was the least.", "",
    ]  # fmt: skip
    last: dict[tuple[int, int, str, float], list[str]] = {}
    errors: dict[tuple[int, int, str, float], list[str]] = {}
    models: dict[tuple[int, int], tuple] = {}  # (devices, pool seed) -> (task, model), loaded once a task
    for (pool_seed, devices, sha, first) in dict.fromkeys((r["pool_seed"], r["devices"], r["plans_sha"], JudgeConfig.of(r).first_draw) for r in rows):
        run = _Run.of(pool_seed, devices, sha, [r for r in rows if r["plans_sha"] == sha and JudgeConfig.of(r).first_draw == first])
        if run is None:
            continue  # a run still being measured
        lines += _run_lines(run)
        key = (pool_seed, devices, run.ids, run.refined["seconds"], run.refined.get("early_stop", False), run.refined.get("pairs", 0), run.refined.get("checks", 0))
        last[key] = _summary_cells(run)
        if (devices, pool_seed) not in models:
            models[devices, pool_seed] = planning_model(devices, pool_seed)
        errors[key] = _error_cells(run, *models[devices, pool_seed])
    lines += [
        "## Every task's last run (per kind of ids and refinement budget)", "",
        "| pool | D | ids judged | refined for | moves timed | tables moved (split) | refined / unrefined | refined / best heuristic | "
        "unrefined / best heuristic | refined / TorchRec | unrefined / TorchRec | units the refined plan was fastest |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {pool} | {d} | {seen} | {_budget(*key[3:])} | " + " | ".join(cells) + " |" for key, cells in sorted(last.items()) for pool, d, seen in [key[:3]]),
        "", "## The shipped model against the judged devices, every task's last run", "",
        "The shipped `cpu.pt` as of the report (collectives priced by the links; the model that planned runs before "
        "2026-12-07 was the `cpu.pt` of then, and their error is the file of now's) prices each device of the plans; the judge's "
        "median per device (steadied) is the measurement. Level: measured / predicted, the median over every device of "
        "every plan of the run; MAPE: per device, the prediction times that level against the measurement; rank "
        "correlation: within a plan, predicted against measured; the measurement against itself: the judge's first pass "
        "against its second, the median over the run's plans.", "",
        "| pool | D | ids judged | refined for | level | MAPE, unrefined plan | refined plan | every plan | rank correlation, unrefined plan "
        "| refined plan | every plan (median) | the measurement against itself |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(f"| {pool} | {d} | {seen} | {_budget(*key[3:])} | " + " | ".join(cells) + " |" for key, cells in sorted(errors.items()) for pool, d, seen in [key[:3]]),
        "",
    ]  # fmt: skip
    REPORT.write_text("\n".join(lines))
    return "\n".join(lines)


def _run_lines(run: _Run) -> list[str]:
    """One judged run's section: how its plan was refined, and every plan's measurement."""
    config, judged, refined, base = run.config, run.judged, run.refined, run.base
    won = wins(judged)
    lines = [
        f"## Pool {run.pool_seed}, D = {run.devices} (plans {run.sha}; measured on {run.cpu}; {config.units} units{', steadied by a reference' if config.reference else ''}; plans built and timed in the {config.order} order; ids: draws {config.first_draw}-{config.first_draw + config.draws - 1}, {run.ids})", "",
        f"Refined for {_budget(refined['seconds'], refined.get('early_stop', False), refined.get('pairs', 0), refined.get('checks', 0))}, each device and move timed on {refined.get('draws', 1)} draw(s) of ids, "
        f"{refined.get('rounds', 3)} rounds each{', steadied by a reference' if refined.get('steady') else ''}; "
        f"refined plan: {base}'s; tables moved: {', '.join(refined['moved']) or 'none'}.", "",
        f"| planner | compute ms | slowest / mean device | / {base} (90% interval) | / size_lookup | units fastest |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for name, j in judged.items():
        cells = [ratio_text(j, judged.get(other)) for other in (base, "size_lookup")]
        lines.append(f"| {name} | {j.compute_ms:.1f} | {j.imbalance:.2f} | {cells[0]} | {cells[1]} | {won.get(name, 0)} of {config.units} |")
    if run.check:
        lines += ["", f"The judge against itself: neuroshard built and timed again, its copy / neuroshard {run.check}."]
    if run.final:
        final, top = run.final, run.final[base].times.shape[1]
        best = best_heuristic({n: j for n, j in final.items() if n != COPY})
        lines += ["", f"The final round (each plan's {top} slowest device{'s' if top > 1 else ''} by the passes, built together and timed side by side, "
                  f"no reference; {final[base].times.shape[0]} units): {REFINED} / {base} {ratio_text(final[REFINED], final[base])}, "
                  f"copy / neuroshard {ratio_text(final.get(COPY), final['neuroshard']) if COPY in final else '-'}, "
                  f"{base} / {best} {ratio_text(final[base], final.get(best))}, {REFINED} / {best} {ratio_text(final[REFINED], final.get(best))}."]  # fmt: skip
    return lines + [""]


def _summary_cells(run: _Run) -> list[str]:
    """A judged run's cells of the summary table (see ``report``)."""
    judged = run.judged
    before = {p.table: p for p in run.plans[run.base].placements}
    halved = sum(len(p.widths) > len(before[p.table].widths) for p in run.plans[REFINED].placements)
    best, torchrec = best_heuristic(judged), judged.get("torchrec_timeout")
    refined, unrefined = judged[REFINED], judged[run.base]
    return [
        _moves_timed(run.refined),
        f"{len(run.refined['moved'])} ({halved})", ratio_text(refined, unrefined),
        f"{ratio_text(refined, judged[best])} ({best})", ratio_text(unrefined, judged[best]), ratio_text(refined, torchrec),
        ratio_text(unrefined, torchrec), f"{wins(judged)[REFINED]} of {run.config.units}",
    ]  # fmt: skip


def _budget(seconds: float, early_stop: bool, pairs: int = 0, checks: int = 0) -> str:
    """The refine step's budget, whether its refiner timed a move only as far as it paid
    (``MeasuredRefiner`` since 2026-12-02; before, every move on every draw and the old plan on
    the target too), whether it also tried quarters, two tables at once, and every device
    where the two least measured took no move (``pairs``: since the fourth session of 2026-12-02),
    and whether it widened its margin by the noise it measured (``checks``: since the fifth)."""
    return (
        f"{seconds:g} s{', timed as far as a move pays' if early_stop else ''}{', quarters and pairs too' if pairs else ''}"
        f"{', margin widened by its noise' if checks else ''}"
    )


def _moves_timed(refined: dict) -> str:
    """How many moves the refine step's row timed ("-": its row kept no log)."""
    return str(sum(line.startswith(MOVE_TIMED) for line in refined["log"])) if "log" in refined else "-"


def _error_cells(run: _Run, task: Task, model: CostModel) -> list[str]:
    """A judged run's cells of the model-error table (see ``report``): ``model`` prices each
    device of ``task``'s plans."""
    judged = run.judged
    predicted = {name: device_compute(model, task, run.plans[name]) for name in judged}  # [D] each
    level = float(np.median(np.concatenate([j.per_device / predicted[n] for n, j in judged.items()])))
    mape = {n: float(np.mean(np.abs(predicted[n] * level / j.per_device - 1))) for n, j in judged.items()}
    rank = {n: rank_correlation(predicted[n].tolist(), j.per_device.tolist()) for n, j in judged.items()}
    itself, base = [j.passes_agree for j in judged.values()], run.base
    return [
        f"{level:.2f}", f"{100 * mape[base]:.1f}%", f"{100 * mape[REFINED]:.1f}%", f"{100 * float(np.mean(list(mape.values()))):.1f}%",
        f"{rank[base]:.2f}", f"{rank[REFINED]:.2f}", f"{float(np.median(list(rank.values()))):.2f}", f"{float(np.median(itself)):.2f}",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["refine", "measure", "final", "report"])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--pool-seed", type=int, default=2)
    p.add_argument("--seconds", type=float, default=240.0)
    p.add_argument("--rounds", type=int, default=3, help="measure: the judge's rounds a pass and draw")
    p.add_argument("--reference", action="store_true", help="measure: time the judge's reference in every round (steadied)")
    p.add_argument("--copy", action="store_true", help="measure: time the first plan (neuroshard) twice, as built twice: the A/A check")
    p.add_argument(
        "--first-draw", type=int, default=MeasuredRefiner.draws,
        help="measure: the judge's first draw of ids (default: past the refiner's own draws, 0 on)",
    )  # fmt: skip
    p.add_argument("--top", type=int, default=2, help="final: each plan's slowest devices timed side by side (benchmarks.scale final_round)")
    p.add_argument("--final-rounds", type=int, default=6, help="final: rounds a draw")
    p.add_argument("--base", default="neuroshard", help="refine: the stored plan of benchmarks.scale to refine (neuroshard_LABEL: that model's plan)")
    p.add_argument("--plans-sha", help="measure: the plans of this earlier judged run (the report's 'plans SHA'), not the task's last refined plan")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("torchrec_neuroshard").setLevel(logging.INFO)
    torch.set_num_threads(1)
    with threadpool_limits(limits=1), cpu_threads(1):
        if args.step == "refine":
            refine(args.devices, args.pool_seed, args.seconds, args.base)
        elif args.step == "final":
            refined = _refined_row(args.pool_seed, args.devices, args.plans_sha) if args.plans_sha else None
            final_round(args.devices, args.pool_seed, _plans(args.devices, args.pool_seed, refined), args.top, MEASURED, args.final_rounds)
        elif args.step == "measure":
            measure(args.devices, args.pool_seed, JudgeConfig(rounds=args.rounds, reference=args.reference, first_draw=args.first_draw, copy=args.copy), args.plans_sha)
    if args.step == "report":
        print(report())


if __name__ == "__main__":
    main()
