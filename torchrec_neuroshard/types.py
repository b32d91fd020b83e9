"""Plain data every stage speaks: tables, tasks, plans, and the cost-model interface.

Data flows one way: ``TableSpec``/``Task`` -> cost model -> search -> ``Plan`` -> TorchRec.
Everything here is a small frozen dataclass or an abstract interface; no stage keeps state
between calls.
"""

from __future__ import annotations

import abc
import enum
import json
import math
import numbers
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Collection, Sequence

import numpy as np

from torchrec_neuroshard.kernels import ComputeKernel, ShardingError, check_cache_load_factor, kernel_of, shard_storage

if TYPE_CHECKING:
    from torchrec_neuroshard.steparts import StepParts

NUM_ACCESS_BINS = 17
"""Access-histogram bins: counts in (0,1], (1,2], (2,4], ..., (16384,32768], >32768."""

WIDTH_ALIGNMENT = 4
"""FBGEMM's fused kernels need every shard width to be a multiple of this."""

ACCESS_HIST_TOLERANCE = 1e-3
"""How far an access histogram's sum may be from 1 (stored histograms are rounded)."""

INPUT_INDEX_BYTES = 8
"""TorchRec's storage estimator counts every input index as int64 (TBEs convert to it)."""



class InfeasibleError(ShardingError):
    """No placement satisfies the memory cap."""


def _whole_number(value: object, what: str) -> int:
    """``value`` as an int when it is a whole number (1024 or 1024.0; not True, not 1.7),
    else a ``ShardingError`` naming ``what`` and the value."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer():
        return int(value)
    raise ShardingError(f"{what} must be a whole number, got {value!r}; give it as an integer")


def _finite_non_negative(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _field(d: dict, key: str, what: str) -> object:
    """``d[key]``, or a ``ShardingError`` naming the missing field and where it belongs."""
    if not isinstance(d, dict):
        raise ShardingError(f"{what} must be a JSON object, got {type(d).__name__} {str(d)[:60]!r}")
    if key not in d:
        raise ShardingError(f"{what} has no {key!r} field; add it (fields: {sorted(d)})")
    return d[key]


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
            object.__setattr__(self, field, _whole_number(getattr(self, field), f"table {self.name!r}: {field}"))
        if self.rows <= 0:
            raise ShardingError(f"table {self.name!r}: rows must be positive, got {self.rows}")
        if self.dim <= 0 or self.dim % WIDTH_ALIGNMENT:
            padded = max(WIDTH_ALIGNMENT, math.ceil(self.dim / WIDTH_ALIGNMENT) * WIDTH_ALIGNMENT)
            raise ShardingError(
                f"table {self.name!r}: dim {self.dim} is not a positive multiple of "
                f"{WIDTH_ALIGNMENT}; FBGEMM's fused kernels need that. Pad it to {padded}."
            )
        if not _finite_non_negative(self.pooling_factor):
            raise ShardingError(
                f"table {self.name!r}: pooling factor must be finite and >= 0, "
                f"got {self.pooling_factor!r}"
            )
        hist = self.access_hist
        if not isinstance(hist, (Sequence, np.ndarray)) or isinstance(hist, str) or len(hist) != NUM_ACCESS_BINS:
            got = f"{len(hist)}" if isinstance(hist, (Sequence, np.ndarray)) and not isinstance(hist, str) else repr(hist)
            raise ShardingError(f"table {self.name!r}: access_hist needs {NUM_ACCESS_BINS} bins, got {got}")
        bad = [(i, x) for i, x in enumerate(self.access_hist) if not _finite_non_negative(x)]
        if bad:
            raise ShardingError(
                f"table {self.name!r}: access_hist bin {bad[0][0]} is {bad[0][1]!r}; every bin is a "
                f"fraction of the table's unique ids, finite and >= 0: re-measure it with "
                f"tables.profile_batches"
            )
        total = math.fsum(self.access_hist)
        if abs(total - 1.0) > ACCESS_HIST_TOLERANCE:
            fix = f"normalise it: divide every bin by {total:.6g}" if total > 0 else "re-measure it with tables.profile_batches"
            raise ShardingError(f"table {self.name!r}: access_hist sums to {total:.6g}, not 1 (it holds fractions); {fix}")
        object.__setattr__(self, "pooling_factor", float(self.pooling_factor))
        object.__setattr__(self, "access_hist", tuple(float(x) for x in self.access_hist))
        if self.bytes_per_element not in (1, 2, 4, 8):
            raise ShardingError(
                f"table {self.name!r}: bytes_per_element must be 1, 2, 4 or 8, "
                f"got {self.bytes_per_element}"
            )
        if not _finite_non_negative(self.optimizer_multiplier):
            raise ShardingError(
                f"table {self.name!r}: optimizer_multiplier must be finite and >= 0, got {self.optimizer_multiplier!r}"
            )
        object.__setattr__(self, "optimizer_multiplier", float(self.optimizer_multiplier))

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
            name=_field(d, "name", what),
            rows=_field(d, "rows", what),
            dim=_field(d, "dim", what),
            pooling_factor=_field(d, "pooling_factor", what),
            access_hist=_field(d, "access_hist", what),
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

    def memory_bytes(self, kind: "ShardingKind", batch_size: int, world_size: int, blocks: int | None = None) -> int:
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

    def host_memory_bytes(self, kind: "ShardingKind", batch_size: int, world_size: int, blocks: int | None = None) -> int:
        """Bytes of host memory (DDR) TorchRec counts for this shard: its weights and
        optimizer state when its table's kernel keeps them there (UVM kernels), else 0."""
        return self.storage(kind, batch_size, world_size, blocks)[1]

    def storage(self, kind: "ShardingKind", batch_size: int, world_size: int, blocks: int | None = None) -> tuple[int, int]:
        """(``memory_bytes``, ``host_memory_bytes``)."""
        t = self.table
        weights = self.size_bytes
        if weights == 0:  # an empty row block
            return 0, 0
        local = batch_size / world_size
        indices = t.pooling_factor * (local if kind is ShardingKind.DATA_PARALLEL else batch_size)
        if kind.splits_rows:
            indices /= blocks or world_size
        bags = min(1.0, t.pooling_factor) * (local if kind is ShardingKind.DATA_PARALLEL else batch_size)
        outputs = bags if t.pooled else indices  # a sequence kernel outputs every lookup
        io = math.ceil(indices * INPUT_INDEX_BYTES) + math.ceil(outputs * self.width * t.bytes_per_element)
        if t.kernel is ComputeKernel.FUSED:
            return weights + math.ceil(weights * t.optimizer_multiplier) + io, 0
        return shard_storage(
            t.rows, t.dim, self.num_rows, self.width, t.bytes_per_element, t.optimizer_multiplier, io, t.kernel, t.cache_load_factor
        )


