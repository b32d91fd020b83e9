"""Does a kernel correction fitted on device-sized kernels price the small ones worse?

    python -m studies.correction_scope --models cpu runs/cpu_work.pt

``lab.kernel_correction`` fits its slope on kernels of 16-128 tables timed in pairs; a
model file carrying it multiplies every pooled kernel's price, the shipped data's 1-15
table kernels too (the 2-rank DMP step's devices hold 3-10 tables). On the held-out test
split of the shipped CPU model's kernels (the split ``benchmarks.costmodel`` scores: at
4,096, and the batch shift's at 256-65,536), each model prices every kernel as the
planner does (``kernel_ms``); printed per table count: MAPE, Spearman and the median of
predicted / measured. A correction that helps devices but hurts these kernels should be
kept to the range it was fitted on. Measures nothing: pure pricing, any machine.
"""

from __future__ import annotations

import argparse
from typing import Sequence

import torch

from benchmarks.costmodel import CPU_DATA, CPU_SHIFT_DATA, DATA_DIR, held_out_kernels, kernel_prices
from torchrec_neuroshard.costmodel import NeuralCostModel, model_named
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.training import mape, spearman

BUCKETS = ((1, 4), (5, 8), (9, 15))
"""Table counts a kernel holds, reported apart."""


def held_out(files: Sequence[str], seed: int) -> list[dict]:
    """The held-out pooled kernels of the data files ``files``, split over all their rows."""
    return held_out_kernels([r for name in files for r in read_rows(DATA_DIR / name)], seed)


def scores(model: NeuralCostModel, rows: Sequence[dict]) -> str:
    """'MAPE %, Spearman, median predicted / measured' of ``model``'s prices of ``rows``."""
    if len(rows) < 3:
        return "-"
    truth = torch.tensor([r["fwd_ms"] + r["bwd_ms"] for r in rows], dtype=torch.float64)  # [N]
    priced = kernel_prices(model, rows)  # [N]
    return f"{mape(priced, truth):.1f}%, {spearman(priced, truth):.3f}, {float((priced / truth).median()):.3f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["cpu"], help="model files or shipped names")
    args = p.parse_args(argv)
    models = {name: model_named(name) for name in args.models}
    seed = int(next(iter(models.values())).meta.get("seed", 0))
    sets = {"at 4,096": held_out(CPU_DATA, seed), "at 256-65,536 (batch shift's)": held_out(CPU_SHIFT_DATA, seed)}
    print("MAPE, Spearman, median predicted / measured of each held-out kernel set, priced as the planner prices (`kernel_ms`)\n")
    print(f"| kernels | tables | count | {' | '.join(models)} |")
    print("|---|---|---|" + "---|" * len(models))
    for label, rows in sets.items():
        for low, high in (*BUCKETS, (1, max(len(r["shards"]) for r in rows))):
            mine = [r for r in rows if low <= len(r["shards"]) <= high]
            print(f"| {label} | {low}-{high} | {len(mine)} | {' | '.join(scores(m, mine) for m in models.values())} |")


if __name__ == "__main__":
    main()
