"""The transfer curve: held-out error on new hardware against the calibration samples.

    python -m benchmarks.transfer

For each transfer, base model -> another machine's measured compute samples:
  - cpu.pt (AMD EPYC, CPU scale) -> NVIDIA H200 (lab/data/h200_compute.jsonl.gz, full size)
  - cpu.pt (AMD EPYC)            -> Intel Xeon (lab/data/intel_xeon_compute.jsonl.gz)
a fixed test split (``--test-share`` of the target's sample groups, seed 0) is never used
for calibration. For n in ``--counts``, the first n of the other samples in calibration's
covering order (``lab.coverage.covering_rows``) fine-tune the base (``fine_tune``, the
code ``neuroshard calibrate`` runs), and the test split is scored: fwd+bwd MAPE and
Spearman, mean over ``--seeds`` fine-tuning seeds, and the fine-tune's wall time (one
thread). n = 0 is the base as shipped, beside its best single rescale (the median ratio,
fitted on the test split itself: an optimistic bound for a scale-only calibration). For
comparison, a model trained from scratch on the same n samples (``train_compute``).
Target: <= 10% MAPE from <= 300 samples, calibration under 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.hardware import Hardware, local_hardware
from torchrec_neuroshard.lab.fine_tune import fine_tune
from torchrec_neuroshard.lab.collect import iter_kind, read_rows
from torchrec_neuroshard.lab.coverage import covering_rows
from torchrec_neuroshard.lab.training import compute_metrics, mape, spearman, train_compute
from torchrec_neuroshard.lab.training_data import load_compute_data, split_by_group

DATA = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data"
TARGETS = {"H200": DATA / "h200_compute.jsonl.gz", "Intel Xeon": DATA / "intel_xeon_compute.jsonl.gz"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="cpu", help="shipped model to calibrate from")
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--counts", type=int, nargs="+", default=[0, 50, 100, 200, 300, 400, -1], help="-1: all")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--test-share", type=float, default=0.3)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    base = load_pretrained(args.base)
    print(f"Base model: {args.base}.pt, measured on {base.hardware.describe()}; this machine: {local_hardware('cpu').describe()}\n")
    print("| target | calibration samples | test MAPE % (mean, min-max over seeds) | test Spearman | fine-tune s (one thread) | from scratch on the same samples: MAPE % / Spearman |")
    print("|---|---|---|---|---|---|")
    for target in args.targets:
        rows = list(iter_kind(read_rows(TARGETS[target]), "compute"))
        hw = Hardware.from_record(rows[0]["hardware"])
        data = load_compute_data(rows, reads_batch=base.compute_net.reads_batch)
        pool_mask, _, test_mask = split_by_group(data.group, 0, (1.0 - args.test_share, 1.0 - args.test_share))
        test = data.subset(test_mask)
        pool_rows = [r for r, keep in zip(rows, pool_mask) if keep]
        name = f"{target} ({hw.name}, {len(test)} test samples)"
        m0 = compute_metrics(base.compute_net, base.compute_norm, test)
        with torch.no_grad():
            pred = base.compute_net(base.compute_norm(test.x), test.sample, len(test)).exp().sum(1)
        truth = test.y.sum(1)
        scale = float((truth / pred).median())
        print(
            f"| {name} | 0 (as shipped) | {m0['mape_total']:.1f} | {m0['spearman_total']:.3f} | - | - |\n"
            f"| {name} | 0, best single rescale (x{scale:.3g}) | {mape(pred * scale, truth):.1f} | {spearman(pred, truth):.3f} | - | - |",
            flush=True,
        )
        for n in args.counts:
            if n == 0:
                continue
            chosen = pool_rows if n < 0 or n >= len(pool_rows) else covering_rows(pool_rows, n)
            mapes, rhos, secs, scratch = [], [], [], []
            for seed in range(args.seeds):
                t0 = time.perf_counter()
                tuned = fine_tune(base, chosen, seed=seed, progress=False)
                secs.append(time.perf_counter() - t0)
                m = compute_metrics(tuned.compute_net, tuned.compute_norm, test)
                mapes.append(m["mape_total"])
                rhos.append(m["spearman_total"])
                cal = load_compute_data(chosen, reads_batch=base.compute_net.reads_batch)
                tr, va, _ = split_by_group(cal.group, seed, (0.8, 1.0))
                net, norm, _ = train_compute(cal.subset(tr), cal.subset(va), 200, seed, progress=False)
                scratch.append(compute_metrics(net, norm, test))
            label = f"all {len(chosen)}" if len(chosen) == len(pool_rows) else str(len(chosen))
            print(
                f"| {name} | {label} | {statistics.mean(mapes):.1f} ({min(mapes):.1f}-{max(mapes):.1f}) "
                f"| {statistics.mean(rhos):.3f} | {statistics.median(secs):.1f} "
                f"| {statistics.mean(s['mape_total'] for s in scratch):.1f} / "
                f"{statistics.mean(s['spearman_total'] for s in scratch):.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
