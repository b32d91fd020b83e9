"""NeuroShardPlanner on models beyond the GPUs' HBM: full-size tasks on cuda topologies
of meta-device models (no GPU needed), beside TorchRec's planner; bad input."""

from __future__ import annotations

import logging

import pytest
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.types import CacheParams

from torchrec_neuroshard.kernels import ComputeKernel
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.planner import NeuroShardPlanner
from torchrec_neuroshard.search import search
from torchrec_neuroshard.sharding import from_torchrec
from torchrec_neuroshard.stats import torchrec_sharding_options
from torchrec_neuroshard.tables import module_for_tables
from torchrec_neuroshard.types import InfeasibleError, ShardingError, Task

FULL_SIZE = WorkloadScale(row_divisor=1, batch_size=65_536)
SHARDERS = [EmbeddingBagCollectionSharder()]
TASKS = [  # (devices, tables, seed, share of the bytes the HBM cap sends to host memory)
    (8, 24, 1, 0.5),
    (8, 24, 4, 0.9),
    (16, 24, 2, 0.3),
    (16, 24, 5, 0.7),
    (64, 24, 3, 0.1),
]


def full_size(devices: int, tables: int, seed: int) -> Task:
    return generate_task(synthetic_pool(), tables, devices, FULL_SIZE, seed=seed)


def setting(task: Task, to_host: float, ddr_share: float = 1.0) -> tuple[Topology, dict, int]:
    """The task's cuda topology with HBM for (1 - ``to_host``) of its bytes, each rank's
    host memory ``ddr_share`` of them; its pooling factors as constraints; the per-rank batch."""
    world = task.num_devices
    total = sum(t.memory_bytes(task.batch_size, world) for t in task.tables)
    hbm = int((1 - to_host) * total / world)
    topology = Topology(world_size=world, compute_device="cuda", hbm_cap=hbm, ddr_cap=int(ddr_share * total), local_world_size=8)
    constraints = {t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in task.tables}
    return topology, constraints, task.batch_size // world


def ours(task: Task, topology: Topology, constraints: dict, per_rank: int) -> NeuroShardPlanner:
    planner = NeuroShardPlanner(
        topology, per_rank, constraints=constraints, storage_reservation=0.0, access_hists={t.name: t.access_hist for t in task.tables}
    )
    planner.sharding_plan_ = planner.plan(module_for_tables(task.tables), SHARDERS)
    return planner


@pytest.mark.parametrize("devices, tables, seed, to_host", TASKS)
def test_plans_beyond_hbm_where_torchrec_does_within_both_memories(devices, tables, seed, to_host, caplog) -> None:
    """Each setting is one where TorchRec's planner plans every table (its failing to is a
    failure here); ours plans it too, and its plan holds, as TorchRec's storage estimator
    counts it, at most each rank's HBM and host memory; TorchRec's sharder offers every
    kernel we chose; the ShardingPlan reads back as our plan."""
    task = full_size(devices, tables, seed)
    topology, constraints, per_rank = setting(task, to_host)
    module = module_for_tables(task.tables)
    theirs = EmbeddingShardingPlanner(
        topology=topology, batch_size=per_rank, constraints=constraints, storage_reservation=FixedPercentageStorageReservation(0.0)
    ).plan(module, SHARDERS)
    assert set(theirs.plan[""]) == {t.name for t in task.tables}
    with caplog.at_level(logging.INFO, logger="torchrec_neuroshard.planner"):
        planner = ours(task, topology, constraints, per_rank)
    plan = planner.plan_
    assert plan.offloaded(), "the HBM cap leaves no room for every table: some must be in host memory"
    assert "UVM kernels priced by the shipped UVM pricing, fitted to UVM kernels measured on an NVIDIA H200" in caplog.text
    options, _ = torchrec_sharding_options(plan, module, SHARDERS, topology, per_rank, constraints, {})
    hbm, ddr = [0] * devices, [0] * devices
    for option in options:
        assert option.compute_kernel in SHARDERS[0].compute_kernels(option.sharding_type, "cuda"), option.name
        for shard in option.shards:
            hbm[shard.rank] += shard.storage.hbm
            ddr[shard.rank] += shard.storage.ddr
    assert max(hbm) <= topology.devices[0].storage.hbm and max(ddr) <= topology.devices[0].storage.ddr
    assert hbm == plan.device_memory(task.tables, task.batch_size)
    assert ddr == plan.device_host_memory(task.tables, task.batch_size)
    assert {p.table: p for p in from_torchrec(planner.sharding_plan_, devices).placements} == {p.table: p for p in plan.placements}
    caching = {
        ps.cache_params.load_factor for m in planner.sharding_plan_.plan.values() for ps in m.values() if ps.compute_kernel == "fused_uvm_caching"
    }
    assert all(0 < f <= 1 for f in caching)


