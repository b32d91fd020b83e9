"""The parts of a sharded step beyond the table-wise/column-wise kernels and their pooled
all-to-all: linear cost models fitted on measured samples (``neuroshard collect step``).

Each part is a small linear model over physically meaningful features (a fixed cost, a
per-peer latency, megabytes moved or touched), fitted with non-negative coefficients to
minimise relative error. Every feature is written once, here, as a function of what a
rank does, so the collector, the fit and the planner cannot disagree on a unit:

- ``input_dist``: one KJT input distribution of one lookup group (the splits, the int32
  lengths and the int64 indices all-to-alls) as seen by one rank;
- ``all_reduce``: the data-parallel gradient all-reduce of ``nbytes``;
- ``reduce_scatter`` / ``all_gather``: a row-wise group's pooled partial sums forward and
  their gradients backward, ``nbytes`` being the whole buffer every rank holds;
- ``dp_fwd`` / ``dp_bwd``: the dense TBE DMP runs for the data-parallel tables of one
  module at the local batch (forward; backward with the dense gradient and the update).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from torchrec_neuroshard.errors import ShardingError

MB = 1e6

DP_LOOKUP_FEATURES = ("k_lookups", "k_lookups_x_pressure", "lookup_mb_x_pressure")
"""Both data-parallel parts: thousands of lookups (each index costs, whatever its width),
and they and the MB they read times the cache pressure, the replicated weights' share of
``DP_UPDATE_KNEE_MB`` (at most 1): a lookup costs more as the tables together fill the
last-level cache. Without them one linear part misprices the 9-64 small read-heavy tables a
planner replicates at D = 8 by half (``python -m studies.dp_regimes``)."""

PART_FEATURES: dict[str, tuple[str, ...]] = {
    "input_dist": ("one", "peers", "send_mb", "recv_mb"),
    "all_reduce": ("one", "peers", "ring_mb"),
    "reduce_scatter": ("one", "peers", "ring_mb"),
    "all_gather": ("one", "peers", "ring_mb"),
    "dp_fwd": ("one", "lookup_mb", "output_mb", "lookup_mb_over_cache", *DP_LOOKUP_FEATURES),
    "dp_bwd": ("one", "lookup_mb", "output_mb", "table_mb", "table_mb_over_knee", *DP_LOOKUP_FEATURES),
}
"""The features of every part, in column order."""

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")

DP_UPDATE_KNEE_MB = 32.0
"""Above this many MB of data-parallel weights, the dense gradient and the update cost
several times more per MB (the 2-core AMD EPYC's data-parallel samples: its L3 is 32 MiB,
and glibc serves allocations above 32 MB by fresh mmaps, so each step's dense gradient
page-faults). ``dp_bwd``'s fifth feature is the MB beyond it."""

DP_CACHED_TABLE_MB = 1.0
"""A forward lookup into a table of at most this many MB costs less per MB read than one
into a larger table (its rows stay in cache: the 2-core AMD EPYC has 512 KiB of L2 a core).
``dp_fwd``'s fourth feature is the MB read from larger tables. Chosen on the validation split
of the "dp" and "dp_small" rows then stored (``cpu_step.jsonl.gz`` as of git e76beb9) by
``python -m studies.dp_cache_knee`` (results in studies/results/dp_cache_knee.md)."""


def input_dist_features(world_size: int, send_bytes: float, recv_bytes: float) -> list[float]:
    """One rank's share of one KJT input distribution: the bytes it sends to and receives
    from the other ranks (its own slice stays local)."""
    return [1.0, float(world_size - 1), send_bytes / MB, recv_bytes / MB]


def collective_features(op: str, world_size: int, nbytes: float) -> list[float]:
    """A ring collective over ``nbytes`` (the buffer every rank holds): an all-reduce
    moves 2 (D-1)/D of it per rank, a reduce-scatter or all-gather (D-1)/D."""
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}; one of {COLLECTIVES}")
    share = (world_size - 1) / world_size * (2.0 if op == "all_reduce" else 1.0)
    return [1.0, float(world_size - 1), share * nbytes / MB]


