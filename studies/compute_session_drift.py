"""Does a compute sample cost now what its stored row says?

    python -m studies.compute_session_drift [--samples 12]

Re-measures the first N samples of the shipped CPU compute data (``collect compute``'s own
draw, bags and kernel, one thread) and prints, per sample, the stored and the current
fwd+bwd ms, their ratio, and the shipped model's prediction: a machine that slowed
unevenly since the data were collected shows ratios that vary with the kernel, which no
single rescale of the model can follow. Writes benchmarks/results/compute_session_drift.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
from pathlib import Path

import torch

from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.lab.collect import PoolLookups, draw_compute_sample, iter_kind, read_rows
from torchrec_neuroshard.lab.measure_compute import measure_compute
from torchrec_neuroshard.lab.workloads import WorkloadScale, synthetic_pool

HERE = Path(__file__).parent
DATA = HERE.parent / "torchrec_neuroshard" / "lab" / "data" / "cpu_compute.jsonl.gz"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=12)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    rows = list(iter_kind(read_rows(DATA), "compute"))[: args.samples]
    scale, pool = WorkloadScale.for_device(device), synthetic_pool()
    bank = PoolLookups(pool, scale)
    model = load_pretrained("cpu")
    load = os.getloadavg()[0]
    lines = ["| sample | tables | stored ms | now ms | now / stored | predicted ms |", "|---|---|---|---|---|---|"]
    ratios = []
    for r in rows:
        shards, lookups = bank.shards(draw_compute_sample(pool, scale, 0, r["group"]))
        m = measure_compute(shards, lookups, device, 5, 10, 1)
        stored, now = r["fwd_ms"] + r["bwd_ms"], m.fwd.median_ms + m.bwd.median_ms
        ratios.append(now / stored)
        lines.append(
            f"| {r['group']} | {len(shards)} | {stored:.2f} | {now:.2f} | {now / stored:.2f} | {sum(model.compute_cost([shards])[0]):.2f} |"
        )
        print(lines[-1], flush=True)
    text = (
        "# Compute drift between sessions\n\n"
        f"Date: {datetime.date.today()}, load average {load:.1f} before. `python -m studies.compute_session_drift "
        f"--samples {args.samples}` (one thread).\n\n" + "\n".join(lines) + "\n\n"
        f"now / stored: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}.\n"
    )
    (HERE / "results" / "compute_session_drift.md").write_text(text)
    print(text.splitlines()[-1])


if __name__ == "__main__":
    main()