def test_a_model_that_fits_hbm_is_planned_as_without_uvm() -> None:
    """The task of test_hardware's cuda test, with host memory: the plan is the search's
    own (no offload stage), every table fused, and the same with UVM kernels disallowed."""
    task = generate_task(synthetic_pool(), 10, 4, FULL_SIZE, seed=3)
    topology = Topology(world_size=4, compute_device="cuda", hbm_cap=2 * task.memory_cap_bytes, local_world_size=4)
    constraints = {t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in task.tables}
    planner = ours(task, topology, constraints, 65_536 // 4)
    fused_only = {n: ParameterConstraints(pooling_factors=c.pooling_factors, compute_kernels=["fused"]) for n, c in constraints.items()}
    assert ours(task, topology, fused_only, 65_536 // 4).plan_ == planner.plan_
    searched = search(planner.task_, planner._model, planner.search_config, None, ())
    assert searched.plan == planner.plan_ and not planner.plan_.offloaded()
    assert {ps.compute_kernel for m in planner.sharding_plan_.plan.values() for ps in m.values()} <= {"fused", "dense"}


def test_a_model_beyond_hbm_and_host_memory_names_both_shortfalls() -> None:
    task = full_size(8, 12, 1)
    topology, constraints, per_rank = setting(task, to_host=0.5, ddr_share=0.01)
    with pytest.raises(InfeasibleError, match=r"does not fit the 8 ranks' HBM and host memory together: .* bytes of HBM .*\(short by 0\), and about [\d,]+ bytes of host memory against [\d,]+ \(short by [1-9][\d,]+\)"):
        ours(task, topology, constraints, per_rank)


def test_bad_kernels_and_load_factors_name_the_table() -> None:
    task = full_size(8, 6, 1)
    topology, constraints, per_rank = setting(task, to_host=0.5)
    name = task.tables[0].name
    cpu = Topology(world_size=8, compute_device="cpu")
    for topo, c, why in [
        (cpu, ParameterConstraints(compute_kernels=["fused_uvm"]), r"\['fused_uvm'\], which its sharder does not offer on cpu"),
        (topology, ParameterConstraints(compute_kernels=["key_value"]), r"NeuroShardPlanner plans \['fused', 'fused_uvm'"),
        (topology, ParameterConstraints(cache_params=CacheParams(load_factor=1.5)), r"needs a cache_load_factor in \(0, 1\] .*, got 1.5"),
        (topology, ParameterConstraints(cache_params=CacheParams(load_factor=0.0)), r"needs a cache_load_factor in \(0, 1\] .*, got 0.0"),
        (cpu, ParameterConstraints(cache_params=CacheParams(load_factor=0.2)), r"may run only \['fused'\] on cpu, which cache nothing"),
    ]:
        with pytest.raises(ShardingError, match=rf"table {name!r}: .*{why}"):
            NeuroShardPlanner(topo, per_rank, constraints={name: c}).plan(module_for_tables(task.tables), SHARDERS)


def test_constraints_fix_kernels_and_load_factors() -> None:
    """A table allowed only fused_uvm goes to host memory though HBM has room; a fixed
    load factor is the one planned; tables allowed only fused stay in HBM."""
    task = full_size(8, 12, 1)
    topology, constraints, per_rank = setting(task, to_host=0.5)
    first, second = task.tables[0].name, task.tables[1].name
    constraints[first] = ParameterConstraints(pooling_factors=[task.tables[0].pooling_factor], compute_kernels=["fused_uvm"])
    constraints[second] = ParameterConstraints(
        pooling_factors=[task.tables[1].pooling_factor], compute_kernels=["fused_uvm_caching"], cache_params=CacheParams(load_factor=0.37)
    )
    for t in task.tables[2:]:
        constraints[t.name] = ParameterConstraints(pooling_factors=[t.pooling_factor], compute_kernels=["fused", "fused_uvm_caching"])
    planner = ours(task, topology, constraints, per_rank)
    placements = {p.table: p for p in planner.plan_.placements}
    assert placements[first].kernel is ComputeKernel.FUSED_UVM
    assert (placements[second].kernel, placements[second].cache_load_factor) == (ComputeKernel.FUSED_UVM_CACHING, 0.37)
    assert {placements[t.name].kernel for t in task.tables[2:]} <= {ComputeKernel.FUSED, ComputeKernel.FUSED_UVM_CACHING}
    module_plan = next(iter(planner.sharding_plan_.plan.values()))
    assert module_plan[second].cache_params.load_factor == 0.37


def test_a_sharders_fused_params_set_the_load_factor_where_constraints_do_not() -> None:
    """As in TorchRec's planner and kernels: a table's constraint cache_params.load_factor,
    else its sharder's fused_params cache_load_factor; one outside (0, 1] names the module."""
    task = full_size(8, 12, 1)
    topology, constraints, per_rank = setting(task, to_host=0.5)
    for t in task.tables:
        constraints[t.name] = ParameterConstraints(pooling_factors=[t.pooling_factor], compute_kernels=["fused", "fused_uvm_caching"])
    first = task.tables[0].name
    constraints[first] = ParameterConstraints(
        pooling_factors=[task.tables[0].pooling_factor], compute_kernels=["fused_uvm_caching"], cache_params=CacheParams(load_factor=0.05)
    )
    sharders = [EmbeddingBagCollectionSharder(fused_params={"cache_load_factor": 0.15})]
    planner = NeuroShardPlanner(topology, per_rank, constraints=constraints, storage_reservation=0.0)
    sharding_plan = planner.plan(module_for_tables(task.tables), sharders)
    cached = {p.table: p.cache_load_factor for p in planner.plan_.placements if p.kernel is ComputeKernel.FUSED_UVM_CACHING}
    assert cached.pop(first) == 0.05 and cached and set(cached.values()) == {0.15}  # 0.15: not a factor it tries
    assert {name: ps.cache_params.load_factor for name, ps in sharding_plan.plan[""].items() if name in cached} == cached
    sharders = [EmbeddingBagCollectionSharder(fused_params={"cache_load_factor": 1.5})]
    with pytest.raises(ShardingError, match=r"module '': its EmbeddingBagCollectionSharder's fused_params cache_load_factor=1.5 is not in \(0, 1\]"):
        NeuroShardPlanner(topology, per_rank, constraints=constraints).plan(module_for_tables(task.tables), sharders)


def test_the_issues_model_of_410_gb_on_8_gpus_of_32_gb() -> None:
    """Issue 27's model: 16 tables of 50M rows x 128 (410 GB) on 8 GPUs of 32 GB HBM and
    512 GB host memory each, TorchRec's defaults otherwise. It refused (a table fitting no
    device); it plans, every rank within both memories."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=128, num_embeddings=50_000_000, feature_names=[f"f{i}"]) for i in range(16)]
    module = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    topology = Topology(world_size=8, compute_device="cuda", hbm_cap=32 * 1024**3, ddr_cap=512 * 1024**3, local_world_size=8)
    planner = NeuroShardPlanner(topology)
    sharding_plan = planner.plan(module, SHARDERS)
    assert len(sharding_plan.plan[""]) == 16 and planner.plan_.offloaded()
    options, _ = torchrec_sharding_options(planner.plan_, module, SHARDERS, topology, 512, None, {})
    for field, cap in (("hbm", 0.85 * 32 * 1024**3), ("ddr", 512 * 1024**3)):  # TorchRec's default reservation: 15% of HBM
        per_rank = [0] * 8
        for option in options:
            for shard in option.shards:
                per_rank[shard.rank] += getattr(shard.storage, field)
        assert max(per_rank) <= cap, field


def test_our_estimator_inside_torchrecs_planner_prices_each_option_on_its_kernel() -> None:
    """TorchRec's enumerator offers a table on fused, fused_uvm and fused_uvm_caching: our
    estimator prices each on its own kernel (the UVM ones with the shipped UVM pricing), not
    all as fused; a kernel we have no price for is an error naming the table."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    from torchrec_neuroshard.access import uniform_access_histogram
    from torchrec_neuroshard.comm import AlphaBetaComm
    from torchrec_neuroshard.costmodel import load_pretrained
    from torchrec_neuroshard.estimators import NeuralPerfEstimator
    from torchrec_neuroshard.types import Shard, TableSpec
    from torchrec_neuroshard.uvmcost import UvmPricedModel, UvmPricing

    world, per_rank, rows, dim, pf = 2, 8_192, 1_000_000, 64, 10.0
    hist = tuple(uniform_access_histogram(rows, pf * per_rank * world))
    task = Task((TableSpec("x", rows, dim, pf, hist),), world, 10**12, per_rank * world)
    topo = Topology(world_size=world, compute_device="cuda", hbm_cap=10**9, ddr_cap=10**11, local_world_size=2)
    model = load_pretrained("h200").with_comm(AlphaBetaComm.from_topology(topo, task.batch_size))
    kernels = ["fused", "fused_uvm", "fused_uvm_caching"]
    cons = {"x": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=kernels, pooling_factors=[pf], cache_params=CacheParams(load_factor=0.05))}
    enumerator = EmbeddingEnumerator(topo, per_rank, cons, estimator=[NeuralPerfEstimator(topo, cons, cost_model=model)])
    options = {o.compute_kernel: o for o in enumerator.enumerate(module_for_tables(task.tables), SHARDERS)}
    assert sorted(options) == kernels
    priced = UvmPricedModel(model.with_batch_size(task.batch_size), UvmPricing.shipped(), task.batch_size)
    for kernel, factor in [("fused", None), ("fused_uvm", None), ("fused_uvm_caching", 0.05)]:
        spec = TableSpec("x", rows, dim, pf, hist, kernel=kernel, cache_load_factor=factor)
        (fwd, bwd), = priced.compute_cost([[Shard(spec, dim)]])
        perf = options[kernel].shards[0].perf
        assert (perf.fwd_compute, perf.bwd_compute) == pytest.approx((fwd, bwd), rel=1e-4), kernel
    assert options["fused_uvm"].shards[0].perf.fwd_compute > options["fused"].shards[0].perf.fwd_compute
    options["fused"].compute_kernel = "dram_virtual_table"
    with pytest.raises(ShardingError, match="table 'x': compute kernel 'dram_virtual_table' is not one NeuroShard plans"):
        NeuralPerfEstimator(topo, cons, cost_model=model).estimate([options["fused"]])


def test_our_estimator_and_perf_model_size_a_cache_by_the_sharders_fused_params() -> None:
    """A UVM cache without cache_params is sized by its sharder's fused_params, as TorchRec's
    storage estimator sizes it: priced as the same option with that load factor set."""
    import copy

    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    from torchrec_neuroshard.estimators import NeuralPerfEstimator, NeuralPerfModel

    task = full_size(2, 1, 0)
    topo = Topology(world_size=2, compute_device="cuda", hbm_cap=10**11, ddr_cap=10**12, local_world_size=2)
    cons = {task.tables[0].name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused_uvm_caching"])}
    sharders = [EmbeddingBagCollectionSharder(fused_params={"cache_load_factor": 0.05})]
    estimator = NeuralPerfEstimator(topo, cons, batch_size=task.per_rank_batch)
    enumerator = EmbeddingEnumerator(topo, task.per_rank_batch, cons, estimator=[estimator])
    (option,) = enumerator.enumerate(module_for_tables(task.tables), sharders)
    fixed = copy.deepcopy(option)
    fixed.cache_params = CacheParams(load_factor=0.05)
    default = copy.deepcopy(option)
    estimator.estimate([fixed])
    estimator.estimate([default])  # no sharders: TorchRec's default load factor, 0.2
    assert option.shards[0].perf == fixed.shards[0].perf != default.shards[0].perf
    with_sharders = NeuralPerfModel(topo, batch_size=task.per_rank_batch, sharders=sharders)
    without = NeuralPerfModel(topo, batch_size=task.per_rank_batch)
    assert with_sharders.rate([option]) == without.rate([fixed]) != without.rate([option])


def test_a_torchrec_plan_reads_back_at_the_load_factor_its_sharders_run_its_caches() -> None:
    """TorchRec's planner leaves cache_params out where only the sharder's fused_params set
    the load factor; our Plan of it records that factor, not TorchRec's default."""
    from torchrec_neuroshard.sharding import sharder_load_factors

    task = full_size(8, 12, 1)
    topology, constraints, per_rank = setting(task, to_host=0.5)
    sharders = [EmbeddingBagCollectionSharder(fused_params={"cache_load_factor": 0.05})]
    module = module_for_tables(task.tables)
    reservation = FixedPercentageStorageReservation(0.0)
    theirs = EmbeddingShardingPlanner(topology, per_rank, storage_reservation=reservation, constraints=constraints).plan(module, sharders)
    cached = [name for name, ps in theirs.plan[""].items() if ps.compute_kernel == "fused_uvm_caching"]
    assert cached and all(theirs.plan[""][name].cache_params is None for name in cached)
    read = from_torchrec(theirs, 8, sharder_load_factors(module, sharders))
    assert {read.placement(name).cache_load_factor for name in cached} == {0.05}
    assert {from_torchrec(theirs, 8).placement(name).cache_load_factor for name in cached} == {0.2}


def test_torchrecs_planner_reads_a_tables_cache_as_our_pricing_sees_it() -> None:
    """AccessCacheStatistics: the unique rows a batch looks up and the share our cache of the
    hottest rows misses (all at no cache, none at all rows cached, never more with more
    cache); TorchRec's EmbeddingOffloadScaleupProposer, given them, scales caches up."""
    from dataclasses import replace

    from torchrec.distributed.planner.proposers import EmbeddingOffloadScaleupProposer

    from torchrec_neuroshard.estimators import AccessCacheStatistics
    from torchrec_neuroshard.uvmcost import cached_share, unique_rows

    task = full_size(8, 12, 1)
    for t in task.tables:
        stats = AccessCacheStatistics(t, task.batch_size)
        misses = [stats.expected_miss_rate(clf) for clf in (0.0, 0.01, 0.05, 0.3, 1.0)]
        assert misses[0] == 1.0 and misses[-1] == pytest.approx(0.0, abs=1e-12) and misses == sorted(misses, reverse=True)
        assert misses[2] == pytest.approx(1 - cached_share(t, task.batch_size, 0.05))
        assert stats.expected_lookups == pytest.approx(unique_rows(t, task.batch_size)) and 0 <= stats.cacheability <= 1
    topology, constraints, per_rank = setting(task, to_host=0.5)
    for t in task.tables:
        stats = AccessCacheStatistics(t, task.batch_size)
        constraints[t.name] = replace(constraints[t.name], cache_params=CacheParams(load_factor=0.1, stats=stats))
    reservation = FixedPercentageStorageReservation(0.0)
    planner = EmbeddingShardingPlanner(topology, per_rank, storage_reservation=reservation, constraints=constraints, proposer=EmbeddingOffloadScaleupProposer())
    factors = [ps.cache_params.load_factor for ps in planner.plan(module_for_tables(task.tables), SHARDERS).plan[""].values() if ps.compute_kernel == "fused_uvm_caching"]
    assert factors and max(factors) > 0.1


def test_the_chosen_proposals_full_search_keeps_what_its_screen_computed(monkeypatch) -> None:
    """Each offload proposal's kinds, heuristics' plans and first greedy runs of the split
    search are computed once: the full search of the cheapest one reuses its screen's
    (search's memo), so no kind choice (task, given placements), no heuristic's plan of a
    task and no split search's greedy runs (task, states) are computed twice."""
    from torchrec_neuroshard.search import joint, splits

    kinds, baselines, greedy = [], [], []

    def running(task, model, keys, states, scales, **budget):
        greedy.append((task, tuple(states)))
        return run(task, model, keys, states, scales, **budget)

    def choosing(task, model, config, choice, embed, given):
        kinds.append((task, given))
        return choose(task, model, config, choice, embed, given)

    def seeding(name, task):
        baselines.append((name, task))
        return seed(name, task)

    choose, seed, run = joint.choose_kinds, joint.baseline_plan, splits.greedy_runs
    monkeypatch.setattr(joint, "choose_kinds", choosing)
    monkeypatch.setattr(joint, "baseline_plan", seeding)
    monkeypatch.setattr(splits, "greedy_runs", running)
    task = full_size(8, 24, 1)
    planner = ours(task, *setting(task, to_host=0.5))
    assert planner.plan_.offloaded() and len(kinds) >= 2 and len(baselines) >= 10 and len(greedy) >= 6
    assert len(set(kinds)) == len(kinds) and len(set(baselines)) == len(baselines) and len(set(greedy)) == len(greedy)


def test_the_plan_kept_is_warned_about_once_however_many_proposals_were_searched(caplog) -> None:
    """two_tower's 40-row tables lie below every table the compute net learned; with HBM for
    a third of their bytes the planner searches offload proposals past a planning budget
    already spent (until one plans: issue 41), and each warning (the tables, the budget) is
    given once, of the plan it keeps."""
    from tests.models import two_tower

    topology = Topology(world_size=1, compute_device="cuda", hbm_cap=12_000, ddr_cap=2**30, local_world_size=1)
    planner = NeuroShardPlanner(topology, batch_size=8, storage_reservation=0.0, timeout_seconds=1e-9)
    with caplog.at_level(logging.INFO, logger="torchrec_neuroshard.planner"):
        planner.plan(two_tower(), SHARDERS)
    assert planner.plan_.offloaded()
    for warning in ("lie outside the data the compute model was trained on", "planning budget timeout_seconds=1e-09 ran out"):
        warned = [r.getMessage() for r in caplog.records if warning in r.getMessage()]
        assert len(warned) == 1, f"{len(warned)} warnings '{warning}' over the searches of one plan"
    assert "'a0'" in caplog.text and "'b1'" in caplog.text


def test_big_tables_beyond_hbm_are_split_by_rows_and_priced_below_torchrecs_plan() -> None:
    """Issue 40's first task: 12 tables of 50M rows x 128 on 8 GPUs of 32 GiB (pooling factor
    20). Whole, two such tables never share a GPU, so every proposal that keeps them whole
    fails or sends many to host memory; the row-wise proposal splits every one over all
    ranks, its caches as large as the HBM left allows, and our model prices that plan below
    TorchRec's (all row-wise, two caches at its default 0.2) on the same task and model."""
    import torch
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_neuroshard.search import predicted_breakdown
    from torchrec_neuroshard.sharding import sharder_load_factors
    from torchrec_neuroshard.types import ShardingKind

    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=128, num_embeddings=50_000_000, feature_names=[f"f{i}"]) for i in range(12)]
    module = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    topology = Topology(world_size=8, compute_device="cuda", hbm_cap=32 * 1024**3, ddr_cap=512 * 1024**3, local_world_size=8)
    constraints = {c.name: ParameterConstraints(pooling_factors=[20.0]) for c in configs}
    planner = NeuroShardPlanner(topology, 512, constraints=constraints, storage_reservation=0.0)
    planner.plan(module, SHARDERS)
    assert {p.kind for p in planner.plan_.placements} == {ShardingKind.ROW_WISE} and planner.plan_.offloaded()
    theirs = EmbeddingShardingPlanner(topology, 512, constraints=constraints, storage_reservation=FixedPercentageStorageReservation(0.0)).plan(module, SHARDERS)
    model, task = planner._priced_model(), planner.task_
    ours_ms = predicted_breakdown(model, task, planner.plan_)[0]
    theirs_ms = predicted_breakdown(model, task, from_torchrec(theirs, 8, sharder_load_factors(module, SHARDERS)))[0]
    assert ours_ms < theirs_ms


def test_relax_takes_the_cheapest_option_the_budget_leaves_room_for() -> None:
    """The greedy sent both tables to a 1% cache; the budget has room for one at 50%: the
    dearer one (first) takes it, the other stays; a table not movable never moves."""
    from torchrec_neuroshard.offload import KernelOption, relax

    def option(factor: float, hbm: int, penalty: float) -> KernelOption:
        return KernelOption(ComputeKernel.FUSED_UVM_CACHING, factor, hbm, 100, penalty)

    options = {name: [option(0.5, 50, 1.0), option(0.2, 20, 1.6), option(0.01, 1, 2.0)] for name in ("a", "b")}
    chosen = {"a": options["a"][2], "b": options["b"][2]}
    relaxed = relax(chosen, options, hbm_budget=60, host_budget=1000, movable={"a", "b"})
    assert sorted(o.load_factor for o in relaxed.values()) == [0.01, 0.5]
    assert relax(chosen, options, hbm_budget=60, host_budget=1000, movable=set()) == chosen
    assert relax(chosen, options, hbm_budget=2, host_budget=1000, movable={"a", "b"}) == chosen  # no room
