"""How much room an evaluator run leaves below TorchRec's plan: each task's balanced bound.

    python -m studies.headroom benchmarks/results/step_suite_calibrated.jsonl

Reads the rows ``benchmarks.compare`` wrote (each plan's measured per-device forward and
backward compute and communication) and, per task, estimates the best cost any plan could
reach from what was measured there:

    bound = min over plans (the plan's compute summed over devices / D)   # perfect balance
          + min over plans and devices (that device's communication)      # least comm seen

No plan beats perfect balance of the least total work measured, paying the least
communication any device paid; a plan doing less work (other fusion of tables into
kernels) could, so it is an estimate from the measured plans, not a proof. Each planner's
cost / bound says how far it stands from it, and bound / TorchRec's cost is the lowest
NeuroShard / TorchRec ratio reachable on that task: its geomean over the tasks is the floor
under the suite's NeuroShard / TorchRec target.

    python -m studies.headroom --dmp-step benchmarks/results/dmp_step_modules_final.jsonl.gz

does the same for a ``benchmarks.dmp_step`` run, where no per-device figure was measured:
the shipped model prices each plan's modules (each sharded module is paid at its slowest
device, ``stepcost.predict_step``), and the bound is, per module, the least work of any
plan perfectly balanced, summed over the modules. The best heuristic (by measured step)
is then ``predicted / bound`` above it, and if the whole measured embedding time shrank
in that proportion (generous: the collectives' fixed cost does not), a plan at the bound
would take ``1 - share * (1 - bound / predicted)`` of its step: the geomean of that is
the floor under the dmp_step NeuroShard / best heuristic target.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Sequence
from torchrec_neuroshard.lab.collect import read_rows

if TYPE_CHECKING:
    from torchrec_neuroshard.types import CostModel, Plan, Task

HEURISTIC_PREFIXES = ("neuroshard", "torchrec")
"""Planners that are not the classic heuristics (variants share these prefixes)."""


def balanced_bound(per_device_by_plan: Sequence[Sequence[Sequence[float]]]) -> float:
    """ms: the least per-device work of any plan, perfectly balanced, plus the least
    communication any device of any plan paid. Rows are [fwd_compute, bwd_compute,
    fwd_comm, bwd_comm] per device."""
    balanced = min(sum(d[0] + d[1] for d in devices) / len(devices) for devices in per_device_by_plan)
    comm = min(d[2] + d[3] for devices in per_device_by_plan for d in devices)
    return balanced + comm


def geomean(xs: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def headroom(rows: Sequence[dict]) -> str:
    tasks: dict[object, dict[str, dict]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("per_device"):
            tasks.setdefault(r["task"], {})[r["planner"]] = r
    variants = sorted({name for plans in tasks.values() for name in plans if name.startswith("neuroshard")})
    lines = [
        f"| task | D | bound ms | {' | '.join(f'{v} / bound' for v in variants)} | TorchRec / bound | "
        "best heuristic / bound | bound / TorchRec |",
        "|---|---|---|" + "---|" * len(variants) + "---|---|---|",
    ]
    floor = []
    for task, plans in tasks.items():
        if "neuroshard" not in plans or "torchrec" not in plans:
            continue
        bound = balanced_bound([p["per_device"] for p in plans.values()])
        heuristics = [p["cost_ms"] for name, p in plans.items() if not name.startswith(HEURISTIC_PREFIXES)]
        world = len(plans["neuroshard"]["per_device"])
        ours = " | ".join(f"{plans[v]['cost_ms'] / bound:.2f}" if v in plans else "-" for v in variants)
        floor.append(bound / plans["torchrec"]["cost_ms"])
        lines.append(
            f"| {task} | {world} | {bound:.1f} | {ours} | {plans['torchrec']['cost_ms'] / bound:.2f} | "
            f"{min(heuristics) / bound:.2f} | {floor[-1]:.3f} |"
        )
    lines.append(
        f"\nLowest NeuroShard / TorchRec geomean reachable if every plan hit its task's bound: "
        f"**{geomean(floor):.3f}** over {len(floor)} tasks."
    )
    return "\n".join(lines)


def module_loads(task: "Task", plan: "Plan", model: "CostModel") -> list[list[float]]:
    """ms: per module of ``task``, each device's predicted total (``predict_step`` of the
    module's tables alone)."""
    from torchrec_neuroshard.stepcost import predict_step

    loads = []
    for names in task.modules:
        loads.append([d.total for d in predict_step(model, task.subset(names), plan.subset(names)).devices])
    return loads


