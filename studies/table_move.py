"""What one table costs its device, measured, against what each shipped CPU model says:
one move of a table between two devices of a stored scale plan (issue 43).

    taskset -c 1 python -m studies.table_move --pool-seed 4 --devices 16 --table t625_732 --to 12

The scale benchmark's NeuroShard plan of the task (``benchmarks/results/scale_planned``),
and the same plan with ``--table`` moved from its device to ``--to``: both devices timed
under both plans by the judge (``lab.judge.time_device``: the plans interleaved, rounds x
draws of ids), and each device's compute as each shipped CPU model predicts it
(``lab.refine.device_compute``). Percent changes, so that a machine's level (the models
were measured on other days and CPU kinds) cancels. Appends to ``results/table_move.md``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from threadpoolctl import threadpool_limits

from benchmarks.scale import planning_model
from benchmarks.scale_report import PLANNED, latest_plans
from torchrec_neuroshard.hardware import local_hardware
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.evaluate import task_lookups
from torchrec_neuroshard.lab.judge import JudgeConfig, time_device
from torchrec_neuroshard.lab.refine import device_compute
from torchrec_neuroshard.types import Plan

OUT = Path(__file__).parent / "results" / "table_move.md"
MODELS = ("cpu", "intel_xeon")


def moved_plan(plan: Plan, table: str, to: int) -> tuple[Plan, int]:
    """``plan`` with table-wise ``table`` on device ``to``, and the device it left."""
    (placement,) = [p for p in plan.placements if p.table == table]
    if len(placement.devices) != 1:
        raise ValueError(f"table {table!r} is {placement.kind.value} over {len(placement.devices)} devices: give a table-wise one")
    placements = tuple(replace(p, devices=(to,)) if p.table == table else p for p in plan.placements)
    return Plan(placements, plan.num_devices), placement.devices[0]


def _change(before: float, after: float) -> str:
    return f"{before:.1f} -> {after:.1f} ({after / before - 1:+.1%})"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pool-seed", type=int, default=4)
    p.add_argument("--devices", type=int, default=16)
    p.add_argument("--table", default="t625_732")
    p.add_argument("--to", type=int, default=12)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("torchrec_neuroshard").setLevel(logging.ERROR)
    stored = latest_plans(read_rows(PLANNED), args.pool_seed, args.devices)["neuroshard"]
    plan = Plan.from_dict(stored["plan"])
    moved, source = moved_plan(plan, args.table, args.to)
    task, _ = planning_model(args.devices, args.pool_seed)  # the task on the topology's links (the models price replicas on them)
    lines = [
        f"## Pool {args.pool_seed}, D = {args.devices}: {args.table} from device {source} to {args.to}", "",
        f"`python -m studies.table_move --pool-seed {args.pool_seed} --devices {args.devices} --table {args.table} --to {args.to} "
        f"--rounds {args.rounds}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {local_hardware('cpu').name}, one thread); "
        "each device's compute ms under the stored plan -> the moved one", "",
        f"| | device {source} | device {args.to} |", "|---|---|---|",
    ]  # fmt: skip
    for name in MODELS:
        _, model = planning_model(args.devices, args.pool_seed, name)
        before, after = device_compute(model, task, plan), device_compute(model, task, moved)
        lines.append(f"| predicted, {name}.pt | {_change(before[source], after[source])} | {_change(before[args.to], after[args.to])} |")
    draws = [task_lookups(task, draw=k) for k in range(2)]
    cells = []
    with threadpool_limits(limits=1):
        for device in (source, args.to):
            rows = time_device(task, {"plan": plan, "moved": moved}, device, draws, JudgeConfig(rounds=args.rounds))
            ms = {n: statistics.median(x for r in rows if r["planner"] == n for x in r["fused_ms"]) for n in ("plan", "moved")}
            cells.append(_change(ms["plan"], ms["moved"]))
    lines.append(f"| measured (median of {2 * args.rounds} rounds) | {cells[0]} | {cells[1]} |")
    head = "" if OUT.exists() else "# One table moved between two devices: measured against each CPU model\n\n"
    with OUT.open("a") as f:
        f.write(head + "\n".join(lines) + "\n\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
