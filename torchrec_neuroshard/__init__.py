"""torchrec-neuroshard: NeuroShard embedding-table sharding for TorchRec.

The two-line switch from TorchRec's planner::

    from torchrec_neuroshard import NeuroShardPlanner
    plan = NeuroShardPlanner(topology, batch_size=B).collective_plan(model, sharders, pg)
"""

from torchrec_neuroshard.baselines import BASELINES, baseline_plan, torchrec_plan
from torchrec_neuroshard.costmodel import NeuralCostModel, load_pretrained
from torchrec_neuroshard.dlrm_dataset import load_dlrm_dataset
from torchrec_neuroshard.estimators import NeuralPerfEstimator, NeuralPerfModel
from torchrec_neuroshard.evaluate import PlanMeasurement, evaluate_plan, evaluate_plans
from torchrec_neuroshard.measure_comm import measure_comm
from torchrec_neuroshard.measure_compute import measure_compute
from torchrec_neuroshard.planner import NeuroShardPlanner, shard_model
from torchrec_neuroshard.pretrain import pretrain
from torchrec_neuroshard.search import SearchConfig, SearchResult, predicted_breakdown, search
from torchrec_neuroshard.sharding import from_torchrec, to_torchrec
from torchrec_neuroshard.tables import profile_batches, tables_from_module
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
)
from torchrec_neuroshard.workloads import WorkloadScale, generate_task, synthetic_pool

__all__ = [
    "BASELINES",
    "CostModel",
    "DeviceCost",
    "InfeasibleError",
    "NeuralCostModel",
    "NeuralPerfEstimator",
    "NeuralPerfModel",
    "NeuroShardPlanner",
    "Plan",
    "PlanMeasurement",
    "SearchConfig",
    "SearchResult",
    "Shard",
    "ShardingError",
    "TablePlacement",
    "TableSpec",
    "Task",
    "WorkloadScale",
    "baseline_plan",
    "evaluate_plan",
    "evaluate_plans",
    "from_torchrec",
    "generate_task",
    "load_dlrm_dataset",
    "load_pretrained",
    "measure_comm",
    "measure_compute",
    "predicted_breakdown",
    "pretrain",
    "profile_batches",
    "search",
    "shard_model",
    "synthetic_pool",
    "tables_from_module",
    "to_torchrec",
    "torchrec_plan",
]
