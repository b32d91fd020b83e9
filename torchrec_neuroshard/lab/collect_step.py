"""Samples of a sharded step's other parts: the KJT input distribution, the collectives of
row-wise and data-parallel tables, and the data-parallel (dense TBE) kernel.

    neuroshard collect step --out step.jsonl --samples 60 --world-sizes 2 3 4 6 8

One JSON line per sample, with "kind" one of ``STEP_KINDS``, appended as measured; the
file resumes like the other datasets (sample i of a kind and world size is a pure function
of (seed, kind, world size, i)). Rows hold raw quantities (bytes, element counts, each
rank's ms): ``steparts``' feature functions turn them into features at fit time.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm import tqdm

from torchrec_neuroshard.lab.collect import (
    ComputeSample,
    PoolLookups,
    _open_for_append,
    hardware,
    iter_kind,
    read_rows,
    shard_record,
)
from torchrec_neuroshard.lab.evaluate import INDEX_DTYPE, LENGTHS_DTYPE, SPLITS_PER_PEER, _local_lookups
from torchrec_neuroshard.lab.measure_comm import Exchange, exchange_bytes, measure_exchanges
from torchrec_neuroshard.lab.measure_compute import measure_replicated_compute
from torchrec_neuroshard.lab.workloads import DIMS, PoolTable, WorkloadScale, synthetic_pool
from torchrec_neuroshard.steparts import COLLECTIVES

STEP_KINDS = ("input_dist", *COLLECTIVES, "dp", "dp_small", "dp_many")
"""The kinds of rows ``collect step`` writes; "dp", "dp_small" and "dp_many" rows give both
dp_fwd and dp_bwd ("dp_small" draws tables smaller than the pool holds, ``draw_dp_small``;
"dp_many" the dozens a planner replicates on a device of a production model, ``draw_dp_many``)."""
DP_KINDS = ("dp", "dp_small", "dp_many")
DISTRIBUTED_KINDS = tuple(k for k in STEP_KINDS if k not in DP_KINDS)
MAX_TABLES_PER_RANK = 12
"""Input distribution: each destination rank holds U{0..12} tables of the group."""
COLLECTIVE_BYTES = (4 * 2**10, 64 * 2**20)
"""Collective buffers, log-uniform: from a few small tables' partial sums to the gradient
of a few large data-parallel tables at the CPU scale (rows / 64: mean 64k rows x 128 x 4 B
= 32 MB a table)."""
MAX_DP_TABLES = 8
DP_MEMORY_CAP_BYTES = 256 * 2**20
"""Rejection cap on a data-parallel sample's weights (every rank holds them all)."""
MAX_DP_SMALL_TABLES = 4
DP_SMALL_ROWS = (10, 5_000)
"""``draw_dp_small``'s rows, log-uniform: the small tables TorchRec replicates (a few to a
few thousand rows), which the pool at the CPU scale barely holds (1 table <= 2,000 rows)."""
MAX_DP_MANY_TABLES = 64
DP_MANY_MAX_ROWS = 25_000
DP_MANY_CAP_BYTES = 48 * 2**20
"""``draw_dp_many``'s tables and weights: what a planner replicates is small (the 12-48
tables of the data-parallel sets of 856-table plans at D = 8 hold 5-19 MB), and the cap
spans the update's knee (``steparts.DP_UPDATE_KNEE_MB``)."""


def _rng(seed: int, kind: str, world_size: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, STEP_KINDS.index(kind), world_size, index])


def draw_input_dist(pool: Sequence[PoolTable], world_size: int, batch_size: int, seed: int, index: int) -> list[Exchange]:
    """One KJT input distribution as DMP sends it: the splits, int32 lengths and int64
    indices all-to-alls. Rank j holds U{0..12} pool tables; rank r sends it the lengths of
    its local batch for each, and Poisson(local x pooling factor x U(0.5, 1.5)) indices."""
    rng = _rng(seed, "input_dist", world_size, index)
    local = batch_size // world_size
    held = [rng.integers(0, len(pool), int(rng.integers(0, MAX_TABLES_PER_RANK + 1))) for _ in range(world_size)]
    lengths = [[local * len(held[j]) for j in range(world_size)] for _ in range(world_size)]
    values = [
        [sum(int(rng.poisson(local * pool[t].pooling_factor * rng.uniform(0.5, 1.5))) for t in held[j]) for j in range(world_size)]
        for _ in range(world_size)
    ]
    return [
        Exchange("all_to_all", tuple((SPLITS_PER_PEER,) * world_size for _ in range(world_size)), INDEX_DTYPE),
        Exchange("all_to_all", tuple(map(tuple, lengths)), LENGTHS_DTYPE),
        Exchange("all_to_all", tuple(map(tuple, values)), INDEX_DTYPE),
    ]


