"""Does a world size cost what its stored samples say, measured now beside the others?

    python -m studies.comm_session_drift [--data runs/cpu_comm.jsonl] [--samples 10]

Re-measures comm samples 0..N-1 of every world size in the data back to back (same
machine state for all), and prints per D the median ratio of now / stored fwd+bwd ms: a
world size collected in another session (another machine load) shows a ratio unlike the
others', which a held-out-world-size test would mistake for the world size's own cost.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from torchrec_neuroshard.lab.collect import draw_comm_sample, iter_kind, read_rows
from torchrec_neuroshard.lab.launch import spawn
from torchrec_neuroshard.lab.measure_comm import measure_comm
from torchrec_neuroshard.lab.workloads import WorkloadScale, divisible_batch


def _worker(rank: int, world: int, n: int, batch: int) -> list[list[float]]:
    out = []
    for i in range(n):
        s = draw_comm_sample(world, 0, i)
        m = measure_comm(s.dims, s.skews_ms, batch, torch.device("cpu"))
        out.append([f + b for f, b in zip(m.fwd_ms, m.bwd_ms)])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="torchrec_neuroshard/lab/data/cpu_comm.jsonl.gz")
    p.add_argument("--samples", type=int, default=10)
    args = p.parse_args(argv)
    rows = list(iter_kind(read_rows(args.data), "comm"))
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for d in sorted({r["world_size"] for r in rows}):
        now = spawn(_worker, d, args.samples, divisible_batch(WorkloadScale().batch_size, d))[0]
        stored = {r["group"]: [f + b for f, b in zip(r["fwd_ms"], r["bwd_ms"])] for r in rows if r["world_size"] == d}
        ratios = [a / b for i in range(args.samples) for a, b in zip(now[i], stored[i])]
        print(
            f"D={d}: now / stored fwd+bwd ms, median {statistics.median(ratios):.2f}; median now "
            f"{statistics.median(x for v in now for x in v):.1f} ms, stored "
            f"{statistics.median(x for i in range(args.samples) for x in stored[i]):.1f} ms",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
