"""What sets a plan's compute: each plan's slowest measured devices, what they hold, and
how the model that planned them priced them.

    python -m studies.slowest_devices --devices 128 --planners neuroshard neuroshard_today

For the scale benchmark's last judged run per held-out pool and D (``benchmarks.scale``,
rows and plans as committed): each named plan's ``--top`` slowest devices by the judge's
per-device medians, each with its price as planned (the row's stored ``predicted_ms``: the
model that searched, not the shipped one re-pricing it) and its column shards (table,
columns of the table's, pooling factor); and the tables the plan splits (column-wise,
row-wise, table-row-wise), heaviest lookup first. With ``--models``: every plan priced by
each model file (its slowest device), and each model's own search on the task (``search``)
with the choices of row splits and replicas its kinds step weighed (the search result's
``kind_choices``: how many died with the costliest tables first, placed the largest first,
and how many died so too).
Last, each model's predicted / measured compute of every judged device, by whether the
device holds one column shard or several and whether it is slow.
Writes ``results/slowest_devices.md``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

from benchmarks.scale import planning_model, scale_task
from benchmarks.scale_report import MEASURED, PLANNED, judged_task, latest_plans
from torchrec_neuroshard.lab.judgement import Judged
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.workloads import HELD_OUT_POOL_SEEDS
from torchrec_neuroshard.search import predicted_breakdown, search
from torchrec_neuroshard.types import Plan, Task

OUT = Path(__file__).parent / "results" / "slowest_devices.md"
SPLIT_KINDS = ("column_wise", "row_wise", "table_row_wise")


def slowest(measured_ms: np.ndarray, top: int) -> list[int]:
    """The ``top`` devices of the largest measured time, slowest first (ties by device)."""
    return sorted(range(len(measured_ms)), key=lambda d: (-measured_ms[d], d))[:top]


def device_text(task: Task, plan: Plan, device: int) -> str:
    """A device's column shards as 'table (columns / dim, pooling factor)'."""
    shards = plan.device_shards(task.tables)[device]
    return ", ".join(f"{s.table.name} ({s.width}/{s.table.dim}, {s.table.pooling_factor:.0f})" for s in shards) or "-"


def split_tables(task: Task, plan: Plan) -> list[str]:
    """The tables ``plan`` splits, heaviest lookup (pooling factor x dim) first, with their kind."""
    by_name = {t.name: t for t in task.tables}
    split = [p for p in plan.placements if p.kind.value in SPLIT_KINDS]
    split.sort(key=lambda p: -by_name[p.table].pooling_factor * by_name[p.table].dim)
    return [f"{p.table} {p.kind.value}" for p in split]


def task_lines(pool_seed: int, devices: int, judged: dict[str, Judged], planned: dict[str, dict], planners: list[str], top: int) -> list[str]:
    """One task's table rows: each planner's slowest devices, measured against as planned
    (``judged``: the task's last judged run; ``planned``: its last plan rows, by planner)."""
    task, lines = scale_task(devices, pool_seed), []
    for name in (n for n in planners if n in judged and n in planned):
        plan, measured = Plan.from_dict(planned[name]["plan"]), judged[name].per_device  # [devices]
        predicted = np.asarray(planned[name]["predicted_ms"])  # [devices]
        splits = split_tables(task, plan)
        for rank, d in enumerate(slowest(measured, top)):
            split_text = f"{len(splits)}: {'; '.join(splits[:4])}{' ...' if len(splits) > 4 else ''}" if rank == 0 else ""
            lines.append(
                f"| {pool_seed} | {devices} | {name} | {d} | {measured[d]:.1f} | {predicted[d]:.1f} "
                f"| {np.median(measured):.1f} | {device_text(task, plan, d)} | {split_text} |"
            )
    return lines


def model_lines(pool_seed: int, devices: int, planned: dict[str, dict], planners: list[str], models: list[str]) -> list[str]:
    """Per model file: each judged plan's slowest device as it prices it, and its own
    search's choices of row splits and replicas (``SearchResult.kind_choices``)."""
    lines = []
    for path in models:
        task, model = planning_model(devices, pool_seed, None if path == "cpu" else path)
        priced = []
        for name in (n for n in planners if n in planned):
            _, per_device = predicted_breakdown(model, task, Plan.from_dict(planned[name]["plan"]))
            priced.append(f"{name} {max(d.compute for d in per_device):.1f}")
        result = search(task, model)
        _, per_device = predicted_breakdown(model, task, result.plan)
        split = [c for c in result.kind_choices if c.rows]
        costliest = sum(c.largest_first or not np.isfinite(c.greedy_ms) for c in split)  # died costliest first
        died = sum(not np.isfinite(c.greedy_ms) for c in split)  # died largest first too
        chosen = f"rows {sum(p.kind.splits_rows for p in result.plan.placements)}, replicas {len(result.plan.data_parallel)}"
        lines.append(
            f"| {pool_seed} | {devices} | {path} | {'; '.join(priced)} | {max(d.compute for d in per_device):.1f} "
            f"| {chosen} | {costliest} / {died} of {len(split)} |"
        )
    return lines


