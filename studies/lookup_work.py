"""Where the CPU model's per-device error comes from: a device's lookup work.

    python -m studies.lookup_work                       # the scale benchmark's last judged runs
    python -m studies.lookup_work --pairs runs/p.jsonl  # and device-sized kernel pairs (``collect devices``)

A device's lookup work is what its kernels read a sample: the sum over its shards of the
table's pooling factor x the shard's width x its share of the table's rows. For each plan
of the scale benchmark's last judged run per held-out pool and D (``benchmarks.scale``,
rows and plans as committed), from the judge's per-device medians: Spearman's rank
correlation of the devices' measured compute with the model's prediction and with their
lookup work, and the elasticity of measured / predicted in lookup work within the plan
(the least-squares slope of log(measured / predicted) on log(work / mean work), both
centred; 0 where the model weighs lookup work as the hardware does) with the share of the
residual's variance it explains. With ``--pairs``: the same slope over pairs of
device-sized kernels timed in turn (the ratio of a pair is free of the machine's drift),
each model named by ``--models``. Predictions: the plans' stored per-device compute (the
shipped ``cpu.pt``, re-priced as ``benchmarks.scale report`` does). Writes
``results/lookup_work.md``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np
import torch

from benchmarks.device_kernels import priced_ms
from benchmarks.scale import price_with_shipped, scale_task
from benchmarks.scale_report import MEASURED, PLANNED, judged_task, latest_plans
from torchrec_neuroshard.costmodel import NeuralCostModel
from torchrec_neuroshard.hardware import local_hardware
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.collect_devices import whole_pairs
from torchrec_neuroshard.lab.evaluate import lookup_groups
from torchrec_neuroshard.lab.judgement import rank_correlation
from torchrec_neuroshard.lab.workloads import HELD_OUT_POOL_SEEDS
from torchrec_neuroshard.types import Plan

OUT = Path(__file__).parent / "results" / "lookup_work.md"


def device_work(task, plan: Plan) -> np.ndarray:
    """Each device's lookup work a sample: pooling factor x width x row share, summed [devices]."""
    groups, _ = lookup_groups(task, plan, [[t.name for t in task.tables]])
    work = np.zeros(task.num_devices)  # [devices]
    for g in groups:
        for k, shards in enumerate(g.shards):
            work[k] += sum(task.table(n).pooling_factor * w * rows / task.table(n).rows for n, w, _, rows in shards)
    return work


def elasticity(log_work: np.ndarray, residual: np.ndarray) -> tuple[float, float]:
    """(slope, share of variance explained) of ``residual`` (log measured / predicted) on
    ``log_work``, through the origin: centre both first where their level is arbitrary."""
    slope = float((log_work * residual).sum() / (log_work * log_work).sum())
    return slope, float(1 - ((residual - slope * log_work) ** 2).sum() / (residual * residual).sum())


def plan_lines(devices: list[int]) -> list[str]:
    measured, planned = read_rows(MEASURED), read_rows(PLANNED)
    lines = [
        "| pool | D | planner | measured slowest / mean | lookup work most / mean | Spearman with the prediction "
        "| with lookup work | elasticity of measured / predicted in lookup work | variance explained |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    judged_tasks = {(r["pool_seed"], r["devices"]) for r in measured}
    for d in devices:
        for pool_seed in (p for p in HELD_OUT_POOL_SEEDS if (p, d) in judged_tasks):
            judged, rows = judged_task(measured, pool_seed, d), latest_plans(planned, pool_seed, d)
            price_with_shipped(pool_seed, d, rows)
            task = scale_task(d, pool_seed)
            for name, m in ((n, m) for n, m in judged.items() if n in rows and rows[n]["status"] == "ok"):
                predicted, work = np.asarray(rows[name]["predicted_ms"]), device_work(task, Plan.from_dict(rows[name]["plan"]))
                residual = np.log(m.per_device / predicted)  # [devices]
                slope, explained = elasticity(np.log(work) - np.log(work).mean(), residual - residual.mean())
                lines.append(
                    f"| {pool_seed} | {d} | {name} | {m.imbalance:.2f} | {work.max() / work.mean():.2f} | {rank_correlation(predicted, m.per_device):.2f} "
                    f"| {rank_correlation(work, m.per_device):.2f} | {slope:.2f} | {explained:.2f} |"
                )
    return lines


def pair_lines(path: Path, models: list[Path]) -> list[str]:
    rows = whole_pairs(read_rows(path))
    measured = np.array([r["fwd_ms"] + r["bwd_ms"] for r in rows])  # [kernels], partners side by side
    work = np.array([sum(s["pooling_factor"] * s["width"] for s in r["shards"]) for r in rows])  # [kernels]
    lines = [
        f"Pairs of device-sized kernels in {path} ({len(rows) // 2} pairs, training pools):",
        "",
        "| model | median predicted / measured | pair ratio MAPE | pairs ordered as measured | elasticity of the pair's measured / predicted in its lookup work | variance explained |",
        "|---|---|---|---|---|---|",
    ]
    for model_path in models:
        predicted = priced_ms(NeuralCostModel.load(model_path), rows).numpy()
        residual = np.log(measured[0::2] / measured[1::2]) - np.log(predicted[0::2] / predicted[1::2])  # [pairs]
        slope, explained = elasticity(np.log(work[0::2] / work[1::2]), residual)  # a pair's two orders read alike
        ordered = np.mean((predicted[0::2] > predicted[1::2]) == (measured[0::2] > measured[1::2]))
        lines.append(
            f"| {model_path} | {np.median(predicted / measured):.3f} | {100 * np.mean(np.abs(np.exp(-residual) - 1)):.1f}% "
            f"| {100 * ordered:.0f}% | {slope:.3f} | {explained:.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 128])
    p.add_argument("--pairs", type=Path, nargs="*", default=[], help="device-pair files (collect devices) to read the same slope on")
    p.add_argument("--models", type=Path, nargs="+", default=[Path("torchrec_neuroshard/pretrained/cpu.pt")])
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    lines = [
        "# A device's lookup work and the CPU model's error",
        "",
        f"`python -m studies.lookup_work {' '.join(argv)}`; {local_hardware('cpu').describe()}; {datetime.date.today().isoformat()}. "
        "Per plan of the scale benchmark's last judged run (held-out pools): how the devices' measured compute ranks against "
        "the shipped model's prediction and against their lookup work (pooling factor x width x row share, summed), and how "
        "the model's error grows with lookup work.",
        "",
        *plan_lines(args.devices),
    ]
    for path in args.pairs:
        lines += ["", *pair_lines(path, args.models)]
    text = "\n".join(lines) + "\n"
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
