"""NeuroShardPlanner in place of EmbeddingShardingPlanner: every argument TorchRec's planner
takes, and every field of its ParameterConstraints, honoured or refused by name (issue 28)."""

import copy
import logging

import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.types import PlanLoader

from tests.models import two_tower
from torchrec_neuroshard.costmodel import cost_model_for
from torchrec_neuroshard.planner import NeuroShardPlanner
from torchrec_neuroshard.stats import table_perfs
from torchrec_neuroshard.types import ShardingError

SHARDERS = [EmbeddingBagCollectionSharder()]
STATS = "torchrec.distributed.planner.stats"


def topology(world: int = 2, ddr: int = 64 * 2**20) -> Topology:
    return Topology(world_size=world, compute_device="cpu", ddr_cap=ddr, local_world_size=world)


def test_embedding_stats_of_a_plan_with_a_replicated_table_show_each_tables_own_perf(caplog) -> None:
    """A data-parallel table carries every rank (as TorchRec's plans do), so TorchRec's
    EmbeddingStats (``assert shard.ranks``) logs the plan; each table's Perf there is the
    sum over its shards of its own predicted cost, not a share of its rank's."""
    from tests.models import row_wise_cpu_sharder

    kinds = {"a1": ParameterConstraints(sharding_types=["data_parallel"]), "b0": ParameterConstraints(sharding_types=["row_wise"])}
    planner = NeuroShardPlanner(topology(), 64, stats=EmbeddingStats(), constraints=kinds)
    with caplog.at_level(logging.INFO, logger=STATS):
        plan = planner.plan(two_tower(), [row_wise_cpu_sharder()])
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


def plan_that_torchrec_refuses(rank: int, world: int) -> tuple[str, str]:
    """Worker: collective_plan where TorchRec's HeuristicalStorageReservation raises its
    PlannerError on rank 0 (a 1-byte HBM cap)."""
    from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation

    gpus = Topology(world_size=world, compute_device="cuda", hbm_cap=1, local_world_size=world)
    planner = NeuroShardPlanner(gpus, 8, storage_reservation=HeuristicalStorageReservation(percentage=0.15))
    try:
        planner.collective_plan(two_tower(), SHARDERS)
    except Exception as e:  # noqa: BLE001 - what each rank sees is the result
        return type(e).__name__, str(e)
    return "no error", ""


@pytest.mark.dmp
def test_any_error_planning_on_rank_0_reaches_every_rank_as_itself() -> None:
    from torchrec_neuroshard.lab.launch import spawn

    got = spawn(plan_that_torchrec_refuses, 2)
    assert got[0] == got[1] and got[0][0] == "PlannerError" and "negative available hbm" in got[0][1]


def test_an_error_that_does_not_pickle_is_sent_as_a_runtime_error_naming_it() -> None:
    from torchrec_neuroshard.planner import _portable

    class Odd(Exception):
        def __init__(self, code: int, *, why: str) -> None:
            super().__init__(f"code {code}: {why}")

    e = ValueError("plain")
    assert _portable(e) is e
    sent = _portable(Odd(3, why="keyword-only"))
    assert type(sent) is RuntimeError and "Odd on rank 0 while planning: code 3: keyword-only" in str(sent)


REFUSED_ARGUMENTS = ("enumerator", "proposer", "partitioner", "performance_model")
HONOURED_ARGUMENTS = {  # each one's behaviour test
    "topology": "test_topology_none_is_torchrecs_default_for_this_process",
    "batch_size": "test_positional_use_as_torchrecs_planner",
    "storage_reservation": "tests/test_planner.py::test_constructor_takes_torchrecs_keywords",
    "stats": "test_embedding_stats_of_a_plan_with_a_replicated_table_show_each_tables_own_perf",
    "constraints": "test_every_parameter_constraints_field_is_honoured_or_refused_by_name",
    "debug": "tests/test_planner.py::test_constructor_takes_torchrecs_keywords",
    "callbacks": "test_callbacks_change_the_plan_as_in_torchrecs_planner",
    "timeout_seconds": "test_timeout_seconds_is_a_planning_budget",
    "plan_loader": "test_a_plan_loader_plan_is_used_as_torchrecs_planner_uses_it",
}


