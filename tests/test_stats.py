"""The plan's stats price each table as the model prices it: a replicated table's perf is
what it adds to the step, and the fixed cost of replicating anything is named once, not
charged to every replicated table (issue 41)."""

import logging

import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_neuroshard.planner import NeuroShardPlanner
from torchrec_neuroshard.stats import replica_overhead, table_perfs
from torchrec_neuroshard.stepcost import Collectives, data_parallel_ms

SHARDERS = [EmbeddingBagCollectionSharder()]


def model() -> EmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(name="small", embedding_dim=32, num_embeddings=1_000, feature_names=["f0"]),
        EmbeddingBagConfig(name="other", embedding_dim=32, num_embeddings=2_000, feature_names=["f1"]),
        EmbeddingBagConfig(name="big", embedding_dim=128, num_embeddings=1_000_000, feature_names=["f2"]),
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def test_a_replicated_tables_perf_is_its_own_and_the_fixed_cost_is_shown_once(caplog) -> None:
    gpus = Topology(world_size=4, compute_device="cuda", local_world_size=4)
    replicate = {n: ParameterConstraints(sharding_types=["data_parallel"]) for n in ("small", "other")}
    planner = NeuroShardPlanner(gpus, 512, constraints=replicate, stats=EmbeddingStats())
    with caplog.at_level(logging.INFO, logger="torchrec.distributed.planner.stats"):
        planner.plan(model(), SHARDERS)
    task, parts = planner.task_, planner._model.step_parts
    perfs = table_perfs(planner._model, task, planner.plan_)
    fixed = replica_overhead(planner._model, task)
    small = [t for t in task.tables if t.name == "small"]
    links = Collectives.of(planner._model, task).links
    alone, nothing = (data_parallel_ms(parts, tables, task.batch_size, 4, links) for tables in (small, []))
    added = sum(alone.values()) - sum(nothing.values())
    assert fixed.total > 0.1 and 0 < added < 0.1 * fixed.total  # the fixed cost dwarfs what a 1k x 32 table adds
    for cost in perfs["small"]:
        assert abs(cost.total - added) < 1e-6
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("replicated tables:")]
    assert len(lines) == 1 and f"{fixed.total:.3f} ms a rank fixed per module with any" in lines[0] and "1 module(s)" in lines[0]
