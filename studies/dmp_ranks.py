"""Each rank's embedding time under DMP for some plans of one dmp_step task, beside the
shipped model's prediction of each device: where a plan the model calls balanced is not.

    python -m studies.dmp_ranks T45_D2_pool0 neuroshard,size_lookup,neuroshard_calibrated \
        --results benchmarks/results/dmp_step_modules_final.jsonl.gz

Re-runs the plans a ``benchmarks.dmp_step`` results file recorded for the task (same task,
model and batches as there, ``--steps`` interleaved steps) and prints, per plan and rank,
the median step, the median time in the sharded embeddings forward and backward, and the
shipped model's predicted compute and comm of that device: priced as one module of all
tables, and summed over the model's EBCs priced apart (``dmp_step.with_ebcs``: each
EmbeddingBagCollection runs its own kernels).
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

import torch

from torchrec_neuroshard.lab.dmp_model import StepConfig, StepModel, generated_tasks, task_bags, with_ebcs
from torchrec_neuroshard.lab.dmp_measure import PlannedTask, _worker
from torchrec_neuroshard.costmodel import NeuralCostModel, load_pretrained
from torchrec_neuroshard.lab.launch import spawn
from torchrec_neuroshard.lab.workloads import WorkloadScale
from torchrec_neuroshard.sharding import to_torchrec
from torchrec_neuroshard.stepcost import predict_step
from torchrec_neuroshard.types import Plan, ShardingError, Task
from torchrec_neuroshard.lab.collect import read_rows

HERE = Path(__file__).parent


def task_of(label: str, batch_size: int = WorkloadScale().batch_size) -> Task:
    """The generated task of a dmp_step label ``T{tables}_D{devices}_pool{seed}`` at the
    global ``batch_size`` (the run's ``--batch-size``)."""
    found = re.fullmatch(r"T(\d+)_D(\d+)_pool(\d+)", label)
    if found is None:
        raise ShardingError(
            f"task {label!r} is no generated dmp_step task (T<tables>_D<devices>_pool<seed>); "
            "a run of --task files cannot be re-priced from its labels"
        )
    tables, devices, pool = map(int, found.groups())
    return generated_tasks([tables], [pool], devices, WorkloadScale(batch_size=batch_size))[0][0]


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """A dmp_step task label, planner names and the results file holding their plans."""
    parser.add_argument("task", help="a dmp_step task label, e.g. T45_D2_pool0")
    parser.add_argument("planners", help="comma-separated planner names of that results file")
    parser.add_argument("--results", type=Path, default=HERE.parent / "benchmarks" / "results" / "dmp_step_modules_final.jsonl.gz")


def stored_plans(results: Path, task: str, planners: str) -> dict[str, Plan]:
    """The plans ``results`` recorded for ``task`` by the comma-separated ``planners``."""
    rows = read_rows(results)
    wanted = planners.split(",")
    plans = {r["planner"]: Plan.from_dict(r["plan"]) for r in rows if r["task"] == task and r["planner"] in wanted}
    missing = sorted(set(wanted) - set(plans))
    if missing:
        raise SystemExit(f"{results} has no plan of {missing} for task {task}")
    return plans


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_task_arguments(p)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--calibrated", type=Path, help="a model file made by `neuroshard calibrate`: its compute too")
    args = p.parse_args(argv)
    task = task_of(args.task)
    config = StepConfig(steps=args.steps, warmup=3)
    ours = stored_plans(args.results, args.task, args.planners)
    module = StepModel(task, config, torch.device("cpu"))
    plans = {name: to_torchrec(plan, module, "cpu") for name, plan in ours.items()}
    per_rank = spawn(_worker, task.num_devices, PlannedTask(task, args.task, plans, {}, dict.fromkeys(plans, True)), task_bags(task, config), config)
    model = load_pretrained("cpu").with_batch_size(task.batch_size)
    calibrated = NeuralCostModel.load(args.calibrated).with_batch_size(task.batch_size) if args.calibrated else None
    by_ebc = with_ebcs(task, config)
    print(f"{args.task}, {args.steps} steps; per rank: median step / embedding forward / backward ms | "
          "predicted compute (one module; modules apart) and comm ms\n")
    extra = " calibrated pred compute |" if calibrated else ""
    print(f"| planner | rank | step | emb fwd | emb bwd | pred compute | pred compute, modules apart | pred comm |{extra}")
    print("|---|---|---|---|---|---|---|---|" + ("---|" if calibrated else ""))
    for name, plan in ours.items():
        predicted = predict_step(model, task, plan)
        apart = predict_step(model, by_ebc, plan).devices
        recalibrated = predict_step(calibrated, task, plan).devices if calibrated else None
        for rank in range(task.num_devices):
            steps = per_rank[rank][name]["steps"]  # per step: (step, emb fwd, emb bwd, cpu) ms
            step, fwd, bwd = (statistics.median(s[k] for s in steps) for k in range(3))
            d = predicted.devices[rank]
            cal = f" {recalibrated[rank].compute:.1f} |" if recalibrated else ""
            print(
                f"| {name} | {rank} | {step:.0f} | {fwd:.0f} | {bwd:.0f} | {d.compute:.1f} | "
                f"{apart[rank].compute:.1f} | {d.fwd_comm + d.bwd_comm:.1f} |{cal}"
            )


if __name__ == "__main__":
    main()
