"""A TorchRec caller's error handling works on NeuroShardPlanner unchanged: every planning
failure is a TorchRec ``PlannerError`` (issue 41), a model with nothing to shard gets
TorchRec's empty plan, a topology of no ranks a one-line error, weighted bags a refusal by
name."""

import logging

import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError, PlannerErrorType

from tests.models import two_tower
from torchrec_neuroshard.planner import NeuroShardPlanner
from torchrec_neuroshard.types import InfeasibleError, ShardingError

SHARDERS = [EmbeddingBagCollectionSharder()]


def topology(world: int = 2, ddr: int = 64 * 2**20) -> Topology:
    return Topology(world_size=world, compute_device="cpu", ddr_cap=ddr, local_world_size=world)


def test_a_model_that_fits_nowhere_is_torchrecs_insufficient_storage_error() -> None:
    with pytest.raises(PlannerError) as caught:
        NeuroShardPlanner(topology(ddr=4096), 64).plan(two_tower(), SHARDERS)
    assert isinstance(caught.value, InfeasibleError) and isinstance(caught.value, ValueError)
    assert caught.value.error_type is PlannerErrorType.INSUFFICIENT_STORAGE


def test_bad_input_is_a_planner_error_too() -> None:
    bad = NeuroShardPlanner(topology(), constraints={"a0": ParameterConstraints(sharding_types=["diagonal"])})
    with pytest.raises(PlannerError, match="table 'a0': unknown sharding type 'diagonal'") as caught:
        bad.plan(two_tower(), SHARDERS)
    assert isinstance(caught.value, ShardingError) and caught.value.error_type is PlannerErrorType.INPUT_VALIDATION


def test_a_module_with_nothing_to_shard_gets_torchrecs_empty_plan(caplog) -> None:
    theirs = EmbeddingShardingPlanner(topology()).plan(torch.nn.Linear(4, 4), SHARDERS)
    with caplog.at_level(logging.WARNING, logger="torchrec_neuroshard.planner"):
        ours = NeuroShardPlanner(topology()).plan(torch.nn.Linear(4, 4), SHARDERS)
    assert ours.plan == theirs.plan == {}
    assert "nothing to plan: Linear holds no module that one of the 1 sharders shards" in caplog.text


def test_a_topology_of_no_ranks_is_a_one_line_error() -> None:
    with pytest.raises(ShardingError, match=r"^Topology\(world_size=0\): a plan needs at least one rank; give world_size >= 1$"):
        NeuroShardPlanner(Topology(world_size=0, compute_device="cpu"))


def test_weighted_bags_are_refused_by_name() -> None:
    """Per-id weights (an EBC made with is_weighted=True; a feature processor's position
    weights) are refused, each table named, never priced as unweighted bags."""
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from tests.models import MixedModules

    sharders = [s for s in get_default_sharders() if "ManagedCollision" not in type(s).__name__]
    with pytest.raises(ShardingError, match=r"^tables 'pos' \(module 'fp'\) take per-id weights .* TorchRec's planner"):
        NeuroShardPlanner(topology()).plan(MixedModules(torch.device("meta")), sharders)
    bags = [EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=40, feature_names=[f"f_{n}"]) for n in ("u", "v")]
    weighted = EmbeddingBagCollection(tables=bags, is_weighted=True, device=torch.device("meta"))
    with pytest.raises(ShardingError, match=r"^tables 'u' \(module ''\), 'v' \(module ''\) take per-id weights"):
        NeuroShardPlanner(topology()).plan(weighted, SHARDERS)
