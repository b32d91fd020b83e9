"""NeuroShardPlanner in place of EmbeddingShardingPlanner: every argument TorchRec's planner
takes, and every field of its ParameterConstraints, honoured or refused by name (issue 28)."""

import logging

import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.stats import EmbeddingStats

from tests.models import two_tower
from torchrec_neuroshard.costmodel import cost_model_for
from torchrec_neuroshard.planner import NeuroShardPlanner
from torchrec_neuroshard.stats import table_perfs

SHARDERS = [EmbeddingBagCollectionSharder()]
STATS = "torchrec.distributed.planner.stats"


def topology(world: int = 2, ddr: int = 64 * 2**20) -> Topology:
    return Topology(world_size=world, compute_device="cpu", ddr_cap=ddr, local_world_size=world)


def test_embedding_stats_of_a_plan_with_a_replicated_table_show_each_tables_own_perf(caplog) -> None:
    """A data-parallel table carries every rank (as TorchRec's plans do), so TorchRec's
    EmbeddingStats (``assert shard.ranks``) logs the plan; each table's Perf there is the
    sum over its shards of its own predicted cost, not a share of its rank's."""
    replicated = {"a1": ParameterConstraints(sharding_types=["data_parallel"])}
    planner = NeuroShardPlanner(topology(), 64, stats=EmbeddingStats(), constraints=replicated)
    with caplog.at_level(logging.INFO, logger=STATS):
        plan = planner.plan(two_tower(), SHARDERS)
    dp = plan.plan["user.ebc"]["a1"]
    assert dp.sharding_type == "data_parallel" and dp.ranks == [0, 1]
    assert "--- Planner Statistics ---" in caplog.text
    perfs = table_perfs(cost_model_for(planner.topology, None), planner.task_, planner.plan_)
    for p in planner.plan_.placements:
        ranks = range(2) if p.kind.value == "data_parallel" else p.devices
        own = sum(perfs[p.table][d].total for d in ranks)
        assert own > 0 and f"{round(own, 3)} (" in caplog.text, p.table
    # a plan of replicated tables only (nothing searched) logs too, at perf 0
    everything = {n: ParameterConstraints(sharding_types=["data_parallel"]) for n in ("a0", "a1", "b0", "b1")}
    only_dp = NeuroShardPlanner(topology(), 64, stats=EmbeddingStats(), constraints=everything).plan(two_tower(), SHARDERS)
    assert all(ps.ranks == [0, 1] for m in only_dp.plan.values() for ps in m.values())
