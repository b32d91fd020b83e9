"""Does the model price a replicated (data-parallel) table as its kernel costs, small and large?

    python -m studies.dp_small_tables [--model cpu] [--drift 8] [--all-reduce]

For tables from a few hundred rows up to the sizes of the dp samples, at the CPU scale's
global batch (4,096) on D = 2, 4, 8: the step parts' predicted dense kernel (``dp_fwd`` +
``dp_bwd``, ``stepcost.data_parallel_ms``) against ``measure_replicated_compute`` now, on
rank 0's local batch (what the evaluator times). ``--all-reduce`` also measures the
gradient all-reduce on D gloo ranks beside its predicted ``all_reduce``.

The machine's speed drifts between sessions: ``--drift N`` first re-measures the first N
stored dp samples of ``cpu_step_dp.jsonl.gz`` (their own draw and bags) and prints now/stored,
so ratios predicted/measured can be read against the machine of the data. Writes
benchmarks/results/dp_small_tables.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import statistics
from pathlib import Path

import torch

from torchrec_neuroshard.access import uniform_access_histogram
from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.lab.collect import PoolLookups, iter_kind, read_rows
from torchrec_neuroshard.lab.collect_step import _dp_row, draw_dp
from torchrec_neuroshard.lab.evaluate import _local_lookups
from torchrec_neuroshard.lab.launch import spawn
from torchrec_neuroshard.lab.measure_comm import Exchange, measure_exchanges
from torchrec_neuroshard.lab.measure_compute import measure_replicated_compute
from torchrec_neuroshard.lab.workloads import WorkloadScale, lookups_for, synthetic_pool
from torchrec_neuroshard.stepcost import data_parallel_ms
from torchrec_neuroshard.types import TableSpec

HERE = Path(__file__).parent
DATA = HERE.parent / "torchrec_neuroshard" / "lab" / "data" / "cpu_step_dp.jsonl.gz"
TABLES = [  # (rows, dim, pooling factor): tiny tables first, then sizes the dp samples hold
    (100, 16, 1.0),
    (500, 32, 4.0),
    (1_000, 64, 10.0),
    (5_000, 16, 2.0),
    (5_000, 64, 10.0),
    (50_000, 64, 5.0),
    (200_000, 128, 10.0),
]
WORLD_SIZES = (2, 4, 8)


def _all_reduce_worker(rank: int, world_size: int, numel: int) -> float:
    ms, _ = measure_exchanges([Exchange("all_reduce", ((numel,),))], torch.device("cpu"))
    return max(ms)


def _drift(samples: int) -> list[float]:
    """now / stored fwd+bwd ms of the first ``samples`` stored dp samples at D = 2."""
    scale, pool = WorkloadScale(), synthetic_pool()
    bank = PoolLookups(pool, scale)
    ratios = []
    for r in [r for r in iter_kind(read_rows(DATA), "dp") if r["world_size"] == 2][:samples]:
        now = _dp_row(draw_dp(pool, scale, 2, 0, r["group"]), bank, 2, torch.device("cpu"), 3, 7)
        ratios.append((now["fwd_ms"] + now["bwd_ms"]) / (r["fwd_ms"] + r["bwd_ms"]))
    return ratios


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cpu")
    p.add_argument("--drift", type=int, default=8, help="stored dp samples to re-measure first (0: none)")
    p.add_argument("--all-reduce", action="store_true", help="also measure the gradient all-reduce on D gloo ranks")
    p.add_argument("--out", default=str(HERE / "results" / "dp_small_tables.md"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    device, batch = torch.device("cpu"), WorkloadScale().batch_size
    parts = load_pretrained(args.model).step_parts
    load = os.getloadavg()[0]
    lines = []
    if args.drift:
        ratios = _drift(args.drift)
        lines.append(
            f"Machine drift: {len(ratios)} stored dp samples (D=2) re-measured now / stored fwd+bwd: "
            f"median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}.\n"
        )
        print(lines[-1], flush=True)
    ar = " | all_reduce pred ms | all_reduce meas ms" if args.all_reduce else ""
    lines += [
        f"| rows | dim | pooling | D | weights MB | kernel pred ms (fwd + bwd) | kernel meas ms (fwd + bwd) | pred / meas{ar} |",
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if args.all_reduce else ""),
    ]
    for rows, dim, pooling in TABLES:
        table = TableSpec(f"t{rows}x{dim}", rows, dim, pooling, tuple(uniform_access_histogram(rows, pooling * batch)))
        bags = lookups_for(table, batch, seed=0)
        for d in WORLD_SIZES:
            local = batch // d
            pred = data_parallel_ms(parts, [table], local * d, d)
            m = measure_replicated_compute([table], {table.name: _local_lookups(bags, 0, local)}, device, 3, 7)
            kp, km = pred["dp_fwd"] + pred["dp_bwd"], m.fwd.median_ms + m.bwd.median_ms
            row = (
                f"| {rows} | {dim} | {pooling:g} | {d} | {rows * dim * 4 / 1e6:.3f} | {kp:.3f} ({pred['dp_fwd']:.3f} + {pred['dp_bwd']:.3f}) "
                f"| {km:.3f} ({m.fwd.median_ms:.3f} + {m.bwd.median_ms:.3f}) | {kp / km:.2f} |"
            )
            if args.all_reduce:
                measured = spawn(_all_reduce_worker, d, rows * dim)[0]
                row += f" {pred['all_reduce']:.3f} | {measured:.3f} |"
            lines.append(row)
            print(row, flush=True)
    text = (
        f"# Replicated tables: predicted vs measured ({args.model} model)\n\n"
        f"Date: {datetime.date.today()}, load average {load:.1f} before. `python -m studies.dp_small_tables "
        f"{' '.join(argv) if argv is not None else ' '.join(sys.argv[1:])}` (one thread, batch {batch}, "
        "uniform access, rank 0's local batch).\n\n" + "\n".join(lines) + "\n"
    )
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
