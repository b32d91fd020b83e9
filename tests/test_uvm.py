"""UVM kernels in plans: memory as TorchRec counts it, plans and their JSON, the stand-in
price and the offload greedy. The planner on full-size tasks: tests/test_uvm_planner.py."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.models import two_tower
from torchrec_neuroshard.heuristics import BASELINES, baseline_plan
from torchrec_neuroshard.kernels import ComputeKernel
from torchrec_neuroshard.offload import KernelOption, choose_kernels, kernel_options, ladder
from torchrec_neuroshard.tables import ModuleTable
from torchrec_neuroshard.types import InfeasibleError, Plan, Shard, ShardingError, ShardingKind, TablePlacement, TableSpec, Task
from torchrec_neuroshard.uvmcost import UvmPricedModel, UvmPricing, cached_share, unique_rows

UVM, CACHING, FUSED = ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING, ComputeKernel.FUSED
PCIE = 32 * 1024**3 / 1000  # TorchRec's HBM_TO_DDR_MEM_BW, bytes per ms
STAND_IN = UvmPricing.stand_in(PCIE)


def _hist(singletons: float) -> tuple[float, ...]:
    """An access histogram with ``singletons`` of the unique rows seen once, the rest 5 to 8 times."""
    return (singletons, 0.0, 0.0, 1.0 - singletons) + (0.0,) * 13


def _table(name: str = "t", rows: int = 1_000_000, dim: int = 64, pf: float = 10.0, singletons: float = 0.5) -> TableSpec:
    return TableSpec(name, rows, dim, pf, _hist(singletons))


@pytest.mark.parametrize("optimizer", [None, "adam", "rowwise_adagrad"])
def test_uvm_memory_is_what_torchrec_storage_estimator_counts(optimizer) -> None:
    """Every shard of every kind TorchRec's enumerator proposes on cuda with the UVM
    kernels, at three cache load factors and TorchRec's default: our HBM and host memory
    equal its EmbeddingStorageEstimator's, apart."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
    from torchrec.distributed.planner.types import ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.distributed.types import CacheParams
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from torchrec_neuroshard.tables import module_tables

    model, world, per_rank = two_tower(), 2, 16
    if optimizer:
        opt = torch.optim.Adam if optimizer == "adam" else RowWiseAdagrad
        apply_optimizer_in_backward(opt, model.parameters(), {"lr": 0.1})
    factors = {"a0": 0.2, "a1": 0.05, "b0": None, "b1": 0.73}
    pooling = {"a0": 3.0, "a1": 0.5, "b0": 7.0, "b1": 1.0}
    kernels = [UVM.value, CACHING.value]
    constraints = {
        n: ParameterConstraints(pooling_factors=[pooling[n]], compute_kernels=kernels, cache_params=CacheParams(load_factor=f))
        for n, f in factors.items()
    }
    topology = Topology(world_size=world, compute_device="cuda")
    enumerator = EmbeddingEnumerator(topology, per_rank, constraints, estimator=EmbeddingStorageEstimator(topology, constraints))
    specs = {t.spec.name: t.spec for t in module_tables(model, per_rank * world, constraints, compute_device="cuda")}
    checked = set()
    for option in enumerator.enumerate(model, get_default_sharders()):
        if option.sharding_type == "table_row_wise":
            continue  # its own IO rule (tests/test_hosts.py)
        kind, kernel = ShardingKind(option.sharding_type), ComputeKernel(option.compute_kernel)
        factor = (factors[option.name] or 0.2) if kernel.cached else None  # TorchRec's default UVM_CACHING_RATIO
        spec = replace(specs[option.name], kernel=kernel, cache_load_factor=factor)
        for shard in option.shards:
            rows, width = shard.size
            ours = Shard(spec, width, rows).storage(kind, per_rank * world, world)
            assert ours == (shard.storage.hbm, shard.storage.ddr), (option.name, kind, kernel, shard.size)
            assert shard.storage.ddr > 0  # the weights are in host memory
            checked.add((kind, kernel))
    assert {k for k, _ in checked} == {ShardingKind.TABLE_WISE, ShardingKind.COLUMN_WISE, ShardingKind.ROW_WISE, ShardingKind.TABLE_COLUMN_WISE}
    assert {k for _, k in checked} == {UVM, CACHING}


