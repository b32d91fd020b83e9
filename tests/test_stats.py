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


def _four_tables() -> EmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=100_000, feature_names=[f"f{i}"]) for i in range(4)
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def test_an_empty_device_beside_a_crowded_one_is_logged_with_the_models_price_of_filling_it(caplog, monkeypatch) -> None:
    """A plan with device 3 empty and two whole tables on device 0 (the search's plan
    rearranged): one line names them and the model's price of moving one of device 0's
    tables to device 3, as predict_step prices that plan; a plan with no empty device, none."""
    from dataclasses import replace

    from torchrec_neuroshard import planner as planner_module
    from torchrec_neuroshard.stats import empty_device_line
    from torchrec_neuroshard.stepcost import predict_step
    from torchrec_neuroshard.types import Plan, TablePlacement

    searched = planner_module.search

    def crowded(task, *args, **kwargs):
        result = searched(task, *args, **kwargs)
        whole = tuple(TablePlacement(f"t{i}", (64,), (device,)) for i, device in enumerate((0, 0, 1, 2)))
        return replace(result, plan=Plan(whole, task.num_devices))

    gpus = Topology(world_size=4, compute_device="cuda", local_world_size=4)
    planner = NeuroShardPlanner(gpus, 512)
    planner.plan(_four_tables(), SHARDERS)
    assert empty_device_line(planner._model, planner.task_, planner.plan_) is None  # its own plan fills every device
    monkeypatch.setattr(planner_module, "search", crowded)
    with caplog.at_level(logging.INFO, logger="torchrec_neuroshard.planner"):
        planner.plan(_four_tables(), SHARDERS)
    lines = [r for r in caplog.records if "devices empty" in r.getMessage()]
    assert len(lines) == 1
    model, task, plan = planner._model.with_batch_size(planner.task_.batch_size), planner.task_, planner.plan_
    moved = [Plan(tuple(replace(p, devices=(3,)) if p.table == name else p for p in plan.placements), 4) for name in ("t0", "t1")]
    best = min(predict_step(model, task, m).cost_ms for m in moved)
    message = lines[0].getMessage()
    assert "leaves 1 of 4 devices empty (first: 3); 1 device(s) hold two or more shards (the priciest, device 0, holds 2" in message
    assert f"to device 3 at {best:.3f} ms a step, the plan at {predict_step(model, task, plan).cost_ms:.3f} ms" in message
    assert (lines[0].levelno == logging.WARNING) == (best < predict_step(model, task, plan).cost_ms)


def test_empty_devices_beside_devices_of_one_shard_each_are_logged_with_the_price_of_splitting() -> None:
    """Four tables whole on 8 GPUs leave 4 empty with one shard on each other: the line
    says so and prices the priciest device's table split by rows over all 8, as
    ``predict_step`` prices that plan."""
    from torchrec_neuroshard.stats import empty_device_line
    from torchrec_neuroshard.stepcost import predict_step
    from torchrec_neuroshard.types import Plan, TablePlacement

    planner = NeuroShardPlanner(Topology(world_size=8, compute_device="cuda", local_world_size=8), 512)
    planner.plan(_four_tables(), SHARDERS)
    model, task = planner._model.with_batch_size(planner.task_.batch_size), planner.task_
    plan = Plan(tuple(TablePlacement(f"t{i}", (64,), (i,)) for i in range(4)), 8)
    line, cheaper = empty_device_line(planner._model, task, plan)
    priciest = max(range(4), key=lambda d: predict_step(model, task, plan).devices[d].total)
    split = Plan(tuple(TablePlacement.row_blocks(task.by_name[f"t{i}"], range(8)) if i == priciest else p for i, p in enumerate(plan.placements)), 8)
    price = predict_step(model, task, split).cost_ms
    assert f"leaves 4 of 8 devices empty (first: 4); every other holds one shard (the priciest, device {priciest}:" in line
    assert f"splitting table t{priciest} by rows over every device at {price:.3f} ms a step" in line
    assert cheaper == (price < predict_step(model, task, plan).cost_ms)
