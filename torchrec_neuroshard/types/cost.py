"""The cost-model interface the search prices plans with, and one device's priced cost."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from torchrec_neuroshard.errors import ShardingError
from torchrec_neuroshard.types.table import Shard, TableSpec

if TYPE_CHECKING:
    from torchrec_neuroshard.steparts import StepParts

@dataclass(frozen=True)
class DeviceCost:
    """Cost of one device in ms: fused-kernel compute and the pooled all-to-all."""

    fwd_compute: float
    bwd_compute: float
    fwd_comm: float
    bwd_comm: float

    @property
    def compute(self) -> float:
        """Forward and backward kernel ms."""
        return self.fwd_compute + self.bwd_compute

    @property
    def total(self) -> float:
        return self.compute + self.fwd_comm + self.bwd_comm


class CostModel(abc.ABC):
    """Predicts the costs the search optimises. Units: ms. Implementations are stateless.

    Compute is additive in an embedding space, as a DeepSets model is: a device's cost is
    ``device_cost(sum of embed_shards(its shards))``. That is what lets the search add a
    shard to a device with one vector add and one small head evaluation.
    """

    @abc.abstractmethod
    def embed_shards(self, shards: Sequence[Shard]) -> np.ndarray:
        """Per-shard embeddings, float32 [len(shards), E]."""

    @abc.abstractmethod
    def device_cost(self, pooled: np.ndarray) -> np.ndarray:
        """(forward ms, backward ms) [N, 2] of devices whose shard embeddings sum to
        ``pooled`` [N, E]. Callers give empty devices cost 0 themselves."""

    @abc.abstractmethod
    def comm_cost_array(self, dims: np.ndarray, skews_ms: np.ndarray) -> np.ndarray:
        """Per-device (forward ms, backward ms) all-to-all cost [R, D, 2] of R plans.

        ``dims`` [R, D] is each device's dim sum; ``skews_ms`` [R, D] each device's
        forward-compute lateness relative to the earliest device.
        """

    def for_tables(self, tables: Sequence[TableSpec]) -> "CostModel":
        """The model pricing only ``tables``' shards, in embeddings as narrow as those need
        (the search's hot loops add and copy them); default ``self``."""
        return self

    def wait_free_comm(self, dims: np.ndarray) -> np.ndarray | None:
        """``comm_cost_array`` without the forward's wait, where the comm model has that
        form (``CommModel.wait_free_cost``); default None: it has not."""
        return None

    def with_batch_size(self, batch_size: int) -> "CostModel":
        """The model predicting at global batch ``batch_size``; the search calls this with
        its task's batch, so callers never rescale. Default: batch-independent."""
        return self

    @property
    def step_parts(self) -> "StepParts | None":
        """The fitted models of the step's parts beyond the kernels and the pooled
        all-to-all (``steparts``); default none: those parts are not priced."""
        return None

    def compute_cost(
        self, devices: Sequence[Sequence[Shard]], embed: Callable[[Sequence[Shard]], np.ndarray] | None = None
    ) -> list[tuple[float, float]]:
        """(forward ms, backward ms) of one fused kernel per device; empty costs (0, 0).
        ``embed`` (default ``embed_shards``) lets a caller reuse cached embeddings.

        Raises ``ShardingError`` naming the tables of a device whose prediction is not
        finite (an exp that overflowed far outside the kernels the model learned), rather
        than letting an inf or NaN cost rank plans."""
        flat = [s for dev in devices for s in dev]
        if not flat:
            return [(0.0, 0.0)] * len(devices)
        emb = (embed or self.embed_shards)(flat)  # [S, E]
        index = np.repeat(np.arange(len(devices)), [len(dev) for dev in devices])  # [S]
        pooled = np.zeros((len(devices), emb.shape[1]), dtype=emb.dtype)  # [N, E]
        np.add.at(pooled, index, emb)
        with np.errstate(over="ignore", invalid="ignore"):  # refused below, by name
            cost = self.device_cost(pooled)  # [N, 2]
        cost[[len(dev) == 0 for dev in devices]] = 0.0
        _refuse_non_finite(cost, devices)
        return [(float(f), float(b)) for f, b in cost]

    def embedding_cost(self, fwd: np.ndarray, bwd: np.ndarray, dims: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Comm [R, D, 2] and embedding cost [R] (ms) of R plans from their per-device
        compute ``fwd``, ``bwd`` and dim sums ``dims`` [R, D]: each device's forward skew is
        its lateness behind the earliest; the cost is the max over devices of compute + comm."""
        comm = self.comm_cost_array(dims, fwd - fwd.min(1, keepdims=True))
        return comm, (fwd + bwd + comm.sum(2)).max(1)


def _refuse_non_finite(cost: np.ndarray, devices: Sequence[Sequence[Shard]]) -> None:
    """Raise ``ShardingError`` naming the tables of the first device whose (forward,
    backward) ms in ``cost`` [N, 2] are not finite."""
    bad = np.flatnonzero(~np.isfinite(cost).all(1))
    if not bad.size:
        return
    shards = devices[int(bad[0])]
    worst = max(shards, key=lambda s: s.table.pooling_factor).table
    raise ShardingError(
        f"the cost model predicts {cost[bad[0]].tolist()} ms for a kernel of tables "
        f"{sorted({s.table.name for s in shards})}: not finite, so they lie far outside the kernels it "
        f"learned (e.g. table {worst.name!r}: {worst.pooling_factor:g} lookups per sample on "
        f"{worst.rows:,} rows); check their pooling factors, calibrate on such kernels "
        "(`neuroshard calibrate`), or plan them with TorchRec's planner"
    )
