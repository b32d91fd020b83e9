"""Does the plan evaluator rank plans as the real training step does?

    python -m benchmarks.validate_evaluator                     # 8 tasks, D = 2 (about 25 min on 2 cores)
    python -m benchmarks.validate_evaluator --tables 16 --pool-seed 0 --steps 4   # a quick look

Every planner plans each task ONCE (``dmp_step.plan_task``); each plan is then measured
both ways on the same bags: the real step under DMP (``dmp_step.measure_task``: slowest
rank's median step time) and the evaluator (``lab.evaluate.evaluate_plans`` with the same
EBC grouping). Reported: Spearman between evaluator cost and step time over all (task,
plan) pairs and within each task, the share of tasks on which both agree which of
NeuroShard and TorchRec is faster, and the headline comparison on both measures.
Rows append to a JSONL file per task, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from torchrec_neuroshard.lab.planners import geomean
from torchrec_neuroshard.lab.dmp_model import StepConfig, feature_groups, generated_tasks, task_bags
from torchrec_neuroshard.lab.dmp_measure import measure_task, plan_task
from torchrec_neuroshard.heuristics import BASELINES
from torchrec_neuroshard.lab.collect import append_rows, hardware, read_rows
from torchrec_neuroshard.lab.evaluate import evaluate_plans
from torchrec_neuroshard.lab.launch import default_device
from torchrec_neuroshard.lab.training import spearman
from torchrec_neuroshard.lab.workloads import WorkloadScale

HERE = Path(__file__).parent
TABLES = (16, 30, 45, 60)
POOL_SEEDS = (0, 1)


def validate_task(task, label: str, config: StepConfig, rounds: int) -> list[dict]:
    """Both measures of every plan of one task: dmp_step's rows plus ``evaluator_ms``."""
    planned = plan_task(task, label, config)
    rows = measure_task(planned, config)
    ran = [r["planner"] for r in rows if r["status"] == "ok"]
    bags = dict(zip((t.name for t in task.tables), task_bags(task, config)[0]))
    measured = evaluate_plans(
        task, [planned.plans[n] for n in ran], rounds=rounds, lookups=bags, modules=feature_groups(task, config)
    )
    by_name = dict(zip(ran, measured))
    for r in rows:
        if r["planner"] in by_name:
            m = by_name[r["planner"]]
            r["evaluator_ms"] = m.cost_ms
            r["evaluator_iqr_ms"] = m.spread_ms
            r["evaluator_per_device"] = [[d.fwd_compute, d.bwd_compute, d.fwd_comm, d.bwd_comm] for d in m.devices]
            r["evaluator_input_comm"] = list(m.input_comm_ms)
    return rows


def _spread(xs: Sequence[float]) -> float:
    """(max - min) / median: how far apart a task's plans are."""
    return (max(xs) - min(xs)) / statistics.median(xs)


def summarize(rows: Sequence[dict]) -> dict:
    """Agreement of the two measures, and the headline comparison on each."""
    ok = [r for r in rows if r["status"] == "ok" and "evaluator_ms" in r and r.get("fits_cap", True)]
    tasks = list(dict.fromkeys(r["task"] for r in ok))
    by_task = {t: {r["planner"]: r for r in ok if r["task"] == t} for t in tasks}
    within = [
        spearman(torch.tensor([r["evaluator_ms"] for r in p.values()]), torch.tensor([r["step_ms"] for r in p.values()]))
        for p in by_task.values()
        if len(p) > 2
    ]
    both = [p for p in by_task.values() if "neuroshard" in p and "torchrec" in p]

    def agreement(key: str) -> float:
        agree = [
            (p["neuroshard"]["evaluator_ms"] < p["torchrec"]["evaluator_ms"]) == (p["neuroshard"][key] < p["torchrec"][key])
            for p in both
        ]
        return sum(agree) / len(agree) if agree else float("nan")

    cpu = [r for r in ok if r.get("step_cpu_ms") is not None]
    out = {
        "tasks": len(tasks),
        "pairs": len(ok),
        "spearman_all_pairs": spearman(torch.tensor([r["evaluator_ms"] for r in ok]), torch.tensor([r["step_ms"] for r in ok])),
        "spearman_within_task_median": statistics.median(within) if within else float("nan"),
        "spearman_within_task": within,
        "ns_vs_torchrec_agreement": agreement("step_ms"),
        "spearman_all_pairs_cpu": spearman(torch.tensor([r["evaluator_ms"] for r in cpu]), torch.tensor([r["step_cpu_ms"] for r in cpu])) if cpu else float("nan"),
        "spearman_within_task_cpu": [
            spearman(torch.tensor([r["evaluator_ms"] for r in p.values()]), torch.tensor([r["step_cpu_ms"] for r in p.values()]))
            for p in by_task.values()
            if len(p) > 2 and all(r.get("step_cpu_ms") is not None for r in p.values())
        ],
        "ns_vs_torchrec_agreement_cpu": agreement("step_cpu_ms") if cpu else float("nan"),
        "step_iqr_over_median": statistics.median(r["step_iqr_ms"] / r["step_ms"] for r in ok),
        "step_plan_spread": statistics.median(_spread([r["step_ms"] for r in p.values()]) for p in by_task.values()),
        "evaluator_plan_spread": statistics.median(_spread([r["evaluator_ms"] for r in p.values()]) for p in by_task.values()),
        "evaluator_iqr_over_median": statistics.median(r["evaluator_iqr_ms"] / r["evaluator_ms"] for r in ok),
    }
    for measure, key in (("evaluator", "evaluator_ms"), ("dmp_step", "step_ms"), ("dmp_step_cpu", "step_cpu_ms")):
        if measure == "dmp_step_cpu" and len(cpu) < len(ok):
            continue
        beats = [
            all(p["neuroshard"][key] < p[b][key] for b in BASELINES if b in p) for p in by_task.values() if "neuroshard" in p
        ]
        out[f"{measure}_neuroshard_over_torchrec_geomean"] = geomean([p["neuroshard"][key] / p["torchrec"][key] for p in both])
        out[f"{measure}_neuroshard_below_every_heuristic"] = sum(beats) / len(beats) if beats else float("nan")
        out[f"{measure}_best_heuristic_over_torchrec_geomean"] = geomean(
            [min(p[b][key] for b in BASELINES if b in p) / p["torchrec"][key] for p in both]
        )
    return out


