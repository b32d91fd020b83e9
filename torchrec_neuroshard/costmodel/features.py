"""The features the cost nets read, their normaliser, and the range they were trained on.

A shard's features (``SHARD_FEATURES``) describe its table and width, and for a net that
learned the batch (``BATCH_FEATURE``) the global batch its kernel runs; a device's comm
features (``DEVICE_FEATURES``) its own dim sum and skew and summaries pooled over all
devices, so the comm net is permutation-equivariant over devices. Every model file records
the range of every shard feature each compute net was trained on (``FeatureRange``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from torchrec_neuroshard.types import NUM_ACCESS_BINS, Shard, ShardingError

SHARD_FEATURES = (
    "log_rows", "width", "log_width", "pooling_factor", "log_pooling", "log_lookup_bytes",
    "log_size_bytes", "bytes_per_element",
    *(f"access_bin_{i}" for i in range(NUM_ACCESS_BINS)),
)  # fmt: skip
DEVICE_FEATURES = (
    "dim", "skew_ms", "wait_ms", "send_dim", "recv_dim", "mean_dim", "max_dim", "min_dim",
    "max_skew_ms", "world_size", "inv_world_size",
)  # fmt: skip
BATCH_FEATURE = "log_batch"
"""The log of the global batch a kernel runs, read after ``SHARD_FEATURES`` by a compute net
trained on samples at several batches (``ComputeNet.reads_batch``); a net trained at one
batch does not read it, and its cost scales linearly with the batch instead."""
WIDTH_FEATURE = SHARD_FEATURES.index("width")
POOLING_FEATURE = SHARD_FEATURES.index("pooling_factor")

RANGE_TOLERANCE = 1.0
"""How far outside its trained range a shard feature may lie, in the training standard
deviations the net's normaliser divides by, before ``feature_range_warning`` names it.
Every feature is clamped into the range whatever the distance; nearer than this, the clamp
moved the shipped CPU model's price of uniformly read tables (500 to 300,000 rows) by 11%
at most, about its test error, where a 1,000-row table read 20 times per sample, 24
deviations out, moved 4-9x."""


def feature_names(reads_batch: bool) -> tuple[str, ...]:
    """The features a compute net reads: ``SHARD_FEATURES``, then ``BATCH_FEATURE`` if it reads the batch."""
    return SHARD_FEATURES + (BATCH_FEATURE,) * reads_batch


def shard_features(shards: Sequence[Shard], batch_size: int | None = None) -> torch.Tensor:
    """Raw features of each shard, float32 [len(shards), F]: ``SHARD_FEATURES``, and the log
    of ``batch_size`` last when one is given (``feature_names(True)``)."""
    extra = [math.log(batch_size)] if batch_size is not None else []
    rows = []
    for s in shards:
        t = s.table
        lookups = t.pooling_factor * s.width
        rows.append(
            [
                math.log(t.rows), s.width, math.log(s.width), t.pooling_factor,
                math.log1p(t.pooling_factor), math.log1p(lookups * t.bytes_per_element),
                math.log(t.size_bytes(s.width)), t.bytes_per_element, *t.access_hist, *extra,
            ]  # fmt: skip
        )
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(SHARD_FEATURES) + len(extra))


def device_features(dims: np.ndarray, skews_ms: np.ndarray) -> np.ndarray:
    """Per-device comm features of R plans: dims, skews [R, D] -> float32 [R, D, F].

    Dims are in hundreds of columns; skews in ms. Every feature is either the device's
    own or pooled symmetrically over the plan's devices, so the model is equivariant.
    """
    d = np.asarray(dims, dtype=np.float32) / 100.0
    s = np.asarray(skews_ms, dtype=np.float32)
    r, n = d.shape
    # What each rank moves in the forward all-to-all, per sample of the global batch:
    # it sends its own columns to the n - 1 others and receives theirs, each 1/n of the batch.
    send = d * (n - 1) / n
    recv = (d.sum(1, keepdims=True) - d) / n
    pooled = np.stack(
        [d.mean(1), d.max(1), d.min(1), s.max(1), np.full(r, n / 8.0), np.full(r, 1.0 / n)],
        axis=1,
    )
    own = np.stack([d, s, s.max(1, keepdims=True) - s, send, recv], axis=2)
    return np.concatenate([own, np.broadcast_to(pooled[:, None, :], (r, n, pooled.shape[1]))], axis=2).astype(np.float32)


@dataclass(frozen=True)
class Normalizer:
    """z-score statistics of a feature matrix (std floored so constant features stay 0)."""

    mean: torch.Tensor
    std: torch.Tensor

    @staticmethod
    def fit(x: torch.Tensor) -> "Normalizer":
        return Normalizer(x.mean(0), x.std(0).clamp_min(1e-3))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def state(self) -> dict:
        return {"mean": self.mean.tolist(), "std": self.std.tolist()}

    @staticmethod
    def from_state(d: dict) -> "Normalizer":
        return Normalizer(torch.tensor(d["mean"]), torch.tensor(d["std"]))


@dataclass(frozen=True)
class FeatureRange:
    """The smallest and largest value of each raw feature a compute net reads
    (``feature_names``) in the samples it was trained on: ``low``, ``high`` float32 [F]. A
    model file records it in ``meta["feature_range"]`` (a sequence net's in
    ``meta["sequence"]``)."""

    low: torch.Tensor
    high: torch.Tensor

    def __post_init__(self) -> None:
        counts = (len(SHARD_FEATURES), len(feature_names(True)))
        if self.low.ndim != 1 or self.low.shape != self.high.shape or len(self.low) not in counts:
            raise ShardingError(
                f"a feature range needs {counts[0]} or {counts[1]} lows and highs (one per feature its net reads), got "
                f"{list(self.low.shape)} and {list(self.high.shape)}; re-run `neuroshard pretrain`"
            )
        if not (self.low.isfinite().all() and self.high.isfinite().all() and (self.low <= self.high).all()):
            raise ShardingError("a feature range needs finite lows no greater than its highs; re-run `neuroshard pretrain`")

    @staticmethod
    def fit(x: torch.Tensor) -> "FeatureRange":
        """The range of the feature rows x [N, F]."""
        return FeatureRange(x.min(0).values, x.max(0).values)

    def union(self, other: "FeatureRange") -> "FeatureRange":
        return FeatureRange(torch.minimum(self.low, other.low), torch.maximum(self.high, other.high))

    def clamp(self, x: torch.Tensor) -> torch.Tensor:
        """Feature rows x [N, F] with every feature clamped into the range: rows inside it
        come back bit for bit."""
        return torch.clamp(x, self.low, self.high)

    def state(self) -> dict:
        return {"low": self.low.tolist(), "high": self.high.tolist()}

    @staticmethod
    def from_state(d: dict) -> "FeatureRange":
        return FeatureRange(torch.tensor(d["low"], dtype=torch.float32), torch.tensor(d["high"], dtype=torch.float32))
