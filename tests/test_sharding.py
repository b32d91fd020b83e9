"""Plans go through to_torchrec into real DMP on gloo ranks and match an unsharded model."""

import pytest
import torch

from tests.models import shard_and_compare, two_tower
from torchrec_neuroshard.lab.launch import spawn
from torchrec_neuroshard.sharding import from_torchrec, to_torchrec
from torchrec_neuroshard.types import Plan, Shard, ShardingError, ShardingKind, TablePlacement

# a0 (dim 64) split unevenly 32+16+16 with two shards on rank 1; a1 table-wise on rank 0;
# b0 (32) split 16+16 both on rank 0; b1 table-wise on rank 1.
UNEVEN = Plan(
    (
        TablePlacement("a0", (32, 16, 16), (0, 1, 1)),
        TablePlacement("a1", (16,), (0,)),
        TablePlacement("b0", (16, 16), (0, 0)),
        TablePlacement("b1", (8,), (1,)),
    ),
    num_devices=2,
)


@pytest.mark.dmp
def test_uneven_column_plan_matches_unsharded_reference_on_two_gloo_ranks() -> None:
    results = spawn(shard_and_compare, 2, UNEVEN.to_dict())
    for r in results:
        assert r["keys"] == ["f_a0", "f_a1", "f_b0", "f_b1"]
        assert r["max_err"] < 1e-5
        # backward through the fused kernel updated every local shard that was looked up
        assert r["changed"] == r["shards"] > 0


def test_to_torchrec_column_spec_places_each_width() -> None:
    sp = to_torchrec(UNEVEN, two_tower())
    a0 = sp.plan["user.ebc"]["a0"]
    assert a0.sharding_type == "column_wise" and a0.compute_kernel == "fused"
    assert [(s.shard_offsets, s.shard_sizes, str(s.placement)) for s in a0.sharding_spec.shards] == [
        ([0, 0], [40, 32], "rank:0/cpu"),
        ([0, 32], [40, 16], "rank:1/cpu"),
        ([0, 48], [40, 16], "rank:1/cpu"),
    ]
    assert sp.plan["item_ebc"]["b1"].sharding_type == "table_wise"
    assert from_torchrec(sp, 2) == UNEVEN


def test_to_torchrec_rejects_bad_widths_and_unknown_tables() -> None:
    bad = Plan(UNEVEN.placements[:3] + (TablePlacement("b1", (6, 2), (0, 1)),), 2)
    with pytest.raises(ShardingError, match=r"'b1'.*\[6, 2\] are not multiples of 4"):
        to_torchrec(bad, two_tower())
    missing = Plan(UNEVEN.placements[:3], 2)
    with pytest.raises(ShardingError, match="'b1'.*not in the plan"):
        to_torchrec(missing, two_tower())


def test_module_without_ebc_is_a_clear_error() -> None:
    with pytest.raises(ShardingError, match="Linear contains no torchrec EmbeddingBagCollection"):
        to_torchrec(UNEVEN, torch.nn.Linear(2, 2))


# The narrowest column shards the search makes (WIDTH_ALIGNMENT, 4 columns; TorchRec's
# enumerator never makes shards under its 128-column MIN_CW_DIM unless min_partition asks):
# b1 (dim 8) as 4 + 4 on both ranks, a1 (16) as 4 + 4 + 8 with two on rank 1, a0 (64) as 4 + 60.
NARROWEST = Plan(
    (
        TablePlacement("a0", (4, 60), (1, 0)),
        TablePlacement("a1", (4, 4, 8), (1, 0, 1)),
        TablePlacement("b0", (32,), (0,)),
        TablePlacement("b1", (4, 4), (0, 1)),
    ),
    num_devices=2,
)


