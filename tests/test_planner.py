"""NeuroShardPlanner and the neural estimators on real DMP over gloo ranks."""

import logging

import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints, Topology

from tests.models import TwoEBCs, meta_ebc, plan_shard_and_compare, row_wise_cpu_sharder, two_tower
from torchrec_neuroshard.lab.launch import spawn
from torchrec_neuroshard.planner import NeuroShardPlanner
from torchrec_neuroshard.tables import module_for_tables
from torchrec_neuroshard.types import ShardingError
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool

SHARDERS = [EmbeddingBagCollectionSharder()]
ROW_WISE_SHARDERS = [row_wise_cpu_sharder()]


def topology(world: int = 2, ddr: int = 64 * 2**20) -> Topology:
    return Topology(world_size=world, compute_device="cpu", ddr_cap=ddr, local_world_size=world)


@pytest.mark.dmp
@pytest.mark.parametrize("world_size", [2, 4])
def test_collective_plan_is_identical_on_every_rank_and_dmp_matches_reference(world_size: int) -> None:
    results = spawn(plan_shard_and_compare, world_size, {})
    assert len({r["plan"] for r in results}) == 1
    for r in results:
        assert r["max_err"] < 1e-5


@pytest.mark.dmp
def test_constraints_are_honoured_through_dmp() -> None:
    constraints = {
        "a0": {"sharding_types": ["table_wise"]},
        "a1": {"sharding_types": ["data_parallel"]},
        "b0": {"sharding_types": ["row_wise"]},
        "b1": {"sharding_types": ["column_wise", "table_wise"], "pooling_factors": [3.0]},
    }
    results = spawn(plan_shard_and_compare, 2, constraints)
    types = results[0]["types"]
    assert types["a0"] == ("table_wise", [64])
    assert types["a1"][0] == "data_parallel"
    assert types["b0"][0] == "row_wise" and types["b0"][1] == [32, 32]
    assert types["b1"][0] in ("table_wise", "column_wise")
    for r in results:
        assert r["max_err"] < 1e-5


@pytest.mark.dmp
def test_neural_estimator_inside_torchrecs_planner_gives_a_plan_dmp_accepts() -> None:
    results = spawn(plan_shard_and_compare, 2, {}, True)
    assert len({r["plan"] for r in results}) == 1
    assert all(r["max_err"] < 1e-5 for r in results)


def test_min_partition_and_memory_split(caplog) -> None:
    task = generate_task(synthetic_pool(), 12, 4, WorkloadScale(), seed=3)
    module = module_for_tables(task.tables)
    widest = max(task.tables, key=lambda t: t.dim)
    cons = {t.name: ParameterConstraints(min_partition=t.dim) for t in task.tables}
    planner = NeuroShardPlanner(topology(4, task.memory_cap_bytes * 2), constraints=cons)
    # the table goes where TorchRec's planner logs its EmbeddingStats
    with caplog.at_level(logging.INFO, logger="torchrec.distributed.planner.stats"):
        plan = planner.plan(module, SHARDERS)
    assert all(ps.sharding_type == "table_wise" for ps in plan.plan[""].values())
    assert "predicted embedding cost" in caplog.text and "Rank" in caplog.text and "DDR (GB)" in caplog.text
    assert widest.name in caplog.text