def report(rows: Sequence[dict], summary: dict, command: str, config: StepConfig, rounds: int) -> str:
    hw = hardware(default_device(), 1)
    lines = [
        "# The evaluator against the real training step",
        "",
        f"Date: {datetime.date.today()}. {hw['device']} ({hw['device_name']}), torch {hw['torch']}, fbgemm-gpu "
        f"{hw['fbgemm_gpu']}; 2 ranks, one thread each. `{command}`. DMP: {config.steps} timed steps after "
        f"{config.warmup} warm-up, interleaved across plans, {config.num_ebcs} EBCs; evaluator: {rounds} interleaved rounds.",
        "",
        f"- Spearman, evaluator cost vs DMP step time, over all {summary['pairs']} (task, plan) pairs of "
        f"{summary['tasks']} tasks: **{summary['spearman_all_pairs']:.3f}** (target 0.9); within a task (plans of one "
        f"task only; median over tasks): **{summary['spearman_within_task_median']:.3f}** "
        f"({', '.join(f'{s:.2f}' for s in summary['spearman_within_task'])}).",
        f"- NeuroShard vs TorchRec: the two agree which is faster on **{100 * summary['ns_vs_torchrec_agreement']:.0f}%** "
        "of tasks (target 90%).",
        f"- The same against the busiest rank's CPU time per step (blind to other processes' load): "
        f"Spearman over all pairs {summary['spearman_all_pairs_cpu']:.3f}, within a task (median) "
        f"{statistics.median(summary['spearman_within_task_cpu'] or [float('nan')]):.3f}; NeuroShard-vs-TorchRec "
        f"agreement {100 * summary['ns_vs_torchrec_agreement_cpu']:.0f}%.",
        f"- Noise: median IQR / median of a plan's DMP step time {100 * summary['step_iqr_over_median']:.1f}%, "
        f"of its evaluator cost over rounds {100 * summary['evaluator_iqr_over_median']:.1f}%; a task's plans lie "
        f"{100 * summary['step_plan_spread']:.1f}% apart in DMP step time ((max - min) / median, median over tasks), "
        f"{100 * summary['evaluator_plan_spread']:.1f}% apart in evaluator cost.",
        "",
        "| measure | NeuroShard / TorchRec (geomean) | best heuristic per task / TorchRec | NeuroShard below every heuristic |",
        "|---|---|---|---|",
    ]
    for measure in ("evaluator", "dmp_step", "dmp_step_cpu"):
        if f"{measure}_neuroshard_over_torchrec_geomean" not in summary:
            continue
        lines.append(
            f"| {measure} | {summary[f'{measure}_neuroshard_over_torchrec_geomean']:.3f} | "
            f"{summary[f'{measure}_best_heuristic_over_torchrec_geomean']:.3f} | "
            f"{100 * summary[f'{measure}_neuroshard_below_every_heuristic']:.0f}% |"
        )
    lines += [
        "",
        "| task | planner | DMP step ms | IQR | step CPU ms | embedding share | evaluator ms | IQR | splits | data-parallel | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['task']} | {r['planner']} | | | | | | | | | {r['status'][:100]} |")
            continue
        lines.append(
            f"| {r['task']} | {r['planner']} | {r['step_ms']:.1f} | {r['step_iqr_ms']:.1f} | {r.get('step_cpu_ms') or float('nan'):.1f} | {100 * r['embedding_share']:.0f}% | "
            f"{r.get('evaluator_ms', float('nan')):.1f} | {r.get('evaluator_iqr_ms', float('nan')):.1f} | {r['splits']} | "
            f"{r['data_parallel']} | ok{'' if r['fits_cap'] else ' (over cap)'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, nargs="*", default=list(TABLES))
    p.add_argument("--pool-seed", type=int, nargs="*", default=list(POOL_SEEDS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="evaluator rounds")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--name", default="validate_evaluator", help="results file stem")
    args = p.parse_args(argv)
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    config = StepConfig(steps=args.steps, warmup=args.warmup)
    tasks = generated_tasks(args.tables, args.pool_seed, 2, WorkloadScale())
    path = args.out / f"{args.name}.jsonl.gz"
    done = {r["task"] for r in read_rows(path)}
    for task, label in tqdm(tasks, desc="tasks"):
        if label in done:
            continue
        append_rows(path, validate_task(task, label, config, args.rounds))
    labels = {label for _, label in tasks}
    rows = [r for r in read_rows(path) if r["task"] in labels]
    summary = summarize(rows)
    command = "python -m benchmarks.validate_evaluator " + " ".join(sys.argv[1:] if argv is None else argv)
    text = report(rows, summary, command.strip(), config, args.rounds)
    (args.out / f"{args.name}.md").write_text(text)
    (args.out / f"{args.name}_summary.json").write_text(json.dumps(summary, indent=1))
    print(text)


if __name__ == "__main__":
    main()
