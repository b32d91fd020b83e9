"""How a step's price ranks the plans of a task against the DMP step those plans took,
priced two ways: each device's whole step (the max over devices of its total, as if the
model were one sharded module), and each sharded module paid at its slowest device (the
sum over modules of the max over devices: each EmbeddingBagCollection's collectives hold
every rank until the slowest arrives, which ``stepcost.predict_step`` now prices).

    python -m studies.module_sync benchmarks/results/dmp_step_modules_final.jsonl.gz \
        --calibrated benchmarks/results/calibrated_2026-11-26/cpu_calibrated_full.pt

Reads the plans and step times a ``benchmarks.dmp_step`` results file recorded (generated
tasks, their EBCs as that run dealt them); measures nothing. Per pricing and model: the
within-task Spearman with the step (median over tasks, and each task), beside the
measurement's own (odd vs even timed steps).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from studies.dmp_ranks import task_of
from torchrec_neuroshard.lab.dmp_model import StepConfig, with_ebcs
from torchrec_neuroshard.lab.dmp_report import within_task_spearman
from torchrec_neuroshard.costmodel import NeuralCostModel, load_pretrained
from torchrec_neuroshard.stepcost import predict_step
from torchrec_neuroshard.types import Plan
from torchrec_neuroshard.lab.collect import read_rows

PRICINGS = ("devices only", "each module's slowest device")


def priced(rows: list[dict], models: dict[str, NeuralCostModel]) -> dict[tuple[str, str], dict[tuple[str, str], float]]:
    """(model, pricing) -> (task, planner) -> predicted ms."""
    out: dict[tuple[str, str], dict[tuple[str, str], float]] = {(m, p): {} for m in models for p in PRICINGS}
    for r in rows:
        task = task_of(r["task"])
        modular = with_ebcs(task, StepConfig(num_ebcs=r["config"]["num_ebcs"]))
        plan = Plan.from_dict(r["plan"])
        for name, model in models.items():
            at_batch = model.with_batch_size(task.batch_size)
            for pricing, t in zip(PRICINGS, (task, modular)):
                out[name, pricing][r["task"], r["planner"]] = predict_step(at_batch, t, plan).cost_ms
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, help="a benchmarks.dmp_step results file (.jsonl)")
    p.add_argument("--calibrated", type=Path, help="a model file made by `neuroshard calibrate`: priced by it too")
    args = p.parse_args(argv)
    rows = [r for r in read_rows(args.results) if r.get("status") == "ok"]
    models = {"shipped cpu.pt": load_pretrained("cpu")}
    if args.calibrated:
        models[f"calibrated {args.calibrated.name}"] = NeuralCostModel.load(args.calibrated)
    step = {(r["task"], r["planner"]): r["step_ms"] for r in rows}
    odd = {(r["task"], r["planner"]): statistics.median(r["step_samples_ms"][0::2]) for r in rows}
    even = {(r["task"], r["planner"]): statistics.median(r["step_samples_ms"][1::2]) for r in rows}
    tasks = sorted({t for t, _ in step})
    print(f"Within-task Spearman with the DMP step of `{args.results.name}` ({len(rows)} plans, {len(tasks)} tasks)\n")
    print("| model | pricing | median | " + " | ".join(tasks) + " |")
    print("|---|---|---|" + "---|" * len(tasks))
    for (model, pricing), figure in priced(rows, models).items():
        rho = within_task_spearman(figure, step)
        print(f"| {model} | {pricing} | **{statistics.median(rho.values()):.3f}** | " + " | ".join(f"{rho[t]:.2f}" for t in tasks) + " |")
    halves = within_task_spearman(odd, even)
    print(f"| the measurement | odd vs even steps | **{statistics.median(halves.values()):.3f}** | " + " | ".join(f"{halves[t]:.2f}" for t in tasks) + " |")


if __name__ == "__main__":
    main()