@pytest.mark.dmp
def test_the_narrowest_column_shards_we_make_run_under_dmp_and_match_the_unsharded_model() -> None:
    from torchrec_neuroshard.types.table import WIDTH_ALIGNMENT

    assert min(w for p in NARROWEST.placements for w in p.widths) == WIDTH_ALIGNMENT
    for r in spawn(shard_and_compare, 2, NARROWEST.to_dict()):
        assert r["max_err"] < 1e-5
        assert r["changed"] == r["shards"] > 0

# Every kind a Plan records, over two plans of the same model (2 ranks, one host).
KINDS_A = Plan(
    (
        TablePlacement("a0", (32, 16, 16), (0, 1, 1)),  # column_wise, uneven
        TablePlacement.data_parallel("a1"),
        TablePlacement("b0", devices=(0, 1), kind=ShardingKind.ROW_WISE, rows=(20, 20)),
        TablePlacement("b1", (8,), (1,)),  # table_wise
    ),
    num_devices=2,
)
KINDS_B = Plan(
    (
        TablePlacement("a0", (32, 32), (1, 0), ShardingKind.TABLE_COLUMN_WISE),
        TablePlacement("a1", devices=(0, 1), kind=ShardingKind.TABLE_ROW_WISE, rows=(20, 20)),
        TablePlacement("b0", (32,), (0,)),
        TablePlacement.data_parallel("b1"),
    ),
    num_devices=2,
)


@pytest.mark.dmp
@pytest.mark.parametrize("plan", [KINDS_A, KINDS_B], ids=["cw-dp-rw-tw", "tcw-trw-tw-dp"])
def test_every_kind_round_trips_and_runs_under_dmp(plan: Plan) -> None:
    sharding_plan = to_torchrec(plan, two_tower())
    assert from_torchrec(sharding_plan, 2) == plan
    types = {name: ps.sharding_type for mp in sharding_plan.plan.values() for name, ps in mp.items()}
    assert types == {p.table: p.kind.value for p in plan.placements}
    for r in spawn(shard_and_compare, 2, plan.to_dict()):
        assert r["max_err"] < 1e-5
        assert r["changed"] >= 1


# Two hosts of two ranks each (host = rank // 2): a1 row-split within host 1, a0
# column-split within host 0, b0 row-split across both hosts, b1 table-wise on rank 3.
TWO_HOSTS = Plan(
    (
        TablePlacement("a0", (32, 32), (1, 0), ShardingKind.TABLE_COLUMN_WISE),
        TablePlacement("a1", devices=(2, 3), kind=ShardingKind.TABLE_ROW_WISE, rows=(20, 20)),
        TablePlacement("b0", devices=(0, 1, 2, 3), kind=ShardingKind.ROW_WISE, rows=(10, 10, 10, 10)),
        TablePlacement("b1", (8,), (3,)),
    ),
    num_devices=4,
)


@pytest.mark.dmp
def test_host_kinds_run_under_dmp_on_two_hosts() -> None:
    sharding_plan = to_torchrec(TWO_HOSTS, two_tower(), local_size=2)
    assert from_torchrec(sharding_plan, 4) == TWO_HOSTS
    types = {name: ps.sharding_type for mp in sharding_plan.plan.values() for name, ps in mp.items()}
    assert types == {p.table: p.kind.value for p in TWO_HOSTS.placements}
    # a within-host kind whose devices straddle the host boundary is refused
    spanning = Plan(
        TWO_HOSTS.placements[:1]
        + (TablePlacement("a1", devices=(1, 2), kind=ShardingKind.TABLE_ROW_WISE, rows=(20, 20)),)
        + TWO_HOSTS.placements[2:],
        num_devices=4,
    )
    with pytest.raises(ShardingError, match=r"'a1': table_row_wise keeps a table on one host.*\[1, 2\] span hosts of 2"):
        to_torchrec(spanning, two_tower(), local_size=2)
    for r in spawn(shard_and_compare, 4, TWO_HOSTS.to_dict(), 2):
        assert r["keys"] == ["f_a0", "f_a1", "f_b0", "f_b1"]
        assert r["max_err"] < 1e-5
        assert r["changed"] >= 1