def draw_collective(op: str, world_size: int, seed: int, index: int) -> Exchange:
    """A float32 collective of log-uniform size in ``COLLECTIVE_BYTES`` (the whole buffer
    every rank holds; reduce-scatter and all-gather chunks are equal)."""
    lo, hi = np.log(COLLECTIVE_BYTES[0]), np.log(COLLECTIVE_BYTES[1])
    numel = int(np.exp(_rng(seed, op, world_size, index).uniform(lo, hi))) // 4
    if op == "all_reduce":
        return Exchange(op, ((numel,),))
    return Exchange(op, ((max(1, numel // world_size),) * world_size,))


def collective_nbytes(ex: Exchange) -> int:
    """The bytes of the buffer every rank holds (``steparts.collective_features``' nbytes)."""
    return 4 * sum(ex.counts[0])


def draw_dp(pool: Sequence[PoolTable], scale: WorkloadScale, world_size: int, seed: int, index: int) -> ComputeSample:
    """U{1..8} distinct pool tables at widths from ``DIMS``, redrawn until their weights fit
    ``DP_MEMORY_CAP_BYTES`` at ``scale``."""
    rng = _rng(seed, "dp", world_size, index)
    while True:
        ids = rng.choice(len(pool), int(rng.integers(1, MAX_DP_TABLES + 1)), replace=False)
        widths = rng.choice(DIMS, len(ids))
        size = sum(max(1, pool[i].rows // scale.row_divisor) * w * 4 for i, w in zip(ids, widths))
        if size <= DP_MEMORY_CAP_BYTES:
            return ComputeSample(tuple(int(i) for i in ids), tuple(int(w) for w in widths))


def draw_dp_small(
    pool: Sequence[PoolTable], scale: WorkloadScale, world_size: int, seed: int, index: int
) -> tuple[ComputeSample, list[PoolTable]]:
    """U{1..4} distinct pool tables, each keeping its pooling factor and access model but
    with rows log-uniform in ``DP_SMALL_ROWS`` at ``scale``, at widths from ``DIMS``: the
    sample, indexing the returned tables (full-size pool tables: rows x the scale's divisor)."""
    rng = _rng(seed, "dp_small", world_size, index)
    ids = rng.choice(len(pool), int(rng.integers(1, MAX_DP_SMALL_TABLES + 1)), replace=False)
    lo, hi = np.log(DP_SMALL_ROWS[0]), np.log(DP_SMALL_ROWS[1])
    rows = [int(np.exp(rng.uniform(lo, hi))) for _ in ids]
    widths = rng.choice(DIMS, len(ids))
    tables = [replace(pool[i], name=f"{pool[i].name}_r{r}", rows=r * scale.row_divisor) for i, r in zip(ids, rows)]
    return ComputeSample(tuple(range(len(tables))), tuple(int(w) for w in widths)), tables


def draw_dp_many(pool: Sequence[PoolTable], scale: WorkloadScale, world_size: int, seed: int, index: int) -> ComputeSample:
    """U{9..64} distinct pool tables of at most ``DP_MANY_MAX_ROWS`` rows at ``scale``, each
    at a width from ``DIMS`` that keeps it within an equal share of ``DP_MANY_CAP_BYTES`` (so
    the set fits the cap), drawn among those that fit that share at the narrowest width with
    odds by their pooling factor (a planner replicates the small tables read most)."""
    rng = _rng(seed, "dp_many", world_size, index)
    count = int(rng.integers(MAX_DP_TABLES + 1, MAX_DP_MANY_TABLES + 1))
    share = DP_MANY_CAP_BYTES / count
    rows = [max(1, t.rows // scale.row_divisor) for t in pool]
    small = [i for i, r in enumerate(rows) if r <= DP_MANY_MAX_ROWS and r * min(DIMS) * 4 <= share]
    reads = np.array([pool[i].pooling_factor for i in small])  # a planner replicates the read-heavy
    ids = rng.choice(small, min(count, len(small)), replace=False, p=reads / reads.sum())
    widths = [int(rng.choice([w for w in DIMS if rows[i] * w * 4 <= share])) for i in ids]
    return ComputeSample(tuple(int(i) for i in ids), tuple(widths))


def _done(path: Path, kind: str, world_size: int) -> int:
    return sum(1 for r in iter_kind(read_rows(path), kind) if r["world_size"] == world_size)


def _comm_row(kind: str, index: int, world_size: int, ms: Sequence[float], iqr: Sequence[float], hw: dict) -> dict:
    return {
        "kind": kind,
        "group": index,
        "world_size": world_size,
        "ms": [round(x, 5) for x in ms],
        "iqr_ms": [round(x, 5) for x in iqr],
        "max_ms": round(max(ms), 5),
        "hardware": hw,
    }


def _collect_step_worker(
    rank: int, world_size: int, out: str, kinds: Sequence[str], num_samples: int, seed: int, batch_size: int, progress: bool
) -> None:
    from torchrec_neuroshard.lab.launch import default_device

    device = default_device(rank)
    path = Path(out)
    pool = synthetic_pool()
    hw = {**hardware(device, 1), "backend": torch.distributed.get_backend()}
    for kind in kinds:
        start = torch.tensor([_done(path, kind, world_size) if rank == 0 else 0])
        torch.distributed.broadcast(start, 0)
        f = _open_for_append(path)[0] if rank == 0 else None
        try:
            it = range(int(start), num_samples)
            bar = tqdm(it, initial=int(start), total=num_samples, disable=rank != 0 or not progress, desc=f"{kind} D={world_size}")
            for i in bar:
                if kind == "input_dist":
                    exchanges = draw_input_dist(pool, world_size, batch_size, seed, i)
                    extra = {
                        "batch_size": batch_size,
                        "lengths": [list(row) for row in exchanges[1].counts],
                        "values": [list(row) for row in exchanges[2].counts],
                    }
                    sent = [exchange_bytes(exchanges, r) for r in range(world_size)]
                    extra.update(send_bytes=[s for s, _ in sent], recv_bytes=[r for _, r in sent])
                else:
                    exchanges = [draw_collective(kind, world_size, seed, i)]
                    extra = {"nbytes": collective_nbytes(exchanges[0])}
                ms, iqr = measure_exchanges(exchanges, device)
                if f is not None:
                    f.write(json.dumps({**_comm_row(kind, i, world_size, ms, iqr, hw), **extra}) + "\n")
                    f.flush()
        finally:
            if f is not None:
                f.close()


def _dp_row(sample: ComputeSample, bank: PoolLookups, world_size: int, device: torch.device, warmup: int, repeats: int) -> dict:
    shards, lookups = bank.shards(sample)
    local = bank.scale.batch_size // world_size
    mine = {n: _local_lookups(bags, 0, local) for n, bags in lookups.items()}  # rank 0's samples
    tables = [s.table for s in shards]
    m = measure_replicated_compute(tables, mine, device, warmup, repeats)
    return {
        "local_batch": local,
        "tables": [shard_record(s) for s in shards],
        "lookups": [int(mine[t.name][0].numel()) for t in tables],
        "fwd_ms": round(m.fwd.median_ms, 5),
        "bwd_ms": round(m.bwd.median_ms, 5),
        "fwd_iqr_ms": round(m.fwd.iqr_ms, 5),
        "bwd_iqr_ms": round(m.bwd.iqr_ms, 5),
    }


def collect_step(
    out: str | Path,
    num_samples: int,
    world_sizes: Sequence[int] = (2, 3, 4, 6, 8),
    kinds: Sequence[str] = STEP_KINDS,
    seed: int = 0,
    scale: WorkloadScale | None = None,
    dp_warmup: int = 3,
    dp_repeats: int = 7,
    progress: bool = True,
) -> dict[str, int]:
    """Measure ``num_samples`` samples of every kind in ``kinds`` at every world size (the
    ones already in ``out`` are kept: a re-run resumes). Distributed kinds spawn D ranks
    (rank 0 writes); the data-parallel kinds time rank 0's local batch (B // D) in this
    process on 1 thread.
    Returns the rows of each kind in ``out`` afterwards."""
    from torchrec_neuroshard.lab.launch import default_device, spawn

    unknown = sorted(set(kinds) - set(STEP_KINDS))
    if unknown:
        raise ValueError(f"unknown step sample kinds {unknown}; choose from {STEP_KINDS}")
    device = default_device()
    scale = scale or WorkloadScale.for_device(device)
    path = Path(out)
    pool = synthetic_pool()
    bank = PoolLookups(pool, scale)
    hw = hardware(device, 1)
    for d in world_sizes:
        distributed = [k for k in kinds if k in DISTRIBUTED_KINDS and _done(path, k, d) < num_samples]
        if distributed:
            spawn(_collect_step_worker, d, str(path), distributed, num_samples, seed, scale.batch_size, progress)
        for kind in (k for k in DP_KINDS if k in kinds):
            f, _ = _open_for_append(path)
            with f:
                start = _done(path, kind, d)
                for i in tqdm(range(start, num_samples), initial=start, total=num_samples, disable=not progress, desc=f"{kind} D={d}"):
                    if kind in ("dp", "dp_many"):
                        draw = draw_dp if kind == "dp" else draw_dp_many
                        row = _dp_row(draw(pool, scale, d, seed, i), bank, d, device, dp_warmup, dp_repeats)
                    else:  # small tables: a bank of their own per sample
                        sample, tables = draw_dp_small(pool, scale, d, seed, i)
                        row = _dp_row(sample, PoolLookups(tables, scale), d, device, dp_warmup, dp_repeats)
                    f.write(json.dumps({"kind": kind, "group": i, "world_size": d, **row, "hardware": hw}) + "\n")
                    f.flush()
    rows = read_rows(path)
    return {k: sum(1 for _ in iter_kind(rows, k)) for k in kinds}


def _noise_worker(rank: int, world_size: int, kinds: Sequence[str], num_samples: int, trials: int, seed: int, batch_size: int) -> dict:
    from torchrec_neuroshard.lab.launch import default_device

    device = default_device(rank)
    pool = synthetic_pool()
    out = {}
    for kind in kinds:
        if kind == "input_dist":
            samples = [draw_input_dist(pool, world_size, batch_size, seed, i) for i in range(num_samples)]
        else:
            samples = [[draw_collective(kind, world_size, seed, i)] for i in range(num_samples)]
        ms: list[list[tuple[float, ...]]] = [[] for _ in samples]
        for _ in range(trials):
            for k, exchanges in enumerate(samples):
                ms[k].append(measure_exchanges(exchanges, device)[0])
        out[kind] = [statistics.stdev(per) / statistics.mean(per) for trial in ms for per in zip(*trial)]
    return out


def step_noise(
    world_size: int, num_samples: int, trials: int, kinds: Sequence[str] = STEP_KINDS, seed: int = 0, scale: WorkloadScale | None = None
) -> dict[str, list[float]]:
    """Coefficient of variation of fixed samples 0..num_samples-1 of each kind re-measured
    ``trials`` times, trials interleaved across samples: one value per (sample, rank) for
    the distributed kinds, per sample for "dp_fwd" and "dp_bwd"."""
    from torchrec_neuroshard.lab.launch import default_device, spawn

    device = default_device()
    scale = scale or WorkloadScale.for_device(device)
    distributed = [k for k in kinds if k in DISTRIBUTED_KINDS]
    out = spawn(_noise_worker, world_size, distributed, num_samples, trials, seed, scale.batch_size)[0] if distributed else {}
    if "dp" in kinds:
        pool = synthetic_pool()
        bank = PoolLookups(pool, scale)
        samples = [draw_dp(pool, scale, world_size, seed, i) for i in range(num_samples)]
        rows: list[list[dict]] = [[] for _ in samples]
        for _ in range(trials):
            for k, s in enumerate(samples):
                rows[k].append(_dp_row(s, bank, world_size, device, 3, 7))
        for part, field in (("dp_fwd", "fwd_ms"), ("dp_bwd", "bwd_ms")):
            out[part] = [statistics.stdev(r[field] for r in per) / statistics.mean(r[field] for r in per) for per in rows]
    return out
