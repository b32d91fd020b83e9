"""Topologies of several hosts: the links price the bytes across hosts, the search chooses
table-row-wise where they favour it, and memory counts a host's row blocks as TorchRec does."""

import json
from dataclasses import replace

import numpy as np
import pytest

from torchrec_neuroshard.comm import AlphaBetaComm, OuterExchange, PairExchange
from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.search import search
from torchrec_neuroshard.stepcost import POOLED_BYTES, predict_step
from torchrec_neuroshard.types import Links, Plan, ShardingError, ShardingKind, TablePlacement, Task

GB_PER_S = 1e6
"""1 GB/s in bytes per ms."""


def cpu_task() -> Task:
    return generate_task(synthetic_pool(seed=0), 8, 4, WorkloadScale(), seed=8)


def every_kind(task: Task, twrw_host: int, local: int) -> Plan:
    """TW, CW, DP, RW over all ranks and TWRW over one host's ranks."""
    t = task.tables
    first = twrw_host * local
    return Plan(
        (
            TablePlacement(t[0].name, (t[0].dim,), (0,)),
            TablePlacement(t[1].name, (t[1].dim,), (1,)),
            TablePlacement(t[2].name, (t[2].dim,), (2,)),
            TablePlacement(t[3].name, (t[3].dim,), (3,)),
            TablePlacement(t[4].name, (t[4].dim // 2, t[4].dim // 2), (3, 0)),
            TablePlacement.data_parallel(t[5].name),
            TablePlacement.row_blocks(t[6], range(4)),
            TablePlacement.row_blocks(t[7], range(first, first + local), ShardingKind.TABLE_ROW_WISE),
        ),
        4,
    )


@pytest.mark.parametrize("world, local", [(1, 1), (6, 6), (12, 4), (10, 4)])
def test_exchanges_price_as_their_dense_matrix(world: int, local: int) -> None:
    """The O(D) exchanges the step's collectives use give each rank the bytes of the dense
    [D, D] matrix they stand for, within and across hosts (also a last, partial host)."""
    rng = np.random.default_rng(world)
    links = AlphaBetaComm(batch_size=64, intra_host_bw=300 * GB_PER_S, inter_host_bw=25 * GB_PER_S, local_world_size=local)
    sender, receiver = rng.uniform(0, 1e6, world), rng.uniform(0, 3, world)
    receiver[rng.uniform(size=world) < 0.3] = 0.0  # ranks outside the exchange
    dense = sender[:, None] * receiver[None, :]
    np.fill_diagonal(dense, 0.0)
    src, dst = np.nonzero(dense)
    for exchange in (OuterExchange(sender, receiver), PairExchange(world, src, dst, dense[src, dst])):
        np.testing.assert_allclose(links.all_to_all_ms(exchange), links.all_to_all_ms(dense), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(links.cross_host_ms(exchange), links.cross_host_ms(dense), rtol=1e-12, atol=1e-12)
    if world == local:  # one host: nothing crosses, exactly
        assert not links.cross_host_ms(OuterExchange(sender, receiver)).any()
    dims = rng.integers(1, 512, (3, world)).astype(float)  # a batch of plans' dim sums: their all-to-alls, wait-free
    per_peer = dims * (links.batch_size / world) * links.bytes_per_element  # [3, D] what each rank sends each peer
    batched = links.all_to_all_ms(OuterExchange(per_peer, np.ones(world)))  # [3, D]
    for row, ms, wait_free in zip(per_peer, batched, links.wait_free_cost(dims)[:, :, 0]):
        dense = np.repeat(row[:, None], world, 1)
        np.fill_diagonal(dense, 0.0)
        np.testing.assert_allclose(ms, links.all_to_all_ms(dense), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(wait_free, links.all_to_all_ms(dense) if world > 1 else 0.0, rtol=1e-6)


def test_links_of_one_host_change_no_price() -> None:
    """On one host nothing crosses a host: every part is what the measured parts alone give."""
    model = load_pretrained("cpu")
    task = cpu_task()
    model = model.with_batch_size(task.batch_size)
    plan = every_kind(task, 0, 4)
    alone = predict_step(model, task, plan)
    linked = predict_step(model, replace(task, links=Links(4, 1 * GB_PER_S, 0.001 * GB_PER_S)), plan)
    assert linked.parts == alone.parts
    assert linked.cost_ms == alone.cost_ms
    assert alone.parts["cross_host"] == (0.0,) * 4 and min(alone.parts["reduce_scatter"]) > 0


def test_two_hosts_price_what_crosses_them() -> None:
    model = load_pretrained("cpu")
    task = cpu_task()
    model = model.with_batch_size(task.batch_size)
    plan = every_kind(task, 1, 2)
    slow, fast = (replace(task, links=Links(2, 100 * GB_PER_S, bw * GB_PER_S)) for bw in (0.001, 1000.0))
    p_slow, p_fast = predict_step(model, slow, plan), predict_step(model, fast, plan)
    # the table-row-wise table's host (ranks 2, 3) trades its samples with the other host's
    # ranks of the same place: rank 2 sends rank 0 its local batch's pooled rows
    twrw = task.tables[7]
    sent = task.batch_size / 4 * twrw.dim * POOLED_BYTES
    assert p_slow.parts["cross_host"] == pytest.approx([sent / (0.001 * GB_PER_S)] * 4)
    assert p_fast.parts["cross_host"] == pytest.approx([sent / (1000 * GB_PER_S)] * 4)
    # a measured collective costs at least its bytes across hosts: on the slow link, more
    for part in ("input_dist", "a2a_fwd", "a2a_bwd", "reduce_scatter", "all_gather", "all_reduce"):
        assert np.all(np.asarray(p_slow.parts[part]) >= p_fast.parts[part]) and sum(p_slow.parts[part]) > sum(p_fast.parts[part]), part
    assert p_slow.cost_ms > 2 * p_fast.cost_ms
    # the same plan with the TWRW table on host 0 moves its reduce-scatter there
    on_host0 = predict_step(model, fast, every_kind(task, 0, 2))
    host_rs = np.subtract(on_host0.parts["reduce_scatter"], p_fast.parts["reduce_scatter"])
    assert host_rs[:2].min() > 0 and host_rs[2:].max() < 0


def gpu_task() -> Task:
    """16 full-size tables and one hot 128-wide table at 20 times the hottest pooling."""
    base = generate_task(synthetic_pool(seed=0), 16, 8, WorkloadScale(1, 65_536), seed=16)
    hot = max(base.tables, key=lambda t: t.pooling_factor * t.dim)
    big = replace(hot, name="hot", pooling_factor=hot.pooling_factor * 20, dim=128)
    return replace(base, tables=base.tables + (big,), memory_cap_bytes=base.memory_cap_bytes * 4)


@pytest.mark.parametrize(
    "local, inter_gb_per_s, kind",
    [(8, 25.0, ShardingKind.ROW_WISE), (4, 2.0, ShardingKind.TABLE_ROW_WISE)],
)
def test_search_splits_a_hot_table_the_way_the_links_favour(local: int, inter_gb_per_s: float, kind: ShardingKind) -> None:
    """A GPU model without measured collectives prices them by the links: one host splits
    the hot table over all 8 GPUs; two hosts behind a slow link keep its rows on one host."""
    links = Links(local, 300 * GB_PER_S, inter_gb_per_s * GB_PER_S)
    task = replace(gpu_task(), links=links)
    model = load_pretrained("h200")
    model = model.with_comm(AlphaBetaComm.from_topology(links, model.batch_size))
    result = search(task, model)
    hot = result.plan.placement("hot")
    assert hot.kind is kind
    assert len(hot.devices) == (8 if kind is ShardingKind.ROW_WISE else local)
    others = {p.kind for p in result.plan.placements if p.table != "hot"}
    assert others <= {ShardingKind.TABLE_WISE, ShardingKind.COLUMN_WISE}
    # independent of table order
    flipped = search(replace(task, tables=task.tables[::-1]), model)
    assert set(flipped.plan.placements) == set(result.plan.placements)


def test_table_row_wise_memory_is_what_torchrec_counts() -> None:
    """A table-row-wise block reads 1 / (ranks per host) of the indices: our memory of each
    of TorchRec's TWRW shards (2 hosts of 2 GPUs) equals its storage estimator's."""
    import torch
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
    from torchrec.distributed.planner.types import ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_neuroshard.tables import module_tables
    from torchrec_neuroshard.types import Shard

    model = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name="t", embedding_dim=32, num_embeddings=1000, feature_names=["f"])],
        device=torch.device("meta"),
    )
    world, per_rank = 4, 16
    constraints = {"t": ParameterConstraints(pooling_factors=[5.0], sharding_types=["table_row_wise"])}
    topology = Topology(world_size=world, compute_device="cuda", local_world_size=2)
    enumerator = EmbeddingEnumerator(topology, per_rank, constraints, estimator=EmbeddingStorageEstimator(topology, constraints))
    options = [o for o in enumerator.enumerate(model, get_default_sharders()) if o.sharding_type == "table_row_wise" and o.compute_kernel == "fused"]
    assert options
    (spec,) = [t.spec for t in module_tables(model, per_rank * world, constraints, compute_device="cuda")]
    for option in options:
        assert len(option.shards) == 2
        for shard in option.shards:
            rows, width = shard.size
            ours = Shard(spec, width, rows).memory_bytes(ShardingKind.TABLE_ROW_WISE, per_rank * world, world, 2)
            assert ours == shard.storage.hbm, shard.size
    placement = TablePlacement.row_blocks(spec, range(2, 4), ShardingKind.TABLE_ROW_WISE)
    expected = [0, 0] + [Shard(spec, 32, 500).memory_bytes(ShardingKind.TABLE_ROW_WISE, per_rank * world, world, 2)] * 2
    assert Plan((placement,), world).device_memory([spec], per_rank * world) == expected


def test_links_refuse_nonsense() -> None:
    with pytest.raises(ShardingError, match="local_world_size must be >= 1, got 0"):
        Links(0, 1.0, 1.0)
    with pytest.raises(ShardingError, match="inter_host_bw must be a positive number of bytes per ms, got nan"):
        Links(2, 1.0, float("nan"))
    task = replace(cpu_task(), links=Links(2, 1.0, 2.0))
    assert Task.from_json(task.to_json()) == task
    with pytest.raises(ShardingError, match="the task's links has no 'inter_host_bw' field"):
        Task.from_dict({**json.loads(task.to_json()), "links": {"local_world_size": 2, "intra_host_bw": 1.0}})


def test_planner_spreads_table_row_wise_tables_over_hosts() -> None:
    """Three tables larger than a GPU, each allowed only table-row-wise, on 2 hosts of 2:
    the largest goes to one host, the next to the other, the third beside the smaller;
    the plan does not depend on table order, and the planner prices on the topology's links."""
    import torch
    from torchrec.distributed.planner import ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_neuroshard.planner import NeuroShardPlanner
    from torchrec_neuroshard.sharding import from_torchrec

    rows = {"big": 3000, "mid": 2000, "low": 1500, "small": 40}

    def model(order) -> EmbeddingBagCollection:
        return EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=n, embedding_dim=16, num_embeddings=rows[n], feature_names=[f"f_{n}"]) for n in order],
            device=torch.device("meta"),
        )

    topology = Topology(world_size=4, compute_device="cuda", hbm_cap=150_000, local_world_size=2)
    constraints = {n: ParameterConstraints(sharding_types=["table_row_wise"]) for n in ("big", "mid", "low")}
    plans = []
    for order in (list(rows), list(rows)[::-1]):
        planner = NeuroShardPlanner(topology, batch_size=8, constraints=constraints, storage_reservation=0.0)
        plans.append(from_torchrec(planner.plan(model(order), get_default_sharders()), 4))
        assert planner.task_.links == Links.of(topology)
    assert set(plans[0].placements) == set(plans[1].placements)
    hosts = {n: {d // 2 for d in plans[0].placement(n).devices} for n in ("big", "mid", "low")}
    assert hosts == {"big": {0}, "mid": {1}, "low": {1}}
    assert all(plans[0].placement(n).kind is ShardingKind.TABLE_ROW_WISE for n in hosts)


@pytest.mark.parametrize("pooling, kind", [(5, ShardingKind.TABLE_WISE), (200, ShardingKind.DATA_PARALLEL)])
def test_gpu_model_replicates_a_tiny_hot_table(pooling: float, kind: ShardingKind) -> None:
    """h200.pt's measured dense kernel and the links' all-reduce price replication: a
    100-row table read 200 times per sample is replicated on 8 GPUs, read 5 times it is not."""
    task = generate_task(synthetic_pool(seed=0), 16, 8, WorkloadScale(1, 65_536), seed=16)
    tiny = replace(task.tables[0], name="tiny", rows=100, dim=128, pooling_factor=pooling)
    links = Links(8, 300 * GB_PER_S, 25 * GB_PER_S)
    task = replace(task, tables=task.tables + (tiny,), links=links)
    model = load_pretrained("h200")
    model = model.with_comm(AlphaBetaComm.from_topology(links, model.batch_size))
    assert search(task, model).plan.placement("tiny").kind is kind
    # without links nothing prices the all-reduce: never replicated
    assert search(replace(task, links=None), model).plan.placement("tiny").kind is not ShardingKind.DATA_PARALLEL


def test_gpu_placements_name_the_device_on_the_rank_host() -> None:
    """On 2 hosts of 2 GPUs, rank 3 is cuda:1 of its host, never cuda:3."""
    import torch
    from torchrec.distributed.planner import Topology
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_neuroshard.planner import NeuroShardPlanner

    model = EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=f"t{i}", embedding_dim=32, num_embeddings=1000, feature_names=[f"f{i}"]) for i in range(8)],
        device=torch.device("meta"),
    )
    topology = Topology(world_size=4, compute_device="cuda", local_world_size=2)
    plan = NeuroShardPlanner(topology, batch_size=64).plan(model, get_default_sharders())
    placements = [str(s.placement) for ps in plan.plan[""].values() if ps.sharding_spec is not None for s in ps.sharding_spec.shards]
    assert placements and all(p.split("/")[1] == f"cuda:{int(p.split('/')[0].split(':')[1]) % 2}" for p in placements)
    assert {int(p.split("/")[0].split(":")[1]) for p in placements} - {0, 1}  # ranks of the second host are used


def test_a_plan_keeping_a_table_on_one_host_may_not_span_hosts() -> None:
    task = replace(cpu_task(), links=Links(2, 1.0, 1.0), memory_cap_bytes=2**40)
    plan = every_kind(task, 0, 2)
    plan.validate(task)
    spanning = Plan(
        tuple(TablePlacement.row_blocks(task.tables[7], (1, 2), ShardingKind.TABLE_ROW_WISE) if p.table == task.tables[7].name else p
              for p in plan.placements),
        4,
    )  # fmt: skip
    with pytest.raises(ShardingError, match=r"table_row_wise keeps a table on one host, but its devices \[1, 2\] span hosts of 2 ranks"):
        spanning.validate(task)
    spanning.validate(replace(task, links=None))  # one host: any devices
    with pytest.raises(ShardingError, match="the task's links must be a Links"):
        replace(task, links={"local_world_size": 2})
