"""Device-sized compute samples: kernels of 16-128 tables from many pools, timed in pairs.

A production device runs 50-110 tables in one fused kernel. The first collections
(``collect.collect_compute``) fused 1-15, from pool 0 alone, and the net priced larger
kernels by a linear stretch of a 15-table one. Here pair k draws two kernels of U{16..128}
(table, width) configs from the pool of seed ``pool_seeds[k % n]`` (by default the training
pools 10-19; a held-out seed is refused) at one global batch, log-uniform in 1,024-16,384,
and times the two interleaved (``measure_interleaved``): the machine drifts by tens of
percent within the hour, the ratio of two kernels timed in turn does not.

Rows are ``collect``'s compute rows plus ``pool_seed``, ``pair`` and ``pair_member``; both
members of a pair share one split group (``DEVICE_GROUP_OFFSET`` + k). Re-running resumes.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from torchrec_neuroshard.lab.collect import PoolLookups, _open_for_append, draw_batch, draw_compute_sample, hardware, shard_record
from torchrec_neuroshard.lab.measure_compute import measure_interleaved
from torchrec_neuroshard.lab.workloads import TRAINING_POOL_SEEDS, WorkloadScale, training_pool

DEVICE_TABLES = (16, 128)
"""Tables one device-sized kernel fuses, drawn uniformly."""
DEVICE_BATCH_SIZES = (1024, 16_384)
"""Global batches of the pairs, log-uniform (the CPU benchmarks run 4,096)."""
DEVICE_MEMORY_CAP_BYTES = 2 * 2**30
"""A kernel's fp32 weights at the CPU scale: a D = 8 device of the 856-table pool holds 1.1-1.5 GB."""
DEVICE_GROUP_OFFSET = 700_000
"""Added to a pair's index in its split group: apart from the small kernels' groups."""


def pairs_apart(files: Sequence[Sequence[dict]]) -> list[dict]:
    """The rows of several files, in order, each file's pairs numbered after the previous
    files' (``pair`` and its split group moved alike): every file numbers its pairs from 0,
    and pair k of one file is not pair k of another. One file's rows come back as they are."""
    out, offset = [], 0
    for rows in files:
        out += [{**r, "pair": r["pair"] + offset, "group": r["group"] + offset} if "pair" in r else r for r in rows]
        offset += 1 + max((r["pair"] for r in rows if "pair" in r), default=-1)
    return out


def _resume(path: Path) -> tuple[object, int]:
    """Open ``path`` for appending, after dropping a pair cut in half: (file, pairs kept)."""
    f, kept = _open_for_append(path)
    if kept % 2:
        f.close()
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(b"".join(lines[:-1]))
        f, kept = _open_for_append(path)
    return f, kept // 2


def whole_pairs(rows: Sequence[dict]) -> list[dict]:
    """The rows of every pair in ``rows`` with both members (rows without a pair left out),
    by pair, partners side by side: member 0, then member 1."""
    members: dict[int, dict[int, dict]] = {}
    for r in rows:
        if "pair" in r:
            members.setdefault(r["pair"], {})[r["pair_member"]] = r
    return [pair[m] for _, pair in sorted(members.items()) if len(pair) == 2 for m in (0, 1)]


def pair_rows(
    k: int, seed: int, pool_seeds: Sequence[int], scale: WorkloadScale, device: torch.device, warmup: int, repeats: int,
    num_threads: int = 1,
) -> list[dict]:
    """Pair ``k``: its two kernels drawn, timed interleaved, as two compute rows."""
    pool_seed = pool_seeds[k % len(pool_seeds)]
    pool = training_pool(pool_seed)
    at = replace(scale, batch_size=draw_batch(seed, k, DEVICE_BATCH_SIZES))
    bank = PoolLookups(pool, at)
    kernels = [
        bank.shards(draw_compute_sample(pool, at, seed, 2 * k + m, tables=DEVICE_TABLES, cap_bytes=DEVICE_MEMORY_CAP_BYTES))
        for m in range(2)
    ]  # fmt: skip
    measured = measure_interleaved(kernels, device, warmup, repeats, num_threads)
    hw = hardware(device, num_threads)
    return [
        {
            "kind": "compute", "group": DEVICE_GROUP_OFFSET + k, "pool_seed": pool_seed, "pair": k, "pair_member": m,
            "batch_size": at.batch_size, "weights_precision": "fp32", "pooling_mode": "sum",
            "shards": [shard_record(s) for s in shards],
            "fwd_ms": round(mm.fwd.median_ms, 5), "bwd_ms": round(mm.bwd.median_ms, 5),
            "fwd_iqr_ms": round(mm.fwd.iqr_ms, 5), "bwd_iqr_ms": round(mm.bwd.iqr_ms, 5), "hardware": hw,
        }  # fmt: skip
        for m, ((shards, _), mm) in enumerate(zip(kernels, measured))
    ]


def collect_device_pairs(
    out: str | Path,
    num_pairs: int,
    device: torch.device,
    seed: int = 0,
    pool_seeds: Sequence[int] = TRAINING_POOL_SEEDS[1:],
    warmup: int = 3,
    repeats: int = 9,
    progress: bool = True,
    scale: WorkloadScale | None = None,
    num_threads: int = 1,
) -> int:
    """Measure pairs ``[pairs already in out, num_pairs)`` and append their rows; returns
    the pairs in the file afterwards. ``scale``: default the device's (rows / 64 on a CPU);
    ``num_threads``: CPU torch threads."""
    for s in pool_seeds:
        training_pool(s)  # refuses a held-out seed before anything is measured
    scale = scale or WorkloadScale.for_device(device)
    f, start = _resume(Path(out))
    with f:
        for k in tqdm(range(start, num_pairs), initial=start, total=num_pairs, disable=not progress, desc="device pairs"):
            f.write("".join(json.dumps(r) + "\n" for r in pair_rows(k, seed, pool_seeds, scale, device, warmup, repeats, num_threads)))
            f.flush()
    return max(start, num_pairs)
