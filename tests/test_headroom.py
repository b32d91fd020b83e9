import math

from studies.headroom import balanced_bound, headroom, step_bound


def test_balanced_bound_is_the_least_work_balanced_plus_the_least_comm() -> None:
    # rows per device: fwd compute, bwd compute, fwd comm, bwd comm
    skewed = [[10.0, 20.0, 1.0, 1.0], [2.0, 4.0, 3.0, 3.0]]  # work 36 over 2 devices
    even = [[9.0, 10.0, 2.0, 2.0], [9.0, 10.0, 2.5, 2.5]]  # work 38 over 2 devices
    assert math.isclose(balanced_bound([skewed, even]), 36 / 2 + 2.0)


def test_headroom_reports_every_task_with_both_planners_and_the_reachable_floor() -> None:
    def row(task, planner, cost, per_device):
        return {"task": task, "planner": planner, "status": "ok", "cost_ms": cost, "per_device": per_device}

    rows = [
        row(0, "neuroshard", 30.0, [[10, 10, 5, 5], [10, 10, 5, 5]]),
        row(0, "torchrec", 40.0, [[15, 15, 5, 5], [5, 5, 5, 5]]),
        row(0, "lookup", 32.0, [[11, 11, 5, 5], [9, 9, 5, 5]]),
        row(1, "lookup", 10.0, [[1, 1, 1, 1]]),  # no NeuroShard or TorchRec row: left out
    ]
    text = headroom(rows)
    assert "| 0 | 2 | 30.0 | 1.00 | 1.33 | 1.07 | 0.750 |" in text
    assert "**0.750** over 1 tasks" in text


def test_step_bound_is_each_modules_least_work_balanced_summed() -> None:
    # [plan][module][device] predicted ms
    skewed = [[10.0, 2.0], [4.0, 4.0]]  # module 0: work 12, module 1: work 8
    even = [[7.0, 7.0], [3.0, 3.0]]  # module 0: work 14, module 1: work 6
    assert math.isclose(step_bound([skewed, even]), 12 / 2 + 6 / 2)

