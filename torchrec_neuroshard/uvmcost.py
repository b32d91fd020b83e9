"""The price of the UVM kernels: what a shard adds to its fused kernel's cost when its
table lives in host memory (fused_uvm) or behind an HBM cache (fused_uvm_caching).

The neural cost model learned the fused kernel in HBM. A shard on a UVM kernel costs that
(its lookups, pooling and update are the same kernel's work) plus a penalty linear in four
quantities of one step (``features``): its lookups' bytes, its lookups, its unique rows'
bytes and the bytes of the unique rows its cache misses. A shard of ``width`` columns whose
kernel sees L = pooling x batch lookups of U unique rows (from the access histogram: U = L /
the mean accesses of a unique row, each bin at a representative count, ``BIN_COUNTS``):

- fused_uvm reads every lookup's row over UVM forward, and each unique row's update goes
  back to host memory backward;
- fused_uvm_caching looks every lookup up in the cache; the cache (``cache_load_factor`` x
  rows slots) holds the hottest rows: rows accessed twice or more in a batch fill it from
  the most accessed down, and its room beyond them holds rows seen once at random (a share
  room / the rows not hot). M unique rows missed are fetched forward and written back;
- fused: nothing.

``UvmPricing`` holds the ms per unit of each quantity, per kernel and phase. The shipped
pricing (``pretrained/uvm.json``, ``UvmPricing.shipped``) is FITTED to fused_uvm and
fused_uvm_caching kernels measured on a GPU against the same shards in HBM
(``lab.fit_uvm`` on ``lab.measure_uvm``'s samples; its file names the GPU, the samples and
the held-out error). ``UvmPricing.stand_in`` is the analytic price used before that
measurement (TorchRec's convention: bytes at ``hbm_to_ddr_mem_bw / 10``), kept to compare.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from torchrec_neuroshard.kernels import UVM_KERNELS, ComputeKernel
from torchrec_neuroshard.types import NUM_ACCESS_BINS, CostModel, Shard, TableSpec

SHIPPED = Path(__file__).parent / "pretrained" / "uvm.json"
FEATURES = ("lookup_gb", "lookups_m", "unique_gb", "missed_gb")
"""A shard's quantities of one step: GB its lookups read, millions of lookups, GB of its
unique rows, GB of the unique rows its cache misses."""
UVM_EFFICIENCY = 0.1
"""The stand-in's share of ``hbm_to_ddr_mem_bw`` random row gathers over UVM reach (TorchRec's ``/ 10``)."""
BIN_COUNTS = np.asarray([1.0, 2.0] + [1.5 * 2.0**j for j in range(1, NUM_ACCESS_BINS - 2)] + [1.5 * 2.0**15])
"""A representative access count of each access-histogram bin: 1, 2, then the middle of
(2^j, 2^(j+1)], and 1.5 x 32768 for the open last bin. [17]"""


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


def _cached_shares(rows: np.ndarray, hists: np.ndarray, unique: np.ndarray, load_factor: np.ndarray) -> np.ndarray:
    """``cached_share`` of U tables of ``rows``, ``unique`` rows and ``load_factor`` [U] each
    and histograms ``hists`` [U, 17], at once: the same arithmetic, elementwise."""
    room = load_factor * rows  # [U]
    per_bin = unique[:, None] * hists  # [U, 17] unique rows of each bin
    cached = np.zeros(len(rows))  # [U]
    for b in range(NUM_ACCESS_BINS - 1, 0, -1):  # the most accessed bins first, singletons last
        take = np.minimum(per_bin[:, b], room)
        cached, room = cached + take, room - take
    cold_rows = np.maximum(1.0, rows - (unique - per_bin[:, 0]))
    cached = cached + per_bin[:, 0] * np.minimum(1.0, room / cold_rows)
    return np.where(unique > 0, np.minimum(1.0, cached / np.where(unique > 0, unique, 1.0)), 1.0)


def features(shard: Shard, batch_size: int) -> np.ndarray:
    """``FEATURES`` of ``shard`` at ``batch_size`` (the batch its kernel sees), [4]."""
    table = shard.table
    row_gb = shard.width * table.bytes_per_element / 1e9
    lookups = table.pooling_factor * batch_size
    unique = unique_rows(table, batch_size)
    missed = unique * (1.0 - cached_share(table, batch_size, table.cache_load_factor)) if table.kernel.cached else 0.0
    return np.asarray([lookups * row_gb, lookups / 1e6, unique * row_gb, missed * row_gb])


@dataclass(frozen=True)
class UvmPricing:
    """ms per unit of each of ``FEATURES``, forward and backward, per UVM kernel (by value):
    ``coefficients[kernel] = (forward [4], backward [4])``; ``source`` says where they come from."""

    coefficients: Mapping[str, tuple[tuple[float, ...], tuple[float, ...]]]
    source: str

    def __post_init__(self) -> None:
        for kernel in UVM_KERNELS:
            fwd, bwd = self.coefficients.get(kernel.value, ((), ()))
            if len(fwd) != len(FEATURES) or len(bwd) != len(FEATURES):
                raise ValueError(f"UVM pricing needs {len(FEATURES)} forward and backward coefficients for {kernel.value}, got {fwd!r} {bwd!r}")

    def penalty_ms(self, shards: Sequence[Shard], batch_size: int) -> np.ndarray:
        """(forward, backward) ms each shard's kernel adds to the fused one, [N, 2]."""
        out = np.zeros((len(shards), 2))
        for i, shard in enumerate(shards):
            if shard.table.kernel is not ComputeKernel.FUSED:
                fwd, bwd = self.coefficients[shard.table.kernel.value]
                x = features(shard, batch_size)  # [4]
                out[i] = (float(np.dot(fwd, x)), float(np.dot(bwd, x)))
        return out

    def whole_table_penalties(self, tables: Sequence[TableSpec], kernels: Sequence[tuple[ComputeKernel, float | None]], batch_size: int) -> np.ndarray:
        """[N] forward + backward ms each of N ``tables`` adds whole (every column) on its
        (kernel, cache load factor) of ``kernels``: ``penalty_ms`` of each, the same
        arithmetic, done together (the offload stage prices ~9 kernels of each of
        thousands of tables)."""
        out = np.zeros(len(tables))  # [N] 0 for fused
        uvm = [i for i, (kernel, _) in enumerate(kernels) if kernel is not ComputeKernel.FUSED]
        if not uvm:
            return out
        specs = [tables[i] for i in uvm]
        lookups = np.asarray([t.pooling_factor * batch_size for t in specs])  # [U]
        row_gb = np.asarray([t.dim * t.bytes_per_element / 1e9 for t in specs])  # [U]
        unique = np.asarray([unique_rows(t, batch_size) for t in specs])  # [U]
        caching = np.asarray([kernels[i][0].cached for i in uvm])  # [U]
        factor = np.asarray([kernels[i][1] if kernels[i][0].cached else 1.0 for i in uvm], dtype=np.float64)  # [U]
        rows = np.asarray([float(t.rows) for t in specs])  # [U]
        hists = np.asarray([t.access_hist for t in specs], dtype=np.float64)  # [U, 17]
        missed = np.where(caching, unique * (1.0 - _cached_shares(rows, hists, unique, factor)), 0.0)  # [U]
        x = (lookups * row_gb, lookups / 1e6, unique * row_gb, missed * row_gb)  # 4 x [U], ``features``
        coef = np.asarray([self.coefficients[kernels[i][0].value] for i in uvm])  # [U, 2 (fwd, bwd), 4]
        fwd, bwd = (((c[:, 0] * x[0] + c[:, 1] * x[1]) + c[:, 2] * x[2]) + c[:, 3] * x[3] for c in (coef[:, 0], coef[:, 1]))
        out[uvm] = fwd + bwd  # the dot products summed in order, as np.dot of 4 sums them
        return out

    @staticmethod
    def stand_in(hbm_to_ddr_bytes_per_ms: float) -> "UvmPricing":
        """The analytic stand-in: fused_uvm reads its lookups' rows forward and reads and
        writes its unique rows backward, fused_uvm_caching fetches and writes back its
        missed rows, all at ``hbm_to_ddr_mem_bw / 10``; the cache lookups are free."""
        if not hbm_to_ddr_bytes_per_ms > 0:
            raise ValueError(f"hbm_to_ddr_bytes_per_ms must be positive, got {hbm_to_ddr_bytes_per_ms!r}")
        per_gb = 1e9 / (hbm_to_ddr_bytes_per_ms * UVM_EFFICIENCY)
        return UvmPricing(
            {
                ComputeKernel.FUSED_UVM.value: ((per_gb, 0, 0, 0), (0, 0, 2 * per_gb, 0)),
                ComputeKernel.FUSED_UVM_CACHING.value: ((0, 0, 0, per_gb), (0, 0, 0, per_gb)),
            },
            f"analytic stand-in: bytes at hbm_to_ddr_mem_bw / 10 ({hbm_to_ddr_bytes_per_ms * UVM_EFFICIENCY / 1e6:.2f} GB/s)",
        )

    @staticmethod
    def shipped(path: Path = SHIPPED) -> "UvmPricing":
        """The pricing fitted to UVM kernels measured on a GPU (``lab.fit_uvm``), read once
        per file and modification time."""
        return _read_pricing(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_pricing(path: Path, mtime_ns: int) -> UvmPricing:
    d = json.loads(path.read_text())
    coefficients = {k: (tuple(v["forward"]), tuple(v["backward"])) for k, v in d["coefficients"].items()}
    return UvmPricing(coefficients, d["source"])


class UvmPricedModel(CostModel):
    """``base`` (the neural model of the fused kernel) with each shard's UVM penalty
    (``pricing``) carried as two extra embedding columns (forward, backward ms): penalties add
    over a device's shards, so the search prices a device as before, with one vector add."""

    def __init__(self, base: CostModel, pricing: UvmPricing, batch_size: int) -> None:
        self.base = base
        self.pricing = pricing
        self.batch_size = int(batch_size)

    def embed_shards(self, shards: Sequence[Shard]) -> np.ndarray:
        emb = self.base.embed_shards(shards)  # [N, E]
        extra = self.pricing.penalty_ms(shards, self.batch_size).astype(emb.dtype)  # [N, 2]
        return np.concatenate([emb, extra], axis=1)  # [N, E + 2]

    def device_cost(self, pooled: np.ndarray) -> np.ndarray:
        return self.base.device_cost(pooled[:, :-2]) + pooled[:, -2:]  # [N, 2]

    def comm_cost_array(self, dims: np.ndarray, skews_ms: np.ndarray) -> np.ndarray:
        return self.base.comm_cost_array(dims, skews_ms)

    def wait_free_comm(self, dims: np.ndarray) -> np.ndarray | None:
        return self.base.wait_free_comm(dims)

    def for_tables(self, tables: Sequence[TableSpec]) -> "UvmPricedModel":
        return UvmPricedModel(self.base.for_tables(tables), self.pricing, self.batch_size)

    def with_batch_size(self, batch_size: int) -> "UvmPricedModel":
        return UvmPricedModel(self.base.with_batch_size(batch_size), self.pricing, batch_size)

    @property
    def step_parts(self):  # noqa: ANN201 - the base's
        return self.base.step_parts
