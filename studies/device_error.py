"""Where a cost model misprices a device against another: the per-device error within a
plan, and what it follows.

    python -m studies.device_error --models cpu runs/cpu_today.pt

Held out: every device of every judged plan of ``benchmarks.scale``'s last judged run per
held-out pool and D (rows as committed) whose plan splits no table by rows and replicates
none (its measured time is then its fused kernel alone). A device's error is log(measured /
the model's price), less its plan's mean (the machine's level and drift cancel): its
spread, and its correlation with what the device holds: the lookup-weighted mean width of
its shards (sum of pooling factor x width / sum of pooling factors), how many shards, the
heaviest shard's share of its lookups, its lookups per ms of the model's price, and the
bytes of rows a batch reads in it (``kernel_correction.footprint``) (each as a log, less its
plan's mean).
Training side: the device pairs of ``lab/data/cpu_compute_devices_seed1.jsonl.gz`` (pool
seeds 10 on, 16-128 tables a kernel, timed back to back): each pair's difference of the
same error against the difference of the same holdings.
Writes ``results/device_error.md``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np

from benchmarks.scale import planning_model
from benchmarks.scale_report import MEASURED, PLANNED, cpu_label, judged_task, last_judged, latest_plans
from torchrec_neuroshard.costmodel import model_named
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.kernel_correction import footprint, mean_width, priced_pairs
from torchrec_neuroshard.lab.workloads import HELD_OUT_POOL_SEEDS
from torchrec_neuroshard.search import predicted_breakdown
from torchrec_neuroshard.types import Plan, Shard, ShardingKind

OUT = Path(__file__).parent / "results" / "device_error.md"
PAIRS = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data" / "cpu_compute_devices_seed1.jsonl.gz"
HOLDINGS = ("mean width", "shards", "heaviest share", "lookups per ms", "footprint")


def holdings(shards: list[Shard], price_ms: float, batch_size: int) -> np.ndarray:
    """[5] log of a device's lookup-weighted mean width, its shard count, its heaviest
    shard's share of its lookups (pooling factor x width), its lookups per ms of
    ``price_ms``, the model's price of it (what a work correction reads: ``KernelCorrection``),
    and the bytes of rows a batch of ``batch_size`` reads in it (``kernel_correction.footprint``)."""
    lookups = np.array([s.table.pooling_factor * s.width for s in shards])  # [S]
    return np.log([mean_width(shards), len(shards), lookups.max() / lookups.sum(), lookups.sum() / price_ms, footprint(shards, batch_size)])


def held_out_devices(path: str, devices: int, pool_seeds: list[int], measured_rows: list[dict], planned_rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Every judged device of the plans without row splits or replicas at D = ``devices``:
    its error (log measured / priced by the model file ``path``, less its plan's mean) [N]
    and holdings (``holdings``, less its plan's mean) [N, 5]."""
    errors, held = [], []
    for pool_seed in pool_seeds:
        judged, planned = judged_task(measured_rows, pool_seed, devices), latest_plans(planned_rows, pool_seed, devices)
        task, model = planning_model(devices, pool_seed, None if path == "cpu" else path)
        for name, measured in judged.items():
            plan = Plan.from_dict(planned[name]["plan"])
            if any(p.kind.splits_rows or p.kind is ShardingKind.DATA_PARALLEL for p in plan.placements):
                continue
            _, per_device = predicted_breakdown(model, task, plan)
            kept = [(d, shards) for d, shards in enumerate(plan.device_shards(task.tables)) if shards]
            error = np.log([measured.per_device[d] / per_device[d].compute for d, _ in kept])  # [devices]
            held_plan = np.array([holdings(shards, per_device[d].compute, task.batch_size) for d, shards in kept])  # [devices, 5]
            errors.append(error - error.mean())
            held.append(held_plan - held_plan.mean(0))
    return np.concatenate(errors), np.concatenate(held)


def pair_differences(path: str, rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Each whole pair's difference (first member less second) of the error (log measured
    / priced by ``path``) [P] and of the holdings [P, 5]."""
    pairs = priced_pairs(model_named(path), rows)
    errors = [pair.errors[0] - pair.errors[1] for pair in pairs]
    held = [np.subtract(*(holdings(s, price, batch) for s, price, batch in zip(pair.shards, pair.prices, pair.batches))) for pair in pairs]
    return np.array(errors), np.array(held)


def error_line(label: str, path: str, error: np.ndarray, held: np.ndarray) -> str:
    """A table row: the spread of the error, its correlation with each holding, and its
    slope on the mean width (least squares through 0: both are centred)."""
    corr = [np.corrcoef(held[:, k], error)[0, 1] for k in range(len(HOLDINGS))]
    slope = held[:, 0] @ error / (held[:, 0] @ held[:, 0])
    return f"| {label} | {path} | {len(error)} | {error.std():.3f} | " + " | ".join(f"{c:+.2f}" for c in corr) + f" | {slope:+.3f} |"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 128])
    p.add_argument("--pool-seeds", type=int, nargs="+", default=list(HELD_OUT_POOL_SEEDS[:3]))
    p.add_argument("--models", nargs="+", default=["cpu"], help="model files (cpu: the shipped one)")
    args = p.parse_args(argv)
    measured_rows, planned_rows, pair_rows = read_rows(MEASURED), read_rows(PLANNED), read_rows(PAIRS)
    lines = []
    for path in args.models:
        for devices in args.devices:
            cpus = sorted({cpu_label(last[0].get("cpu")) for pool_seed in args.pool_seeds if (last := last_judged(measured_rows, pool_seed, devices))})
            label = f"held out, D = {devices}, judged on {' and '.join(cpus)}"
            lines.append(error_line(label, path, *held_out_devices(path, devices, args.pool_seeds, measured_rows, planned_rows)))
        lines.append(error_line("device pairs, pool seeds 10 on", path, *pair_differences(path, pair_rows)))
    text = "\n".join([
        "# Where the cost model misprices a device against another", "",
        f"`python -m studies.device_error {' '.join(sys.argv[1:] if argv is None else argv)}`; written {datetime.date.today()} "
        f"from the committed rows of `benchmarks.scale` (held-out pools {', '.join(map(str, args.pool_seeds))}, each task's last "
        "judged run) and the device pairs of `lab/data/cpu_compute_devices_seed1.jsonl.gz`. Error: log(measured / priced), "
        "less its plan's mean (held out) or its partner's (pairs); its sd, and its correlation with each holding (as a log, "
        "less the plan's mean or the partner's): a positive correlation is a device the model underprices the more of it it holds. A model fine-tuned on the device pairs (`calibrate --device-pairs`, "
        "`pretrain` on their file) is read on them in sample.", "",
        "| devices | model | n | error sd | " + " | ".join(f"corr. with {h}" for h in HOLDINGS) + " | slope on mean width |",
        "|---|---|---|---|" + "---|" * len(HOLDINGS) + "---|",
        *lines,
    ])  # fmt: skip
    OUT.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