SLOW = 1.2
"""A device is slow when measured at this many times its plan's median device or more."""
HOLDINGS = ("one shard", "one shard, slow", "several", "several, slow")


def holding_lines(judged: dict[tuple[int, int], dict[str, Judged]], planned: dict[tuple[int, int], dict[str, dict]], models: list[str]) -> list[str]:
    """Per model file, its predicted / measured compute (median, and how many devices) of
    every device of every judged plan (``judged`` and ``planned`` by (pool seed, D)), by
    what the device holds (one column shard or several) and whether it is slow (``SLOW``)."""
    lines = []
    for path in models:
        ratios: dict[str, list[float]] = {h: [] for h in HOLDINGS}
        for pool_seed, devices in judged:
            task, model = planning_model(devices, pool_seed, None if path == "cpu" else path)
            for name, measured in judged[pool_seed, devices].items():
                plan = Plan.from_dict(planned[pool_seed, devices][name]["plan"])
                _, per_device = predicted_breakdown(model, task, plan)
                median = np.median(measured.per_device)
                for d, shards in enumerate(plan.device_shards(task.tables)):
                    kind = ("one shard" if len(shards) == 1 else "several") + (", slow" if measured.per_device[d] >= SLOW * median else "")
                    ratios[kind].append(per_device[d].compute / measured.per_device[d])
        cells = [f"{np.median(r):.3f} ({len(r)})" if r else "-" for r in ratios.values()]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[128])
    p.add_argument("--pool-seeds", type=int, nargs="+", default=list(HELD_OUT_POOL_SEEDS[:3]))
    p.add_argument("--planners", nargs="+", default=["neuroshard", "neuroshard_today"])
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--models", nargs="*", default=[], help="model files (or cpu: the shipped one) to price the plans and search with")
    args = p.parse_args(argv)
    tasks = [(s, d) for d in args.devices for s in args.pool_seeds]
    measured_rows, planned_rows = read_rows(MEASURED), read_rows(PLANNED)
    judged = {t: judged_task(measured_rows, *t) for t in tasks}
    planned = {t: latest_plans(planned_rows, *t) for t in tasks}
    rows = [line for t in tasks for line in task_lines(*t, judged[t], planned[t], args.planners, args.top)]
    priced = [line for t in tasks for line in model_lines(*t, planned[t], args.planners, args.models)]
    holding = holding_lines(judged, planned, args.models)
    text = "\n".join([
        "# The slowest devices of each plan", "",
        f"`python -m studies.slowest_devices {' '.join(sys.argv[1:] if argv is None else argv)}`; "
        f"written {datetime.date.today()} from the committed rows of `benchmarks.scale` (each task's last judged run). "
        "Measured: the judge's per-device median (ms, steadied as scale.md's tables are); as planned: the "
        "planning model's price of that device (the row's `predicted_ms`). Shards: table (its columns on the "
        "device / its dim, pooling factor). Split tables: how many the plan splits, heaviest lookup first.", "",
        "| pool | D | planner | device | measured ms | as planned ms | median device ms | shards | split tables |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        *([
            "", "## The plans priced by each model, and each model's own search", "",
            "Each judged plan's slowest device as the model prices it (ms); the model's own plan (`search`, as "
            "`benchmarks.scale plan` runs it): its slowest device, the row splits and replicas it fixed, and how many "
            "of the choices with row splits had every quick greedy placement of the other tables run out of memory, "
            "placed costliest first / placed largest first too (those it could not price).", "",
            "| pool | D | model | judged plans priced | its own plan | its row splits, replicas | row-split choices out of memory (costliest first / largest first) |",
            "|---|---|---|---|---|---|---|",
            *priced,
            "", "## Each model's error by what a device holds", "",
            f"Every device of every judged plan above (all planners): the model's predicted / measured compute, median "
            f"(devices), by whether the device holds one column shard or several and whether it is slow (measured at "
            f"{SLOW} x its plan's median device or more).", "",
            "| model | " + " | ".join(HOLDINGS) + " |",
            "|---|---|---|---|---|",
            *holding,
        ] if priced else []),
    ])  # fmt: skip
    OUT.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
