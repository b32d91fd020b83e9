"""The bridge between our ``Plan`` and TorchRec's ``ShardingPlan``, both directions."""

from __future__ import annotations

from torch import nn
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)

from torchrec_neuroshard.tables import find_embedding_bag_collections
from torchrec_neuroshard.types import Plan, ShardingError, TablePlacement, WIDTH_ALIGNMENT

FUSED = "fused"


def _placement(device_type: str, rank: int, local_size: int) -> str:
    if device_type == "cuda":
        return f"rank:{rank}/cuda:{rank % local_size}"
    return f"rank:{rank}/{device_type}"


def to_torchrec(
    plan: Plan,
    module: nn.Module,
    device_type: str = "cpu",
    local_size: int | None = None,
    decided: dict[str, ParameterSharding] | None = None,
) -> ShardingPlan:
    """TorchRec ``ShardingPlan`` for every EmbeddingBagCollection in ``module``.

    A one-shard table becomes table_wise/fused on its device; a split table becomes
    column_wise/fused with an explicit ``EnumerableShardingSpec`` placing each width (in
    column order) on its device, so uneven widths and two shards on one rank both work.

    Args:
        device_type: "cpu" (gloo) or "cuda" (NCCL).
        local_size: ranks per host, for cuda device indices; default all ranks on one host.
        decided: ParameterShardings decided elsewhere (e.g. row_wise fallbacks), by table.
    """
    local_size = local_size or plan.num_devices
    decided = decided or {}
    placements = {p.table: p for p in plan.placements}
    known = set(placements) | set(plan.data_parallel) | set(decided)
    module_plans: dict[str, EmbeddingModuleShardingPlan] = {}
    seen: set[str] = set()
    for path, ebc in find_embedding_bag_collections(module).items():
        module_plan = EmbeddingModuleShardingPlan()
        for config in ebc.embedding_bag_configs():
            name = config.name
            seen.add(name)
            if name not in known:
                raise ShardingError(
                    f"table {name!r} (EBC at {path!r}) is not in the plan; plan it with the "
                    "same module you shard"
                )
            if name in decided:
                module_plan[name] = decided[name]
                continue
            if name in plan.data_parallel:
                module_plan[name] = ParameterSharding(
                    sharding_type=ShardingType.DATA_PARALLEL.value,
                    compute_kernel="dense",
                    ranks=None,
                    sharding_spec=None,
                )
                continue
            p = placements[name]
            if sum(p.widths) != config.embedding_dim:
                raise ShardingError(
                    f"table {name!r}: plan widths {list(p.widths)} sum to {sum(p.widths)}, "
                    f"but the module's table has dim {config.embedding_dim}"
                )
            bad = [w for w in p.widths if w % WIDTH_ALIGNMENT]
            if bad:
                raise ShardingError(
                    f"table {name!r}: shard widths {bad} are not multiples of {WIDTH_ALIGNMENT}"
                )
            offsets = [sum(p.widths[:i]) for i in range(len(p.widths))]
            spec = EnumerableShardingSpec(
                [
                    ShardMetadata(
                        shard_offsets=[0, off],
                        shard_sizes=[config.num_embeddings, w],
                        placement=_placement(device_type, d, local_size),
                    )
                    for off, w, d in zip(offsets, p.widths, p.devices)
                ]
            )
            sharding_type = (
                ShardingType.TABLE_WISE.value
                if len(p.widths) == 1
                else ShardingType.COLUMN_WISE.value
            )
            module_plan[name] = ParameterSharding(
                sharding_type=sharding_type,
                compute_kernel=FUSED,
                ranks=list(p.devices),
                sharding_spec=spec,
            )
        module_plans[path] = module_plan
    extra = sorted(known - seen)
    if extra:
        raise ShardingError(f"the plan names tables the module does not have: {extra}")
    return ShardingPlan(plan=module_plans)


def row_wise_sharding(
    rows: int, dim: int, world_size: int, device_type: str = "cpu", local_size: int | None = None
) -> ParameterSharding:
    """row_wise/fused: contiguous blocks of ceil(rows / world_size) rows, block r on rank r."""
    local_size = local_size or world_size
    block = -(-rows // world_size)
    shards = []
    for r in range(world_size):
        start = min(rows, r * block)
        size = min(block, rows - start)
        shards.append(
            ShardMetadata(
                shard_offsets=[start, 0],
                shard_sizes=[size, dim],
                placement=_placement(device_type, r, local_size),
            )
        )
    return ParameterSharding(
        sharding_type=ShardingType.ROW_WISE.value,
        compute_kernel=FUSED,
        ranks=list(range(world_size)),
        sharding_spec=EnumerableShardingSpec(shards),
    )


def _rank_of(placement: object) -> int:
    rank = getattr(placement, "rank", None)
    if callable(rank):
        rank = rank()
    if rank is None:
        rank = int(str(placement).split("/")[0].split(":")[1])
    return int(rank)


def from_torchrec(sharding_plan: ShardingPlan, num_devices: int) -> Plan:
    """Our ``Plan`` from a TorchRec plan of table_wise / column_wise / table_column_wise /
    data_parallel tables, so TorchRec's own plans are measured by the same code.

    Raises ``ShardingError`` for sharding types with row splits (row_wise, table_row_wise,
    grid_shard): their cost is not a column split's.
    """
    placements: list[TablePlacement] = []
    data_parallel: list[str] = []
    for path, module_plan in sharding_plan.plan.items():
        for name, ps in module_plan.items():
            if ps.sharding_type == ShardingType.DATA_PARALLEL.value:
                data_parallel.append(name)
                continue
            if ps.sharding_type not in (
                ShardingType.TABLE_WISE.value,
                ShardingType.COLUMN_WISE.value,
                ShardingType.TABLE_COLUMN_WISE.value,
            ):
                raise ShardingError(
                    f"table {name!r} (module {path!r}) is sharded {ps.sharding_type}; only "
                    "table_wise, column_wise, table_column_wise and data_parallel convert"
                )
            shards = sorted(ps.sharding_spec.shards, key=lambda s: s.shard_offsets[1])
            if any(s.shard_offsets[0] != 0 for s in shards):
                raise ShardingError(f"table {name!r}: a column shard does not start at row 0")
            placements.append(
                TablePlacement(
                    table=name,
                    widths=tuple(int(s.shard_sizes[1]) for s in shards),
                    devices=tuple(_rank_of(s.placement) for s in shards),
                )
            )
    return Plan(tuple(placements), num_devices, tuple(data_parallel))
