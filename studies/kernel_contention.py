"""Each device's kernels of some dmp_step plans, timed alone and with the other devices'
kernels running at the same time, as the ranks of a DMP step on one host run them.

    python -m studies.kernel_contention T45_D2_pool0 neuroshard,size_lookup,neuroshard_calibrated
    python -m studies.kernel_contention all all --out studies/results/kernel_contention.jsonl

One process per device. Per round and plan: "alone", each device's fused kernels (one per
lookup group, forward and backward, ``measure_compute``) while the other processes wait;
then "together", every device's at once. Medians over the rounds. A cost model of kernels
timed alone prices the first; the step pays the second.

With ``all all`` it measures every task and planner of the results file, one task at a
time (a task already in ``--out`` is skipped, so an interrupted run resumes), and reports
how each figure ranks a task's plans against the DMP step those plans took: the
prediction, the slowest device's kernels timed alone, and timed together.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from studies.dmp_ranks import add_task_arguments, stored_plans, task_of
from torchrec_neuroshard.lab.dmp_model import StepConfig, feature_groups, with_ebcs
from torchrec_neuroshard.lab.dmp_report import within_task_spearman
from torchrec_neuroshard.costmodel import NeuralCostModel
from torchrec_neuroshard.lab.evaluate import lookup_groups, task_lookups
from torchrec_neuroshard.lab.launch import spawn
from torchrec_neuroshard.lab.measure_compute import measure_compute
from torchrec_neuroshard.stepcost import predict_step
from torchrec_neuroshard.types import Plan, Shard
from torchrec_neuroshard.lab.collect import read_rows

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


def measure_task(label: str, plans: dict[str, Plan], rounds: int) -> list[dict]:
    """One row per plan and device: its kernels' forward and backward ms, alone and together."""
    world = task_of(label).num_devices
    per_rank = spawn(_worker, world, label, {n: p.to_dict() for n, p in plans.items()}, rounds)
    rows = []
    for name in plans:
        for rank in range(world):
            (af, ab), (tf, tb) = (per_rank[rank][f"{name}|{mode}"] for mode in MODES)
            rows.append({"task": label, "planner": name, "device": rank, "rounds": rounds,
                         "alone_fwd_ms": af, "alone_bwd_ms": ab, "together_fwd_ms": tf, "together_bwd_ms": tb})
    return rows


def print_table(rows: list[dict]) -> None:
    print("| task | planner | device | alone fwd | alone bwd | together fwd | together bwd | together / alone |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        alone, together = r["alone_fwd_ms"] + r["alone_bwd_ms"], r["together_fwd_ms"] + r["together_bwd_ms"]
        print(f"| {r['task']} | {r['planner']} | {r['device']} | {r['alone_fwd_ms']:.1f} | {r['alone_bwd_ms']:.1f} | "
              f"{r['together_fwd_ms']:.1f} | {r['together_bwd_ms']:.1f} | {together / alone:.2f} |")


def rank_agreement(rows: list[dict], steps: list[dict]) -> dict[str, float]:
    """Median over tasks of the within-task Spearman between the DMP step and: the
    prediction, the slowest device's kernels alone, and together (forward and backward
    each the slowest device's, as the ranks wait for each other between them)."""
    ran = {(s["task"], s["planner"]): s for s in steps if s.get("status") == "ok"}
    figures: dict[str, dict[tuple[str, str], float]] = {"predicted": {}, "alone": {}, "together": {}}
    for (task, planner), s in ran.items():
        mine = [r for r in rows if (r["task"], r["planner"]) == (task, planner)]
        if not mine:
            continue
        figures["predicted"][task, planner] = s["predicted_ms"]
        for mode in MODES:
            figures[mode][task, planner] = max(r[f"{mode}_fwd_ms"] for r in mine) + max(r[f"{mode}_bwd_ms"] for r in mine)
    step = {k: s["step_ms"] for k, s in ran.items()}
    rhos = {name: within_task_spearman(figure, step).values() for name, figure in figures.items()}
    return {name: statistics.median(r) if r else float("nan") for name, r in rhos.items()}


def model_ratios(rows: list[dict], steps: list[dict], model: NeuralCostModel) -> str:
    """Markdown: each device's kernels timed alone over the fused-kernel compute ``model``
    predicts for that device (``predict_step``, forward + backward), and per task the
    range of that ratio: how far apart the model's errors on two devices can lie."""
    plans = {(s["task"], s["planner"]): Plan.from_dict(s["plan"]) for s in steps if "plan" in s}
    predicted_devices = {}  # (task, planner) -> the plan's predicted DeviceCosts, each plan priced once
    for label in dict.fromkeys(r["task"] for r in rows):
        task = with_ebcs(task_of(label), StepConfig())
        at_batch = model.with_batch_size(task.batch_size)
        for planner in dict.fromkeys(r["planner"] for r in rows if r["task"] == label):
            predicted_devices[label, planner] = predict_step(at_batch, task, plans[label, planner]).devices
    lines = ["| task | planner | device | alone ms | predicted ms | alone / predicted |", "|---|---|---|---|---|---|"]
    by_task: dict[str, list[float]] = {}
    for r in rows:
        device = predicted_devices[r["task"], r["planner"]][r["device"]]
        alone, predicted = r["alone_fwd_ms"] + r["alone_bwd_ms"], device.compute
        by_task.setdefault(r["task"], []).append(alone / predicted)
        lines.append(f"| {r['task']} | {r['planner']} | {r['device']} | {alone:.1f} | {predicted:.1f} | {alone / predicted:.2f} |")
    lines += ["", *(f"{t}: alone / predicted {min(v):.2f}-{max(v):.2f} over its {len(v)} devices" for t, v in by_task.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, help="jsonl of the rows, appended task by task (resumes)")
    p.add_argument("--model", type=Path, help="a cost model file: also each device's kernels over its predicted compute")
    args = p.parse_args(argv)
    steps = read_rows(args.results)
    tasks = sorted({s["task"] for s in steps}) if args.task == "all" else [args.task]
    done = read_rows(args.out) if args.out else []
    rows = list(done)
    for label in tqdm([t for t in tasks if t not in {r["task"] for r in done}], desc="tasks"):
        planners = ",".join(s["planner"] for s in steps if s["task"] == label and "plan" in s) if args.planners == "all" else args.planners
        new = measure_task(label, stored_plans(args.results, label, planners), args.rounds)
        rows += new
        if args.out:
            with args.out.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in new)
    print(f"{', '.join(tasks)}; {args.rounds} rounds; per device, its fused kernels' forward + backward ms (medians)\n")
    print_table([r for r in rows if r["task"] in tasks])
    if len(tasks) > 1:
        agreement = rank_agreement(rows, steps)
        print("\nWithin-task Spearman with the DMP step (median over tasks): "
              + ", ".join(f"{k} {v:.3f}" for k, v in agreement.items()))
    if args.model:
        print(f"\nEach device's kernels alone over their compute as `{args.model}` predicts it\n")
        print(model_ratios([r for r in rows if r["task"] in tasks], steps, NeuralCostModel.load(args.model)))


if __name__ == "__main__":
    main()
