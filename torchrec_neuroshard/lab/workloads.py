"""Workloads: a synthetic DLRM-like table pool, per-table index generators, task generator.

The pool's statistics follow the public DLRM embedding-lookup dataset (856 tables, batch
65,536; see ``DLRM_*`` constants). Each table's index accesses follow a power law over its
rows, p(rank k) ~ k^-alpha, with alpha drawn per table; the access histogram a table shows
at a given batch size is computed in closed form (Poisson approximation) and matched by the
sampler. Scaling rows and batch by the same factor keeps the histograms (for alpha < 1
exactly, approximately above), which is how the CPU runs a shrunken copy of the pool.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from torchrec_neuroshard.access import active_rows, expected_access_histogram, expected_unique
from torchrec_neuroshard.types import NUM_ACCESS_BINS, ShardingError, TableSpec, Task

# Published statistics of the 2021 DLRM dataset file (REFERENCE.md sec. 7).
DLRM_NUM_TABLES = 856
DLRM_BATCH_SIZE = 65_536
DLRM_MEAN_ROWS = 4.1e6
DLRM_STD_ROWS = 3.1e6
DLRM_MEAN_POOLING = 887_017_990 / DLRM_BATCH_SIZE / DLRM_NUM_TABLES  # ~15.8
DLRM_STD_POOLING = 25.6
DLRM_REUSE_HISTOGRAM = (
    0.473, 0.152, 0.139, 0.112, 0.072, 0.032, 0.011, 0.005, 0.002, 0.001,
    0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
)  # fmt: skip
"""Share of unique indices accessed k times in one batch, bins (0,1], (1,2], ... >32768."""

TRAINING_POOL_SEEDS = (0, *range(10, 20))
"""The pools training kernels come from: seed 0 (every collection before issue 43) and
10-19 (the device-sized kernels, ``lab.collect_devices``)."""
HELD_OUT_POOL_SEEDS = (2, 3, 4, 5, 7)
"""Pools no training kernel came from. Claims are made on these; collectors refuse them."""

DIMS = (4, 8, 16, 32, 64, 128)
"""Embedding widths the pool's tables are augmented over (the prototype's choice)."""

REUSE_MIXTURE = (
    (0.0, 0.05, 0.1645), (0.0, 0.1, 0.2735), (0.0, 0.2, 0.3846), (0.0, 0.5, 0.1111),
    (0.6, 0.2, 1.1359), (0.6, 5.0, 1.1286), (0.9, 0.02, 4.8372), (0.9, 5.0, 0.2089),
)  # fmt: skip
"""Access models of the pool's tables: (alpha, active_ratio, relative share of tables).

