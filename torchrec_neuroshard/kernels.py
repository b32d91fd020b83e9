"""Compute kernels of a sharded table and the memory each takes, as TorchRec counts it.

A table's weights live where its kernel keeps them (TorchRec's ``EmbeddingComputeKernel``):

- ``fused``: in the GPU's HBM (on a CPU topology, in DDR: the CPU's only memory);
- ``fused_uvm_caching``: in host memory (DDR, reached over UVM), with an HBM cache of
  ``cache_load_factor`` x rows of the hottest rows;
- ``fused_uvm``: in host memory, every lookup read over UVM.

``shard_storage`` is TorchRec 1.8's ``calculate_shard_storages`` for these kernels
(training, no pipelining) on a cuda topology, to the byte: the tests compare it with
TorchRec's ``EmbeddingStorageEstimator``. This module imports only the package's errors, so
``types`` can count every plan's memory with it.
"""

from __future__ import annotations

import enum
import math
import numbers

from torchrec_neuroshard.errors import ShardingError


class ComputeKernel(str, enum.Enum):
    """The kernels NeuroShard plans; the values are TorchRec's ``EmbeddingComputeKernel`` values."""

    FUSED = "fused"
    FUSED_UVM_CACHING = "fused_uvm_caching"
    FUSED_UVM = "fused_uvm"

    @property
    def in_host_memory(self) -> bool:
        """The weights (and optimizer state) live in host memory (DDR)."""
        return self is not ComputeKernel.FUSED

    @property
    def cached(self) -> bool:
        return self is ComputeKernel.FUSED_UVM_CACHING


UVM_KERNELS = frozenset({ComputeKernel.FUSED_UVM_CACHING, ComputeKernel.FUSED_UVM})
CACHE_AUX_BYTES_PER_ROW = 4
"""UVM caching's ``cache_index_table_map``: one int32 per row of the table (shard)."""
CACHE_AUX_BYTES_PER_SLOT = 16
"""UVM caching's ``lxu_cache_state`` and ``lru_state``: two int64 per cache slot."""


def sharder_load_factor(sharder: object) -> float | None:
    """The cache load factor a sharder's ``fused_params`` set (a ``ModuleSharder`` or
    TorchRec's ``SharderData``), None if unset: TorchRec's planner and kernels take it for a
    UVM cache without ``cache_params``."""
    return (getattr(sharder, "fused_params", None) or {}).get("cache_load_factor")


def kernel_of(value: object, table: str) -> ComputeKernel:
    """``value`` ("fused", "fused_uvm", "fused_uvm_caching" or a ``ComputeKernel``) as a
    ``ComputeKernel``, or a ``ShardingError`` naming ``table`` and the kernels we plan."""
    if type(value) is ComputeKernel:
        return value
    try:
        return ComputeKernel(value)
    except ValueError:
        raise ShardingError(
            f"table {table!r}: compute kernel {value!r} is not one NeuroShard plans; use one of "
            f"{[k.value for k in ComputeKernel]}, or plan this table with TorchRec's planner"
        ) from None


def check_cache_load_factor(kernel: ComputeKernel, load_factor: object, table: str) -> float | None:
    """The cache load factor of a table on ``kernel``: a number in (0, 1] for
    fused_uvm_caching, None for the other kernels; else a ``ShardingError`` naming the table."""
    if not kernel.cached:
        if load_factor is not None:
            raise ShardingError(
                f"table {table!r}: cache_load_factor {load_factor!r} given for the {kernel.value} kernel, "
                "which caches nothing; drop it, or use fused_uvm_caching"
            )
        return None
    ok = isinstance(load_factor, numbers.Real) and not isinstance(load_factor, bool) and 0 < load_factor <= 1
    if not ok:
        raise ShardingError(
            f"table {table!r}: fused_uvm_caching needs a cache_load_factor in (0, 1] (the share of its rows "
            f"cached in HBM), got {load_factor!r}"
        )
    return float(load_factor)


def shard_storage(
    table_rows: int,
    table_dim: int,
    shard_rows: int,
    shard_width: int,
    bytes_per_element: int,
    optimizer_multiplier: float,
    io_bytes: int,
    kernel: ComputeKernel,
    load_factor: float | None,
) -> tuple[int, int]:
    """(HBM bytes, DDR bytes) of one shard of ``shard_rows`` x ``shard_width`` of a
    ``table_rows`` x ``table_dim`` table, as TorchRec's storage estimator counts it on cuda:
    ``io_bytes`` (input indices and pooled output of one step) always in HBM; the weights
    and their optimizer state in HBM for fused, in DDR for the UVM kernels; fused_uvm_caching
    adds in HBM its cache (``round(table bytes x load_factor)``, this shard's share, with
    optimizer state) and the cache's bookkeeping (rows x (4 + 16 x load_factor) bytes)."""
    table_bytes = table_rows * table_dim * bytes_per_element
    share = shard_rows * shard_width
    full = table_rows * table_dim
    weights = math.ceil(table_bytes * share / full)
    with_state = weights + math.ceil(weights * optimizer_multiplier)
    if kernel is ComputeKernel.FUSED:
        return with_state + io_bytes, 0
    if kernel is ComputeKernel.FUSED_UVM:
        return io_bytes, with_state
    cache = math.ceil(round(table_bytes * load_factor) * share / full)
    aux = math.ceil(shard_rows * (CACHE_AUX_BYTES_PER_ROW + load_factor * CACHE_AUX_BYTES_PER_SLOT))
    return cache + math.ceil(cache * optimizer_multiplier) + aux + io_bytes, with_state
