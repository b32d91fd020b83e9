"""Can a learned correction replace the CPU model's linear batch scaling? (issue 28)

    python -m studies.batch_correction [--samples 150]

``benchmarks.batch_curve`` measured 60 compute samples (seed 7) at 1/16x-16x the trained
batch against ``cpu.pt`` scaled linearly. Here the same measurement on other samples (seed
8, ``--samples``, kept in ``results/batch_correction_train.jsonl``, resumable) fits a
correction of the linear scaling, log(measured / scaled prediction) = r (a + b log C + c n
+ d r) with r = log(batch / 4,096), C the prediction at the trained batch and n the
kernel's tables: 1 at the trained batch by construction, so it could ride in the model
file without changing any plan at 4,096. Scored on batch_curve's seed-7 samples, which it
never saw: MAPE per batch, linear beside corrected. Writes results/batch_correction.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.batch_curve import BATCHES, OUT as HELD_OUT, TRAINED_BATCH, collect
from torchrec_neuroshard.lab.collect import read_rows

HERE = Path(__file__).parent
TRAIN = HERE / "results" / "batch_correction_train.jsonl"
SEED = 8


def features(rows: list[dict]) -> np.ndarray:
    """[N, 4] r, r log C, r n, r^2 of each row (r = log(batch / trained batch))."""
    r = np.log(np.asarray([x["batch_size"] for x in rows]) / TRAINED_BATCH)  # [N]
    trained = np.asarray([x["predicted_ms"] for x in rows]) / np.exp(r)  # [N] the prediction at the trained batch
    n = np.asarray([x["tables"] for x in rows], dtype=float)  # [N]
    return np.stack([r, r * np.log(trained), r * n, r * r], axis=1)


def fit(rows: list[dict]) -> np.ndarray:
    y = np.log([x["measured_ms"] / x["predicted_ms"] for x in rows])  # [N]
    coef, *_ = np.linalg.lstsq(features(rows), y, rcond=None)
    return coef


def report(coef: np.ndarray, rows: list[dict], trained_on: int) -> str:
    corrected = np.asarray([x["predicted_ms"] for x in rows]) * np.exp(features(rows) @ coef)
    lines = ["| batch (x trained) | samples | MAPE linear | MAPE corrected |", "|---|---|---|---|"]
    for batch in BATCHES:
        idx = [i for i, x in enumerate(rows) if x["batch_size"] == batch]
        measured = [rows[i]["measured_ms"] for i in idx]
        linear = statistics.fmean(abs(rows[i]["predicted_ms"] - m) / m for i, m in zip(idx, measured))
        fixed = statistics.fmean(abs(corrected[i] - m) / m for i, m in zip(idx, measured))
        lines.append(f"| {batch:,} ({batch / TRAINED_BATCH:g}x) | {len(idx)} | {100 * linear:.1f}% | {100 * fixed:.1f}% |")
    return "\n".join(lines) + f"\n\nFitted on {trained_on} rows of seed {SEED}; coefficients (a, b, c, d) = {np.round(coef, 4).tolist()}."


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=150)
    args = p.parse_args(argv)
    train, held = collect(TRAIN, args.samples, SEED), read_rows(HELD_OUT)
    coef = fit(train)
    text = report(coef, held, len(train))
    (HERE / "results" / "batch_correction.md").write_text(
        f"# A learned batch correction, scored on held-out samples\n\n`python -m studies.batch_correction --samples {args.samples}` "
        f"({time.strftime('%Y-%m-%d')}, this CPU, one thread; held out: benchmarks/results/batch_curve.jsonl)\n\n" + text + "\n"
    )
    print(text)


if __name__ == "__main__":
    main()
