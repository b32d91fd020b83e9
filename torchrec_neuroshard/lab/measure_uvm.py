"""Compute samples of the UVM kernels, measured on a GPU: the same shards and batches on
each kernel, so a sample shows what moving tables to host memory costs.

    python -m torchrec_neuroshard.lab.measure_uvm --out DIR [--samples N] [--deadline-s S]

A sample (``draw_uvm_sample``): 1-3 tables of the full-size pool (rows as in the pool)
at widths from ``DIMS``, weights under ``MAX_SAMPLE_BYTES``, and a cache load factor
log-uniform in ``LOAD_FACTORS``. Its tables are timed as one TBE (EXACT_SGD, fp32) on each
kernel in ``KERNELS`` in turn: fused (HBM), fused_uvm (host memory over UVM) and
fused_uvm_caching (host memory behind an HBM cache of the load factor's share of rows).
Every kernel runs ``DRAWS`` successive batches of the global batch 65,536 in turn (the same
hot rows, other draws: ``workloads.lookups_for``), a warm-up pass over them first, so a
cache meets new batches as in training. One JSON row per (sample, kernel); round 1 repeats
the first samples, for the noise floor. Resumes from the rows in ``DIR``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from torchrec_neuroshard.kernels import ComputeKernel
from torchrec_neuroshard.lab.collect import append_rows, hardware, read_rows, shard_record
from torchrec_neuroshard.lab.measure_compute import measure_compute
from torchrec_neuroshard.lab.workloads import DIMS, WorkloadScale, lookups_for, synthetic_pool, table_spec
from torchrec_neuroshard.types import Shard

FILE = "uvm_compute.jsonl"
KERNELS = (ComputeKernel.FUSED, ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING)
LOAD_FACTORS = (0.002, 0.5)
"""The range of cache load factors drawn, log-uniform (TorchRec's default is 0.2)."""
MAX_SAMPLE_BYTES = 4 * 2**30
"""A sample's weights: well under the GPU's free memory, managed memory included."""
GLOBAL_BATCH = 65_536
DRAWS, WARMUP, REPEATS = 3, 3, 6


def draw_uvm_sample(index: int, seed: int = 0) -> tuple[list[Shard], float]:
    """Sample ``index``: its shards (whole tables, full size) and its cache load factor."""
    pool = synthetic_pool()
    rng = np.random.default_rng([seed, index, 27])
    scale = WorkloadScale(1, GLOBAL_BATCH)
    while True:
        ids = rng.integers(0, len(pool), int(rng.integers(1, 4)))
        specs = [table_spec(pool[i], int(rng.choice(DIMS)), scale, name=f"{pool[i].name}_{k}") for k, i in enumerate(ids)]
        if sum(s.rows * s.dim * s.bytes_per_element for s in specs) <= MAX_SAMPLE_BYTES:
            break
    low, high = np.log(LOAD_FACTORS)
    load_factor = float(np.exp(rng.uniform(low, high)))
    return [Shard(s, s.dim) for s in specs], round(load_factor, 5)


def on_kernel(shards: list[Shard], kernel: ComputeKernel, load_factor: float) -> list[Shard]:
    factor = load_factor if kernel is ComputeKernel.FUSED_UVM_CACHING else None
    return [Shard(s.table.on_kernel(kernel, factor), s.width) for s in shards]


def measure_sample(index: int, device: torch.device, seed: int = 0) -> list[dict]:
    """The rows of sample ``index``: one per kernel, plus the batches' lookups and unique rows."""
    shards, load_factor = draw_uvm_sample(index, seed)
    draws = [{s.table.name: lookups_for(s.table, GLOBAL_BATCH, seed=1000 + k, draw=j) for k, s in enumerate(shards)} for j in range(DRAWS)]
    lookups = [float(np.mean([d[s.table.name][0].numel() for d in draws])) for s in shards]
    unique = [float(np.mean([torch.unique(d[s.table.name][0].to(device)).numel() for d in draws])) for s in shards]
    union = [int(torch.unique(torch.cat([d[s.table.name][0] for d in draws]).to(device)).numel()) for s in shards]
    rows = []
    for kernel in KERNELS:
        m = measure_compute(on_kernel(shards, kernel, load_factor), draws, device, WARMUP, REPEATS)
        torch.cuda.empty_cache()
        rows.append({
            "kind": "uvm_compute", "sample": index, "seed": seed, "kernel": kernel.value,
            "cache_load_factor": load_factor if kernel is ComputeKernel.FUSED_UVM_CACHING else None,
            "shards": [shard_record(s) for s in shards], "lookups": lookups, "unique_rows": unique, "union_rows": union,
            "batch_size": GLOBAL_BATCH, "draws": DRAWS,
            "fwd_ms": m.fwd.median_ms, "bwd_ms": m.bwd.median_ms, "fwd_iqr_ms": m.fwd.iqr_ms, "bwd_iqr_ms": m.bwd.iqr_ms,
            "hardware": hardware(device, None),
        })  # fmt: skip
    return rows


def collect_uvm(out_dir: Path, samples: int, repeats: int, deadline_s: float, device: torch.device) -> int:
    """Measure the first ``repeats`` samples twice (rounds 0 and 1, for the noise floor),
    then samples up to ``samples``, until ``deadline_s`` seconds have passed; returns the
    rows in the file. Samples already in it are skipped."""
    path = out_dir / FILE
    done = {(r["sample"], r.get("round", 0)) for r in read_rows(path)}
    todo = [(i, 0) for i in range(repeats)] + [(i, 1) for i in range(repeats)] + [(i, 0) for i in range(repeats, samples)]
    t0 = time.perf_counter()
    for index, round_ in todo:
        if (index, round_) in done:
            continue
        if time.perf_counter() - t0 > deadline_s:
            print(f"deadline: stopped before sample {index} round {round_}", flush=True)
            break
        try:
            rows = measure_sample(index, device)
        except Exception as e:  # noqa: BLE001 - a sample that fails is a row saying how, not a lost run
            rows = [{"kind": "uvm_error", "sample": index, "error": f"{type(e).__name__}: {e}"}]
        append_rows(path, [{**r, "round": round_} for r in rows])
        print(f"sample {index} round {round_}: " + ", ".join(f"{r.get('kernel', 'error')} {r.get('fwd_ms', 0) + r.get('bwd_ms', 0):.2f} ms" for r in rows)
              + f" ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    return len(read_rows(path))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--repeats", type=int, default=12, help="the first samples, measured twice in a row of rounds, for the noise floor")
    p.add_argument("--deadline-s", type=float, default=240.0)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("measure_uvm needs a GPU: UVM kernels are a cuda feature (fbgemm-gpu with CUDA)")
    print(f"{collect_uvm(args.out, args.samples, args.repeats, args.deadline_s, torch.device('cuda'))} rows in {args.out / FILE}")


if __name__ == "__main__":
    main()