def dp_features(
    part: str,
    lookups: Sequence[float],
    dims: Sequence[int],
    rows: Sequence[int],
    local_batch: float,
    bytes_per_element: int,
    cached_table_mb: float = DP_CACHED_TABLE_MB,
) -> list[float]:
    """One dense TBE over one module's data-parallel tables at the local batch.

    Args:
        lookups: each table's lookups in the local batch (each reads, forward, and writes
            the gradient of, backward, ``dim`` weight elements);
        dims, rows: each table's width and rows;
        local_batch: the samples of the local batch (the pooled output is local batch x the
            summed dims);
        cached_table_mb: the knee of ``lookup_mb_over_cache`` (``DP_CACHED_TABLE_MB``; other
            values only to choose it, ``studies/dp_cache_knee.py``).

    Features: ``lookup_mb`` (the weights the lookups read), ``output_mb``, and forward
    ``lookup_mb_over_cache``, the part of ``lookup_mb`` read from tables larger than
    ``DP_CACHED_TABLE_MB``; backward ``table_mb`` (the dense gradient and the update of the
    whole weights) and the MB of them beyond ``DP_UPDATE_KNEE_MB``; both, last,
    ``DP_LOOKUP_FEATURES``.
    """
    if not len(lookups) == len(dims) == len(rows):
        raise ValueError(f"dp_features: {len(lookups)} lookups, {len(dims)} dims and {len(rows)} rows; one of each per table")
    table_mb = [r * d * bytes_per_element / MB for r, d in zip(rows, dims)]  # [T]
    read_mb = [n * d * bytes_per_element / MB for n, d in zip(lookups, dims)]  # [T]
    lookup_mb = sum(read_mb)
    output_mb = local_batch * sum(dims) * 4 / MB
    weights = sum(table_mb)
    pressure = min(weights, DP_UPDATE_KNEE_MB) / DP_UPDATE_KNEE_MB
    k_lookups = sum(lookups) / 1e3
    lookup_terms = [k_lookups, k_lookups * pressure, lookup_mb * pressure]
    if part == "dp_fwd":
        over_cache = sum(m for m, t in zip(read_mb, table_mb) if t > cached_table_mb)
        return [1.0, lookup_mb, output_mb, over_cache, *lookup_terms]
    if part == "dp_bwd":
        return [1.0, lookup_mb, output_mb, weights, max(0.0, weights - DP_UPDATE_KNEE_MB), *lookup_terms]
    raise ValueError(f"unknown data-parallel part {part!r}; one of 'dp_fwd', 'dp_bwd'")


@dataclass(frozen=True)
class LinearPart:
    """ms = features . coef, with coef >= 0 (a part never gets faster with more work)."""

    name: str
    coef: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.name not in PART_FEATURES:
            raise ShardingError(f"unknown step part {self.name!r}; known: {sorted(PART_FEATURES)}")
        if len(self.coef) != len(PART_FEATURES[self.name]):
            raise ShardingError(
                f"step part {self.name!r}: {len(self.coef)} coefficients for features {PART_FEATURES[self.name]}; "
                "a model fitted before these features changed: refit its step parts "
                "(`python -m torchrec_neuroshard.lab.refit_steps --model MODEL --data STEP_DATA --out MODEL`)"
            )
        if not all(np.isfinite(c) and c >= 0 for c in self.coef):
            raise ShardingError(f"step part {self.name!r}: coefficients must be finite and >= 0, got {self.coef}")

    @property
    def features(self) -> tuple[str, ...]:
        return PART_FEATURES[self.name]

    def predict(self, x: np.ndarray) -> np.ndarray:
        """ms [N] of feature rows x [N, F]."""
        return np.asarray(x, dtype=np.float64) @ np.asarray(self.coef)

    @staticmethod
    def fit(name: str, x: np.ndarray, y_ms: np.ndarray) -> "LinearPart":
        """Non-negative least squares on relative error: rows weighted by 1 / y."""
        from scipy.optimize import nnls

        x, y = np.asarray(x, dtype=np.float64), np.asarray(y_ms, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != len(PART_FEATURES[name]) or len(y) != len(x):
            raise ShardingError(f"step part {name!r}: features {x.shape} do not match {PART_FEATURES[name]} / targets {y.shape}")
        if len(y) < 2 * x.shape[1] or not np.all(np.isfinite(y)) or np.any(y <= 0):
            raise ShardingError(
                f"step part {name!r}: need >= {2 * x.shape[1]} finite positive timings, got {len(y)}; "
                "collect more with `neuroshard collect step`"
            )
        weight = 1.0 / y
        coef, _ = nnls(x * weight[:, None], np.ones_like(y))
        return LinearPart(name, tuple(float(c) for c in coef))


@dataclass(frozen=True)
class StepParts:
    """The fitted parts of one hardware kind, by name (a model file stores them)."""

    parts: Mapping[str, LinearPart]

    def __post_init__(self) -> None:
        for name, part in self.parts.items():
            if name != part.name:
                raise ShardingError(f"step part stored as {name!r} is a {part.name!r} part")

    def has(self, *names: str) -> bool:
        return all(n in self.parts for n in names)

    def predict(self, name: str, x: Sequence[Sequence[float]] | np.ndarray) -> np.ndarray:
        if name not in self.parts:
            raise ShardingError(
                f"this cost model has no {name!r} part; collect it (`neuroshard collect step`) and pretrain"
            )
        return self.parts[name].predict(np.asarray(x, dtype=np.float64).reshape(-1, len(PART_FEATURES[name])))

    def to_dict(self) -> dict:
        return {name: list(p.coef) for name, p in sorted(self.parts.items())}

    @staticmethod
    def from_dict(d: Mapping[str, Sequence[float]]) -> "StepParts":
        return StepParts({name: LinearPart(name, tuple(float(c) for c in coef)) for name, coef in d.items()})
