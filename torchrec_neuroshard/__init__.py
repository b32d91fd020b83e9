"""torchrec-neuroshard: NeuroShard embedding-table sharding for TorchRec."""

from torchrec_neuroshard.types import (
    CostModel,
    DeviceCost,
    InfeasibleError,
    Plan,
    Shard,
    ShardingError,
    TablePlacement,
    TableSpec,
    Task,
    plan_cost,
)

__all__ = [
    "CostModel",
    "DeviceCost",
    "InfeasibleError",
    "Plan",
    "Shard",
    "ShardingError",
    "TablePlacement",
    "TableSpec",
    "Task",
    "plan_cost",
]