def test_plans_carry_kernels_and_old_files_read_as_fused() -> None:
    old = {"num_devices": 2, "placements": [{"table": "a", "kind": "table_wise", "widths": [64], "devices": [1]}]}
    (p,) = Plan.from_dict(old).placements
    assert (p.kernel, p.cache_load_factor) == (FUSED, None)
    assert Plan.from_dict(old).to_dict() == old  # a fused plan's file is unchanged
    plan = Plan(
        (
            TablePlacement("a", (64,), (1,), kernel="fused_uvm_caching", cache_load_factor=0.25),
            TablePlacement("b", devices=(0, 1), kind=ShardingKind.ROW_WISE, rows=(5, 5), kernel=UVM),
        ),
        2,
    )
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert plan.offloaded() == ("a", "b")
    task = Task((_table("a", rows=1000), _table("b", rows=10)), 2, 10**9, 64, host_memory_cap_bytes=10**9)
    assert Task.from_json(task.to_json()) == task
    assert Task.from_json(replace(task, host_memory_cap_bytes=None).to_json()).host_memory_cap_bytes is None


def test_a_table_moves_to_a_kernel_as_a_new_table_would_be_made_there() -> None:
    a = _table("a", rows=1000)
    assert a.on_kernel(CACHING, 0.25) == replace(a, kernel=CACHING, cache_load_factor=0.25)
    assert a.on_kernel("fused_uvm") == replace(a, kernel=UVM) and a.on_kernel(FUSED) is a
    assert a.kernel is FUSED  # the table itself is left as it was
    with pytest.raises(ShardingError, match="table .a.: fused_uvm_caching needs a cache_load_factor in \\(0, 1\\]"):
        a.on_kernel(CACHING, 1.5)
    with pytest.raises(ShardingError, match="table 'a': cache_load_factor 0.5 given for the fused_uvm kernel"):
        a.on_kernel(UVM, 0.5)
    with pytest.raises(ShardingError, match="table 'a': compute kernel 'key_value' is not one NeuroShard plans"):
        a.on_kernel("key_value")


def test_a_tables_kept_hash_is_its_fields_hash_and_never_outlives_a_change() -> None:
    """A table keeps its hash once computed (searches key caches by table): it is the hash
    of its fields, so a table moved to another kernel (a copy with two fields changed), a
    pickled table and an equal table made anew hash by their own fields."""
    a = _table("a", rows=1000)
    kept = hash(a)
    moved = a.on_kernel(CACHING, 0.25)
    assert hash(moved) == hash(replace(a, kernel=CACHING, cache_load_factor=0.25)) != kept
    assert {a: 1, moved: 2}[replace(a)] == 1 and {a: 1, moved: 2}[moved.on_kernel(CACHING, 0.25)] == 2
    assert hash(pickle.loads(pickle.dumps(a))) == kept and "_hash" not in pickle.loads(pickle.dumps(a)).__dict__


def test_validate_checks_both_memories_and_kernel_fields() -> None:
    a = _table("a", rows=1000)
    task = Task((a,), 2, 10**9, 64, host_memory_cap_bytes=10**9)
    on_host = Plan((TablePlacement("a", (64,), (1,), kernel=UVM),), 2)
    on_host.validate(task)
    assert on_host.device_host_memory(task.tables, 64) == [0, a.size_bytes()]
    assert on_host.device_memory(task.tables, 64)[1] < a.size_bytes()  # only the kernel's buffers in HBM
    with pytest.raises(InfeasibleError, match="device 1 holds 256,000 bytes of host memory \\(DDR\\), over the cap of 1,000"):
        on_host.validate(replace(task, host_memory_cap_bytes=1000))
    with pytest.raises(ShardingError, match="tables \\['a'\\] are on UVM kernels.*no host memory cap"):
        on_host.validate(replace(task, host_memory_cap_bytes=None))
    for factor in (0.0, 1.5, None, True):
        with pytest.raises(ShardingError, match="table .a.: fused_uvm_caching needs a cache_load_factor in \\(0, 1\\] \\(the share"):
            TablePlacement("a", (64,), (1,), kernel=CACHING, cache_load_factor=factor)
    with pytest.raises(ShardingError, match="table 'a': cache_load_factor 0.5 given for the fused_uvm kernel"):
        TablePlacement("a", (64,), (1,), kernel=UVM, cache_load_factor=0.5)
    with pytest.raises(ShardingError, match="table 'a': compute kernel 'key_value' is not one NeuroShard plans"):
        TablePlacement("a", (64,), (1,), kernel="key_value")
    with pytest.raises(ShardingError, match="table 'a': a data_parallel replica runs TorchRec's dense kernel"):
        TablePlacement("a", kind=ShardingKind.DATA_PARALLEL, kernel=UVM)


