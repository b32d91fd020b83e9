"""Tables and their shards as the cost model and the memory count see them, and the
sharding kinds a table may take."""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import asdict, dataclass, fields
from typing import Sequence

import numpy as np

from torchrec_neuroshard.errors import ShardingError
from torchrec_neuroshard.kernels import ComputeKernel, check_cache_load_factor, kernel_of, shard_storage
from torchrec_neuroshard.types.checks import finite_non_negative, required_field, whole_number

NUM_ACCESS_BINS = 17
"""Access-histogram bins: counts in (0,1], (1,2], (2,4], ..., (16384,32768], >32768."""

WIDTH_ALIGNMENT = 4
"""FBGEMM's fused kernels need every shard width to be a multiple of this."""

ACCESS_HIST_TOLERANCE = 1e-3
"""How far an access histogram's sum may be from 1 (stored histograms are rounded)."""

INPUT_INDEX_BYTES = 8
"""TorchRec's storage estimator counts every input index as int64 (TBEs convert to it)."""


class ShardingKind(str, enum.Enum):
    """How one table is sharded. The values are TorchRec's ``ShardingType`` values."""

    TABLE_WISE = "table_wise"
    COLUMN_WISE = "column_wise"
    TABLE_COLUMN_WISE = "table_column_wise"
    ROW_WISE = "row_wise"
    TABLE_ROW_WISE = "table_row_wise"
    DATA_PARALLEL = "data_parallel"

    @property
    def splits_columns(self) -> bool:
        """Shards hold all rows and some columns (one shard: the whole table)."""
        return self in (ShardingKind.TABLE_WISE, ShardingKind.COLUMN_WISE, ShardingKind.TABLE_COLUMN_WISE)

    @property
    def splits_rows(self) -> bool:
        """Shards hold all columns and a contiguous block of rows."""
        return self in (ShardingKind.ROW_WISE, ShardingKind.TABLE_ROW_WISE)

    @property
    def within_host(self) -> bool:
        """TorchRec places every shard of the table on the ranks of one host."""
        return self in (ShardingKind.TABLE_COLUMN_WISE, ShardingKind.TABLE_ROW_WISE)


