"""torchrec-neuroshard: NeuroShard embedding-table sharding for TorchRec.

The two-line switch from TorchRec's planner::

    from torchrec_neuroshard import NeuroShardPlanner
    plan = NeuroShardPlanner(topology, batch_size=B).collective_plan(model, sharders, pg)

The package is the planner core (tables -> cost model -> search -> Plan -> TorchRec).
The lab that measures, collects and trains lives in ``torchrec_neuroshard.lab`` and is
never imported by the core. Names below load on first use, so importing one core module
(or a lab module that needs no torchrec) does not import TorchRec.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "access_histogram": "access",
    "profile_batches": "access",
    "tables_from_module": "tables",
    "CostModel": "types",
    "DeviceCost": "types",
    "InfeasibleError": "types",
    "Plan": "types",
    "Shard": "types",
    "ShardingError": "types",
    "TablePlacement": "types",
    "TableSpec": "types",
    "Task": "types",
    "NeuralCostModel": "costmodel",
    "load_pretrained": "costmodel",
    "SearchConfig": "search",
    "SearchResult": "search",
    "predicted_breakdown": "search",
    "search": "search",
    "BASELINES": "heuristics",
    "baseline_plan": "heuristics",
    "NeuroShardPlanner": "planner",
    "shard_model": "dmp",
    "NeuralPerfEstimator": "estimators",
    "NeuralPerfModel": "estimators",
    "AccessCacheStatistics": "estimators",
    "from_torchrec": "sharding",
    "to_torchrec": "sharding",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'torchrec_neuroshard' has no attribute {name!r}")
    return getattr(importlib.import_module(f"torchrec_neuroshard.{_EXPORTS[name]}"), name)
