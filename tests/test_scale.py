"""The scale benchmark's judge: published-rate communication, device-by-device timing of
real fused kernels, and the report's arithmetic."""

import numpy as np
import pytest

from benchmarks.scale import _device_rounds, scale_task
from benchmarks.scale_report import measured
from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.evaluate import lookup_groups, task_lookups
from torchrec_neuroshard.lab.published_comm import INTER_HOST_GBPS, INTRA_HOST_GBPS, LATENCY_MS, PublishedLinks, modelled_comm
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.types import Plan, TablePlacement


def test_an_all_to_all_costs_its_slowest_ranks_bytes_at_the_published_rates() -> None:
    links = PublishedLinks(ranks_per_host=2, latency_ms=0.0, cross_host_latency_ms=0.0)
    one_host = np.array([[7e9, 450e6], [0.0, 0.0]])  # a rank's own slice moves nothing
    assert links.all_to_all_ms(one_host) == pytest.approx(450e6 / (INTRA_HOST_GBPS * 1e6))
    two_hosts = np.zeros((4, 4))
    two_hosts[0, 1] = two_hosts[0, 2] = 50e6  # rank 0 sends within its host and across
    assert links.all_to_all_ms(two_hosts) == pytest.approx(50e6 / (INTRA_HOST_GBPS * 1e6) + 50e6 / (INTER_HOST_GBPS * 1e6))
    assert PublishedLinks().all_to_all_ms(np.ones((1, 1))) == 0.0  # one rank: no collective


def test_a_ring_crossing_hosts_runs_at_the_inter_host_rate() -> None:
    links = PublishedLinks(ranks_per_host=8)
    assert links.ring_ms(1e9, 8, passes=1) == pytest.approx(LATENCY_MS + 1e9 * 7 / 8 / (INTRA_HOST_GBPS * 1e6))
    assert links.ring_ms(1e9, 16, passes=2) > 2 * 1e9 * 15 / 16 / (INTER_HOST_GBPS * 1e6)


@pytest.mark.slow
def test_the_modelled_comm_follows_the_bytes_a_plan_moves() -> None:
    task = generate_task(synthetic_pool(), 6, 4, WorkloadScale(), seed=2)
    lookups = task_lookups(task)
    whole = baseline_plan("size", task)
    widest = max(task.tables, key=lambda t: t.dim)
    halves = [widest.dim // 2] * 2
    split = Plan(
        tuple(p if p.table != widest.name else TablePlacement(widest.name, tuple(halves), (0, 1)) for p in whole.placements),
        task.num_devices,
    )
    a, b = modelled_comm(task, whole, lookups), modelled_comm(task, split, lookups)
    assert a.forward_ms == pytest.approx(a.backward_ms)  # the gradient all-to-all mirrors the output's
    assert b.input_ms > a.input_ms  # both column shards receive the table's indices
    assert min(a.input_ms, a.forward_ms) > 0


@pytest.mark.measure
def test_every_plans_device_kernels_are_timed_in_interleaved_rounds() -> None:
    task = generate_task(synthetic_pool(), 8, 2, WorkloadScale(row_divisor=1024, batch_size=512), seed=4)
    lookups = task_lookups(task)
    plans = {name: baseline_plan(name, task) for name in ("size", "dim")}
    groups = {name: lookup_groups(task, plan, [[t.name for t in task.tables]])[0] for name, plan in plans.items()}
    for d in range(task.num_devices):
        rounds = _device_rounds(task, groups, lookups, d, rounds=2)
        assert set(rounds) == set(plans)
        for name, times in rounds.items():
            holds = any(d in p.devices for p in plans[name].placements)
            assert len(times) == 2 and all((f > 0 and b > 0) == holds for f, b in times)


def test_a_plans_measured_compute_is_its_slowest_device_with_its_replicas_and_spread() -> None:
    rows = [
        {"devices": 2, "device": "all", "planner": "p", "data_parallel_ms": 1.0,
         "comm_input_ms": 0.1, "comm_forward_ms": 0.2, "comm_backward_ms": 0.3},
        {"devices": 2, "device": 0, "planner": "p", "fwd_ms": [1.0, 2.0, 3.0], "bwd_ms": [1.0, 1.0, 1.0]},
        {"devices": 2, "device": 1, "planner": "p", "fwd_ms": [4.0, 4.0, 6.0], "bwd_ms": [2.0, 2.0, 2.0]},
    ]  # fmt: skip
    m = measured(rows, 2, "p")
    assert m.per_device == (4.0, 7.0) and m.compute_ms == 7.0 and m.comm_ms == pytest.approx(0.6)
    assert m.imbalance == pytest.approx(7.0 / 5.5)
    # quartiles (exclusive method) of device 0: 3 and 5, device 1: 7 and 9
    assert m.spread == pytest.approx((9.0 - 7.0) / 7.0)
    assert measured(rows[:2], 2, "p") is None  # a device not yet measured: no figure
    # re-planned: the rows of the plans measured last, never a mix with the earlier plans'
    again = [{**r, "plans_sha": "new"} for r in rows]
    again[1] = {**again[1], "fwd_ms": [9.0, 9.0, 9.0]}
    assert measured(rows + again, 2, "p").per_device == (11.0, 7.0)  # fwd 9 + bwd 1 + replicas 1
    assert measured(rows + again[:2], 2, "p") is None  # the new plans' device 1 not yet timed


@pytest.mark.slow
def test_the_scaled_pool_holds_the_same_tables_and_batch_at_every_device_count() -> None:
    small, large = scale_task(8), scale_task(128)
    assert small.tables == large.tables and small.batch_size == large.batch_size == 4096
    assert len(small.tables) == 856 and large.memory_cap_bytes < small.memory_cap_bytes
