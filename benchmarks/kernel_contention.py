"""Each device's kernels of some dmp_step plans, timed alone and with the other devices'
kernels running at the same time, as the ranks of a DMP step on one host run them.

    python -m benchmarks.kernel_contention T45_D2_pool0 neuroshard,size_lookup,neuroshard_calibrated

One process per device. Per round and plan: "alone", each device's fused kernels (one per
lookup group, forward and backward, ``measure_compute``) while the other processes wait;
then "together", every device's at once. Medians over the rounds. A cost model of kernels
timed alone prices the first; the step pays the second.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from benchmarks.dmp_ranks import add_task_arguments, stored_plans, task_of
from benchmarks.dmp_step import StepConfig, feature_groups
from torchrec_neuroshard.lab.evaluate import lookup_groups, task_lookups
from torchrec_neuroshard.lab.launch import spawn
from torchrec_neuroshard.lab.measure_compute import measure_compute
from torchrec_neuroshard.types import Plan, Shard

MODES = ("alone", "together")


def _device_kernels_ms(task, plan: Plan, modules, lookups, device: int) -> tuple[float, float]:
    """Forward and backward ms of ``device``'s fused kernels, one per lookup group."""
    fwd = bwd = 0.0
    for group in lookup_groups(task, plan, modules)[0]:
        if group.shards[device]:
            shards = [Shard(task.table(name), width, rows) for name, width, _, rows in group.shards[device]]
            m = measure_compute(shards, lookups, torch.device("cpu"), 3, 9)
            fwd, bwd = fwd + m.fwd.median_ms, bwd + m.bwd.median_ms
    return fwd, bwd


def _worker(rank: int, world: int, label: str, plans: dict[str, dict], rounds: int) -> dict:
    task = task_of(label)
    lookups = task_lookups(task)
    modules = feature_groups(task, StepConfig())
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for mode in MODES:
            for name, stored in plans.items():
                plan = Plan.from_dict(stored)
                turns = range(world) if mode == "alone" else [rank]
                for turn in turns:  # alone: one device at a time, the others wait at the barrier
                    dist.barrier()
                    if turn == rank:
                        times.setdefault((name, mode), []).append(_device_kernels_ms(task, plan, modules, lookups, rank))
                dist.barrier()
    return {f"{name}|{mode}": [statistics.median(t[k] for t in v) for k in (0, 1)] for (name, mode), v in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    plans = {name: plan.to_dict() for name, plan in stored_plans(args.results, args.task, args.planners).items()}
    world = task_of(args.task).num_devices
    per_rank = spawn(_worker, world, args.task, plans, args.rounds)
    print(f"{args.task}, {args.rounds} rounds; per device, its fused kernels' forward + backward ms (medians)\n")
    print("| planner | device | alone fwd | alone bwd | together fwd | together bwd | together / alone |")
    print("|---|---|---|---|---|---|---|")
    for name in plans:
        for rank in range(world):
            (af, ab), (tf, tb) = (per_rank[rank][f"{name}|{mode}"] for mode in MODES)
            print(f"| {name} | {rank} | {af:.1f} | {ab:.1f} | {tf:.1f} | {tb:.1f} | {(tf + tb) / (af + ab):.2f} |")


if __name__ == "__main__":
    main()
