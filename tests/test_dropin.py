"""NeuroShardPlanner in place of EmbeddingShardingPlanner: every argument TorchRec's planner
takes, and every field of its ParameterConstraints, honoured or refused by name (issue 28)."""

import logging

import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.stats import EmbeddingStats

from tests.models import two_tower
from torchrec_neuroshard.costmodel import cost_model_for
from torchrec_neuroshard.planner import NeuroShardPlanner
from torchrec_neuroshard.stats import table_perfs

SHARDERS = [EmbeddingBagCollectionSharder()]
STATS = "torchrec.distributed.planner.stats"


def topology(world: int = 2, ddr: int = 64 * 2**20) -> Topology:
    return Topology(world_size=world, compute_device="cpu", ddr_cap=ddr, local_world_size=world)


def test_embedding_stats_of_a_plan_with_a_replicated_table_show_each_tables_own_perf(caplog) -> None:
    """A data-parallel table carries every rank (as TorchRec's plans do), so TorchRec's
    EmbeddingStats (``assert shard.ranks``) logs the plan; each table's Perf there is the
    sum over its shards of its own predicted cost, not a share of its rank's."""
    replicated = {"a1": ParameterConstraints(sharding_types=["data_parallel"])}
    planner = NeuroShardPlanner(topology(), 64, stats=EmbeddingStats(), constraints=replicated)
    with caplog.at_level(logging.INFO, logger=STATS):
        plan = planner.plan(two_tower(), SHARDERS)
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