def test_every_torchrec_planner_parameter_is_taken_in_its_order_with_its_default() -> None:
    import inspect

    from torchrec.distributed.planner import EmbeddingShardingPlanner

    theirs = [p for p in inspect.signature(EmbeddingShardingPlanner.__init__).parameters.values() if p.name != "self"]
    ours = [p for p in inspect.signature(NeuroShardPlanner.__init__).parameters.values() if p.name != "self"]
    assert [(p.name, p.default, p.kind) for p in ours[: len(theirs)]] == [(p.name, p.default, p.kind) for p in theirs]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(theirs) :])  # NeuroShard's own
    for p in theirs:
        assert (p.name in REFUSED_ARGUMENTS) != (p.name in HONOURED_ARGUMENTS), p.name
        if p.name in REFUSED_ARGUMENTS:
            with pytest.raises(ShardingError, match=rf"{p.name}=object: NeuroShardPlanner takes no {p.name}.*estimator_in_torchrec.py"):
                NeuroShardPlanner(topology(), **{p.name: object()})
    # TorchRec's constraints were NeuroShard's third positional: a dict there is named
    with pytest.raises(ShardingError, match=r"enumerator=dict \(a dict: constraints are TorchRec's 9th parameter"):
        NeuroShardPlanner(topology(), 64, {"a0": ParameterConstraints()})


def test_positional_use_as_torchrecs_planner() -> None:
    planner = NeuroShardPlanner(topology(), 64)
    planner.plan(two_tower(), SHARDERS)
    assert planner.batch_size == 64 and planner.task_.batch_size == 64 * 2  # per-rank, as TorchRec's


def test_topology_none_is_torchrecs_default_for_this_process() -> None:
    import torch.distributed as dist
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    with pytest.raises(ShardingError, match="topology=None builds TorchRec's default topology .*init_process_group first, or pass a Topology"):
        NeuroShardPlanner()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ours, theirs = NeuroShardPlanner().topology, EmbeddingShardingPlanner()._topology
    finally:
        dist.destroy_process_group()
    assert {k: v for k, v in vars(ours).items() if k != "_devices"} == {k: v for k, v in vars(theirs).items() if k != "_devices"}
    assert [(d.rank, d.storage) for d in ours.devices] == [(d.rank, d.storage) for d in theirs.devices]


def test_callbacks_change_the_plan_as_in_torchrecs_planner() -> None:
    """Each callback gets the plan as TorchRec ShardingOptions and returns them; the plan
    is built from what the last one returns (here: every shard moved to the other rank)."""
    from torchrec.distributed.planner.types import ShardingOption

    seen: list[list] = []

    def swap_ranks(options: list) -> list:
        seen.append([(o.name, o.sharding_type, [s.rank for s in o.shards]) for o in options])
        for o in options:
            if o.sharding_type != "data_parallel":
                for s in o.shards:
                    s.rank = 1 - s.rank
        return options

    plain = NeuroShardPlanner(topology(), 64)
    plain.plan(two_tower(), SHARDERS)
    swapped = NeuroShardPlanner(topology(), 64, callbacks=[swap_ranks])
    plan = swapped.plan(two_tower(), SHARDERS)
    assert sorted(n for n, _, _ in seen[0]) == ["a0", "a1", "b0", "b1"]
    for p, q in zip(plain.plan_.placements, swapped.plan_.placements):
        assert p.table == q.table and p.kind == q.kind and q.devices == tuple(1 - d for d in p.devices)
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():
            assert ps.ranks == list(swapped.plan_.placement(name).devices) or ps.sharding_type == "data_parallel"
    with pytest.raises(ShardingError, match=r"callbacks=.*: give a list of callables"):
        NeuroShardPlanner(topology(), callbacks=swap_ranks)
    with pytest.raises(ShardingError, match=r"callback '<lambda>' returned NoneType; a callback returns the list"):
        NeuroShardPlanner(topology(), 64, callbacks=[lambda options: None]).plan(two_tower(), SHARDERS)
    assert all(isinstance(o, ShardingOption) for o in swap_ranks([]))