def test_plan_dict_round_trip_and_memory_by_kind() -> None:
    from torchrec_neuroshard.tables import tables_from_module

    assert Plan.from_dict(KINDS_A.to_dict()) == KINDS_A
    batch = 8
    specs = {t.name: t for t in tables_from_module(two_tower(), batch_size=batch)}

    def memory(kind: ShardingKind, table: str, width: int, rows: int | None = None) -> int:
        return Shard(specs[table], width, rows).memory_bytes(kind, batch, 2)

    replica = memory(ShardingKind.DATA_PARALLEL, "a1", 16)
    block = memory(ShardingKind.ROW_WISE, "b0", 32, 20)
    assert KINDS_A.device_memory(list(specs.values()), batch) == [
        memory(ShardingKind.COLUMN_WISE, "a0", 32) + replica + block,
        2 * memory(ShardingKind.COLUMN_WISE, "a0", 16) + replica + block + memory(ShardingKind.TABLE_WISE, "b1", 8),
    ]
    assert KINDS_A.data_parallel == ("a1",)
    with pytest.raises(ShardingError, match="'a1': a data_parallel table has no shards"):
        TablePlacement("a1", (16,), (0,), ShardingKind.DATA_PARALLEL)
    with pytest.raises(ShardingError, match="'b0' \\(row_wise\\): needs one device per entry of rows"):
        TablePlacement("b0", devices=(0, 1), kind=ShardingKind.ROW_WISE, rows=(40,))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("optimizer", [None, "adam", "rowwise_adagrad"])
def test_memory_is_what_torchrec_storage_estimator_counts(optimizer, device) -> None:
    """Every shard of every kind TorchRec's enumerator proposes for a two-EBC model, with
    and without optimizer state: our memory equals its EmbeddingStorageEstimator's (ddr on
    cpu, hbm on cuda; row-wise is offered on cuda only). No GPU is needed to enumerate."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
    from torchrec.distributed.planner.types import ParameterConstraints, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.optim import RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from torchrec_neuroshard.tables import module_tables

    model, world, per_rank = two_tower(), 2, 16
    if optimizer:
        opt = torch.optim.Adam if optimizer == "adam" else RowWiseAdagrad
        apply_optimizer_in_backward(opt, model.parameters(), {"lr": 0.1})
    pooling = {"a0": 3.0, "a1": 0.5, "b0": 7.0, "b1": 1.0}
    constraints = {n: ParameterConstraints(pooling_factors=[pf]) for n, pf in pooling.items()}
    topology = Topology(world_size=world, compute_device=device)
    enumerator = EmbeddingEnumerator(
        topology, per_rank, constraints, estimator=EmbeddingStorageEstimator(topology, constraints)
    )
    options = enumerator.enumerate(model, get_default_sharders())
    specs = {t.spec.name: t.spec for t in module_tables(model, per_rank * world, constraints)}
    checked = set()
    for option in options:
        if option.sharding_type == "table_row_wise" or option.compute_kernel not in ("fused", "dense"):
            continue  # TWRW: its own IO rule; other kernels (UVM, caching) are not ours
        kind = ShardingKind(option.sharding_type)
        for shard in option.shards:
            rows, width = shard.size
            ours = Shard(specs[option.name], width, rows).memory_bytes(kind, per_rank * world, world)
            assert ours == (shard.storage.ddr if device == "cpu" else shard.storage.hbm), (option.name, kind, shard.size)
            checked.add(kind)
    expected = {ShardingKind.TABLE_WISE, ShardingKind.COLUMN_WISE, ShardingKind.DATA_PARALLEL}
    assert checked == (expected | {ShardingKind.ROW_WISE} if device == "cuda" else expected) | {ShardingKind.TABLE_COLUMN_WISE}
