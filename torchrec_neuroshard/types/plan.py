"""A sharding plan: each table's placement (its kind, its shards, their devices, its
kernel) and what the search may choose for a table; the plan counts its devices' memory and
checks itself against a task."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

from torchrec_neuroshard.errors import InfeasibleError, ShardingError
from torchrec_neuroshard.kernels import ComputeKernel, check_cache_load_factor, kernel_of
from torchrec_neuroshard.types.table import WIDTH_ALIGNMENT, Shard, ShardingKind, TableSpec
from torchrec_neuroshard.types.task import Task


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
        object.__setattr__(self, "kind", kind if type(kind) is ShardingKind else ShardingKind(kind))
        object.__setattr__(self, "widths", tuple(map(int, self.widths)))
        object.__setattr__(self, "devices", tuple(map(int, self.devices)))
        object.__setattr__(self, "rows", tuple(map(int, self.rows)))
        columns = self.kind.splits_columns
        shards, other = (self.widths, self.rows) if columns else (self.rows, self.widths)
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
        return table.on_kernel(self.kernel, self.cache_load_factor)

    @staticmethod
    def data_parallel(table: str) -> "TablePlacement":
        return TablePlacement(table, kind=ShardingKind.DATA_PARALLEL)

    @staticmethod
    def whole(table: TableSpec, device: int) -> "TablePlacement":
        """``table`` table-wise on ``device``, on the table's compute kernel."""
        return TablePlacement(table.name, (table.dim,), (device,), kernel=table.kernel, cache_load_factor=table.cache_load_factor)

    @staticmethod
    def row_blocks(table: TableSpec, devices: Sequence[int], kind: ShardingKind = ShardingKind.ROW_WISE) -> "TablePlacement":
        """``table``'s rows in blocks of ceil(rows / len(devices)) over ``devices`` in order,
        as TorchRec's row-wise sharding lays them out, on the table's compute kernel."""
        block = -(-table.rows // len(devices))
        rows = tuple(max(0, min(block, table.rows - i * block)) for i in range(len(devices)))
        return TablePlacement(
            table.name, devices=tuple(devices), kind=kind, rows=rows, kernel=table.kernel, cache_load_factor=table.cache_load_factor
        )

    def check_fits(self, table: TableSpec, num_devices: int, local_world_size: int) -> None:
        """Raise ``ShardingError`` naming the table and numbers when this placement does not
        fit ``table`` on ``num_devices`` devices in hosts of ``local_world_size`` ranks:
        widths not aligned or not summing to its dim, row blocks not summing to its rows,
        a device out of range, a one-host kind spanning hosts."""
        for w in self.widths:
            if w <= 0 or w % WIDTH_ALIGNMENT:
                raise ShardingError(
                    f"table {self.table!r}: shard width {w} is not a positive multiple of "
                    f"{WIDTH_ALIGNMENT} (widths {list(self.widths)})"
                )
        if self.kind.splits_columns and sum(self.widths) != table.dim:
            raise ShardingError(
                f"table {self.table!r}: shard widths {list(self.widths)} sum to "
                f"{sum(self.widths)}, not the table's dim {table.dim}"
            )
        if self.kind.splits_rows and (sum(self.rows) != table.rows or min(self.rows) < 0):
            raise ShardingError(
                f"table {self.table!r}: row blocks {list(self.rows)} sum to {sum(self.rows)}, "
                f"not the table's {table.rows} rows"
            )
        for d in self.devices:
            if not 0 <= d < num_devices:
                raise ShardingError(f"table {self.table!r}: device {d} out of range [0, {num_devices})")
        self.check_on_one_host(local_world_size)

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
    def of(kinds: frozenset[ShardingKind], dim: int, min_width: int = WIDTH_ALIGNMENT) -> "TableChoices":
        """The choices the sharding ``kinds`` allowed for a table of ``dim`` columns leave:
        column splits need column_wise or table_column_wise (else the table stays whole)."""
        splits = bool(kinds & {ShardingKind.COLUMN_WISE, ShardingKind.TABLE_COLUMN_WISE})
        return TableChoices(
            min_width=min_width if splits else dim,
            data_parallel=ShardingKind.DATA_PARALLEL in kinds,
            row_wise=ShardingKind.ROW_WISE in kinds,
            table_row_wise=ShardingKind.TABLE_ROW_WISE in kinds,
        )

    def allows(self, kind: ShardingKind) -> bool:
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
        """Raise ``ShardingError`` naming the table and numbers for any violation: a table
        unknown, placed twice or not at all, a placement that does not fit its table
        (``TablePlacement.check_fits``), or a device over its memory cap (``InfeasibleError``)."""
        if self.num_devices != task.num_devices:
            raise ShardingError(
                f"plan has {self.num_devices} devices but the task has {task.num_devices}"
            )
        names = {t.name for t in task.tables}
        seen: set[str] = set()
        local_world_size = task.links.local_world_size if task.links is not None else self.num_devices
        for p in self.placements:
            if p.table not in names:
                raise ShardingError(f"plan places unknown table {p.table!r}")
            if p.table in seen:
                raise ShardingError(f"plan places table {p.table!r} twice")
            seen.add(p.table)
            p.check_fits(task.table(p.table), self.num_devices, local_world_size)
        missing = sorted(names - seen)
        if missing:
            raise ShardingError(f"plan does not place tables {missing}")
        self._check_memory(task)

    def fits(self, task: Task) -> bool:
        """Whether ``validate`` passes (every table placed once, in its bounds and memory)."""
        try:
            self.validate(task)
        except ShardingError:
            return False
        return True

    def _check_memory(self, task: Task) -> None:
        """Raise ``InfeasibleError`` for a device over the task's memory cap or host memory
        cap, and ``ShardingError`` for tables in host memory when the task has no host cap."""
        used = self.device_memory(task.tables, task.batch_size)
        if task.reserved_bytes:
            used = [u + r for u, r in zip(used, task.reserved_bytes)]
        self._check_cap(used, task.memory_cap_bytes, " (the task's reserved bytes included)" if task.reserved_bytes else "")
        host = self.device_host_memory(task.tables, task.batch_size)
        if any(host) and task.host_memory_cap_bytes is None:
            raise ShardingError(
                f"tables {sorted(self.offloaded())} are on UVM kernels, in host memory, but the task has no host memory cap; "
                "give the task's host_memory_cap_bytes (the topology's ddr_cap), or plan them fused"
            )
        if any(host):
            self._check_cap(host, task.host_memory_cap_bytes, " of host memory (DDR)")

    def _check_cap(self, used_per_device: Sequence[int], cap: int, what: str) -> None:
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
