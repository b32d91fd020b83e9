"""Access-histogram maths, in one place: binning measured indices, the histogram a
power-law access model is expected to give (the default for a table known only from its
config is uniform access: alpha = 0), and each table's pooling factor and histogram
measured from real batches (``profile_batches``)."""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import numpy as np
import torch

from torchrec_neuroshard.types import NUM_ACCESS_BINS, ShardingError

if TYPE_CHECKING:
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def access_bin(counts: np.ndarray) -> np.ndarray:
    """Bin index 0..16 of each access count >= 1: (0,1]->0, (1,2]->1, (2,4]->2, ..., >32768->16."""
    counts = np.asarray(counts, dtype=np.float64)
    return np.clip(np.ceil(np.log2(np.maximum(counts, 1.0))), 0, NUM_ACCESS_BINS - 1).astype(
        np.int64
    )


def access_histogram(indices: np.ndarray | torch.Tensor) -> tuple[float, ...]:
    """17-bin access histogram of one table's indices in one batch (fractions of unique ids).

    An empty batch gives all mass in bin 0 (a never-read table behaves like a cold one).
    """
    idx = indices.numpy() if isinstance(indices, torch.Tensor) else np.asarray(indices)
    if idx.size == 0:
        return (1.0,) + (0.0,) * (NUM_ACCESS_BINS - 1)
    _, counts = np.unique(idx, return_counts=True)
    hist = np.bincount(access_bin(counts), minlength=NUM_ACCESS_BINS).astype(np.float64)
    return tuple(float(x) for x in hist / hist.sum())


def uniform_access_histogram(rows: int, lookups: float) -> tuple[float, ...]:
    """Histogram expected when ``lookups`` indices are drawn uniformly from ``rows`` rows.

    The documented default for a table known only from its config: no skew assumed.
    """
    return uniform_access_histograms([(rows, lookups)])[0]


def uniform_access_histograms(shapes: Sequence[tuple[int, float]]) -> list[tuple[float, ...]]:
    """``uniform_access_histogram`` of each (rows, lookups) of ``shapes``, all at once.

    Under uniform access every row's count is Poisson(lookups / rows), so the histogram is
    that one distribution's mass per bin over the counts >= 1: 17 values per table, for
    every table in one call per bin. ``expected_access_histogram(rows, lookups, 0.0)`` sums
    the same masses over its ~700 rank buckets, each of per-rank probability 1 / rows up to
    rounding: the same histogram to about 1e-13 (tests/test_tables_workloads.py), at a
    thousandth of the cost (that sum per table was a third of planning 3,000 small tables)."""
    empty = (1.0,) + (0.0,) * (NUM_ACCESS_BINS - 1)
    rows = np.asarray([r for r, _ in shapes], dtype=np.float64).reshape(-1)  # [T]
    lookups = np.asarray([lk for _, lk in shapes], dtype=np.float64).reshape(-1)  # [T]
    live = lookups > 0  # [T]
    if not live.any():
        return [empty] * len(shapes)
    lam = torch.as_tensor(np.maximum(lookups[live] / np.maximum(rows[live], 1.0), 1e-300), dtype=torch.float64)  # [L]
    mass = _bin_mass(lam, torch.ones_like(lam)).clamp_min(0)  # [17, L]
    total = mass.sum(dim=0)  # [L]
    hists = (mass / torch.where(total > 0, total, 1.0)).T.tolist()  # [L][17]
    found = iter(zip(hists, (total > 0).tolist()))
    out = []
    for alive in live.tolist():
        hist, positive = next(found) if alive else (None, False)
        out.append(tuple(hist) if positive else empty)
    return out


def _rank_buckets(rows: int, head: int = 512, ratio: float = 1.02) -> tuple[np.ndarray, np.ndarray]:
    """Split ranks 1..rows into exact head ranks then geometric buckets: (starts, sizes), [B] each."""
    starts = np.arange(1, min(rows, head) + 1, dtype=np.float64)  # [min(rows, head)]
    sizes = np.ones(len(starts))
    if rows > head:
        edges = np.unique(np.geomspace(head + 1, rows + 1, num=max(2, int(math.log(rows / head) / math.log(ratio)))).astype(np.int64))
        edges[0], edges[-1] = head + 1, rows + 1
        starts = np.concatenate([starts, edges[:-1].astype(np.float64)])
        sizes = np.concatenate([sizes, np.diff(edges).astype(np.float64)])
    return starts, sizes


def _power_law_cdf(x: np.ndarray, rows: int, alpha: float) -> np.ndarray:
    """CDF at x of the continuous density ~ x^-alpha on [1, rows + 1)."""
    if abs(alpha - 1.0) < 1e-6:
        return np.log(x) / math.log(rows + 1)
    e = 1.0 - alpha
    return (x**e - 1.0) / ((rows + 1) ** e - 1.0)


