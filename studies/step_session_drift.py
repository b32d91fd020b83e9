"""Do the step parts cost now what their stored samples say?

    neuroshard collect step --world-sizes 2 --kinds input_dist all_reduce dp dp_small \
        --samples 30 --out runs/step_now.jsonl
    python -m studies.step_session_drift runs/step_now.jsonl

``collect step`` draws sample i of a kind and world size from (seed, kind, world size, i)
alone, so a file collected now holds the very samples the shipped data hold, re-measured.
Prints per kind and world size the median and range of now / stored ms (the slowest
rank's for a collective or input distribution, forward + backward for a data-parallel
kernel), beside ``compute_session_drift``'s figure for the fused kernels: a calibrated
model re-measures the kernels but keeps the stored step parts, so where the two drift
apart, its balance between a sharded table and a replicated one drifts with them.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from torchrec_neuroshard.lab.collect import read_rows

DATA = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data"
STORED = (DATA / "cpu_step.jsonl.gz", DATA / "cpu_step_dp.jsonl.gz")
"""The shipped step samples: the collectives and input distributions, the data-parallel kernels."""


def sample_ms(row: dict) -> float:
    """The ms a step-part sample measured: forward + backward of a data-parallel kernel,
    else the slowest rank's."""
    return row["fwd_ms"] + row["bwd_ms"] if "fwd_ms" in row else row["max_ms"]


def drift(now: list[dict], stored: list[dict]) -> dict[tuple[str, int], list[float]]:
    """(kind, world size) -> now / stored ms of every sample in both, matched by its draw."""
    key = lambda r: (r["kind"], r["world_size"], r["group"])  # noqa: E731
    before = {key(r): sample_ms(r) for r in stored}
    out: dict[tuple[str, int], list[float]] = {}
    for r in now:
        if key(r) in before:
            out.setdefault(key(r)[:2], []).append(sample_ms(r) / before[key(r)])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("now", type=Path, help="a `neuroshard collect step` file measured now")
    p.add_argument("--stored", type=Path, nargs="+", default=list(STORED))
    args = p.parse_args(argv)
    ratios = drift(read_rows(args.now), [r for path in args.stored for r in read_rows(path)])
    if not ratios:
        p.error(f"no sample of {args.now} is one of the draws of {[str(s) for s in args.stored]}: pass a file `neuroshard collect step` wrote on this machine")
    print("| kind | world size | samples | now / stored (median) | range |")
    print("|---|---|---|---|---|")
    for (kind, world), r in sorted(ratios.items()):
        print(f"| {kind} | {world} | {len(r)} | {statistics.median(r):.2f} | {min(r):.2f}-{max(r):.2f} |")


if __name__ == "__main__":
    main()
