"""What a predicted millisecond of replication costs in the measured DMP step.

    python -m studies.replication_worth benchmarks/results/dmp_step_heldout.jsonl.gz ...

For every plan of each ``benchmarks.dmp_step`` run, the shipped model prices the step
(``stepcost.predict_step``) and splits the slowest device's predicted cost in two: what
replicating its data-parallel tables costs there (their dense kernel forward and backward
and their gradient all-reduce) and the rest. Per run, least squares fits

    measured step ms = c_task + rest_weight * rest + replication_weight * replication

(one intercept per task: the dense part and the run's fixed costs; a task's plans differ
in how they split the same work). Were the model's balance between replicating and
sharding right, the two weights would be equal; ``replication / rest`` is the share of its
predicted price a replication costs in the step. 90% intervals from 500 bootstrap draws of
the plans. Beside it, how well the model ranks each task's plans (median within-task
Spearman against the measured step) as it prices them, and with the gradient all-reduce
hidden behind the sharded lookups' backward (paid only where longer), as DDP's hooks
could run it.

``--scaled-model OUT`` writes the shipped model with its replication parts scaled by the
median ratio of the runs given (a model file ``dmp_step --calibrated OUT`` plans with,
interleaved with the shipped one): an experiment, fitted on those runs, to measure on others.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
from torchrec_neuroshard.lab.collect import read_rows

if TYPE_CHECKING:
    from torchrec_neuroshard.costmodel import NeuralCostModel

REPLICATION_PARTS = ("dp_fwd", "dp_bwd", "all_reduce")


def priced_rows(rows: Sequence[dict], model: "NeuralCostModel") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[N, tasks + 2] design (task one-hots, rest ms, replication ms), [N] measured step ms and
    [N] the predicted step with the all-reduce hidden behind the sharded backward."""
    from studies.dmp_ranks import task_of
    from torchrec_neuroshard.lab.dmp_model import StepConfig, with_ebcs
    from torchrec_neuroshard.stepcost import predict_step
    from torchrec_neuroshard.types import Plan

    rows = [r for r in rows if r.get("status") == "ok"]
    labels = sorted({r["task"] for r in rows})
    tasks = {label: with_ebcs(task_of(label), StepConfig()) for label in labels}
    design, step, hidden = [], [], []
    for r in rows:
        task = tasks[r["task"]]
        pred = predict_step(model.with_batch_size(task.batch_size), task, Plan.from_dict(r["plan"]))
        slowest = int(np.argmax([d.total for d in pred.devices]))
        replication = sum(pred.parts[k][slowest] for k in REPLICATION_PARTS)
        design.append([float(r["task"] == label) for label in labels] + [pred.cost_ms - replication, replication])
        step.append(r["step_ms"])
        parts = {k: np.asarray(v) for k, v in pred.parts.items()}  # [D] each
        behind = np.minimum(parts["all_reduce"], parts["column_bwd"] + parts["row_bwd"])
        totals = np.asarray([d.total for d in pred.devices])  # [D]
        hidden.append(pred.cost_ms - float(totals.max() - (totals - behind).max()))
    return np.asarray(design), np.asarray(step), np.asarray(hidden)


def fit(design: np.ndarray, step: np.ndarray, draws: int = 500, seed: int = 0) -> dict[str, tuple[float, float, float]]:
    """rest and replication weights and their ratio: (estimate, 5th, 95th percentile)."""

    def weights(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        coef = np.linalg.lstsq(x, y, rcond=None)[0][-2:]
        return np.array([coef[0], coef[1], coef[1] / coef[0]])

    rng = np.random.default_rng(seed)
    boot = np.array([weights(design[i], step[i]) for i in (rng.integers(0, len(step), len(step)) for _ in range(draws))])
    est = weights(design, step)
    lo, hi = np.percentile(boot, [5, 95], axis=0)
    return {k: (float(est[j]), float(lo[j]), float(hi[j])) for j, k in enumerate(("rest", "replication", "ratio"))}


def within_task_spearman(design: np.ndarray, step: np.ndarray, predicted: np.ndarray) -> float:
    """Median over tasks (the one-hot columns) of ``dmp_step.within_task_spearman``."""
    from torchrec_neuroshard.lab.dmp_report import within_task_spearman as per_task

    keys = list(enumerate(design[:, :-2].argmax(1)))  # (row, task)
    by_task = per_task({(t, i): predicted[i] for i, t in keys}, {(t, i): step[i] for i, t in keys})
    return float(np.median(list(by_task.values())))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="+", help="benchmarks.dmp_step results files (.jsonl)")
    p.add_argument("--scaled-model", type=Path, help="write the shipped model with replication priced at the median ratio")
    args = p.parse_args(argv)
    from torchrec_neuroshard.costmodel import load_pretrained

    model = load_pretrained("cpu")
    print(f"`python -m studies.replication_worth {' '.join(map(str, args.results))}`\n")
    print("| run | plans | with replication | rest weight | replication weight | replication / rest | within-task Spearman: as priced / all-reduce hidden |")
    print("|---|---|---|---|---|---|---|")
    ratios = []
    for path in args.results:
        rows = read_rows(path)
        design, step, hidden = priced_rows(rows, model)
        w = fit(design, step)
        cells = " | ".join(f"{e:.2f} ({lo:.2f}-{hi:.2f})" for e, lo, hi in w.values())
        priced = design[:, -2] + design[:, -1]
        ranks = f"{within_task_spearman(design, step, priced):.3f} / {within_task_spearman(design, step, hidden):.3f}"
        print(f"| {path.stem} | {len(step)} | {int((design[:, -1] > 0).sum())} | {cells} | {ranks} |")
        ratios.append(w["ratio"][0])
    if args.scaled_model:
        write_scaled(load_pretrained("cpu"), float(np.median(ratios)), args.scaled_model, [p.name for p in args.results])
        print(f"\nWrote {args.scaled_model}: the shipped model, replication parts x {np.median(ratios):.3f} (median ratio).")


def write_scaled(model: "NeuralCostModel", weight: float, out: Path, runs: Sequence[str]) -> None:
    """Save ``model`` (a freshly loaded one: its meta is replaced) with its replication parts'
    coefficients times ``weight`` (linear parts: every prediction times ``weight``),
    recording where the weight came from."""
    parts = dict(model.meta["step_parts"])
    for name in REPLICATION_PARTS:
        parts[name] = [weight * c for c in parts[name]]
    model.meta = {**model.meta, "step_parts": parts, "calibration": {"replication_weight": weight, "fitted_on": list(runs)}}
    model.save(out)


if __name__ == "__main__":
    main()