A table draws its ids from ``active_ratio`` x lookups rows with p(rank k) ~ k^-alpha. The
mixture is the non-negative least-squares fit of these components' histograms (weighted by
their unique ids) to DLRM_REUSE_HISTOGRAM; ``studies/fit_reuse_mixture.py`` refits it,
and the tests check the pool's aggregate histogram against the published one.
"""


@dataclass(frozen=True)
class WorkloadScale:
    """How much of the full-size pool a machine runs: rows / row_divisor, a batch size.

    The CPU default (rows / 64, batch 4096) keeps kernels in the milliseconds. Shrinking
    rows and batch by the same factor keeps the access histograms (tests check rows / 64
    with batch 1024); the CPU default's 4x larger batch shows more reuse (singletons 0.33
    of unique ids instead of 0.47), which the cost model sees in its features.
    """

    row_divisor: int = 64
    batch_size: int = 4096

    @staticmethod
    def for_device(device: torch.device) -> "WorkloadScale":
        """Full size on a GPU; rows / 64 and batch 4096 on a CPU."""
        return WorkloadScale(1, DLRM_BATCH_SIZE) if device.type == "cuda" else WorkloadScale()


@dataclass(frozen=True)
class PoolTable:
    """One table of the synthetic pool at full size, before any width is chosen."""

    name: str
    rows: int
    pooling_factor: float
    alpha: float
    active_ratio: float

    def lookups(self, scale: WorkloadScale, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of this table's bags at ``scale`` (see ``sample_lookups``)."""
        return sample_lookups(
            max(1, self.rows // scale.row_divisor),
            self.pooling_factor,
            self.alpha,
            self.active_ratio,
            scale.batch_size,
            seed,
        )


def synthetic_pool(num_tables: int = DLRM_NUM_TABLES, seed: int = 0) -> list[PoolTable]:
    """A DLRM-like pool: gamma-distributed rows, lognormal pooling factors (both matching
    the published mean and std), and an access model per table drawn from REUSE_MIXTURE."""
    rng = np.random.default_rng(seed)
    shape = (DLRM_MEAN_ROWS / DLRM_STD_ROWS) ** 2
    rows = rng.gamma(shape, DLRM_STD_ROWS**2 / DLRM_MEAN_ROWS, num_tables)
    rows = np.maximum(rows, 1_000).astype(np.int64)
    sigma2 = math.log1p((DLRM_STD_POOLING / DLRM_MEAN_POOLING) ** 2)
    mu = math.log(DLRM_MEAN_POOLING) - sigma2 / 2
    pooling = np.clip(rng.lognormal(mu, math.sqrt(sigma2), num_tables), 1.0, 400.0)
    share = np.asarray([w for _, _, w in REUSE_MIXTURE])
    component = rng.choice(len(REUSE_MIXTURE), size=num_tables, p=share / share.sum())
    return [
        PoolTable(f"t{i}", int(r), round(float(p), 3), *REUSE_MIXTURE[c][:2])
        for i, (r, p, c) in enumerate(zip(rows, pooling, component))
    ]


def training_pool(seed: int) -> list[PoolTable]:
    """``synthetic_pool(seed=seed)`` for a collector of training samples: a held-out seed
    is refused, so no claim's tables ever reach a model."""
    if seed in HELD_OUT_POOL_SEEDS:
        raise ShardingError(
            f"pool seed {seed} is held out (workloads.HELD_OUT_POOL_SEEDS {HELD_OUT_POOL_SEEDS}): "
            f"collect training samples from another, e.g. one of TRAINING_POOL_SEEDS {TRAINING_POOL_SEEDS}"
        )
    return synthetic_pool(seed=seed)


FIT_ALPHAS = (0.0, 0.3, 0.6, 0.9, 1.2, 1.5)
FIT_ACTIVE_RATIOS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, math.inf)


def fit_access_model(rows: int, lookups: float, access_hist: Sequence[float]) -> tuple[float, float]:
    """(alpha, active_ratio) on a small grid whose expected histogram is closest (L1);
    remembered, since every draw of a table's ids fits the same (54 histograms, about 50 ms
    a table: 45 s of an 856-table task's draw)."""
    return _fit_access_model(rows, float(lookups), tuple(float(x) for x in access_hist))


@functools.lru_cache(maxsize=1 << 14)
def _fit_access_model(rows: int, lookups: float, access_hist: tuple[float, ...]) -> tuple[float, float]:
    target = np.asarray(access_hist)
    best, best_err = (0.0, math.inf), math.inf
    for alpha in FIT_ALPHAS:
        for ratio in FIT_ACTIVE_RATIOS:
            err = np.abs(np.asarray(expected_access_histogram(rows, lookups, alpha, ratio)) - target).sum()
            if err < best_err:
                best, best_err = (alpha, ratio), err
    return best


