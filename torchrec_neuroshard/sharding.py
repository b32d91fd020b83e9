"""The bridge between our ``Plan`` and TorchRec's ``ShardingPlan``, both directions."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Mapping, Sequence

from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.planner.constants import UVM_CACHING_RATIO
from torchrec.distributed.types import CacheParams, EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

from torchrec_neuroshard.kernels import ComputeKernel, kernel_of, sharder_load_factor

from torchrec_neuroshard.tables import ModuleTable, module_shapes, shardable_modules, table_key
from torchrec_neuroshard.types import Plan, ShardingError, ShardingKind, TablePlacement, WIDTH_ALIGNMENT

FUSED = ComputeKernel.FUSED.value
"""The kernel of a table in HBM: FBGEMM's fused TBE, the one the cost model learned (a
placement's ``kernel`` names another: fused_uvm_caching, fused_uvm)."""
DENSE = "dense"
"""The kernel DMP gives data-parallel tables."""
KERNEL_FIELDS = ("enforce_hbm", "stochastic_rounding", "bounds_check_mode", "output_dtype")
"""The ``ParameterConstraints`` fields TorchRec's planner copies into a ``ParameterSharding``
(it copies cache_params too: ``_with_cache``; key_value_params are refused by the planner)."""


def _placement(device_type: str, rank: int, local_size: int) -> str:
    if device_type == "cuda":
        return f"rank:{rank}/cuda:{rank % local_size}"
    return f"rank:{rank}/{device_type}"


def to_torchrec(
    plan: Plan,
    module: nn.Module | Sequence[ModuleTable],
    device_type: str = "cpu",
    local_size: int | None = None,
    constraints: Mapping[str, ParameterConstraints] | None = None,
) -> ShardingPlan:
    """TorchRec ``ShardingPlan`` for every EmbeddingBagCollection in ``module``: the only
    place that builds TorchRec sharding objects.

    Column kinds get an explicit ``EnumerableShardingSpec`` placing each width (in column
    order) on its device, so uneven widths and two shards on one rank both work; row kinds
    one block of rows per device; data-parallel tables the dense kernel, replicated on
    every rank (``ranks`` lists them all, as in TorchRec's plans). A sharded table runs
    its placement's kernel; fused_uvm_caching with ``CacheParams(load_factor=...)``.

    Args:
        module: the model (its tables read by ``tables.module_shapes``), or its tables as
            ``module_tables`` read them.
        device_type: "cpu" (gloo) or "cuda" (NCCL).
        local_size: ranks per host (cuda device indices, the host of table_row_wise and
            table_column_wise); default all ranks on one host.
        constraints: TorchRec ``ParameterConstraints`` by table: their kernel settings
            (``KERNEL_FIELDS``) and ``cache_params`` go into the table's ``ParameterSharding``,
            as TorchRec's planner passes them (the plan's load factor replacing theirs).
    """
    local_size = local_size or plan.num_devices
    shapes = module_shapes(module) if isinstance(module, nn.Module) else [t.shape for t in module]
    placements = {p.table: p for p in plan.placements}
    module_plans: dict[str, EmbeddingModuleShardingPlan] = {}
    seen: set[str] = set()
    for t in shapes:
        name = t.name
        if t.key not in placements:
            raise ShardingError(
                f"table {t.key!r} (module at {t.path!r}) is not in the plan; plan it with the same module you shard"
            )
        seen.add(t.key)
        module_plan = module_plans.setdefault(t.path, EmbeddingModuleShardingPlan())
        p = placements[t.key]
        if not t.pooled and p.kind.splits_columns and len(set(p.widths)) > 1:
            raise ShardingError(
                f"table {name!r} (module {t.path!r}) is a sequence (EmbeddingCollection) table cut into unequal "
                f"column shards {list(p.widths)}; TorchRec's sequence all-to-all needs equal widths: cut it evenly"
            )
        sharding = _parameter_sharding(p, t.rows, t.dim, device_type, local_size, plan.num_devices)
        c = (constraints or {}).get(name)
        if c is not None:
            sharding = replace(sharding, **{f: getattr(c, f) for f in KERNEL_FIELDS})
        module_plan[name] = _with_cache(sharding, p, c.cache_params if c is not None else None)
    extra = sorted(set(placements) - seen)
    if extra:
        raise ShardingError(f"the plan names tables the module does not have: {extra}")
    return ShardingPlan(plan=module_plans)


def _with_cache(sharding: ParameterSharding, p: TablePlacement, given: CacheParams | None) -> ParameterSharding:
    """``sharding`` with the constraints' ``given`` cache params (as TorchRec's planner
    passes them), the plan's load factor in them for fused_uvm_caching."""
    if p.kernel is ComputeKernel.FUSED_UVM_CACHING:
        return replace(sharding, cache_params=replace(given or CacheParams(), load_factor=p.cache_load_factor))
    return replace(sharding, cache_params=given) if given is not None else sharding


