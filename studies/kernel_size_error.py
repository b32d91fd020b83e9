"""How far off is the compute model on kernels fusing more tables than its samples held?

    python -m studies.kernel_size_error [--samples 60] [--large 16 32] [--model PATH]

Collects two sets of fresh compute samples on this machine, interleaved in chunks so that
both see the same hour: kernels of 1-15 tables (the shipped data's range; seed 11, draws
the model never saw) and kernels of ``--large`` tables (seed 12), with ``collect compute``'s
own draw, bags and kernel (one thread; ``--data-dir`` keeps them, and a re-run resumes).
Per set: the median of measured / predicted fwd+bwd (the session's drift, shared by both
sets), and the MAPE after dividing every prediction's error by the in-range set's median
ratio, i.e. with that shared drift taken out: what is left on the large set beyond the
in-range one is the model's error on kernels it never saw. Writes
benchmarks/results/kernel_size_error.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
from pathlib import Path

import numpy as np
import torch

from torchrec_neuroshard.costmodel import NeuralCostModel, load_pretrained
from torchrec_neuroshard.lab.collect import MAX_TABLES_PER_SAMPLE, collect_compute, iter_kind, read_rows, shard_from_record

HERE = Path(__file__).parent
SEEDS = {"within": 11, "large": 12}


def ratios(model: NeuralCostModel, rows: list[dict]) -> np.ndarray:
    """measured / predicted fwd+bwd ms of each compute row."""
    out = []
    for r in rows:
        shards = [shard_from_record(s) for s in r["shards"]]
        predicted = sum(model.with_batch_size(r["batch_size"]).compute_cost([shards])[0])
        out.append((r["fwd_ms"] + r["bwd_ms"]) / predicted)
    return np.asarray(out)


def summary(name: str, tables: str, r: np.ndarray, drift: float) -> str:
    """One table line: the set, its rows, the median ratio and its quartiles, the MAPE
    with the in-range drift taken out."""
    q1, q3 = np.percentile(r, [25, 75])
    mape = 100 * float(np.mean(np.abs(r / drift - 1)))
    return f"| {name} | {tables} | {len(r)} | {np.median(r):.2f} ({q1:.2f}-{q3:.2f}) | {mape:.1f}% |"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=60, help="samples per set")
    p.add_argument("--chunk", type=int, default=10, help="samples of one set before the other's turn")
    p.add_argument("--large", type=int, nargs=2, default=[16, 32], metavar=("LOW", "HIGH"))
    p.add_argument("--model", help="model file (default: the shipped cpu model)")
    p.add_argument("--data-dir", default="runs/kernel_size", help="where the samples are kept (resumes)")
    p.add_argument("--name", default="kernel_size_error")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    ranges = {"within": (1, MAX_TABLES_PER_SAMPLE), "large": tuple(args.large)}
    files = {k: Path(args.data_dir) / f"{k}_{ranges[k][0]}-{ranges[k][1]}.jsonl" for k in ranges}
    load = os.getloadavg()[0]
    for n in range(args.chunk, args.samples + args.chunk, args.chunk):
        for k in ranges:
            collect_compute(files[k], min(n, args.samples), device, seed=SEEDS[k], tables=ranges[k], progress=False)
        print(f"{min(n, args.samples)} of {args.samples} samples per set", flush=True)
    model = NeuralCostModel.load(args.model) if args.model else load_pretrained("cpu")
    rows = {k: list(iter_kind(read_rows(f), "compute"))[: args.samples] for k, f in files.items()}
    r = {k: ratios(model, v) for k, v in rows.items()}
    drift = float(np.median(r["within"]))
    lines = [
        "| set | tables per kernel | samples | measured / predicted, median (quartiles) | MAPE, in-range drift taken out |",
        "|---|---|---|---|---|",
        *(summary(k, f"{ranges[k][0]}-{ranges[k][1]}", r[k], drift) for k in ranges),
    ]
    by_size = {}
    for k in ranges:
        for row, x in zip(rows[k], r[k]):
            by_size.setdefault(len(row["shards"]) // 4 * 4, []).append(x / drift)
    size_lines = ["| tables | samples | measured / predicted / in-range drift, median |", "|---|---|---|"] + [
        f"| {s}-{s + 3} | {len(v)} | {statistics.median(v):.2f} |" for s, v in sorted(by_size.items())
    ]
    text = (
        "# The compute model on kernels of more tables than its samples\n\n"
        f"Date: {datetime.date.today()}, load average {load:.1f} before; model: {args.model or 'shipped cpu.pt'} "
        f"(trained on kernels of up to {model.meta.get('max_tables_per_kernel')} tables). "
        f"`python -m studies.kernel_size_error --samples {args.samples} --large {args.large[0]} {args.large[1]}"
        f"{' --model ' + args.model if args.model else ''}` (one thread, sets interleaved in chunks of {args.chunk}).\n\n"
        + "\n".join(lines) + "\n\n" + "\n".join(size_lines) + "\n"
    )
    (HERE / "results" / f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