def sample_lookups(
    rows: int,
    pooling_factor: float,
    alpha: float,
    active_ratio: float,
    batch_size: int,
    seed: int,
    draw: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of bags for a table: (indices int64 [N], offsets int64 [batch_size + 1]).

    Bag lengths are Poisson(pooling_factor); ids follow the power law over the active ranks
    (see ``expected_access_histogram``), and ranks map to rows by a fixed affine permutation
    (``seed``'s) so hot rows are scattered over the table. ``draw`` > 0: another batch of the
    same table (the same hot rows, other draws), as successive training steps see it.
    """
    rng = np.random.default_rng(seed if draw == 0 else [seed, draw])
    lengths = rng.poisson(pooling_factor, batch_size)
    n = int(lengths.sum())
    active = active_rows(rows, pooling_factor * batch_size, active_ratio)
    u = rng.random(n)
    if abs(alpha - 1.0) < 1e-6:
        x = np.exp(u * math.log(active + 1))
    else:
        e = 1.0 - alpha
        x = (u * ((active + 1) ** e - 1.0) + 1.0) ** (1.0 / e)
    ranks = np.minimum(np.floor(x).astype(np.int64), active) - 1
    mult = _coprime_multiplier(rows, seed)
    ids = (ranks * mult + seed) % rows
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(offsets.astype(np.int64))


def _coprime_multiplier(rows: int, seed: int) -> int:
    m = 2_654_435_761 + 2 * seed
    while math.gcd(m, rows) != 1:
        m += 1
    return m % rows or 1


def table_spec(table: PoolTable, dim: int, scale: WorkloadScale, name: str | None = None) -> TableSpec:
    """The pool table at width ``dim`` on a machine of ``scale``, histogram included."""
    rows = max(1, table.rows // scale.row_divisor)
    lookups = table.pooling_factor * scale.batch_size
    hist = expected_access_histogram(rows, lookups, table.alpha, table.active_ratio)
    return TableSpec(
        name=name or f"{table.name}_d{dim}",
        rows=rows,
        dim=dim,
        pooling_factor=table.pooling_factor,
        access_hist=hist,
    )


def lookups_for(spec: TableSpec, batch_size: int, seed: int, draw: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic bags reproducing ``spec``'s pooling factor and access histogram.

    The access model (power law over the active rows) is fitted to the spec's histogram, so this also serves tables
    profiled from a user's data or read from the DLRM dataset.
    """
    lookups = spec.pooling_factor * batch_size
    alpha, ratio = fit_access_model(spec.rows, lookups, spec.access_hist)
    return sample_lookups(spec.rows, spec.pooling_factor, alpha, ratio, batch_size, seed, draw)


def generate_task(
    pool: Sequence[PoolTable],
    num_tables: int,
    num_devices: int,
    scale: WorkloadScale,
    seed: int,
    memory_slack: float = 1.3,
    dims: Sequence[int] = DIMS,
) -> Task:
    """A random sharding task in the prototype's style.

    Draws ``num_tables`` pool tables (without replacement) each at a random width from
    ``dims``; the per-device memory cap is ``memory_slack`` x (total bytes / devices), but
    never below the largest table, so a cap makes placement matter yet stays feasible. The
    global batch is the scale's, rounded down to a multiple of the devices
    (``divisible_batch``): every rank feeds the same per-rank batch.
    """
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(pool), size=num_tables, replace=num_tables > len(pool))
    tables = tuple(
        table_spec(pool[i], int(rng.choice(dims)), scale, name=f"{pool[i].name}_{k}")
        for k, i in enumerate(chosen)
    )
    batch = divisible_batch(scale.batch_size, num_devices)
    return Task(tables, num_devices, memory_cap(tables, num_devices, batch, memory_slack), batch)


def divisible_batch(batch_size: int, world_size: int) -> int:
    """The largest global batch <= ``batch_size`` that ``world_size`` ranks split evenly
    (4,096 on 3 ranks: 4,095, 1,365 samples each)."""
    return batch_size - batch_size % world_size


def memory_cap(tables: Sequence[TableSpec], num_devices: int, batch_size: int, memory_slack: float = 1.3) -> int:
    """A task's memory per device: ``memory_slack`` x an even share of the tables' memory
    (``TableSpec.memory_bytes`` at the global ``batch_size``: weights, optimizer state and
    kernel buffers, as TorchRec counts them), and at least 1.05 x the largest table (so
    every table fits somewhere whole)."""
    memory = [t.memory_bytes(batch_size, num_devices) for t in tables]
    total = sum(memory)
    largest = max(memory)
    return int(max(memory_slack * total / num_devices, 1.05 * largest))


def pool_reuse_histogram(
    pool: Sequence[PoolTable], batch_size: int = DLRM_BATCH_SIZE, row_divisor: int = 1
) -> np.ndarray:
    """Aggregate reuse histogram of the pool: per-table expected histograms weighted by
    each table's expected number of unique ids (what the published figure aggregates)."""
    total = np.zeros(NUM_ACCESS_BINS)
    for t in pool:
        rows = max(1, t.rows // row_divisor)
        lookups = t.pooling_factor * batch_size
        hist = np.asarray(expected_access_histogram(rows, lookups, t.alpha, t.active_ratio))
        total += hist * expected_unique(rows, lookups, t.alpha, t.active_ratio)
    return total / total.sum()
