"""Does the local search's fast screen cost plan quality? On the 856-table CPU task of
``benchmarks.scale`` at D devices, NeuroShard plans twice: as shipped (the screen prices
the neural comm's skews as they stand) and with the screen it replaced (every candidate's
comm priced in full); both plans' device kernels are then timed device by device,
interleaved, as ``benchmarks.scale measure`` times them.

    python -m studies.screen_plans --devices 8 16 --rounds 9

Prints a table and writes it to ``studies/results/screen_plans.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import time
from pathlib import Path

import torch
from threadpoolctl import threadpool_limits

from benchmarks.fullsize import plan_with
from benchmarks.scale import scale_task
from torchrec_neuroshard.costmodel import cost_model_for
from torchrec_neuroshard.hardware import local_hardware
from torchrec_neuroshard.lab.evaluate import task_lookups
from torchrec_neuroshard.lab.judge import JudgeConfig, time_device
from torchrec_neuroshard.lab.measure_compute import cpu_threads
from torchrec_neuroshard.lab.torchrec_baseline import topology_for
from torchrec_neuroshard.search import local
from torchrec_neuroshard.search import predicted_breakdown
from torchrec_neuroshard.types import Links, ShardingKind

OUT = Path(__file__).parent / "results" / "screen_plans.md"


def _full_comm_estimate(model, keys, key_of, dev, now, worst, cheap, cand):
    """The screen before: kernels estimated separably, every device's comm priced in full."""
    new_worst, new_dst, delta_w = local._separable(model, keys, key_of, dev, now, worst, cheap, cand)
    return local._embedding_cost(model, now, worst, cand[:, 1], new_worst, new_dst, delta_w)


def plans_of(devices: int) -> tuple[object, dict, dict]:
    """The task, and per screen (plan, planning s, predicted compute ms of its slowest device)."""
    task = scale_task(devices, pool_seed=0)  # the pool of that study (it ran on the training pool)
    topology = topology_for(task, "cpu")
    task = dataclasses.replace(task, links=Links.of(topology))
    model = cost_model_for(topology, "cpu").with_batch_size(task.batch_size)
    shipped = local._estimate
    plans, about = {}, {}
    for name, estimate in (("fast screen (shipped)", shipped), ("full-comm screen (before)", _full_comm_estimate)):
        local._estimate = estimate
        try:
            start = time.perf_counter()
            plan, _ = plan_with("neuroshard", task, model, 300, device_type="cpu")
            seconds = time.perf_counter() - start
        finally:
            local._estimate = shipped
        assert not any(p.kind is ShardingKind.DATA_PARALLEL for p in plan.placements), "replicas are not timed here"
        _, per_device = predicted_breakdown(model, task, plan)
        plans[name] = plan
        about[name] = (seconds, max(d.compute for d in per_device))
    return task, plans, about


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[8, 16])
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args()
    torch.set_num_threads(1)
    lines = [
        "# The local search's fast screen against the one it replaced, measured", "",
        f"`python -m studies.screen_plans --devices {' '.join(map(str, args.devices))} --rounds {args.rounds}`; "
        f"{local_hardware('cpu').describe()}, one thread; {datetime.date.today()}. The 856-table task of "
        "`benchmarks.scale` (rows / 64, global batch 4,096); each plan's slowest device, median of "
        f"{args.rounds} interleaved rounds per device (the plans' order rotated each round).", "",
        "| D | screen | planning s | predicted compute ms | measured compute ms | / fast screen's |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    with threadpool_limits(limits=1), cpu_threads(1):
        for devices in args.devices:
            task, plans, about = plans_of(devices)
            lookups = task_lookups(task)
            per_device = {name: [] for name in plans}
            for d in range(devices):
                for row in time_device(task, plans, d, [lookups], JudgeConfig(1, 1, args.rounds, 3)):
                    per_device[row["planner"]].append(statistics.median(row["fused_ms"]))
            compute = {name: max(ms) for name, ms in per_device.items()}
            first = next(iter(compute.values()))
            for name, ms in compute.items():
                seconds, predicted = about[name]
                lines.append(f"| {devices} | {name} | {seconds:.1f} | {predicted:.1f} | {ms:.1f} | {ms / first:.3f} |")
            print("\n".join(lines[-2:]), flush=True)
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