def test_constructor_takes_torchrecs_keywords(caplog) -> None:
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation, HeuristicalStorageReservation

    task = generate_task(synthetic_pool(), 8, 2, WorkloadScale(), seed=5)
    module = module_for_tables(task.tables)
    quiet = NeuroShardPlanner(
        topology=topology(2, task.memory_cap_bytes * 2), batch_size=512, constraints={},
        storage_reservation=HeuristicalStorageReservation(percentage=0.15), debug=False, stats=None,
    )
    with caplog.at_level(logging.INFO, logger="torchrec.distributed.planner.stats"):
        quiet.plan(module, SHARDERS)
    assert "predicted embedding cost" not in caplog.text  # debug off: DEBUG level only
    # a StorageReservation object reserves as in TorchRec's planner (its percentage applies to HBM)
    gpus = Topology(world_size=2, compute_device="cuda", hbm_cap=1000, local_world_size=2)
    assert NeuroShardPlanner(gpus, storage_reservation=FixedPercentageStorageReservation(0.5))._memory_cap(module, SHARDERS) == 500
    with pytest.raises(ShardingError, match=r"storage_reservation=1.5: give a fraction in \[0, 1\)"):
        NeuroShardPlanner(topology(), storage_reservation=1.5).plan(two_tower(), SHARDERS)
    with pytest.raises(ShardingError, match=r"stats=<object object at .*>: give a TorchRec Stats"):
        NeuroShardPlanner(topology(), stats=object())


def test_table_larger_than_a_rank_is_row_wised_or_a_clear_error(caplog) -> None:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    def model() -> torch.nn.Module:
        return EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="big", embedding_dim=16, num_embeddings=1000, feature_names=["f_big"]),
                EmbeddingBagConfig(name="small", embedding_dim=8, num_embeddings=40, feature_names=["f_small"]),
            ],
            device=torch.device("meta"),
        )

    # big is 1000 x 16 x 4 = 64,000 bytes of weights, 65,152 with the buffers of a global
    # batch of 16; each rank has 40,000
    planner = NeuroShardPlanner(topology(2, 40_000), batch_size=8, storage_reservation=0.0, cost_model="cpu")
    with caplog.at_level(logging.INFO, logger="torchrec_neuroshard.planner"):
        plan = planner.plan(model(), ROW_WISE_SHARDERS)
    assert plan.plan[""]["big"].sharding_type == "row_wise"
    assert plan.plan[""]["small"].sharding_type in ("table_wise", "column_wise", "row_wise")  # as the model prices the step
    assert "big: larger than one rank's memory (65,152 > 40,000 bytes): row_wise" in caplog.text
    # decided before the search, the row-wise table is still in the predicted whole step
    from torchrec_neuroshard.costmodel import load_pretrained
    from torchrec_neuroshard.stepcost import predict_step

    task = planner.task_
    priced = predict_step(load_pretrained("cpu").with_batch_size(task.batch_size), task, planner.plan_)
    assert {t.name for t in task.tables} == {"big", "small"}
    assert planner.search_result_.predicted_cost_ms == pytest.approx(priced.cost_ms)
    assert min(priced.parts["reduce_scatter"]) > 0 and min(priced.parts["row_fwd"]) > 0
    strict = NeuroShardPlanner(
        topology(2, 40_000), batch_size=8, storage_reservation=0.0, cost_model="cpu",
        constraints={"big": ParameterConstraints(sharding_types=["table_wise"])},
    )
    with pytest.raises(ShardingError, match=r"table 'big' \(65,152 bytes\) is larger than one rank's memory.*allow only \['table_wise'\]"):
        strict.plan(model(), ROW_WISE_SHARDERS)
    # TorchRec's stock EBC sharder offers no row splits on CPU: then too big is an error
    with pytest.raises(ShardingError, match=r"table 'big' \(65,152 bytes\) is larger than one rank's memory"):
        planner.plan(model(), SHARDERS)