def active_rows(rows: int, lookups: float, active_ratio: float) -> int:
    """Rows in play in one batch: ``active_ratio`` x lookups, at least 1, at most ``rows``."""
    if math.isinf(active_ratio):
        return rows
    return int(min(rows, max(1, round(active_ratio * lookups))))


def _rank_probabilities(rows: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """(per-rank probability, ranks per bucket) of the power law over ``rows`` ranks."""
    starts, sizes = _rank_buckets(rows)
    p = (_power_law_cdf(starts + sizes, rows, alpha) - _power_law_cdf(starts, rows, alpha)) / sizes
    return p, sizes


@functools.lru_cache(maxsize=1 << 16)
def expected_access_histogram(
    rows: int, lookups: float, alpha: float, active_ratio: float = math.inf
) -> tuple[float, ...]:
    """Expected 17-bin access histogram of ``lookups`` power-law draws.

    Draws fall on ``active_rows(rows, lookups, active_ratio)`` rows with p(rank k) ~ k^-alpha;
    each row's count is Poisson(lookups * p_row); the histogram is over rows drawn >= 1 time.
    Cached: a pool's tables are the same at every device count, and tasks are drawn from
    them again and again.
    """
    if lookups <= 0:
        return (1.0,) + (0.0,) * (NUM_ACCESS_BINS - 1)
    p, sizes = _rank_probabilities(active_rows(rows, lookups, active_ratio), alpha)
    lam = torch.as_tensor(np.maximum(p * lookups, 1e-300), dtype=torch.float64)  # [B]
    return _normalised(_bin_mass(lam, torch.as_tensor(sizes, dtype=torch.float64)))


def _bin_mass(lam: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """[17, B] expected rows of each access bin of B buckets of ``n`` [B] ranks, each rank's
    count Poisson(``lam`` [B])."""
    # P(count <= k) = Q(k + 1, lam) for a Poisson(lam) count, at each bin's upper count k = 2^j.
    uppers = torch.tensor([2.0**j + 1.0 for j in range(NUM_ACCESS_BINS - 1)], dtype=torch.float64)  # [16]
    below = torch.special.gammaincc(uppers[:, None], lam[None, :])  # [16, B]
    cdf = torch.cat([torch.exp(-lam)[None], below, torch.ones_like(lam)[None]])  # [18, B]
    return (cdf[1:] - cdf[:-1]) * n


def _normalised(mass: torch.Tensor) -> tuple[float, ...]:
    """The histogram of one table's bin masses [17, B]: summed over its buckets, as fractions."""
    mass = mass.sum(dim=1).clamp_min(0)  # [17]
    total = float(mass.sum())
    if total <= 0:
        return (1.0,) + (0.0,) * (NUM_ACCESS_BINS - 1)
    return tuple(float(x) / total for x in mass)


def expected_unique(rows: int, lookups: float, alpha: float, active_ratio: float = math.inf) -> float:
    """Expected number of distinct rows among ``lookups`` draws (same model as above)."""
    p, sizes = _rank_probabilities(active_rows(rows, lookups, active_ratio), alpha)
    return float((sizes * -np.expm1(-p * lookups)).sum())


def profile_batches(
    batches: Iterable[KeyedJaggedTensor],
    feature_to_table: Mapping[str, str],
) -> tuple[dict[str, float], dict[str, tuple[float, ...]]]:
    """Measure pooling factor and access histogram of each table from real KJT batches.

    Args:
        batches: KeyedJaggedTensors, one per global batch.
        feature_to_table: KJT key -> table name (several features may share a table).

    Returns:
        (pooling factor per table: mean lookups per sample summed over its features,
         access histogram per table: averaged over batches, each batch's ids pooled over
         the table's features).
    """
    lookups: dict[str, int] = defaultdict(int)
    samples: dict[str, int] = defaultdict(int)
    hist_sum: dict[str, np.ndarray] = {}
    hist_n: dict[str, int] = defaultdict(int)
    for kjt in batches:
        per_table: dict[str, list[torch.Tensor]] = defaultdict(list)
        batch = kjt.stride()
        for key, jt in kjt.to_dict().items():
            table = feature_to_table.get(key)
            if table is None:
                continue
            values = jt.values()
            per_table[table].append(values)
            lookups[table] += values.numel()
        for table, vals in per_table.items():
            samples[table] += batch
            h = np.asarray(access_histogram(torch.cat(vals).cpu()))
            hist_sum[table] = hist_sum.get(table, 0) + h
            hist_n[table] += 1
    if not samples:
        raise ShardingError(
            "profile_batches saw no feature of any known table; check feature_to_table "
            f"(knows {sorted(feature_to_table)[:8]}...)"
        )
    # A table looked up by several features sums their lookups per sample.
    pooling = {t: lookups[t] / (samples[t]) for t in samples}
    hists = {t: tuple(float(x) for x in hist_sum[t] / hist_n[t]) for t in hist_sum}
    if any(not math.isfinite(v) for v in pooling.values()):
        raise ShardingError("profiling produced a non-finite pooling factor")
    return pooling, hists