@dataclass(frozen=True)
class TableSpec:
    """One embedding table as the cost model sees it.

    Attributes:
        name: unique table name (TorchRec's ``EmbeddingBagConfig.name``).
        rows: number of embedding rows.
        dim: embedding width (columns); a multiple of 4.
        pooling_factor: mean number of lookups per bag (per sample) for this table.
        access_hist: 17 fractions summing to 1: share of the table's *unique* indices in one
            batch whose access count falls in (0,1], (1,2], (2,4], ..., >32768. Depends on the
            batch size it was measured at (``Task.batch_size``).
        bytes_per_element: 4 for fp32 weights, 2 for fp16.
        feature_names: the KJT feature keys that look this table up.
        pooled: True for bags pooled per sample (an EmbeddingBagCollection's table, TorchRec's
            pooled kernel), False for sequences (an EmbeddingCollection's, the unpooled kernel).
        optimizer_multiplier: optimizer state bytes per weight byte, as TorchRec's storage
            estimator counts it (0 for SGD and fused optimizers it cannot see, 2 for Adam,
            1 / dim for row-wise Adagrad, 1 otherwise).
        kernel: the compute kernel a ``Shard`` of the table is counted and priced on
            (``kernels.ComputeKernel``): fused (HBM, the default), fused_uvm_caching (host
            memory and an HBM cache of ``cache_load_factor`` x rows) or fused_uvm (host
            memory). A plan sets it per table (``TablePlacement.spec_of``).
        cache_load_factor: the cached share of rows, in (0, 1], for fused_uvm_caching; else None.
    """

    name: str
    rows: int
    dim: int
    pooling_factor: float
    access_hist: tuple[float, ...]
    bytes_per_element: int = 4
    feature_names: tuple[str, ...] = ()
    pooled: bool = True
    optimizer_multiplier: float = 0.0
    kernel: ComputeKernel = ComputeKernel.FUSED
    cache_load_factor: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ShardingError("a table has an empty name")
        object.__setattr__(self, "kernel", kernel_of(self.kernel, self.name))
        object.__setattr__(self, "cache_load_factor", check_cache_load_factor(self.kernel, self.cache_load_factor, self.name))
        if not isinstance(self.pooled, (bool, np.bool_)):
            raise ShardingError(
                f"table {self.name!r}: pooled must be true (bags, EmbeddingBagCollection) or false "
                f"(sequences, EmbeddingCollection), got {self.pooled!r}"
            )
        object.__setattr__(self, "pooled", bool(self.pooled))
        for field in ("rows", "dim", "bytes_per_element"):
            object.__setattr__(self, field, whole_number(getattr(self, field), f"table {self.name!r}: {field}"))
        if self.rows <= 0:
            raise ShardingError(f"table {self.name!r}: rows must be positive, got {self.rows}")
        if self.dim <= 0 or self.dim % WIDTH_ALIGNMENT:
            padded = max(WIDTH_ALIGNMENT, math.ceil(self.dim / WIDTH_ALIGNMENT) * WIDTH_ALIGNMENT)
            raise ShardingError(
                f"table {self.name!r}: dim {self.dim} is not a positive multiple of "
                f"{WIDTH_ALIGNMENT}; FBGEMM's fused kernels need that. Pad it to {padded}."
            )
        if not finite_non_negative(self.pooling_factor):
            raise ShardingError(
                f"table {self.name!r}: pooling factor must be finite and >= 0, "
                f"got {self.pooling_factor!r}"
            )
        hist = self.access_hist
        if not isinstance(hist, (Sequence, np.ndarray)) or isinstance(hist, str) or len(hist) != NUM_ACCESS_BINS:
            got = f"{len(hist)}" if isinstance(hist, (Sequence, np.ndarray)) and not isinstance(hist, str) else repr(hist)
            raise ShardingError(f"table {self.name!r}: access_hist needs {NUM_ACCESS_BINS} bins, got {got}")
        bad = [(i, x) for i, x in enumerate(self.access_hist) if not finite_non_negative(x)]
        if bad:
            raise ShardingError(
                f"table {self.name!r}: access_hist bin {bad[0][0]} is {bad[0][1]!r}; every bin is a "
                f"fraction of the table's unique ids, finite and >= 0: re-measure it with "
                f"access.profile_batches"
            )
        total = math.fsum(self.access_hist)
        if abs(total - 1.0) > ACCESS_HIST_TOLERANCE:
            fix = f"normalise it: divide every bin by {total:.6g}" if total > 0 else "re-measure it with access.profile_batches"
            raise ShardingError(f"table {self.name!r}: access_hist sums to {total:.6g}, not 1 (it holds fractions); {fix}")
        object.__setattr__(self, "pooling_factor", float(self.pooling_factor))
        object.__setattr__(self, "access_hist", tuple(float(x) for x in self.access_hist))
        if self.bytes_per_element not in (1, 2, 4, 8):
            raise ShardingError(
                f"table {self.name!r}: bytes_per_element must be 1, 2, 4 or 8, "
                f"got {self.bytes_per_element}"
            )
        if not finite_non_negative(self.optimizer_multiplier):
            raise ShardingError(
                f"table {self.name!r}: optimizer_multiplier must be finite and >= 0, got {self.optimizer_multiplier!r}"
            )
        object.__setattr__(self, "optimizer_multiplier", float(self.optimizer_multiplier))

    def __hash__(self) -> int:
        """The hash of every field, as the dataclass computes it, kept once computed: a
        table keys a search's embedding caches and memos, and hashing its fields is dear."""
        kept = self.__dict__.get("_hash")
        if kept is None:
            kept = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", kept)
        return kept

    def __getstate__(self) -> dict:
        """The fields alone, for pickle and copy: a kept hash holds for this object in this
        process only (``on_kernel`` changes a copy's fields; str hashes differ by process)."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def on_kernel(self, kernel: ComputeKernel | str, cache_load_factor: float | None = None) -> "TableSpec":
        """This table on ``kernel`` (with ``cache_load_factor`` for fused_uvm_caching), both
        checked; the rest was checked when this table was made, so it is not again."""
        if kernel == self.kernel and cache_load_factor == self.cache_load_factor:
            return self  # already there (and so both valid)
        kernel = kernel_of(kernel, self.name)
        cache_load_factor = check_cache_load_factor(kernel, cache_load_factor, self.name)
        moved = copy.copy(self)
        object.__setattr__(moved, "kernel", kernel)
        object.__setattr__(moved, "cache_load_factor", cache_load_factor)
        return moved

    def size_bytes(self, width: int | None = None) -> int:
        """Weight bytes of the table, or of a column shard of ``width`` columns."""
        return self.rows * (self.dim if width is None else width) * self.bytes_per_element

    def memory_bytes(self, batch_size: int, world_size: int) -> int:
        """What the whole table takes on the rank holding it table-wise (``Shard.memory_bytes``)."""
        return Shard(self, self.dim).memory_bytes(ShardingKind.TABLE_WISE, batch_size, world_size)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kernel"] = self.kernel.value
        if self.kernel is ComputeKernel.FUSED:  # files stay as they were before kernels
            del d["kernel"], d["cache_load_factor"]
        return d

    @staticmethod
    def from_dict(d: dict, what: str = "a table") -> "TableSpec":
        """The table ``d`` (``to_dict``'s layout) describes; ``what`` names it in errors."""
        return TableSpec(
            name=required_field(d, "name", what),
            rows=required_field(d, "rows", what),
            dim=required_field(d, "dim", what),
            pooling_factor=required_field(d, "pooling_factor", what),
            access_hist=required_field(d, "access_hist", what),
            bytes_per_element=d.get("bytes_per_element", 4),
            feature_names=tuple(d.get("feature_names", ())),
            pooled=d.get("pooled", True),
            optimizer_multiplier=d.get("optimizer_multiplier", 0.0),
            kernel=d.get("kernel", ComputeKernel.FUSED),
            cache_load_factor=d.get("cache_load_factor"),
        )


@dataclass(frozen=True)
class Shard:
    """A piece of one table: ``width`` columns of ``rows`` rows (default all of them)."""

    table: TableSpec
    width: int
    rows: int | None = None

    @property
    def num_rows(self) -> int:
        return self.table.rows if self.rows is None else self.rows

    @property
    def size_bytes(self) -> int:
        return self.num_rows * self.width * self.table.bytes_per_element

    def memory_bytes(self, kind: ShardingKind, batch_size: int, world_size: int, blocks: int | None = None) -> int:
        """The bytes TorchRec's ``EmbeddingStorageEstimator`` counts for this shard in
        training without pipelining: weights, optimizer state, and its kernel's input
        indices and pooled output for one step (of the GLOBAL ``batch_size``).

        A column or table shard reads every index of the global batch and pools every bag;
        a row block reads about 1 / ``blocks`` of the indices (its table's row blocks:
        default ``world_size``, as row-wise; table-row-wise has one per rank of its host)
        and pools every bag of the global batch; a data-parallel replica (the whole table)
        reads and pools its local batch. These are HBM bytes on a GPU (the table's kernel
        decides what of the weights they hold: ``kernels.shard_storage``); the bytes in host
        memory are ``host_memory_bytes``.
        """
        return self.storage(kind, batch_size, world_size, blocks)[0]

    def host_memory_bytes(self, kind: ShardingKind, batch_size: int, world_size: int, blocks: int | None = None) -> int:
        """Bytes of host memory (DDR) TorchRec counts for this shard: its weights and
        optimizer state when its table's kernel keeps them there (UVM kernels), else 0."""
        return self.storage(kind, batch_size, world_size, blocks)[1]

    def io_bytes(self, kind: ShardingKind, batch_size: int, world_size: int, blocks: int | None = None) -> int:
        """Bytes of one step's input indices and output in HBM, on every kernel."""
        t = self.table
        local = batch_size / world_size
        indices = t.pooling_factor * (local if kind is ShardingKind.DATA_PARALLEL else batch_size)
        if kind.splits_rows:
            indices /= blocks or world_size
        bags = min(1.0, t.pooling_factor) * (local if kind is ShardingKind.DATA_PARALLEL else batch_size)
        outputs = bags if t.pooled else indices  # a sequence kernel outputs every lookup
        return math.ceil(indices * INPUT_INDEX_BYTES) + math.ceil(outputs * self.width * t.bytes_per_element)

    def storage(self, kind: ShardingKind, batch_size: int, world_size: int, blocks: int | None = None) -> tuple[int, int]:
        """(``memory_bytes``, ``host_memory_bytes``)."""
        t = self.table
        weights = self.size_bytes
        if weights == 0:  # an empty row block
            return 0, 0
        io = self.io_bytes(kind, batch_size, world_size, blocks)
        if t.kernel is ComputeKernel.FUSED:
            return weights + math.ceil(weights * t.optimizer_multiplier) + io, 0
        return shard_storage(
            t.rows, t.dim, self.num_rows, self.width, t.bytes_per_element, t.optimizer_multiplier, io, t.kernel, t.cache_load_factor
        )