def test_bad_inputs_are_clear_errors(tmp_path) -> None:
    bad = NeuroShardPlanner(topology(), constraints={"a0": ParameterConstraints(sharding_types=["diagonal"])})
    with pytest.raises(ShardingError, match="table 'a0': unknown sharding type 'diagonal'"):
        bad.plan(two_tower(), SHARDERS)
    dense = NeuroShardPlanner(topology(), constraints={"b1": ParameterConstraints(compute_kernels=["dense"])})
    with pytest.raises(ShardingError, match=r"table 'b1': constraints allow compute kernels \['dense'\]"):
        dense.plan(two_tower(), SHARDERS)
    odd = NeuroShardPlanner(topology(), constraints={"a0": ParameterConstraints(min_partition=6)})
    with pytest.raises(ShardingError, match="table 'a0': min_partition 6 must be a positive multiple of 4"):
        odd.plan(two_tower(), SHARDERS)
    with pytest.raises(ShardingError, match="does not fit even row_wise over 2 ranks"):
        NeuroShardPlanner(topology(2, 100), storage_reservation=0.0).plan(two_tower(), ROW_WISE_SHARDERS)
    corrupt = tmp_path / "model.pt"
    corrupt.write_bytes(b"\x00" * 64)
    with pytest.raises(ShardingError, match="model.pt: not a readable torchrec-neuroshard cost model"):
        NeuroShardPlanner(topology(), cost_model=corrupt).plan(two_tower(), SHARDERS)  # loaded on first plan
    # far beyond the comm model's world sizes: planned, its communication priced by the links
    # (costmodel.shipped._within_reach; tests/test_inputs.py checks the model and the warning)
    assert NeuroShardPlanner(topology(64)).plan(two_tower(), SHARDERS).plan


def test_batch_size_other_than_the_models_is_priced_and_logged(caplog) -> None:
    task = generate_task(synthetic_pool(), 10, 2, WorkloadScale(), seed=4)
    module = module_for_tables(task.tables)
    small = NeuroShardPlanner(topology(2, task.memory_cap_bytes * 2), batch_size=512, cost_model="cpu")  # learned the batch (its shift)
    with caplog.at_level(logging.INFO, logger="torchrec_neuroshard.planner"):
        small.plan(module, SHARDERS)
    assert (
        "global batch 1024 (per-rank 512 x 2 ranks): compute scaled linearly by 0.25 (learned at 4,096), "
        "moved by its batch shift (learned at 256-"
    ) in caplog.text
    assert "comm scaled linearly from 4,096" in caplog.text
    big = NeuroShardPlanner(topology(2, task.memory_cap_bytes * 2), batch_size=2048, cost_model="cpu")
    big.plan(module, SHARDERS)
    # the kernels of one plan cost less at a quarter of the batch: how much less the net
    # learned (linear scaling said exactly 0.25; the step's fixed latencies do not scale)
    from torchrec_neuroshard.costmodel import load_pretrained
    from torchrec_neuroshard.stepcost import predict_step

    model = load_pretrained("cpu")

    def kernels_ms(task) -> float:
        parts = predict_step(model.with_batch_size(task.batch_size), task, big.plan_).parts
        return sum(sum(parts[k]) for k in ("column_fwd", "column_bwd"))

    assert 0.2 < kernels_ms(small.task_) / kernels_ms(big.task_) < 0.5


@pytest.mark.dmp
def test_shard_model_helper_returns_a_working_dmp() -> None:
    from tests.models import shard_with_helper

    assert spawn(shard_with_helper, 2) == [["f_a0", "f_a1", "f_b0", "f_b1"]] * 2


def test_decisions_do_not_depend_on_table_or_module_order() -> None:
    # "big" is larger than a rank (row-wised), "rep" may only be replicated, the rest searched
    user = [("big", 16, 8000), ("rep", 8, 50), ("u1", 64, 400), ("u2", 32, 300)]
    item = [("i1", 128, 200), ("i2", 16, 200), ("i3", 64, 100)]
    cons = {"rep": ParameterConstraints(sharding_types=["data_parallel"]), "u1": ParameterConstraints(pooling_factors=[4.0])}
    decisions = []
    for tables_a, tables_b in [(user, item), (item[::-1], user[::-1]), (user[::-1], item)]:
        planner = NeuroShardPlanner(topology(2, 500_000), batch_size=64, constraints=cons, storage_reservation=0.0)
        planner.plan(TwoEBCs(meta_ebc(tables_a), meta_ebc(tables_b)), ROW_WISE_SHARDERS)
        decisions.append({p.table: p for p in planner.plan_.placements})
    assert decisions[0] == decisions[1] == decisions[2]
    assert decisions[0]["big"].kind.value == "row_wise" and decisions[0]["rep"].kind.value == "data_parallel"


