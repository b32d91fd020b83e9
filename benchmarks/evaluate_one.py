"""The plan evaluator's per-device breakdown for one task: TorchRec's plan vs size-greedy.

    python -m benchmarks.evaluate_one [--tables 40 --devices 4 --seed 0 --rounds 5]
"""

from __future__ import annotations

import argparse

from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.torchrec_baseline import torchrec_plan
from torchrec_neuroshard.lab.evaluate import evaluate_plans, format_breakdown
from torchrec_neuroshard.sharding import from_torchrec
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tables", type=int, default=40)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    task = generate_task(synthetic_pool(), args.tables, args.devices, WorkloadScale(), seed=args.seed)
    plans = {"TorchRec": from_torchrec(torchrec_plan(task), task.num_devices), "size-greedy": baseline_plan("size", task)}
    measured = evaluate_plans(task, list(plans.values()), rounds=args.rounds, progress=True)
    for (name, plan), m in zip(plans.items(), measured):
        print(f"\n== {name} ({sum(len(p.widths) > 1 for p in plan.placements)} split, {len(plan.data_parallel)} data-parallel tables) ==")
        print(format_breakdown(m))


if __name__ == "__main__":
    main()