def _parameter_sharding(
    p: TablePlacement, rows: int, dim: int, device_type: str, local_size: int, world: int
) -> ParameterSharding:
    if p.kind is ShardingKind.DATA_PARALLEL:  # every rank holds it, as TorchRec's plans say
        return ParameterSharding(
            sharding_type=p.kind.value, compute_kernel=DENSE, ranks=list(range(world)), sharding_spec=None
        )
    p.check_on_one_host(local_size)
    if p.kind.splits_columns:
        if sum(p.widths) != dim:
            raise ShardingError(
                f"table {p.table!r}: plan widths {list(p.widths)} sum to {sum(p.widths)}, "
                f"but the module's table has dim {dim}"
            )
        bad = [w for w in p.widths if w % WIDTH_ALIGNMENT]
        if bad:
            raise ShardingError(f"table {p.table!r}: shard widths {bad} are not multiples of {WIDTH_ALIGNMENT}")
        boxes = [([0, sum(p.widths[:i])], [rows, w]) for i, w in enumerate(p.widths)]
    else:
        if sum(p.rows) != rows:
            raise ShardingError(
                f"table {p.table!r}: row blocks {list(p.rows)} sum to {sum(p.rows)}, "
                f"but the module's table has {rows} rows"
            )
        boxes = [([sum(p.rows[:i]), 0], [r, dim]) for i, r in enumerate(p.rows)]
    spec = EnumerableShardingSpec(
        [
            ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=_placement(device_type, d, local_size))
            for (offsets, sizes), d in zip(boxes, p.devices)
        ]
    )
    return ParameterSharding(sharding_type=p.kind.value, compute_kernel=p.kernel.value, ranks=list(p.devices), sharding_spec=spec)


def _rank_of(placement: object) -> int:
    rank = getattr(placement, "rank", None)
    if callable(rank):
        rank = rank()
    if rank is None:
        rank = int(str(placement).split("/")[0].split(":")[1])
    return int(rank)


def sharder_load_factors(module: nn.Module, sharders: Sequence[object]) -> dict[str, float]:
    """By module path, the cache load factor its sharder's ``fused_params`` set: what a
    UVM cache without ``cache_params`` runs at under DMP (modules whose sharders set none
    are left out)."""
    factors = {path: sharder_load_factor(sharder) for path, (_, sharder) in shardable_modules(module, sharders).items()}
    return {path: factor for path, factor in factors.items() if factor is not None}


def from_torchrec(sharding_plan: ShardingPlan, num_devices: int, load_factors: Mapping[str, float] | None = None) -> Plan:
    """Our ``Plan`` from a TorchRec plan: the only place that reads TorchRec sharding
    objects, so TorchRec's own plans are measured by the same code as ours.

    Each sharded table gets its compute kernel (fused, fused_uvm_caching with its
    ``cache_params.load_factor``, when it has none its module's in ``load_factors``
    (``sharder_load_factors``), else TorchRec's default ``UVM_CACHING_RATIO``; or fused_uvm).

    A table is named as in its module, or ``path.name`` where several modules hold a table
    of that name (``tables.table_key``). Raises ``ShardingError`` for kinds a ``Plan`` does
    not record (grid_shard) and kernels NeuroShard does not plan (key_value, ...), naming
    the table.
    """
    placements: list[TablePlacement] = []
    modules_with = Counter(name for module_plan in sharding_plan.plan.values() for name in module_plan)
    for path, module_plan in sharding_plan.plan.items():
        for table, ps in module_plan.items():
            name = table_key(path, table, modules_with[table])
            try:
                kind = ShardingKind(ps.sharding_type)
            except ValueError:
                raise ShardingError(
                    f"table {name!r} (module {path!r}) is sharded {ps.sharding_type}; known kinds: "
                    f"{[k.value for k in ShardingKind]}"
                ) from None
            if kind is ShardingKind.DATA_PARALLEL:
                placements.append(TablePlacement.data_parallel(name))
                continue
            axis = 1 if kind.splits_columns else 0
            shards = sorted(ps.sharding_spec.shards, key=lambda s: s.shard_offsets[axis])
            if any(s.shard_offsets[1 - axis] != 0 for s in shards):
                raise ShardingError(f"table {name!r}: a {kind.value} shard does not start at offset 0 of its full axis")
            sizes = tuple(int(s.shard_sizes[axis]) for s in shards)
            devices = tuple(_rank_of(s.placement) for s in shards)
            kernel = kernel_of(ps.compute_kernel, name)
            load_factor = None
            if kernel is ComputeKernel.FUSED_UVM_CACHING:
                given = ps.cache_params.load_factor if ps.cache_params is not None else None
                load_factor = (load_factors or {}).get(path, UVM_CACHING_RATIO) if given is None else given
            widths, rows = (sizes, ()) if kind.splits_columns else ((), sizes)
            placements.append(TablePlacement(name, widths, devices, kind, rows, kernel, load_factor))
    return Plan(tuple(placements), num_devices)
