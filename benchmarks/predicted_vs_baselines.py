"""Predicted embedding cost of NeuroShard's plans against the baselines' (no measuring).

    python -m benchmarks.predicted_vs_baselines

Over the committed suite (benchmarks/tasks/suite.json), every plan is scored by the
shipped cost model; prints per (T, D) the geometric mean of each planner's predicted cost
relative to NeuroShard's, and how often NeuroShard's is the lowest. This is what the
search optimises; benchmarks/compare.py says whether the prediction holds when measured.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from benchmarks.compare import HERE, LABELS, load_suite, plan_task
from torchrec_neuroshard.heuristics import BASELINES
from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.search import predicted_breakdown

PLANNERS = ("neuroshard", "neuroshard_nolocal", "neuroshard_prototype", "torchrec", *BASELINES)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--suite", type=Path, default=HERE / "tasks" / "suite.json")
    args = p.parse_args(argv)
    model = load_pretrained()
    by_size: dict[tuple[int, int], list[dict[str, float]]] = {}
    for task in load_suite(args.suite):
        costs = {}
        for name in PLANNERS:
            try:
                plan = plan_task(name, task, model)
                plan.validate(task)
                costs[name] = predicted_breakdown(model, task, plan)[0]
            except Exception:  # noqa: BLE001 - an invalid plan has no predicted cost
                costs[name] = math.nan
        by_size.setdefault((len(task.tables), task.num_devices), []).append(costs)
    print("| T, D | " + " | ".join(LABELS[n] for n in PLANNERS) + " | NeuroShard lowest |")
    print("|---|" + "---|" * (len(PLANNERS) + 1))
    for size, rows in sorted(by_size.items()):
        cells = []
        for name in PLANNERS:
            ratios = [r[name] / r["neuroshard"] for r in rows if not math.isnan(r[name])]
            cells.append(f"{math.exp(statistics.mean(math.log(x) for x in ratios)):.3f}" if ratios else "n/a")
        lowest = sum(all(r["neuroshard"] <= r[n] + 1e-9 for n in PLANNERS if not math.isnan(r[n])) for r in rows)
        print(f"| {size[0]}, {size[1]} | " + " | ".join(cells) + f" | {lowest}/{len(rows)} |")
    print(
        "\nCells: geometric mean of predicted cost / NeuroShard's predicted cost (> 1: worse than "
        "NeuroShard); invalid plans left out. TorchRec's plans replicate some tables (data_parallel), "
        "which the model does not price (no local-batch kernel or gradient all-reduce term), so its "
        "predicted figures are optimistic; compare.md has them measured (TorchRec at its per-rank batch)."
    )


if __name__ == "__main__":
    main()
