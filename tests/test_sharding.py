"""Plans go through to_torchrec into real DMP on gloo ranks and match an unsharded model."""

import pytest
import torch

from tests.models import shard_and_compare, two_tower
from torchrec_neuroshard.lab.launch import spawn
from torchrec_neuroshard.sharding import from_torchrec, to_torchrec
from torchrec_neuroshard.types import Plan, ShardingError, ShardingKind, TablePlacement

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


@pytest.mark.parametrize("plan", [KINDS_A, KINDS_B], ids=["cw-dp-rw-tw", "tcw-trw-tw-dp"])
def test_every_kind_round_trips_and_runs_under_dmp(plan: Plan) -> None:
    sharding_plan = to_torchrec(plan, two_tower())
    assert from_torchrec(sharding_plan, 2) == plan
    types = {name: ps.sharding_type for mp in sharding_plan.plan.values() for name, ps in mp.items()}
    assert types == {p.table: p.kind.value for p in plan.placements}
    for r in spawn(shard_and_compare, 2, plan.to_dict()):
        assert r["max_err"] < 1e-5
        assert r["changed"] >= 1


def test_plan_dict_round_trip_and_memory_by_kind() -> None:
    from torchrec_neuroshard.tables import tables_from_module

    assert Plan.from_dict(KINDS_A.to_dict()) == KINDS_A
    specs = {t.name: t for t in tables_from_module(two_tower(), batch_size=8)}
    mem = KINDS_A.device_memory(list(specs.values()))
    dp = specs["a1"].size_bytes()
    b0_block = 20 * 32 * 4
    assert mem == [40 * 32 * 4 + dp + b0_block, 40 * 32 * 4 + dp + b0_block + 40 * 8 * 4]
    assert KINDS_A.data_parallel == ("a1",)
    with pytest.raises(ShardingError, match="'a1': a data_parallel table has no shards"):
        TablePlacement("a1", (16,), (0,), ShardingKind.DATA_PARALLEL)
    with pytest.raises(ShardingError, match="'b0' \\(row_wise\\): needs one device per entry of rows"):
        TablePlacement("b0", devices=(0, 1), kind=ShardingKind.ROW_WISE, rows=(40,))
