"""Which compute samples calibration measures: a covering order over the feature space.

Compute samples are drawn as ``neuroshard collect compute`` draws them, from a fixed
candidate list of ``CANDIDATES`` draws (seed ``CALIBRATION_SEED``), and taken round robin
over strata of (table count, total width, mean pooling factor), so the first n of the order
spread over the space for every n.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Hashable, Sequence

from torchrec_neuroshard.lab.collect import draw_compute_sample, shard_from_record
from torchrec_neuroshard.lab.workloads import PoolTable, WorkloadScale
from torchrec_neuroshard.types import ShardingError

CALIBRATION_SEED = 20_261_126
"""Seed of the calibration draws: apart from ``collect``'s default seeds 0 and 7."""
CANDIDATES = 6_000
"""Draws the covering order is taken from."""

def stratum(widths: Sequence[int], pooling_factors: Sequence[float]) -> tuple[int, int, int]:
    """The cell of a compute sample: log2 bins of its table count and total width, and
    its mean pooling factor in bins (< 8, < 24, >= 24)."""
    pooling = sum(pooling_factors) / len(pooling_factors)
    return (
        int(math.log2(len(widths))),
        int(math.log2(sum(widths))) // 2,
        0 if pooling < 8 else 1 if pooling < 24 else 2,
    )


def covering_order(keys: Sequence[Hashable]) -> list[int]:
    """Indices of ``keys`` in round-robin order over their strata (each stratum in its own
    order): every prefix is as evenly spread over the strata as it can be."""
    by_key: dict[Hashable, list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        by_key[k].append(i)
    queues = [by_key[k] for k in sorted(by_key)]
    order: list[int] = []
    for depth in range(max(len(q) for q in queues)):
        order += [q[depth] for q in queues if depth < len(q)]
    return order


def calibration_indices(pool: Sequence[PoolTable], scale: WorkloadScale, count: int, seed: int = CALIBRATION_SEED) -> list[int]:
    """The first ``count`` sample indices (for ``draw_compute_sample(pool, scale, seed, i)``)
    of the covering order over ``CANDIDATES`` draws."""
    if count > CANDIDATES:
        raise ShardingError(f"calibration takes at most {CANDIDATES} compute samples, asked for {count}")
    keys = []
    for i in range(CANDIDATES):
        s = draw_compute_sample(pool, scale, seed, i)
        keys.append(stratum(s.widths, [pool[t].pooling_factor for t in s.table_ids]))
    return covering_order(keys)[:count]


def covering_rows(rows: Sequence[dict], count: int) -> list[dict]:
    """The first ``count`` compute rows of the covering order (for rows measured before,
    e.g. another machine's dataset)."""
    keys = []
    for r in rows:
        shards = [shard_from_record(s) for s in r["shards"]]
        keys.append(stratum([s.width for s in shards], [s.table.pooling_factor for s in shards]))
    return [rows[i] for i in covering_order(keys)[:count]]