@dataclass(frozen=True)
class Links:
    """The links between a task's devices, as TorchRec's ``Topology`` gives them: ranks per
    host (rank ``r`` sits on host ``r // local_world_size``), and bytes per ms between two
    ranks of a host and per rank between hosts. ``stepcost`` prices with them the bytes a
    collective moves across hosts, and every collective the cost model has not measured."""

    local_world_size: int
    intra_host_bw: float
    inter_host_bw: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_world_size", _whole_number(self.local_world_size, "local_world_size"))
        if self.local_world_size < 1:
            raise ShardingError(f"local_world_size must be >= 1, got {self.local_world_size}")
        for name in ("intra_host_bw", "inter_host_bw"):
            value = getattr(self, name)
            if not (_finite_non_negative(value) and value > 0):
                raise ShardingError(f"{name} must be a positive number of bytes per ms, got {value!r}")
            object.__setattr__(self, name, float(value))

    @staticmethod
    def from_dict(d: dict, what: str = "the links") -> "Links":
        """The links ``d`` (``asdict``'s layout) describes; ``what`` names them in errors."""
        return Links(*(_field(d, key, what) for key in ("local_world_size", "intra_host_bw", "inter_host_bw")))

    @staticmethod
    def of(topology: object) -> "Links":
        """The links of a TorchRec ``Topology``."""
        return Links(int(topology.local_world_size), float(topology.intra_host_bw), float(topology.inter_host_bw))


