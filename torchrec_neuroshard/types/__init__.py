"""Plain data every stage speaks: tables, tasks, plans, and the cost-model interface.

Data flows one way: ``TableSpec``/``Task`` -> cost model -> search -> ``Plan`` -> TorchRec.
Everything here is a small frozen dataclass that checks its fields, or an abstract
interface; no stage keeps state between calls. ``table``: tables, shards, sharding kinds;
``task``: the problem; ``plan``: the answer; ``cost``: the ``CostModel`` interface.
"""

from torchrec_neuroshard.errors import InfeasibleError, ShardingError
from torchrec_neuroshard.types.cost import CostModel, DeviceCost
from torchrec_neuroshard.types.plan import Plan, TableChoices, TablePlacement
from torchrec_neuroshard.types.table import NUM_ACCESS_BINS, WIDTH_ALIGNMENT, Shard, ShardingKind, TableSpec
from torchrec_neuroshard.types.task import Links, Task

__all__ = [
    "NUM_ACCESS_BINS", "WIDTH_ALIGNMENT", "CostModel", "DeviceCost", "InfeasibleError", "Links", "Plan", "Shard",
    "ShardingError", "ShardingKind", "TableChoices", "TablePlacement", "TableSpec", "Task",
]  # fmt: skip