def test_each_sharded_module_is_a_module_of_the_task_it_searches() -> None:
    user = [("u1", 64, 400), ("u2", 32, 300)]
    item = [("i1", 128, 200), ("i2", 16, 200), ("i3", 64, 100)]
    planner = NeuroShardPlanner(topology(2, 500_000), batch_size=64, storage_reservation=0.0)
    planner.plan(TwoEBCs(meta_ebc(user), meta_ebc(item)), SHARDERS)
    assert planner.task_.modules == (("u1", "u2"), ("i1", "i2", "i3"))


def test_batch_size_is_the_per_rank_batch_as_in_torchrecs_planner() -> None:
    """NeuroShard and our estimator inside TorchRec's planner, given the same batch_size,
    price the same table-wise shard at the same load: per-rank batch x world size."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator

    from torchrec_neuroshard.costmodel import load_pretrained
    from torchrec_neuroshard.estimators import NeuralPerfEstimator
    from torchrec_neuroshard.types import Shard

    per_rank, world = 256, 4
    model = meta_ebc([("x", 32, 5000), ("y", 16, 2000)])
    cons = {"x": ParameterConstraints(sharding_types=["table_wise"], pooling_factors=[8.0]), "y": ParameterConstraints(pooling_factors=[2.0])}
    ours = NeuroShardPlanner(topology(world), batch_size=per_rank, constraints=cons)
    ours.plan(model, SHARDERS)
    assert ours.task_.batch_size == per_rank * world
    x = ours.task_.table("x")
    want_fwd, want_bwd = load_pretrained("cpu").with_batch_size(per_rank * world).compute_cost([[Shard(x, 32)]])[0]

    topo = topology(world)
    enumerator = EmbeddingEnumerator(
        topology=topo, batch_size=per_rank, constraints=cons,
        estimator=[NeuralPerfEstimator(topo, cons), EmbeddingStorageEstimator(topo, cons)],
    )
    options = enumerator.enumerate(model, SHARDERS)
    x_tw = next(o for o in options if o.name == "x" and o.sharding_type == "table_wise")
    assert x_tw.shards[0].perf.fwd_compute == pytest.approx(want_fwd, rel=1e-4)
    assert x_tw.shards[0].perf.bwd_compute == pytest.approx(want_bwd, rel=1e-4)
    # and TorchRec's planner itself accepts the same argument
    EmbeddingShardingPlanner(topology=topo, batch_size=per_rank, constraints=cons).plan(model, SHARDERS)


@pytest.mark.dmp
@pytest.mark.parametrize("planner_name", ["neuroshard", "torchrec"])
def test_every_embedding_module_kind_is_planned_and_matches_the_unsharded_model(planner_name: str) -> None:
    """An EBC, an EC, a feature-processed EBC and a managed-collision EBC (its sharder has
    no CPU sharding: without it, both planners shard its inner EBC as a plain EBC), under
    NeuroShard's plan and under TorchRec's: every output equals the unsharded model's, so
    the two plans' outputs agree too. NeuroShard refuses the feature-processed EBC's
    weighted bags (``test_weighted_bags_are_refused_by_name``): it plans the model without it."""
    from tests.models import plan_mixed_and_compare

    results = spawn(plan_mixed_and_compare, 2, planner_name)
    for r in results:
        weighted = ["fp"] if planner_name == "torchrec" else []
        assert sorted(r["errors"]) == sorted(["f_bag", "f_mc", "f_seq"] + ["f_pos"] * len(weighted))
        assert max(r["errors"].values()) < 1e-5, r["errors"]
        assert r["paths"] == ["ebc", "ec", *weighted, "mc._embedding_module"]


@pytest.mark.dmp
def test_a_sequence_table_split_by_columns_evenly_matches_the_unsharded_model() -> None:
    """EmbeddingCollection tables are searched like bags, so they may be column-split (the
    EC sharder offers column_wise): one cut 8 + 8 over two ranks gives the unsharded
    model's sequence embeddings under DMP. An uneven cut, which TorchRec's sequence
    all-to-all cannot run, is refused by name, and the planner never makes one."""
    from tests.models import MixedModules, plan_mixed_and_compare
    from torchrec_neuroshard.sharding import to_torchrec
    from torchrec_neuroshard.tables import module_tables
    from torchrec_neuroshard.types import Plan, TablePlacement

    def plan(seq: TablePlacement) -> Plan:
        others = (TablePlacement("bag", (32,), (0,)), TablePlacement("pos", (16,), (1,)), TablePlacement("mc", (8,), (0,)))
        return Plan((seq, *others), 2)

    for r in spawn(plan_mixed_and_compare, 2, "neuroshard", plan(TablePlacement("seq", (8, 8), (0, 1))).to_dict()):
        assert r["types"]["seq"] == "column_wise"
        assert max(r["errors"].values()) < 1e-5, r["errors"]
    from torchrec.distributed.sharding_plan import get_default_sharders

    sharders = [s for s in get_default_sharders() if "ManagedCollision" not in type(s).__name__]
    tables = module_tables(MixedModules(torch.device("meta")), 16, sharders=sharders)
    assert next(t for t in tables if t.spec.name == "seq").min_width == 8  # one even halving at most
    with pytest.raises(ShardingError, match=r"table 'seq' \(module 'ec'\) is a sequence .* unequal column shards \[12, 4\]"):
        to_torchrec(plan(TablePlacement("seq", (12, 4), (0, 1))), tables)


def test_torchrec_stats_log_our_plan(caplog) -> None:
    """stats= takes TorchRec's Stats as EmbeddingShardingPlanner does (one or a list): its
    EmbeddingStats logs TorchRec's table of our plan, our ranks and each table's own
    predicted perf in it;
    any other object is refused when the planner is made."""
    from torchrec.distributed.planner.stats import EmbeddingStats, NoopEmbeddingStats

    model = module_for_tables(generate_task(synthetic_pool(), 6, 2, WorkloadScale(), seed=0).tables)
    planner = NeuroShardPlanner(topology(ddr=2**30), stats=[EmbeddingStats(), NoopEmbeddingStats()])
    with caplog.at_level(logging.INFO, logger="torchrec.distributed.planner.stats"):
        planner.plan(model, SHARDERS)
    text = caplog.text
    assert "--- Planner Statistics ---" in text
    from torchrec_neuroshard.costmodel import cost_model_for
    from torchrec_neuroshard.stats import table_perfs

    perfs = table_perfs(cost_model_for(planner.topology, None), planner.task_, planner.plan_)
    # TorchRec's per-rank Perf column sums the rank's tables' own predicted costs (rounded to 3 places)
    for rank in range(2):
        own = sum(perfs[p.table][rank].total for p in planner.plan_.placements if rank in p.devices)
        assert f"{round(own, 3)} (" in text, (rank, own)
    for p in planner.plan_.placements:
        assert f".{p.table} " in text
    with pytest.raises(ShardingError, match=r"stats='yes': give a TorchRec Stats .* got str"):
        NeuroShardPlanner(topology(), stats="yes")


def test_a_module_its_sharder_cannot_shard_here_is_a_clear_error() -> None:
    from torchrec.distributed.sharding_plan import get_default_sharders

    from tests.models import MixedModules

    with pytest.raises(ShardingError, match=r"module 'mc' \(ManagedCollisionEmbeddingBagCollection\): .* offers no sharding type on cpu"):
        NeuroShardPlanner(topology()).plan(MixedModules(), get_default_sharders())


def test_dtypes_the_kernel_or_the_model_never_saw_are_clear_errors() -> None:
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    def model(dtype: DataType) -> torch.nn.Module:
        return EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name="h", embedding_dim=16, num_embeddings=100, feature_names=["f"], data_type=dtype)],
            device=torch.device("meta"),
        )

    # the shipped CPU model (cpu.pt) learned fp16 pooled kernels: an fp16 bag table is planned
    planner = NeuroShardPlanner(topology(), cost_model="cpu")
    planner.plan(model(DataType.FP16), SHARDERS)
    assert planner.task_.tables[0].bytes_per_element == 2
    # a kernel a model never saw at that dtype is refused, not mispredicted, for every caller
    # of the model (planner, estimators, CLI, benchmarks): the CPU sequence net saw fp32 only
    from torchrec_neuroshard.costmodel import NeuralCostModel, load_pretrained
    from torchrec_neuroshard.types import Shard, TableSpec

    cpu = load_pretrained("cpu")
    fp16 = TableSpec("h", 100, 16, 1.0, (1.0,) + (0.0,) * 16, bytes_per_element=2)
    with pytest.raises(ShardingError, match=r"table 'h' has 2-byte weights, but the cost model's sequence kernel was trained on \[4\]-byte"):
        cpu.compute_cost([[Shard(TableSpec.from_dict({**fp16.to_dict(), "pooled": False}), 16)]])
    fp32_only = NeuralCostModel(cpu.compute_net, cpu.compute_norm, cpu.comm, {**cpu.meta, "bytes_per_element_trained": [4]})
    with pytest.raises(ShardingError, match=r"table 'h' has 2-byte weights, but the cost model's pooled kernel was trained on \[4\]-byte"):
        fp32_only.compute_cost([[Shard(fp16, 16)]])
    with pytest.raises(ShardingError, match=r"table 'h' \(module ''\) has BF16 weights"):
        NeuroShardPlanner(topology()).plan(model(DataType.BF16), SHARDERS)


@pytest.mark.dmp
def test_a_tiny_hot_table_is_replicated_and_the_plan_runs_under_dmp(caplog) -> None:
    """With the shipped model's step parts, replicating the 40-row, 16-column table read
    500 times per sample is predicted cheaper than its input and output all-to-alls:
    data_parallel (a kind TorchRec's own planner also picks for such tables); the plan, with
    its table-wise rest, runs under DMP on 2 gloo ranks with the unsharded model's outputs.
    Its 40-row tables lie outside the compute model's training data: one warning names them."""
    from tests.models import shard_and_compare

    hot = {"a1": ParameterConstraints(pooling_factors=[500.0])}
    planner = NeuroShardPlanner(topology(), batch_size=512, constraints=hot, storage_reservation=0.0)
    with caplog.at_level(logging.WARNING, logger="torchrec_neuroshard"):
        planner.plan(two_tower(), SHARDERS)
    warned = [r.getMessage() for r in caplog.records if "outside the data the compute model was trained on" in r.getMessage()]
    assert len(warned) == 1 and "'a1': log_rows 3.689 (trained 7.206..12.63)" in warned[0]
    kinds = planner.plan_.kinds()
    assert kinds["a1"].value == "data_parallel"
    assert {k.value for k in kinds.values()} > {"data_parallel"}  # not everything replicated
    for r in spawn(shard_and_compare, 2, planner.plan_.to_dict()):
        assert r["max_err"] < 1e-5


def test_a_sharding_type_we_do_not_plan_is_refused_as_ours_not_the_sharders() -> None:
    # TorchRec plans grid_shard with this sharder: the refusal names NeuroShard, not the sharder
    grid = NeuroShardPlanner(topology(4), constraints={"a0": ParameterConstraints(sharding_types=["grid_shard"])})
    with pytest.raises(ShardingError, match=r"table 'a0': .* NeuroShard does not plan \['grid_shard'\] yet .*EmbeddingShardingPlanner"):
        grid.plan(two_tower(), SHARDERS)
    # the stock CPU sharder offers no row splits: that refusal names the sharder
    rows = NeuroShardPlanner(topology(), constraints={"a0": ParameterConstraints(sharding_types=["row_wise"])})
    with pytest.raises(ShardingError, match=r"table 'a0': .* the sharder of module '.*' offers none of them; allow one of \["):
        rows.plan(two_tower(), SHARDERS)
