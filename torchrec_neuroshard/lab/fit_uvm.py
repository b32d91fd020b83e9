"""Fit the UVM kernels' price to measured samples, and say how well it predicts held-out ones.

    python -m torchrec_neuroshard.lab.fit_uvm --data torchrec_neuroshard/lab/data/uvm_compute_h200.jsonl.gz

``lab.measure_uvm`` timed each sample's shards as one TBE in HBM, on fused_uvm and on
fused_uvm_caching. What a UVM kernel adds to the same shards in HBM, forward and backward,
is fitted (non-negative least squares) as linear in the samples' ``uvmcost.FEATURES``,
computed from the shards' specs as the planner computes them (pooling factor, access
histogram, width, cache load factor): the planner never sees the measured lookups. 80% of
the samples (by sample, seed 0) fit, 20% are held out. Printed and stored: the held-out
MAPE of the kernel's forward+backward (the measured HBM kernel plus the fitted penalty),
beside the analytic stand-in's on the same samples and the noise floor (samples measured
twice, in one session). Writes ``pretrained/uvm.json`` (``--out``), which
``uvmcost.UvmPricing.shipped`` reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from torchrec_neuroshard.kernels import UVM_KERNELS, ComputeKernel
from torchrec_neuroshard.lab.collect import read_rows, shard_from_record
from torchrec_neuroshard.types import Shard
from torchrec_neuroshard.uvmcost import FEATURES, SHIPPED, UvmPricing, features

HOLD_OUT = 0.2
TOPOLOGY_HBM_TO_DDR = 32 * 1024**3 / 1000
"""TorchRec's default ``hbm_to_ddr_mem_bw``, bytes per ms: the stand-in's bandwidth."""


def samples(rows: list[dict]) -> dict[tuple[int, int], dict[str, dict]]:
    """Rows by (sample, round), then by kernel; samples missing a kernel are left out."""
    out: dict[tuple[int, int], dict[str, dict]] = {}
    for r in rows:
        if r.get("kind") == "uvm_compute":
            out.setdefault((r["sample"], r.get("round", 0)), {})[r["kernel"]] = r
    return {k: v for k, v in out.items() if len(v) == 1 + len(UVM_KERNELS)}


def row_shards(row: dict) -> list[Shard]:
    """A row's shards, each on the row's kernel (and cache load factor)."""
    kernel, factor = ComputeKernel(row["kernel"]), row["cache_load_factor"]
    return [replace(s, table=s.table.on_kernel(kernel, factor)) for s in map(shard_from_record, row["shards"])]


def sample_features(row: dict) -> np.ndarray:
    """The summed ``FEATURES`` of a row's shards on its kernel, [4]."""
    return np.sum([features(s, row["batch_size"]) for s in row_shards(row)], axis=0)


def split(keys: list[tuple[int, int]], seed: int = 0) -> tuple[set[int], set[int]]:
    """(fit, held-out) sample ids, by sample so a repeated sample stays on one side."""
    ids = sorted({s for s, _ in keys})
    rng = np.random.default_rng(seed)
    held = set(rng.choice(ids, size=max(1, round(HOLD_OUT * len(ids))), replace=False).tolist())
    return set(ids) - held, held


def fit(by_sample: dict, fit_ids: set[int]) -> UvmPricing:
    """NNLS per kernel and phase of the measured increment over the HBM kernel."""
    coefficients = {}
    for kernel in sorted(k.value for k in UVM_KERNELS):
        rows = [k for (s, _), k in by_sample.items() if s in fit_ids]
        x = np.stack([sample_features(k[kernel]) for k in rows])  # [S, 4]
        phases = []
        for phase in ("fwd_ms", "bwd_ms"):
            y = np.asarray([k[kernel][phase] - k["fused"][phase] for k in rows])  # [S]
            scale = np.maximum(np.asarray([k[kernel]["fwd_ms"] + k[kernel]["bwd_ms"] for k in rows]), 0.1)  # relative error
            coef, _ = nnls(x / scale[:, None], y / scale)
            phases.append(tuple(float(c) for c in coef))
        coefficients[kernel] = (phases[0], phases[1])
    return UvmPricing(coefficients, "")


def mape(pricing: UvmPricing, by_sample: dict, ids: set[int], kernel: str) -> float:
    """MAPE of forward+backward of ``kernel`` on samples ``ids``: HBM measured + penalty."""
    errors = []
    for (s, _), k in by_sample.items():
        if s in ids:
            row = k[kernel]
            predicted = k["fused"]["fwd_ms"] + k["fused"]["bwd_ms"] + float(pricing.penalty_ms(row_shards(row), row["batch_size"]).sum())
            measured = row["fwd_ms"] + row["bwd_ms"]
            errors.append(abs(predicted - measured) / measured)
    return statistics.fmean(errors)


def over_hbm(by_sample: dict, kernel: str) -> tuple[float, float]:
    """(least, most) forward+backward of ``kernel`` over the same shards' kernel in HBM."""
    ratios = [(k[kernel]["fwd_ms"] + k[kernel]["bwd_ms"]) / (k["fused"]["fwd_ms"] + k["fused"]["bwd_ms"]) for k in by_sample.values()]
    return min(ratios), max(ratios)


def noise(by_sample: dict, kernel: str) -> float:
    """Median relative difference of forward+backward between two rounds of a sample."""
    diffs = []
    for (s, round_), k in by_sample.items():
        if round_ == 1 and (s, 0) in by_sample:
            a, b = (x[kernel]["fwd_ms"] + x[kernel]["bwd_ms"] for x in (by_sample[(s, 0)], k))
            diffs.append(abs(a - b) / ((a + b) / 2))
    return statistics.median(diffs) if diffs else float("nan")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, default=SHIPPED)
    args = p.parse_args(argv)
    by_sample = samples(read_rows(args.data))
    fit_ids, held = split(list(by_sample))
    pricing = fit(by_sample, fit_ids)
    stand_in = UvmPricing.stand_in(TOPOLOGY_HBM_TO_DDR)
    hw = next(iter(by_sample.values()))["fused"]["hardware"]
    report = {
        k.value: {
            "held_out_mape": mape(pricing, by_sample, held, k.value),
            "stand_in_mape": mape(stand_in, by_sample, held, k.value),
            "noise_median": noise(by_sample, k.value),
            "over_hbm": over_hbm(by_sample, k.value),
        }
        for k in sorted(UVM_KERNELS, key=lambda k: k.value)
    }
    figures = "; ".join(f"{k}: held-out MAPE {100 * v['held_out_mape']:.1f}% (stand-in {100 * v['stand_in_mape']:.0f}%, noise {100 * v['noise_median']:.1f}%)" for k, v in report.items())
    source = (
        f"fitted to UVM kernels measured on an {hw['device_name']} (fbgemm-gpu {hw['fbgemm_gpu']}, {len(fit_ids)} samples fit, "
        f"{len(held)} held out; {figures})"
    )
    out = {
        "source": source, "features": list(FEATURES), "hardware": hw, "data": args.data.name, "held_out": report,
        "coefficients": {k: {"forward": list(f), "backward": list(b)} for k, (f, b) in pricing.coefficients.items()},
    }  # fmt: skip
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(source)
    for k, v in report.items():
        print(f"{k}: {v['over_hbm'][0]:.2f}-{v['over_hbm'][1]:.1f}x the same shards' kernel in HBM")
    for k, (f, b) in pricing.coefficients.items():
        print(f"{k}: forward {dict(zip(FEATURES, np.round(f, 3)))}, backward {dict(zip(FEATURES, np.round(b, 3)))}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
