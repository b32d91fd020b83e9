"""How much room an evaluator run leaves below TorchRec's plan: each task's balanced bound.

    python -m benchmarks.headroom benchmarks/results/step_suite_groups.jsonl

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
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Sequence

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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, help="a benchmarks.compare results file (.jsonl)")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line.strip()]
    print(f"Balanced bound of each task of `{args.results}` (`python -m benchmarks.headroom {args.results}`):\n")
    print(headroom(rows))


if __name__ == "__main__":
    main()
