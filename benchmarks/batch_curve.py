"""How a kernel's cost follows the batch, against the shipped CPU model's linear scaling.

    python -m benchmarks.batch_curve [--samples 24]

The shipped CPU compute model was trained at one batch (4,096) and prices another batch B
by scaling its prediction by B / 4,096 (``NeuralCostModel.with_batch_size``). Here the same
kernels are MEASURED at 1/16x to 16x that batch on this CPU (one thread): compute samples
of the synthetic pool at the CPU scale (rows / 64; seed 7, never trained on), each timed at
every batch in turn, its tables' access histograms those of that batch, as the planner
would see them. Per batch: the MAPE and median ratio of the model's scaled prediction to
the measurement. Rows append to ``results/batch_curve.jsonl`` (resumable); the table goes
to ``results/batch_curve.md``. Run it on a quiet machine: other work inflates timings.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.lab.collect import append_rows, draw_compute_sample, read_rows
from torchrec_neuroshard.lab.measure_compute import measure_compute
from torchrec_neuroshard.lab.workloads import WorkloadScale, synthetic_pool, table_spec
from torchrec_neuroshard.types import Shard

HERE = Path(__file__).parent
OUT = HERE / "results" / "batch_curve.jsonl"
TRAINED_BATCH = 4096
BATCHES = tuple(int(TRAINED_BATCH * f) for f in (1 / 16, 1 / 4, 1, 4, 16))
SEED = 7
TABLES = (1, 8)


def measure_sample(index: int, seed: int = SEED) -> list[dict]:
    """Sample ``index`` of ``seed`` measured at every batch, with the shipped model's prediction."""
    pool = synthetic_pool()
    sample = draw_compute_sample(pool, WorkloadScale(64, TRAINED_BATCH), seed, index, tables=TABLES)
    model = load_pretrained("cpu")
    rows = []
    for batch in BATCHES:
        scale = WorkloadScale(64, batch)
        shards, lookups = [], {}
        for k, (i, width) in enumerate(zip(sample.table_ids, sample.widths)):
            spec = table_spec(pool[i], width, scale, name=f"{pool[i].name}_{k}")
            shards.append(Shard(spec, width))
            lookups[spec.name] = pool[i].lookups(scale, seed=i)
        m = measure_compute(shards, lookups, torch.device("cpu"), warmup=2, repeats=5, num_threads=1)
        fwd, bwd = model.with_batch_size(batch).compute_cost([shards])[0]
        rows.append({"sample": index, "batch_size": batch, "tables": len(shards), "measured_ms": m.total_ms, "predicted_ms": float(fwd + bwd)})
    return rows


def report(rows: list[dict]) -> str:
    lines = [
        "| batch (x trained) | samples | MAPE of the linear scaling | median predicted / measured |",
        "|---|---|---|---|",
    ]
    for batch in BATCHES:
        rs = [r for r in rows if r["batch_size"] == batch]
        if not rs:
            continue
        errors = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in rs]
        ratio = statistics.median(r["predicted_ms"] / r["measured_ms"] for r in rs)
        lines.append(f"| {batch:,} ({batch / TRAINED_BATCH:g}x) | {len(rs)} | {100 * statistics.fmean(errors):.1f}% | {ratio:.2f} |")
    return "\n".join(lines)


def collect(path: Path, samples: int, seed: int = SEED) -> list[dict]:
    """Samples [0, ``samples``) of ``seed`` at every batch (one thread), those not yet in
    ``path`` measured and appended; all of its rows."""
    torch.set_num_threads(1)
    done = {r["sample"] for r in read_rows(path)}
    for index in tqdm(range(samples), desc="samples"):
        if index not in done:
            append_rows(path, measure_sample(index, seed))
    return read_rows(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=24)
    args = p.parse_args(argv)
    text = report(collect(OUT, args.samples))
    (HERE / "results" / "batch_curve.md").write_text(
        "# Kernel cost against the batch: the shipped CPU model's linear scaling, MEASURED\n\n"
        f"`python -m benchmarks.batch_curve --samples {args.samples}` ({time.strftime('%Y-%m-%d')}; "
        f"{load_pretrained('cpu').hardware.describe()}, one thread; compute samples of seed {SEED}, "
        f"{TABLES[0]}-{TABLES[1]} tables each, every one at every batch)\n\n" + text + "\n"
    )
    print(text)


if __name__ == "__main__":
    main()