@dataclass(frozen=True)
class Task:
    """A sharding problem: tables, devices, a memory cap per device, and the GLOBAL batch
    (per-rank batch x devices: the batch a table-wise shard's kernel sees). TorchRec's
    planners take the per-rank batch, ``batch_size // num_devices``."""

    tables: tuple[TableSpec, ...]
    num_devices: int
    memory_cap_bytes: int
    batch_size: int
    modules: tuple[tuple[str, ...], ...] = ()
    """The table names of each sharded module (an EBC), in the order the model runs them;
    every table in exactly one. Each module's collectives wait for every rank, so the step
    pays each module's slowest device. Empty: the tables run as one module."""
    links: Links | None = None
    """The devices' hosts and links (the planner's ``Topology``); None: one host, and only
    the collectives the cost model measured are priced."""
    host_memory_cap_bytes: int | None = None
    """Host memory (DDR) per device for tables on UVM kernels (the topology's ``ddr_cap``
    on a GPU); ``memory_cap_bytes`` is then each GPU's HBM. None: every table in
    ``memory_cap_bytes`` (a CPU topology, or a plan of fused kernels only)."""

    def __post_init__(self) -> None:
        for field in ("num_devices", "memory_cap_bytes", "batch_size"):
            object.__setattr__(self, field, _whole_number(getattr(self, field), f"the task's {field}"))
        if not self.tables:
            raise ShardingError("the task has no tables")
        dup = sorted(n for n, k in Counter(t.name for t in self.tables).items() if k > 1)
        if dup:
            raise ShardingError(f"duplicate table names: {dup}; every table needs a unique name")
        if isinstance(self.modules, str) or not isinstance(self.modules, Sequence) or any(
            isinstance(m, str) or not isinstance(m, Sequence) for m in self.modules
        ):
            raise ShardingError(f"the task's modules must be lists of table names, got {self.modules!r}")
        object.__setattr__(self, "modules", tuple(tuple(m) for m in self.modules))
        if self.modules:
            named = Counter(n for m in self.modules for n in m)
            wrong = sorted(n for n, k in named.items() if k > 1) + sorted(set(named) - {t.name for t in self.tables})
            unplaced = sorted({t.name for t in self.tables} - set(named))
            if wrong or unplaced or not all(self.modules):
                raise ShardingError(
                    f"the task's modules must name every table once, in non-empty modules: "
                    f"named twice or unknown {wrong}, in no module {unplaced}; leave modules empty for one module"
                )
        if self.num_devices < 1:
            raise ShardingError(f"num_devices must be >= 1, got {self.num_devices}")
        if self.links is not None and not isinstance(self.links, Links):
            raise ShardingError(f"the task's links must be a Links (e.g. Links.of(topology)), got {self.links!r}")
        if self.memory_cap_bytes <= 0:
            raise ShardingError(f"memory cap must be positive, got {self.memory_cap_bytes} bytes")
        if self.batch_size < 1:
            raise ShardingError(f"batch size must be >= 1, got {self.batch_size}")
        if self.host_memory_cap_bytes is not None:
            host = _whole_number(self.host_memory_cap_bytes, "the task's host_memory_cap_bytes")
            if host <= 0:
                raise ShardingError(f"host memory cap must be positive (or None for none), got {host} bytes")
            object.__setattr__(self, "host_memory_cap_bytes", host)

    def table(self, name: str) -> TableSpec:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(name)

    def subset(self, names: Sequence[str], memory_cap_bytes: int | None = None) -> "Task":
        """The task of the tables ``names`` (in the task's order; modules kept, each
        restricted to them), in ``memory_cap_bytes`` (default the task's cap)."""
        keep = set(names)
        return Task(
            tuple(t for t in self.tables if t.name in keep),
            self.num_devices,
            self.memory_cap_bytes if memory_cap_bytes is None else memory_cap_bytes,
            self.batch_size,
            tuple(m for m in (tuple(n for n in module if n in keep) for module in self.modules) if m),
            self.links,
            self.host_memory_cap_bytes,
        )

    def to_json(self) -> str:
        d = {
            "num_devices": self.num_devices,
            "memory_cap_bytes": self.memory_cap_bytes,
            "batch_size": self.batch_size,
            "tables": [t.to_dict() for t in self.tables],
        }
        if self.modules:
            d["modules"] = [list(m) for m in self.modules]
        if self.links is not None:
            d["links"] = asdict(self.links)
        if self.host_memory_cap_bytes is not None:
            d["host_memory_cap_bytes"] = self.host_memory_cap_bytes
        return json.dumps(d)

    @staticmethod
    def from_dict(d: dict, what: str = "the task") -> "Task":
        """The task ``d`` (``to_json``'s layout) describes; ``what`` names it in errors."""
        return Task(
            tables=tuple(
                TableSpec.from_dict(t, f"{what}, table {i}") for i, t in enumerate(_field(d, "tables", what))
            ),
            num_devices=_field(d, "num_devices", what),
            memory_cap_bytes=_field(d, "memory_cap_bytes", what),
            batch_size=_field(d, "batch_size", what),
            modules=d.get("modules", ()),
            links=Links.from_dict(d["links"], f"{what}'s links") if d.get("links") is not None else None,
            host_memory_cap_bytes=d.get("host_memory_cap_bytes"),
        )

    @staticmethod
    def from_json(text: str) -> "Task":
        return Task.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def load(path: str | Path) -> "Task":
        """The one task in a task file; ``load_all`` reads suite files (lists of tasks) too."""
        tasks = Task.load_all(path)
        if len(tasks) != 1:
            raise ShardingError(f"{path} holds {len(tasks)} tasks, not one; read it with Task.load_all")
        return tasks[0]

    @staticmethod
    def load_all(path: str | Path) -> list["Task"]:
        """The tasks in a task file: one task (a JSON object) or a list of them (a suite)."""
        path = Path(path)
        if not path.is_file():
            raise ShardingError(f"task file {str(path)!r} does not exist (or is not a file)")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ShardingError(f"task file {str(path)!r} is not valid JSON: {e}") from e
        if d == []:
            raise ShardingError(f"task file {str(path)!r} is an empty list; it needs a task or a list of tasks")
        if isinstance(d, list):
            return [Task.from_dict(t, f"{path} task {i}") for i, t in enumerate(d)]
        return [Task.from_dict(d, str(path))]


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
class TablePlacement:
    """One table's decision: its sharding kind and where each shard goes.

    - column kinds (table_wise, column_wise, table_column_wise): ``widths`` in column order
      (uneven allowed; one width = table-wise) and each width's device in ``devices``; two
      shards of one table may share a device.
    - row kinds (row_wise, table_row_wise): ``rows``, the row count of each block in row
      order, and each block's device in ``devices`` (one block per device).
    - data_parallel: no shards; the table is replicated on every device.

    ``kind`` defaults to table_wise for one width and column_wise for several.
    ``kernel`` (with ``cache_load_factor`` for fused_uvm_caching) is the table's compute
    kernel (``kernels.ComputeKernel``; a replica always runs TorchRec's dense kernel in HBM,
    recorded as fused): the plan decides it, and every memory count and price of the plan
    takes the table on it (``spec_of``), whatever kernel its ``TableSpec`` names.
    """

    table: str
    widths: tuple[int, ...] = ()
    devices: tuple[int, ...] = ()
    kind: ShardingKind = None  # type: ignore[assignment]  # resolved in __post_init__
    rows: tuple[int, ...] = ()
    kernel: ComputeKernel = ComputeKernel.FUSED
    cache_load_factor: float | None = None

    def __post_init__(self) -> None:
        kind = self.kind
        if kind is None:
            kind = ShardingKind.TABLE_WISE if len(self.widths) == 1 else ShardingKind.COLUMN_WISE
        object.__setattr__(self, "kind", ShardingKind(kind))
        object.__setattr__(self, "widths", tuple(int(w) for w in self.widths))
        object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
        object.__setattr__(self, "rows", tuple(int(r) for r in self.rows))
        shards = self.widths if self.kind.splits_columns else self.rows
        other = self.rows if self.kind.splits_columns else self.widths
        if self.kind is ShardingKind.DATA_PARALLEL:
            if self.widths or self.devices or self.rows:
                raise ShardingError(f"table {self.table!r}: a data_parallel table has no shards to place")
        elif not shards or len(shards) != len(self.devices) or other:
            what = "widths" if self.kind.splits_columns else "rows"
            raise ShardingError(
                f"table {self.table!r} ({self.kind.value}): needs one device per entry of {what}, "
                f"got widths {list(self.widths)}, rows {list(self.rows)}, devices {list(self.devices)}"
            )
        if self.kind is ShardingKind.TABLE_WISE and len(self.widths) != 1:
            raise ShardingError(f"table {self.table!r}: table_wise has one shard, got widths {list(self.widths)}")
        if self.kind.splits_rows and len(set(self.devices)) != len(self.devices):
            raise ShardingError(f"table {self.table!r}: row blocks need distinct devices, got {list(self.devices)}")
        object.__setattr__(self, "kernel", kernel_of(self.kernel, self.table))
        object.__setattr__(self, "cache_load_factor", check_cache_load_factor(self.kernel, self.cache_load_factor, self.table))
        if self.kind is ShardingKind.DATA_PARALLEL and self.kernel is not ComputeKernel.FUSED:
            raise ShardingError(
                f"table {self.table!r}: a data_parallel replica runs TorchRec's dense kernel in HBM, not "
                f"{self.kernel.value}; shard the table to keep it in host memory"
            )

    def spec_of(self, table: TableSpec) -> TableSpec:
        """``table`` on this placement's kernel."""
        if (table.kernel, table.cache_load_factor) == (self.kernel, self.cache_load_factor):
            return table
        return replace(table, kernel=self.kernel, cache_load_factor=self.cache_load_factor)

    @staticmethod
    def data_parallel(table: str) -> "TablePlacement":
        return TablePlacement(table, kind=ShardingKind.DATA_PARALLEL)

    @staticmethod
    def row_blocks(table: TableSpec, devices: Sequence[int], kind: ShardingKind = ShardingKind.ROW_WISE) -> "TablePlacement":
        """``table``'s rows in blocks of ceil(rows / len(devices)) over ``devices`` in order,
        as TorchRec's row-wise sharding lays them out."""
        block = -(-table.rows // len(devices))
        rows = tuple(max(0, min(block, table.rows - i * block)) for i in range(len(devices)))
        return TablePlacement(table.name, devices=tuple(devices), kind=kind, rows=rows)

    def check_on_one_host(self, local_world_size: int) -> None:
        """Raise ``ShardingError`` naming the table when its kind keeps it on one host
        (``within_host``) but its devices span hosts of ``local_world_size`` ranks."""
        if self.kind.within_host and len({d // local_world_size for d in self.devices}) > 1:
            raise ShardingError(
                f"table {self.table!r}: {self.kind.value} keeps a table on one host, but its devices "
                f"{list(self.devices)} span hosts of {local_world_size} ranks"
            )

    def shards(self, table: TableSpec) -> list[tuple[Shard, int]]:
        """(shard, device) pairs, each shard of ``table`` on this placement's kernel
        (``spec_of``); empty for data_parallel."""
        table = self.spec_of(table)
        if self.kind.splits_columns:
            return [(Shard(table, w), d) for w, d in zip(self.widths, self.devices)]
        return [(Shard(table, table.dim, r), d) for r, d in zip(self.rows, self.devices)]

    def to_dict(self) -> dict:
        d: dict = {"table": self.table, "kind": self.kind.value}
        if self.widths:
            d["widths"] = list(self.widths)
        if self.rows:
            d["rows"] = list(self.rows)
        if self.devices:
            d["devices"] = list(self.devices)
        if self.kernel is not ComputeKernel.FUSED:  # files of fused plans stay as they were
            d["kernel"] = self.kernel.value
        if self.cache_load_factor is not None:
            d["cache_load_factor"] = self.cache_load_factor
        return d

    @staticmethod
    def from_dict(d: dict) -> "TablePlacement":
        """The placement ``d`` (``to_dict``'s layout) describes; no kernel: fused (files
        written before kernels were planned)."""
        return TablePlacement(
            d["table"], tuple(d.get("widths", ())), tuple(d.get("devices", ())),
            d.get("kind"), tuple(d.get("rows", ())), d.get("kernel", ComputeKernel.FUSED), d.get("cache_load_factor"),
        )


def host_ranks(rank: int, local_world_size: int, world_size: int) -> range:
    """The ranks of the host of ``rank`` (rank ``r`` sits on host ``r // local_world_size``)."""
    first = rank // local_world_size * local_world_size
    return range(first, min(world_size, first + local_world_size))


def spread_over_hosts(
    tables: Sequence[TableSpec], weight: Callable[[TableSpec], float], world_size: int, local_world_size: int
) -> tuple[TablePlacement, ...]:
    """``tables`` table-row-wise, each in the order given onto the full host that holds the
    least ``weight`` of those before it (the first such host on ties)."""
    held = [0.0] * (world_size // local_world_size)
    placed = []
    for t in tables:
        host = held.index(min(held))
        held[host] += weight(t)
        ranks = host_ranks(host * local_world_size, local_world_size, world_size)
        placed.append(TablePlacement.row_blocks(t, ranks, ShardingKind.TABLE_ROW_WISE))
    return tuple(placed)


@dataclass(frozen=True)
class TableChoices:
    """What the search may do with one table (from its constraints and its module's
    sharder: ``tables.module_tables``). The default is everything TorchRec's
    EmbeddingBagCollectionSharder offers on a GPU: column splits down to 4 columns,
    replication, row-wise splits (``tables.sharder_choices`` for a device)."""

    min_width: int = WIDTH_ALIGNMENT
    """The narrowest column shard; the table's dim keeps it whole."""
    data_parallel: bool = True
    row_wise: bool = True
    table_row_wise: bool = True
    """Row splits over the ranks of one host (searched when the task has several hosts)."""

    @staticmethod
    def of(kinds: "frozenset[ShardingKind]", dim: int, min_width: int = WIDTH_ALIGNMENT) -> "TableChoices":
        """The choices the sharding ``kinds`` allowed for a table of ``dim`` columns leave:
        column splits need column_wise or table_column_wise (else the table stays whole)."""
        splits = bool(kinds & {ShardingKind.COLUMN_WISE, ShardingKind.TABLE_COLUMN_WISE})
        return TableChoices(
            min_width=min_width if splits else dim,
            data_parallel=ShardingKind.DATA_PARALLEL in kinds,
            row_wise=ShardingKind.ROW_WISE in kinds,
            table_row_wise=ShardingKind.TABLE_ROW_WISE in kinds,
        )

    def allows(self, kind: "ShardingKind") -> bool:
        """Whether the search may give the table ``kind`` (column kinds: a whole table always)."""
        if kind is ShardingKind.DATA_PARALLEL:
            return self.data_parallel
        if kind is ShardingKind.ROW_WISE:
            return self.row_wise
        if kind is ShardingKind.TABLE_ROW_WISE:
            return self.table_row_wise
        return True


@dataclass(frozen=True)
class Plan:
    """A sharding plan: one ``TablePlacement`` per table over ``num_devices`` devices."""

    placements: tuple[TablePlacement, ...]
    num_devices: int

    def placement(self, table: str) -> TablePlacement:
        for p in self.placements:
            if p.table == table:
                return p
        raise KeyError(table)

    @property
    def data_parallel(self) -> tuple[str, ...]:
        """Names of the tables replicated on every device."""
        return tuple(p.table for p in self.placements if p.kind is ShardingKind.DATA_PARALLEL)

    def kinds(self) -> dict[str, ShardingKind]:
        return {p.table: p.kind for p in self.placements}

    def subset(self, names: Collection[str]) -> "Plan":
        """The plan of the tables ``names`` (those it places), on the same devices."""
        return Plan(tuple(p for p in self.placements if p.table in names), self.num_devices)

    def kernel_sizes(self, tables: Sequence[TableSpec], modules: Sequence[Sequence[str]] = ()) -> dict[str, int]:
        """Shards each fused column kernel holds, by "device d, module m, kind": TorchRec
        runs one kernel per sharded module (``modules``; default all tables in one), column
        sharding kind and device."""
        sizes = {}
        for m, names in enumerate(modules or [[t.name for t in tables]]):
            part = self.subset(set(names))
            for kind in dict.fromkeys(p.kind for p in part.placements if p.kind.splits_columns):
                same = Plan(tuple(p for p in part.placements if p.kind is kind), self.num_devices)
                for d, shards in enumerate(same.device_shards(tables)):
                    if shards:
                        sizes[f"device {d}, module {m}, {kind.value}"] = len(shards)
        return sizes

    def device_shards(self, tables: Sequence[TableSpec]) -> list[list[Shard]]:
        """Column shards (table-wise and column splits) on each device: ``result[d]`` lists
        the ``Shard``s of device ``d``'s fused kernel over the global batch, the part the
        compute model prices. Row blocks and replicas are not in it."""
        by_name = {t.name: t for t in tables}
        out: list[list[Shard]] = [[] for _ in range(self.num_devices)]
        for p in self.placements:
            if p.kind.splits_columns:
                for shard, d in p.shards(by_name[p.table]):
                    out[d].append(shard)
        return out

    def device_dims(self) -> list[int]:
        """Sum of column-shard widths on each device (the pooled-embedding width it sends)."""
        dims = [0] * self.num_devices
        for p in self.placements:
            if p.kind.splits_columns:
                for w, d in zip(p.widths, p.devices):
                    dims[d] += w
        return dims

    def device_memory(self, tables: Sequence[TableSpec], batch_size: int) -> list[int]:
        """Bytes on each device as TorchRec's storage estimator counts them
        (``Shard.memory_bytes`` at the GLOBAL ``batch_size``, each table on its placement's kernel):
        shards, row blocks, replicas. HBM on a GPU; host memory is ``device_host_memory``."""
        return self._device_storage(tables, batch_size, 0)

    def device_host_memory(self, tables: Sequence[TableSpec], batch_size: int) -> list[int]:
        """Bytes of host memory (DDR) on each device: the weights and optimizer state of
        the shards on UVM kernels (``Shard.host_memory_bytes``)."""
        return self._device_storage(tables, batch_size, 1)

    def _device_storage(self, tables: Sequence[TableSpec], batch_size: int, which: int) -> list[int]:
        by_name = {t.name: t for t in tables}
        used = [0] * self.num_devices
        for p in self.placements:
            table = by_name[p.table]
            if p.kind is ShardingKind.DATA_PARALLEL:
                replica = Shard(p.spec_of(table), table.dim).storage(p.kind, batch_size, self.num_devices)[which]
                used = [u + replica for u in used]
            for shard, d in p.shards(table):
                used[d] += shard.storage(p.kind, batch_size, self.num_devices, len(p.devices))[which]
        return used

    def offloaded(self) -> tuple[str, ...]:
        """Names of the tables on UVM kernels (weights in host memory)."""
        return tuple(p.table for p in self.placements if p.kernel.in_host_memory)

    def validate(self, task: Task) -> None:
        """Raise ``ShardingError`` naming the table and numbers for any violation."""
        if self.num_devices != task.num_devices:
            raise ShardingError(
                f"plan has {self.num_devices} devices but the task has {task.num_devices}"
            )
        names = {t.name for t in task.tables}
        seen: set[str] = set()
        for p in self.placements:
            if p.table not in names:
                raise ShardingError(f"plan places unknown table {p.table!r}")
            if p.table in seen:
                raise ShardingError(f"plan places table {p.table!r} twice")
            seen.add(p.table)
            spec = task.table(p.table)
            for w in p.widths:
                if w <= 0 or w % WIDTH_ALIGNMENT:
                    raise ShardingError(
                        f"table {p.table!r}: shard width {w} is not a positive multiple of "
                        f"{WIDTH_ALIGNMENT} (widths {list(p.widths)})"
                    )
            if p.kind.splits_columns and sum(p.widths) != spec.dim:
                raise ShardingError(
                    f"table {p.table!r}: shard widths {list(p.widths)} sum to "
                    f"{sum(p.widths)}, not the table's dim {spec.dim}"
                )
            if p.kind.splits_rows and (sum(p.rows) != spec.rows or min(p.rows) < 0):
                raise ShardingError(
                    f"table {p.table!r}: row blocks {list(p.rows)} sum to {sum(p.rows)}, "
                    f"not the table's {spec.rows} rows"
                )
            for d in p.devices:
                if not 0 <= d < self.num_devices:
                    raise ShardingError(
                        f"table {p.table!r}: device {d} out of range [0, {self.num_devices})"
                    )
            p.check_on_one_host(task.links.local_world_size if task.links is not None else self.num_devices)
        missing = sorted(names - seen)
        if missing:
            raise ShardingError(f"plan does not place tables {missing}")
        self._check_memory(task, self.device_memory(task.tables, task.batch_size), task.memory_cap_bytes, "")
        host = self.device_host_memory(task.tables, task.batch_size)
        if any(host) and task.host_memory_cap_bytes is None:
            raise ShardingError(
                f"tables {sorted(self.offloaded())} are on UVM kernels, in host memory, but the task has no host memory cap; "
                "give the task's host_memory_cap_bytes (the topology's ddr_cap), or plan them fused"
            )
        if any(host):
            self._check_memory(task, host, task.host_memory_cap_bytes, " of host memory (DDR)")

    def _check_memory(self, task: Task, used_per_device: Sequence[int], cap: int, what: str) -> None:
        for d, used in enumerate(used_per_device):
            if used > cap:
                on_dev = [
                    p.table for p in self.placements if d in p.devices or p.kind is ShardingKind.DATA_PARALLEL
                ]
                raise InfeasibleError(
                    f"device {d} holds {used:,} bytes{what}, over the cap of "
                    f"{cap:,} bytes by {used - cap:,} "
                    f"(tables {on_dev})"
                )

    def to_dict(self) -> dict:
        return {"num_devices": self.num_devices, "placements": [p.to_dict() for p in self.placements]}

    @staticmethod
    def from_dict(d: dict) -> "Plan":
        placements = [TablePlacement.from_dict(p) for p in d["placements"]]
        # files written before kinds existed list replicated tables apart
        placements += [TablePlacement.data_parallel(name) for name in d.get("data_parallel", ())]
        return Plan(tuple(placements), num_devices=int(d["num_devices"]))

    def describe(self) -> str:
        """One line per device: its shards as ``table[width]`` or ``table[rows r]``."""
        per_dev: list[list[str]] = [[] for _ in range(self.num_devices)]
        for p in self.placements:
            for w, d in zip(p.widths, p.devices):
                per_dev[d].append(f"{p.table}[{w}]")
            for r, d in zip(p.rows, p.devices):
                per_dev[d].append(f"{p.table}[{r} rows]")
        dims = self.device_dims()
        lines = [f"device {d} (dim sum {dims[d]}): " + " ".join(items) for d, items in enumerate(per_dev)]
        if self.data_parallel:
            lines.append("data parallel: " + " ".join(self.data_parallel))
        return "\n".join(lines)


@dataclass(frozen=True)
class DeviceCost:
    """Cost of one device in ms: fused-kernel compute and the pooled all-to-all."""

    fwd_compute: float
    bwd_compute: float
    fwd_comm: float
    bwd_comm: float

    @property
    def total(self) -> float:
        return self.fwd_compute + self.bwd_compute + self.fwd_comm + self.bwd_comm


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
        emb = (embed or self.embed_shards)(flat)
        index = np.repeat(np.arange(len(devices)), [len(dev) for dev in devices])
        pooled = np.zeros((len(devices), emb.shape[1]), dtype=emb.dtype)
        np.add.at(pooled, index, emb)
        with np.errstate(over="ignore", invalid="ignore"):  # refused below, by name
            cost = self.device_cost(pooled)
        cost[[len(dev) == 0 for dev in devices]] = 0.0
        bad = np.flatnonzero(~np.isfinite(cost).all(1))
        if bad.size:
            shards = devices[int(bad[0])]
            worst = max(shards, key=lambda s: s.table.pooling_factor).table
            raise ShardingError(
                f"the cost model predicts {cost[bad[0]].tolist()} ms for a kernel of tables "
                f"{sorted({s.table.name for s in shards})}: not finite, so they lie far outside the kernels it "
                f"learned (e.g. table {worst.name!r}: {worst.pooling_factor:g} lookups per sample on "
                f"{worst.rows:,} rows); check their pooling factors, calibrate on such kernels "
                "(`neuroshard calibrate`), or plan them with TorchRec's planner"
            )
        return [(float(f), float(b)) for f, b in cost]

    def embedding_cost(self, fwd: np.ndarray, bwd: np.ndarray, dims: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Comm [R, D, 2] and embedding cost [R] (ms) of R plans from their per-device
        compute ``fwd``, ``bwd`` and dim sums ``dims`` [R, D]: each device's forward skew is
        its lateness behind the earliest; the cost is the max over devices of compute + comm."""
        comm = self.comm_cost_array(dims, fwd - fwd.min(1, keepdims=True))
        return comm, (fwd + bwd + comm.sum(2)).max(1)