def test_placements_made_for_a_table_keep_its_kernel() -> None:
    """A table the offload sent to host memory stays there when the search splits its rows
    (the kinds stage) or a heuristic seeds the search with it whole: its placements carry its
    kernel, so the memory they were chosen by is the memory the plan holds."""
    cached = replace(_table("a", rows=4_000_000), kernel=CACHING, cache_load_factor=0.05)
    whole, blocks = TablePlacement("a", (64,), (1,), kernel=CACHING, cache_load_factor=0.05), TablePlacement.row_blocks(cached, (0, 1), ShardingKind.TABLE_ROW_WISE)
    assert [(p.kernel, p.cache_load_factor) for p in (whole, blocks)] == [(CACHING, 0.05)] * 2
    fused_bytes = replace(cached, kernel=FUSED, cache_load_factor=None).memory_bytes(64, 2)
    task = Task((cached, replace(cached, name="b")), 2, fused_bytes // 2, 64, host_memory_cap_bytes=10**10)
    for name in BASELINES:
        plan = baseline_plan(name, task)
        assert {(p.kernel, p.cache_load_factor) for p in plan.placements} == {(CACHING, 0.05)}, name
        plan.validate(task)  # in HBM the tables would not fit


def test_stand_in_price_follows_cache_size_and_access() -> None:
    batch = 65_536
    table = _table(singletons=0.5)
    penalties = []
    for kernel, factor in [(FUSED, None), (CACHING, 0.5), (CACHING, 0.1), (CACHING, 0.01), (UVM, None)]:
        shard = Shard(replace(table, kernel=kernel, cache_load_factor=factor), 64)
        penalties.append(float(STAND_IN.penalty_ms([shard], batch).sum()))
    assert penalties[0] == 0 and penalties == sorted(penalties) and penalties[-1] > penalties[-2]
    # unique rows from the histogram: half seen once, half in (4, 8] (counted 6) -> lookups / 3.5
    assert unique_rows(table, batch) == pytest.approx(10 * batch / 3.5)
    assert cached_share(table, batch, 1.0) == 1.0
    hot = _table(singletons=0.0)
    assert cached_share(hot, batch, 0.2) == 1.0  # its 109,227 unique rows, all hot, fit 200,000 slots
    assert cached_share(hot, batch, 0.1) == pytest.approx(1e5 / (655_360 / 6))  # 100,000 of them fit
    assert cached_share(table, batch, 0.01) < cached_share(hot, batch, 0.01)
    # a column shard moves its share of the bytes; the priced model adds the penalty to the base
    shard = Shard(replace(table, kernel=UVM), 64)
    half = Shard(replace(table, kernel=UVM), 32)
    np.testing.assert_allclose(STAND_IN.penalty_ms([half], batch), STAND_IN.penalty_ms([shard], batch) / 2)


def test_priced_model_adds_penalties_to_the_base_model() -> None:
    from torchrec_neuroshard.costmodel import load_pretrained

    base = load_pretrained("h200").with_batch_size(65_536)
    priced = UvmPricedModel(base, STAND_IN, 65_536)
    fused = [[Shard(_table("a"), 64)], [Shard(_table("b", pf=3.0), 32), Shard(_table("c"), 64)]]
    np.testing.assert_allclose(priced.compute_cost(fused), base.compute_cost(fused), rtol=1e-6)
    host = [[Shard(replace(_table("a"), kernel=UVM), 64)]]
    extra = STAND_IN.penalty_ms(host[0], 65_536)[0]
    np.testing.assert_allclose(np.subtract(priced.compute_cost(host), base.compute_cost(fused[:1])), [extra], rtol=1e-4)


def test_a_plan_is_priced_on_its_placements_kernels_whatever_the_task_names() -> None:
    """Pricing takes each table on its placement's kernel (as memory does), so TorchRec's plan
    priced on a task that names our plan's kernels is priced on TorchRec's own."""
    from torchrec_neuroshard.comm import AlphaBetaComm
    from torchrec_neuroshard.costmodel import load_pretrained
    from torchrec_neuroshard.stepcost import predict_step

    comm = AlphaBetaComm(65_536, intra_host_bw=1e8, inter_host_bw=1e7, local_world_size=2)
    priced = UvmPricedModel(load_pretrained("h200").with_batch_size(65_536).with_comm(comm), STAND_IN, 65_536)
    tables = (_table("a"), _table("b", pf=3.0), _table("c", rows=10_000))
    fused = Task(tables, 2, 10**10, 65_536, host_memory_cap_bytes=10**10)
    named_cached = replace(fused, tables=tuple(replace(t, kernel=CACHING, cache_load_factor=0.01) for t in tables))
    plans = [
        Plan((TablePlacement("a", (64,), (0,)), TablePlacement("b", (32, 32), (0, 1)), TablePlacement.row_blocks(tables[2], (0, 1))), 2),
        Plan(tuple(TablePlacement.whole(t, d) for t, d in zip(named_cached.tables, (0, 1, 1))), 2),
    ]
    for plan in plans:
        costs = [predict_step(priced, task, plan) for task in (fused, named_cached)]
        assert costs[0] == costs[1]
    in_hbm = Plan(tuple(TablePlacement.whole(t, d) for t, d in zip(tables, (0, 1, 1))), 2)
    assert predict_step(priced, named_cached, plans[1]).cost_ms > predict_step(priced, named_cached, in_hbm).cost_ms


def test_the_greedy_sends_cold_tables_to_host_memory_first() -> None:
    """Two tables of one size: the cold one (few lookups) goes to host memory; a tighter
    budget sends the hot one too; a budget below every table's least HBM gets none."""
    def module_table(spec: TableSpec) -> ModuleTable:
        return ModuleTable("", spec, frozenset({ShardingKind.TABLE_WISE}), 64, frozenset(ComputeKernel))

    hot, cold = _table("hot", pf=40.0, singletons=0.9), _table("cold", pf=0.5, singletons=0.9)
    ladders = {t.name: ladder(kernel_options(module_table(t), 65_536, 8, STAND_IN)) for t in (hot, cold)}
    fused = {n: rungs[0] for n, rungs in ladders.items()}
    assert all(o.kernel is FUSED and o.host == 0 for o in fused.values())
    half = choose_kernels(ladders, fused["hot"].hbm + 0.5 * fused["cold"].hbm, 10**12)
    assert half["hot"].kernel is FUSED and half["cold"].kernel.in_host_memory
    tight = choose_kernels(ladders, 0.3 * fused["hot"].hbm, 10**12)
    assert tight["hot"].kernel.in_host_memory
    assert choose_kernels(ladders, 1000, 10**12) is None
    assert choose_kernels(ladders, fused["hot"].hbm, 1000) is None  # no host memory to send any to
    slopes = [(b.penalty_ms - a.penalty_ms) / (a.hbm - b.hbm) for a, b in zip(ladders["hot"], ladders["hot"][1:])]
    assert slopes == sorted(slopes)  # a convex ladder: each step dearer per byte than the last
    assert isinstance(ladders["hot"][-1], KernelOption) and ladders["hot"][-1].kernel is UVM


def test_every_share_offers_its_whole_proposal_though_the_larger_share_chose_alike() -> None:
    """Two tables of 256 MB, one rank's HBM 200 MB of 2: at 99% and at 95% of the HBM the
    greedy sends one table to host memory alike. 99% is tried with the tables split by rows
    only (whole tables never pack that tight); 95% still offers them whole, and splits them."""
    from torchrec_neuroshard.offload import attempts

    def module_table(spec: TableSpec) -> ModuleTable:
        return ModuleTable("", spec, frozenset({ShardingKind.TABLE_WISE, ShardingKind.ROW_WISE}), 4, frozenset(ComputeKernel))

    tables = [module_table(_table(name, rows=1_000_000, dim=64, pf=pf)) for name, pf in (("hot", 40.0), ("cold", 0.5))]
    made = list(attempts(tables, 2, 200 * 10**6, 10**11, 65_536, STAND_IN, lambda specs: [1.0] * len(specs)))
    kinds = [(p.hbm_share, {pl.kind for pl in p.placements}) for p in made]
    assert (0.99, {ShardingKind.ROW_WISE}) in kinds and (0.95, {ShardingKind.TABLE_WISE}) in kinds
    assert all(share <= 0.95 for share, found in kinds if ShardingKind.TABLE_WISE in found)
