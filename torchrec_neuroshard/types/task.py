"""A sharding problem: the tables, the devices and their links, the memory caps and the
batch; with the task files that hold one task or a suite of them."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Sequence

from torchrec_neuroshard.errors import ShardingError
from torchrec_neuroshard.types.checks import finite_non_negative, required_field, whole_number
from torchrec_neuroshard.types.table import TableSpec


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
        object.__setattr__(self, "local_world_size", whole_number(self.local_world_size, "local_world_size"))
        if self.local_world_size < 1:
            raise ShardingError(f"local_world_size must be >= 1, got {self.local_world_size}")
        for name in ("intra_host_bw", "inter_host_bw"):
            value = getattr(self, name)
            if not (finite_non_negative(value) and value > 0):
                raise ShardingError(f"{name} must be a positive number of bytes per ms, got {value!r}")
            object.__setattr__(self, name, float(value))

    @staticmethod
    def from_dict(d: dict, what: str = "the links") -> "Links":
        """The links ``d`` (``asdict``'s layout) describes; ``what`` names them in errors."""
        return Links(*(required_field(d, key, what) for key in ("local_world_size", "intra_host_bw", "inter_host_bw")))

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
    reserved_bytes: tuple[int, ...] = ()
    """Bytes of each device's ``memory_cap_bytes`` already taken by placements outside the
    task (those the search fixed before placing these tables): device d holds at most
    ``memory_cap_bytes - reserved_bytes[d]`` of this task's tables. Empty: none."""

    def __post_init__(self) -> None:
        for field in ("num_devices", "memory_cap_bytes", "batch_size"):
            object.__setattr__(self, field, whole_number(getattr(self, field), f"the task's {field}"))
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
            host = whole_number(self.host_memory_cap_bytes, "the task's host_memory_cap_bytes")
            if host <= 0:
                raise ShardingError(f"host memory cap must be positive (or None for none), got {host} bytes")
            object.__setattr__(self, "host_memory_cap_bytes", host)
        self._check_reserved()

    def _check_reserved(self) -> None:
        if isinstance(self.reserved_bytes, (str, bytes)) or not isinstance(self.reserved_bytes, Sequence):
            raise ShardingError(f"the task's reserved_bytes must be a list of bytes per device, got {self.reserved_bytes!r}")
        reserved = tuple(whole_number(b, "a device's reserved_bytes") for b in self.reserved_bytes)
        if reserved and (len(reserved) != self.num_devices or min(reserved) < 0):
            raise ShardingError(
                f"the task's reserved_bytes must give bytes >= 0 for each of its {self.num_devices} devices "
                f"(or be empty for none), got {list(reserved)}"
            )
        object.__setattr__(self, "reserved_bytes", reserved)

    @property
    def reserved(self) -> tuple[int, ...]:
        """``reserved_bytes`` of every device (zeros when the task reserves none)."""
        return self.reserved_bytes or (0,) * self.num_devices

    @cached_property
    def by_name(self) -> dict[str, TableSpec]:
        """The tables by name (built once per task)."""
        return {t.name: t for t in self.tables}

    def table(self, name: str) -> TableSpec:
        return self.by_name[name]

    @property
    def per_rank_batch(self) -> int:
        """The batch one rank feeds its model (``batch_size // num_devices``): what
        TorchRec's planner calls ``batch_size``."""
        return self.batch_size // self.num_devices

    def subset(self, names: Sequence[str], reserved_bytes: Sequence[int] | None = None) -> "Task":
        """The task of the tables ``names`` (in the task's order; modules kept, each
        restricted to them), with ``reserved_bytes`` of each device taken (default the task's)."""
        keep = set(names)
        return Task(
            tuple(t for t in self.tables if t.name in keep),
            self.num_devices,
            self.memory_cap_bytes,
            self.batch_size,
            tuple(m for m in (tuple(n for n in module if n in keep) for module in self.modules) if m),
            self.links,
            self.host_memory_cap_bytes,
            self.reserved_bytes if reserved_bytes is None else tuple(reserved_bytes),
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
        if self.reserved_bytes:
            d["reserved_bytes"] = list(self.reserved_bytes)
        return json.dumps(d)

    @staticmethod
    def from_dict(d: dict, what: str = "the task") -> "Task":
        """The task ``d`` (``to_json``'s layout) describes; ``what`` names it in errors."""
        return Task(
            tables=tuple(
                TableSpec.from_dict(t, f"{what}, table {i}") for i, t in enumerate(required_field(d, "tables", what))
            ),
            num_devices=required_field(d, "num_devices", what),
            memory_cap_bytes=required_field(d, "memory_cap_bytes", what),
            batch_size=required_field(d, "batch_size", what),
            modules=d.get("modules", ()),
            links=Links.from_dict(d["links"], f"{what}'s links") if d.get("links") is not None else None,
            host_memory_cap_bytes=d.get("host_memory_cap_bytes"),
            reserved_bytes=d.get("reserved_bytes", ()),
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
