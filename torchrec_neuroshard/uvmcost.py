"""The analytic STAND-IN price of the UVM kernels, until they are measured.

The neural cost model learned the fused kernel in HBM. A shard on a UVM kernel costs that
(its lookups, pooling and update are the same kernel's work) plus the bytes it moves
between host memory and the GPU over UVM each step, at TorchRec's convention for UVM
bandwidth: the topology's ``hbm_to_ddr_mem_bw`` divided by 10 (``kernel_bw_lookup`` prices
fused_uvm at ``hbm_to_ddr_mem_bw / 10``; random row gathers use a tenth of the link).

Bytes per step of a shard of ``width`` columns whose kernel sees L = pooling x batch
lookups of U unique rows (from the access histogram: U = L / the mean accesses of a
unique row, each bin at a representative count, ``BIN_COUNTS``):

- fused_uvm: forward reads every lookup's row over UVM (L rows); backward reads and
  writes each unique row once for the update (2 U rows);
- fused_uvm_caching: the HBM cache (``cache_load_factor`` x rows slots) holds the hottest
  rows: rows accessed twice or more in a batch fill it from the most accessed down, and
  its room beyond them holds rows seen once in a batch at random (a share room / the
  rows not hot). Each unique row missed is fetched forward and written back backward
  when evicted (M rows each way);
- fused: nothing.

It is a stand-in: the hit rate of a real LRU/LFU cache across batches, prefetching and
the link's sharing with the NIC are not modelled. The planner says so in its log when a
plan holds UVM kernels; the step it predicts for them is labelled a prediction.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from torchrec_neuroshard.kernels import ComputeKernel
from torchrec_neuroshard.types import NUM_ACCESS_BINS, CostModel, Shard, TableSpec

UVM_EFFICIENCY = 0.1
"""Share of ``hbm_to_ddr_mem_bw`` random row gathers over UVM reach (TorchRec's ``/ 10``)."""
BIN_COUNTS = np.asarray([1.0, 2.0] + [1.5 * 2.0**j for j in range(1, NUM_ACCESS_BINS - 2)] + [1.5 * 2.0**15])
"""A representative access count of each access-histogram bin: 1, 2, then the middle of
(2^j, 2^(j+1)], and 1.5 x 32768 for the open last bin. [17]"""
STAND_IN_NOTE = (
    "UVM kernels (fused_uvm, fused_uvm_caching) are priced by an analytic STAND-IN, not a measurement: "
    "the fused kernel's predicted cost plus the rows missed in HBM moved at hbm_to_ddr_mem_bw / 10 "
    "(uvmcost module docstring); measure them on a GPU before trusting those predictions"
)


def unique_rows(table: TableSpec, batch_size: int) -> float:
    """Expected unique rows one step's lookups touch (at most the table's rows)."""
    lookups = table.pooling_factor * batch_size
    mean_count = float(np.dot(np.asarray(table.access_hist), BIN_COUNTS))  # [17] . [17]
    return min(float(table.rows), lookups / max(mean_count, 1.0))


def cached_share(table: TableSpec, batch_size: int, load_factor: float) -> float:
    """Share of a step's unique rows found in a cache of ``load_factor`` x rows slots that
    holds the hottest rows (see the module docstring)."""
    unique = unique_rows(table, batch_size)
    if unique <= 0:
        return 1.0
    room = load_factor * table.rows
    per_bin = unique * np.asarray(table.access_hist)  # [17] unique rows of each bin
    cached = 0.0
    for rows_in_bin in per_bin[:0:-1]:  # the most accessed bins first, singletons last
        take = min(rows_in_bin, room)
        cached, room = cached + take, room - take
    hot = unique - per_bin[0]
    cold_rows = max(1.0, table.rows - hot)
    cached += per_bin[0] * min(1.0, room / cold_rows)
    return min(1.0, cached / unique)


def host_bytes(shard: Shard, batch_size: int) -> tuple[float, float]:
    """(forward, backward) bytes ``shard`` moves over UVM in one step at ``batch_size``
    (the batch its kernel sees), on its table's kernel."""
    table = shard.table
    if table.kernel is ComputeKernel.FUSED:
        return 0.0, 0.0
    row_bytes = shard.width * table.bytes_per_element
    unique = unique_rows(table, batch_size)
    if table.kernel is ComputeKernel.FUSED_UVM:
        return table.pooling_factor * batch_size * row_bytes, 2 * unique * row_bytes
    missed = unique * (1.0 - cached_share(table, batch_size, table.cache_load_factor))
    return missed * row_bytes, missed * row_bytes


def penalty_ms(shards: Sequence[Shard], batch_size: int, hbm_to_ddr_bytes_per_ms: float) -> np.ndarray:
    """(forward, backward) ms each shard's UVM traffic adds, [N, 2]."""
    rate = hbm_to_ddr_bytes_per_ms * UVM_EFFICIENCY
    return np.asarray([host_bytes(s, batch_size) for s in shards], dtype=np.float64).reshape(-1, 2) / rate


class UvmPricedModel(CostModel):
    """``base`` (the neural model of the fused kernel) with each shard's UVM stand-in
    penalty carried as two extra embedding columns (forward, backward ms): penalties add
    over a device's shards, so the search prices a device as before, with one vector add."""

    def __init__(self, base: CostModel, hbm_to_ddr_bytes_per_ms: float, batch_size: int) -> None:
        if not hbm_to_ddr_bytes_per_ms > 0:
            raise ValueError(f"hbm_to_ddr_bytes_per_ms must be positive, got {hbm_to_ddr_bytes_per_ms!r}")
        self.base = base
        self.bandwidth = float(hbm_to_ddr_bytes_per_ms)
        self.batch_size = int(batch_size)

    def embed_shards(self, shards: Sequence[Shard]) -> np.ndarray:
        emb = self.base.embed_shards(shards)  # [N, E]
        extra = penalty_ms(shards, self.batch_size, self.bandwidth).astype(emb.dtype)  # [N, 2]
        return np.concatenate([emb, extra], axis=1)  # [N, E + 2]

    def device_cost(self, pooled: np.ndarray) -> np.ndarray:
        return self.base.device_cost(pooled[:, :-2]) + pooled[:, -2:]  # [N, 2]

    def comm_cost_array(self, dims: np.ndarray, skews_ms: np.ndarray) -> np.ndarray:
        return self.base.comm_cost_array(dims, skews_ms)

    def with_batch_size(self, batch_size: int) -> "UvmPricedModel":
        return UvmPricedModel(self.base.with_batch_size(batch_size), self.bandwidth, batch_size)

    @property
    def step_parts(self):  # noqa: ANN201 - the base's
        return self.base.step_parts
