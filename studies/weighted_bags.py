"""What do per-id weights cost a fused kernel? Weighted bags (an EmbeddingBagCollection with
``is_weighted=True``, a feature-processed one's position weights) against the same bags
unweighted, on the same kernel.

    python -m studies.weighted_bags [--samples 40] [--rounds 9] [--seed 11]

Each sample is a compute sample of training pool ``--seed`` (``draw_compute_sample``, CPU
scale); its one fused TBE steps (forward, backward with the update) with and without
``per_sample_weights``, the two alternated ``--rounds`` times in turn-about order, one core.
Per sample the ratio weighted / unweighted of the medians; printed: their median and 10-90%
spread, by how many tables the kernel fuses. Appends rows (resumable) to
studies/results/weighted_bags.jsonl and writes studies/results/weighted_bags.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from torchrec_neuroshard.lab.collect import PoolLookups, draw_compute_sample
from torchrec_neuroshard.lab.measure_compute import build_kernel, concat_lookups, cpu_threads, time_forward_backward
from torchrec_neuroshard.lab.workloads import TRAINING_POOL_SEEDS, WorkloadScale, synthetic_pool

RESULTS = Path(__file__).parent / "results"


def measure_sample(shards: list, lookups: dict, rounds: int) -> tuple[float, float]:
    """Median ms (forward + backward) of the kernel's step unweighted and weighted."""
    device = torch.device("cpu")
    with cpu_threads(1):
        kernel = build_kernel(shards, device)
        indices, offsets = concat_lookups([lookups[s.table.name] for s in shards], device)
        weights = torch.rand(indices.numel(), generator=torch.Generator().manual_seed(0))  # [lookups]
        grad = torch.ones((offsets.numel() - 1) // len(shards), sum(s.width for s in shards))  # [batch, width sum]
        steps = [(lambda: kernel(indices, offsets)), (lambda: kernel(indices, offsets, per_sample_weights=weights))]
        times: list[list[float]] = [[], []]
        for r in range(rounds + 2):  # two untimed rounds first
            for k in (0, 1) if r % 2 == 0 else (1, 0):
                m = time_forward_backward(steps[k], lambda out: out.backward(grad), device, 0, 1)
                if r >= 2:
                    times[k].append(m.total_ms)
    return statistics.median(times[0]), statistics.median(times[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--seed", type=int, default=11, choices=TRAINING_POOL_SEEDS)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    rows_path = RESULTS / "weighted_bags.jsonl"
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    scale = WorkloadScale.for_device(torch.device("cpu"))
    pool = synthetic_pool(seed=args.seed)
    bank = PoolLookups(pool, scale)
    with rows_path.open("a") as out:
        for index in tqdm(range(len(rows), args.samples), initial=len(rows), total=args.samples, desc="weighted vs unweighted"):
            shards, lookups = bank.shards(draw_compute_sample(pool, scale, args.seed, index))
            plain, weighted = measure_sample(shards, lookups, args.rounds)
            row = {"seed": args.seed, "index": index, "tables": len(shards), "unweighted_ms": round(plain, 5), "weighted_ms": round(weighted, 5)}
            out.write(json.dumps(row) + "\n")
            out.flush()
            rows.append(row)
    report = render(rows, args)
    (RESULTS / "weighted_bags.md").write_text(report)
    print(report)


def render(rows: list[dict], args: argparse.Namespace) -> str:
    def line(label: str, chosen: list[dict]) -> str:
        if not chosen:
            return f"| {label} | 0 | - | - |"
        ratios = np.array([r["weighted_ms"] / r["unweighted_ms"] for r in chosen])
        low, high = np.percentile(ratios, [10, 90])
        return f"| {label} | {len(chosen)} | {np.median(ratios):.3f} | {low:.3f}-{high:.3f} |"

    lines = [
        "# Weighted bags against unweighted, same fused kernel (CPU, one core)",
        "",
        f"`python -m studies.weighted_bags --samples {args.samples} --rounds {args.rounds} --seed {args.seed}` "
        f"(training pool {args.seed}, CPU scale).",
        "",
        "| kernels | samples | weighted / unweighted, median | 10-90% |",
        "|---|---|---|---|",
        line("all", rows),
        line("1-5 tables", [r for r in rows if r["tables"] <= 5]),
        line("6-15 tables", [r for r in rows if r["tables"] > 5]),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
