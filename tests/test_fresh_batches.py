"""studies.fresh_batches: a device timed the judge's way (one batch, repeated) and a training
step's (each timed step on the next batch)."""

import pytest

from studies.fresh_batches import FRESH, ROUNDS, compute, device_lines, fresh_ms, time_device
from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.evaluate import task_lookups
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool


def test_fresh_steps_each_read_another_draw_after_one_untimed() -> None:
    ran: list[tuple[int, str]] = []

    def step(draw: int) -> tuple:
        return (lambda: ran.append((draw, "fwd")) or _Out(ran, draw)), (lambda out: out.backward())

    assert fresh_ms([[step(k)] for k in range(1 + FRESH)]) >= 0
    assert [d for d, kind in ran if kind == "fwd"] == list(range(1 + FRESH))  # draw 0 untimed, then each other once
    assert [d for d, kind in ran if kind == "bwd"] == list(range(1 + FRESH))


class _Out:
    """A forward's output whose backward records its draw (a stand-in for a kernel's output tensor)."""

    def __init__(self, ran: list, draw: int) -> None:
        self.ran, self.draw = ran, draw

    def backward(self) -> None:
        self.ran.append((self.draw, "bwd"))


@pytest.mark.measure
def test_every_plan_at_a_device_is_timed_both_ways_in_every_round() -> None:
    task = generate_task(synthetic_pool(), 8, 4, WorkloadScale(row_divisor=4096, batch_size=256), seed=0)
    plans = {name: baseline_plan(name, task) for name in ("size", "lookup")}
    draws = [task_lookups(task, draw=k) for k in range(2 + FRESH)]
    rows = time_device(task, plans, 0, draws)
    assert [r["planner"] for r in rows] == ["size", "lookup"]
    for r in rows:
        assert len(r["repeat_ms"]) == len(r["fresh_ms"]) == ROUNDS and min(r["repeat_ms"] + r["fresh_ms"]) >= 0
        assert (r["footprint_mb"] > 0) == (r["shards"] > 0)


def test_a_plans_compute_is_its_slowest_devices_median_and_devices_are_read_by_footprint() -> None:
    rows = [
        {"pool_seed": 2, "devices": 2, "device": d, "planner": "a", "repeat_ms": [r, r], "fresh_ms": [f, f], "footprint_mb": mb}
        for d, r, f, mb in ((0, 10.0, 12.0, 1.0), (1, 20.0, 20.0, 100.0), (2, 15.0, 16.0, 10.0))
    ]
    rows[0]["repeat_ms"] = [10.0, 11.0]
    assert compute(rows, "repeat") == {"a": 20.0} and compute(rows, "fresh") == {"a": 20.0}
    (line,) = device_lines(rows)
    assert line.startswith("| 2 | 2 | 3 | 1.067") and "| 1.000 (1.000-1.080) |" in line and line.endswith("| -1.00 |")  # the small devices slowed by fresh ids
