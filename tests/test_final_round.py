"""The judge's final round (lab.final_round): each plan's slowest devices by the passes,
built together and timed side by side, read apart from the passes' rows."""

import numpy as np
import pytest

from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.evaluate import task_lookups
from torchrec_neuroshard.lab.final_round import contenders, time_final
from torchrec_neuroshard.lab.judge import COPY, FINAL, JudgeConfig, judge_plans, with_copy
from torchrec_neuroshard.lab.judgement import Judged, final_judgements, judgements
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool

TINY = WorkloadScale(row_divisor=1024, batch_size=512)


def test_a_plans_contenders_are_its_devices_of_the_highest_median_slowest_first() -> None:
    judged = {"a": Judged(np.array([[1.0, 5.0, 3.0], [1.0, 4.0, 9.0], [2.0, 6.0, 3.0]])), "b": Judged(np.ones((3, 3)))}
    assert contenders(judged, 2) == {"a": [1, 2], "b": [0, 1]}  # medians 1, 5, 3; ties keep device order
    with pytest.raises(ValueError, match="top is 0"):
        contenders(judged, 0)


def test_the_final_rounds_rows_are_read_apart_from_the_passes() -> None:
    """A final row names its plan and device; the passes' judgement never reads it (its
    pass is -1), and the final judgement is [draws x rounds, contenders] per plan."""
    config = JudgeConfig(passes=1, draws=1, rounds=2, repeats=1)

    def row(planner: str, device: int, ms: float, **extra) -> dict:
        return {"pass": 0, "draw": 0, "device": device, "planner": planner, "fused_ms": [ms, ms], "replicas_ms": [0.0, 0.0], **extra}

    passes = [row("a", 0, 1.0), row("a", 1, 2.0), row("b", 0, 3.0), row("b", 1, 1.0)]
    final = [row("a", 1, 5.0, stage=FINAL, **{"pass": -1}), row("b", 0, 4.0, stage=FINAL, **{"pass": -1})]
    judged = judgements(passes + final, 2, config)
    assert {n: j.compute_ms for n, j in judged.items()} == {"a": 2.0, "b": 3.0}
    read = final_judgements(passes + final, config)
    assert {n: (j.times.shape, j.compute_ms) for n, j in read.items()} == {"a": ((2, 1), 5.0), "b": ((2, 1), 4.0)}
    assert final_judgements(passes + final[:1] + [{**final[1], "draw": 0, "fused_ms": [4.0, np.nan]}], config).keys() == {"a"}


@pytest.mark.measure
def test_each_plans_contenders_are_built_together_and_timed_in_the_same_rounds() -> None:
    task = generate_task(synthetic_pool(seed=2), 8, 2, TINY, seed=4)
    plans = with_copy({"size": baseline_plan("size", task), "dim": baseline_plan("dim", task)})
    config = JudgeConfig(passes=1, draws=2, rounds=2, repeats=1, copy=True)
    draws = [task_lookups(task, draw=k) for k in range(config.draws)]
    passes = judge_plans(task, {n: p for n, p in plans.items() if n != COPY}, draws, config)
    chosen = {**contenders(judgements(passes, task.num_devices, config), 1), COPY: [1]}
    rows = time_final(task, plans, chosen, draws, config, rounds=3)  # one visit: more rounds than a pass's
    assert sorted((r["planner"], r["device"], r["draw"]) for r in rows) == sorted(
        (name, d, k) for name, devices in chosen.items() for d in devices for k in range(config.draws)
    )
    assert all(r["stage"] == FINAL and r["pass"] == -1 and len(r["fused_ms"]) == 3 for r in rows)
    assert all(min(r["fused_ms"]) > 0 for r in rows if any(r["device"] in p.devices for p in plans[r["planner"]].placements))
    assert {n: j.times.shape for n, j in final_judgements(rows, config).items()} == {n: (config.draws * 3, 1) for n in plans}
    with pytest.raises(ValueError, match="final round: 3 plans' contenders need .* GiB at once, .* free: give fewer devices"):
        time_final(task, plans, chosen, draws, config, memory_bytes=1.0)