def test_timeout_seconds_is_a_planning_budget(caplog) -> None:
    """Past the budget the search splits no deeper and returns its best plan so far, logged."""
    from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
    from torchrec_neuroshard.tables import module_for_tables

    task = generate_task(synthetic_pool(), 12, 2, WorkloadScale(), seed=2)
    model = module_for_tables(task.tables)
    full = NeuroShardPlanner(topology(2, task.memory_cap_bytes * 2), task.batch_size // 2)
    full.plan(model, SHARDERS)
    rushed = NeuroShardPlanner(topology(2, task.memory_cap_bytes * 2), task.batch_size // 2, timeout_seconds=1e-9)
    with caplog.at_level(logging.WARNING, logger="torchrec_neuroshard.planner"):
        plan = rushed.plan(model, SHARDERS)
    assert len(rushed.plan_.placements) == 12 and plan.plan
    assert rushed.search_result_.states_evaluated < full.search_result_.states_evaluated
    assert "planning budget timeout_seconds=1e-09 ran out" in caplog.text and "best it had found by then" in caplog.text
    for bad in (0, -1, "5", True):
        with pytest.raises(ShardingError, match=rf"timeout_seconds={bad!r}: give a positive number of seconds"):
            NeuroShardPlanner(topology(), timeout_seconds=bad)


class StoredPlan(PlanLoader):
    """A plan saved as its ShardingOptions and planner-context hash (a copy: what a store gives back)."""

    def __init__(self, options: list | None, context_hash: str | None) -> None:
        self.options, self.context_hash = copy.deepcopy(options), context_hash

    def load(self) -> dict | None:
        return None if self.options is None else {o.storage_hash(): o for o in self.options}

    def plan_context_hash(self) -> str | None:
        return self.context_hash

    def get_plan_id(self) -> str:
        return "stored"


def test_a_plan_loader_plan_is_used_as_torchrecs_planner_uses_it() -> None:
    """A plan TorchRec's planner made, stored with its context hash and loaded by a
    PlanLoader: NeuroShardPlanner with the same context gives TorchRec's very plan, no
    search; another context is TorchRec's PlannerError; a loader loading nothing: a search."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.stats import NoopEmbeddingStats
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import PlannerError

    theirs = EmbeddingShardingPlanner(
        topology(), 64, storage_reservation=FixedPercentageStorageReservation(0.15), stats=NoopEmbeddingStats()
    )
    want = theirs.plan(two_tower(), SHARDERS)
    stored = StoredPlan(theirs._best_plan, theirs.hash_planner_context_inputs_str())
    ours = NeuroShardPlanner(topology(), 64, storage_reservation=FixedPercentageStorageReservation(0.15), plan_loader=stored)
    assert str(ours.plan(two_tower(), SHARDERS)) == str(want) and ours.search_result_ is None
    other = NeuroShardPlanner(topology(), 32, storage_reservation=FixedPercentageStorageReservation(0.15), plan_loader=stored)
    with pytest.raises(PlannerError, match="plan_loader's plan 'stored' was made for another planner context"):
        other.plan(two_tower(), SHARDERS)
    empty = NeuroShardPlanner(topology(), 64, plan_loader=StoredPlan(None, None))
    empty.plan(two_tower(), SHARDERS)
    assert empty.search_result_ is not None
    with pytest.raises(ShardingError, match="plan_loader=dict: give a TorchRec PlanLoader"):
        NeuroShardPlanner(topology(), plan_loader={})


def beyond_hbm() -> tuple[Topology, torch.nn.Module]:
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=128, num_embeddings=50_000_000, feature_names=[f"f{i}"]) for i in range(16)]
    gpus = Topology(world_size=8, compute_device="cuda", hbm_cap=32 * 1024**3, ddr_cap=512 * 1024**3, local_world_size=8)
    return gpus, EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


@pytest.mark.parametrize("where", ["in memory", "beyond HBM"])
def test_our_own_plan_saved_by_a_callback_reloads_through_plan_loader(where: str) -> None:
    """Our plan's ShardingOptions (kept by a callback, as a user saves a plan) and our
    planner-context hash, given back by a PlanLoader: the very plan, column splits and cache
    load factors TorchRec's enumerator never makes included, with no search."""
    gpus, big = beyond_hbm()
    topo, make = (topology(), two_tower) if where == "in memory" else (gpus, lambda: big)
    kept: list = []
    # in memory: the H200 model, which splits these columns 3-9 ways at this batch, whatever this machine's
    model, batch = ("h200", 256) if where == "in memory" else (None, 64)
    planner = NeuroShardPlanner(topo, batch, callbacks=[lambda options: kept.extend(options) or options], cost_model=model)
    with pytest.raises(ShardingError, match=r"call plan\(\) first"):
        planner.hash_planner_context_inputs_str()
    want = planner.plan(make(), SHARDERS)
    made = {(o.name, o.num_shards, o.cache_load_factor) for o in kept}
    if where == "in memory":  # shard counts TorchRec's enumerator does not make (it makes 1, or dim / 32 here)
        assert any(o.sharding_type == "column_wise" and o.num_shards not in (1, 2) for o in kept), made
    else:
        assert any(o.cache_load_factor not in (None, 0.2) for o in kept), made  # TorchRec's default factor is 0.2
    stored = StoredPlan(kept, planner.hash_planner_context_inputs_str())
    again = NeuroShardPlanner(topo, batch, plan_loader=stored, cost_model=model)
    assert again.plan(make(), SHARDERS).plan == want.plan and again.search_result_ is None
    assert sorted(again.plan_.placements, key=str) == sorted(planner.plan_.placements, key=str)  # load factors too


def test_every_parameter_constraints_field_is_honoured_or_refused_by_name() -> None:
    import dataclasses

    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from torchrec.distributed.types import CacheParams, KeyValueParams
    from torchrec.distributed.planner.shard_estimators import EmbeddingOffloadStats
    from torchrec.modules.embedding_configs import DataType

    from torchrec_neuroshard.planner_args import CONSTRAINT_FIELDS

    assert [f.name for f in dataclasses.fields(ParameterConstraints)] == list(CONSTRAINT_FIELDS)

    def planned(**fields) -> NeuroShardPlanner:
        planner = NeuroShardPlanner(topology(), 64, constraints={"a0": ParameterConstraints(**fields)})
        planner.sharding_plan_ = planner.plan(two_tower(), SHARDERS)
        return planner

    def pooling(planner: NeuroShardPlanner) -> float:
        return next(t.pooling_factor for t in planner.task_.tables if t.name == "a0")

    # num_poolings and batch_sizes: the lookups the table brings, so its predicted cost
    base = planned(pooling_factors=[2.0])
    pooled = planned(pooling_factors=[2.0], num_poolings=[3.0])
    batched = planned(pooling_factors=[2.0], batch_sizes=[128])
    assert (pooling(base), pooling(pooled), pooling(batched)) == (2.0, 6.0, 4.0)
    assert pooled.search_result_.predicted_cost_ms > base.search_result_.predicted_cost_ms
    assert batched.search_result_.predicted_cost_ms > base.search_result_.predicted_cost_ms
    # the kernel settings TorchRec's planner passes on reach the table's ParameterSharding
    kernel = dict(enforce_hbm=True, stochastic_rounding=False, bounds_check_mode=BoundsCheckMode.WARNING, output_dtype=DataType.FP32)
    ps = planned(**kernel, feature_names=["f_a0"], device_group="cpu").sharding_plan_.plan["user.ebc"]["a0"]
    assert {f: getattr(ps, f) for f in kernel} == kernel
    # refused, naming the table, the field and what to do: when the planner is made ...
    for field, value, why in [
        ("is_weighted", True, "unweighted kernels .* drop it"),
        ("cache_params", CacheParams(stats=EmbeddingOffloadStats(0.5, 100, torch.ones(4), 40)), r"\.stats: .* drop stats"),
        ("key_value_params", KeyValueParams(), "not SSD or key-value ones; drop it"),
        ("use_virtual_table", True, "key-value kernel.* drop it"),
        ("device_group", "cuda", "compute device is 'cpu'; .* drop it"),
        ("num_poolings", [1.0, 2.0], "has 2 values and pooling_factors 1; give one per feature"),
        ("batch_sizes", [64, 64], "has 2 values and pooling_factors 1; give one per feature"),
    ]:
        with pytest.raises(ShardingError, match=rf"table 'a0': constraint {field}.*{why}"):
            NeuroShardPlanner(topology(), constraints={"a0": ParameterConstraints(**{field: value})})
    # ... or, where the table tells, when planning
    with pytest.raises(ShardingError, match=r"table 'a0': constraint feature_names=\['other'\], but the table's features are \['f_a0'\]"):
        planned(feature_names=["other"])
    with pytest.raises(ShardingError, match=r"table 'a0': constraint output_dtype=FP16, but its weights take 4 bytes.* drop it"):
        planned(output_dtype=DataType.FP16)


@pytest.mark.dmp
def test_a_table_name_in_two_modules_is_planned_and_sharded_by_module_path(caplog) -> None:
    """Two towers each hold a table "t" (64 and 32 wide): the plan keys them by module path
    as TorchRec's does, a constraint on "t" holds for both (TorchRec keys constraints by
    name), TorchRec's EmbeddingStats logs the plan, and DMP on two ranks matches the model."""
    from tests.models import plan_shard_and_compare, same_names
    from torchrec_neuroshard.lab.launch import spawn
    from torchrec_neuroshard.sharding import from_torchrec
    from torchrec_neuroshard.tables import module_tables

    assert sorted(t.spec.name for t in module_tables(same_names(), 16)) == ["a1", "b1", "item_ebc.t", "user.ebc.t"]
    results = spawn(plan_shard_and_compare, 2, {"t": {"sharding_types": ["row_wise"]}}, False, "same_names")
    assert len({r["plan"] for r in results}) == 1
    for r in results:
        assert r["max_err"] < 1e-5
        assert r["types"]["user.ebc.t"][0] == r["types"]["item_ebc.t"][0] == "row_wise"
    with caplog.at_level(logging.INFO, logger=STATS):
        plan = NeuroShardPlanner(topology(), 8, stats=EmbeddingStats()).plan(same_names(), SHARDERS)
    for path, dim in (("user.ebc", 64), ("item_ebc", 32)):  # each module's own table "t"
        ps = plan.plan[path]["t"]
        widths = [int(s.shard_sizes[1]) for s in ps.sharding_spec.shards]
        assert (sum(widths) if "column" in ps.sharding_type else widths[0]) == dim
    assert "--- Planner Statistics ---" in caplog.text
    ours = from_torchrec(plan, 2)
    assert sorted(p.table for p in ours.placements) == ["a1", "b1", "item_ebc.t", "user.ebc.t"]

