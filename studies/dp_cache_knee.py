"""Which table size separates cached from uncached forward lookups of a replicated table?

    python -m studies.dp_cache_knee [--data torchrec_neuroshard/lab/data/cpu_step_dp.jsonl.gz]

Fits ``dp_fwd`` (as ``fit_step_parts`` does: non-negative, relative error, train split by
sample group) with ``lookup_mb_over_cache`` at each candidate knee, and without it, and
scores each on the validation split ("dp" and "dp_small" rows apart): the knee
``steparts.DP_CACHED_TABLE_MB`` is the one chosen here. Writes
benchmarks/results/dp_cache_knee.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.collect_step import DP_KINDS
from torchrec_neuroshard.lab.training import mape
from torchrec_neuroshard.lab.training_data import split_by_group, step_group
from torchrec_neuroshard.steparts import DP_CACHED_TABLE_MB, LinearPart, dp_features

HERE = Path(__file__).parent
DATA = HERE.parent / "torchrec_neuroshard" / "lab" / "data" / "cpu_step_dp.jsonl.gz"
KNEES_MB = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=HERE / "results" / "dp_cache_knee.md")
    args = p.parse_args(argv)
    rows = [r for r in read_rows(args.data) if r.get("kind") in DP_KINDS]
    small = np.asarray([r["kind"] == "dp_small" for r in rows])  # [N]
    group = np.asarray([step_group(r) for r in rows])  # [N]
    train, val, _ = split_by_group(group, args.seed)
    y = np.asarray([r["fwd_ms"] for r in rows])  # [N]
    lines = [
        f"# dp_fwd: the cached-table knee ({len(rows)} rows of {args.data.name}; validation split, seed {args.seed})\n",
        f"`python -m studies.dp_cache_knee`; the shipped knee is {DP_CACHED_TABLE_MB:g} MB.\n",
        "| knee MB | validation MAPE % (all) | \"dp\" | \"dp_small\" | coefficients |",
        "|---|---|---|---|---|",
    ]
    for knee in (None, *KNEES_MB):
        x = np.asarray(  # [N, features]
            [
                dp_features("dp_fwd", r["lookups"], [t["width"] for t in r["tables"]], [t["rows"] for t in r["tables"]],
                            r["local_batch"], r["tables"][0].get("bytes_per_element", 4), knee or 0.0)
                for r in rows
            ]
        )  # fmt: skip
        if knee is None:  # the form without the feature: its column left out of the fit
            x[:, 3] = 0.0
        part = LinearPart.fit("dp_fwd", x[train], y[train])
        pred = torch.from_numpy(part.predict(x))
        score = [mape(pred[m], torch.from_numpy(y[m])) for m in (val, val & ~small, val & small)]
        label = "none" if knee is None else f"{knee:g}"
        lines.append(f"| {label} | {score[0]:.1f} | {score[1]:.1f} | {score[2]:.1f} | {', '.join(f'{c:.4g}' for c in part.coef)} |")
        print(lines[-1], flush=True)
    args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