def step_bound(loads_by_plan: Sequence[Sequence[Sequence[float]]]) -> float:
    """ms: per module, the least predicted work of any plan perfectly balanced over its
    devices, summed over the modules. ``loads_by_plan``: [plan][module][device]."""
    modules = len(loads_by_plan[0])
    return sum(min(sum(loads[m]) / len(loads[m]) for loads in loads_by_plan) for m in range(modules))


def step_headroom(rows: Sequence[dict], model: "CostModel") -> str:
    """Markdown: per dmp_step task, the model's step bound, NeuroShard's and the best
    heuristic's predicted step over it, and the step a plan at the bound would take over
    the best heuristic's (its measured embedding share shrunk by bound / predicted)."""
    from studies.dmp_ranks import task_of
    from torchrec_neuroshard.lab.dmp_model import StepConfig, with_ebcs
    from torchrec_neuroshard.lab.dmp_report import ok_by_task
    from torchrec_neuroshard.types import Plan

    tasks = ok_by_task(rows)
    lines = [
        "| task | bound ms (predicted) | NeuroShard / bound | best heuristic | its / bound | its embedding share | "
        "a plan at the bound / best heuristic (step) | NeuroShard / best heuristic (step, measured) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    floor, measured = [], []
    for label, plans in tasks.items():
        heuristics = {n: r for n, r in plans.items() if not n.startswith(HEURISTIC_PREFIXES)}
        if "neuroshard" not in plans or not heuristics:
            continue
        first = next(iter(plans.values()))
        task = with_ebcs(task_of(label), StepConfig(num_ebcs=first["config"]["num_ebcs"]))
        at_batch = model.with_batch_size(task.batch_size)
        loads = {n: module_loads(task, Plan.from_dict(r["plan"]), at_batch) for n, r in plans.items()}
        bound = step_bound(list(loads.values()))
        priced = {n: sum(max(m) for m in v) for n, v in loads.items()}
        best = min(heuristics, key=lambda n: heuristics[n]["step_ms"])
        share = heuristics[best]["embedding_share"]
        floor.append(1 - share * (1 - bound / priced[best]))
        measured.append(plans["neuroshard"]["step_ms"] / heuristics[best]["step_ms"])
        lines.append(
            f"| {label} | {bound:.1f} | {priced['neuroshard'] / bound:.3f} | {best} | {priced[best] / bound:.3f} | "
            f"{100 * share:.0f}% | {floor[-1]:.3f} | {measured[-1]:.3f} |"
        )
    lines.append(
        f"\nLowest NeuroShard / best heuristic step geomean reachable if every plan hit its task's bound: "
        f"**{geomean(floor):.3f}** over {len(floor)} tasks (measured: {geomean(measured):.3f})."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, help="a benchmarks.compare results file (.jsonl), or with --dmp-step a dmp_step one")
    p.add_argument("--dmp-step", action="store_true", help="the results are benchmarks.dmp_step's: bound by the shipped model")
    args = p.parse_args(argv)
    rows = read_rows(args.results)
    if args.dmp_step:
        from torchrec_neuroshard.costmodel import load_pretrained

        print(f"Predicted step bound of each task of `{args.results}` (`python -m studies.headroom --dmp-step {args.results}`):\n")
        print(step_headroom(rows, load_pretrained("cpu")))
        return
    print(f"Balanced bound of each task of `{args.results}` (`python -m studies.headroom {args.results}`):\n")
    print(headroom(rows))


if __name__ == "__main__":
    main()
