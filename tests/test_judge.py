"""The judge of plans (lab.judge): every device of every plan timed here in passes of
opposite device order, draws of ids and interleaved rounds, replicas inside the rounds;
and the judgement's arithmetic (slowest device, paired bootstrap, units won)."""

import dataclasses

import numpy as np
import pytest

from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.evaluate import task_lookups
from benchmarks.scale_report import judged_task
from torchrec_neuroshard.lab.judge import COPY, REFERENCE, JudgeConfig, build_order, device_order, judge_plans, round_orders
from torchrec_neuroshard.lab.judgement import Judged, copy_check, judgements, rank_correlation, ratio_interval, runs_ratio_interval, wins
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.types import Plan, ShardingKind, TablePlacement

TINY = WorkloadScale(row_divisor=1024, batch_size=512)


def test_a_judge_config_needs_every_count_at_least_one() -> None:
    assert JudgeConfig(2, 2, 3).units == 12
    with pytest.raises(ValueError, match="JudgeConfig.draws is 0"):
        JudgeConfig(draws=0)


def test_a_judge_config_reads_back_from_its_rows_with_its_first_draw_of_ids() -> None:
    """Rows written before the first draw was recorded read as from draw 0; a run judged on
    later draws (those a refiner did not time) is another configuration, so it is not
    resumed from the first run's rows."""
    later = JudgeConfig(rounds=2, reference=True, first_draw=2)
    assert JudgeConfig.of(dataclasses.asdict(later)) == later
    row = {k: v for k, v in dataclasses.asdict(later).items() if k != "first_draw"}
    assert JudgeConfig.of(row) == JudgeConfig(rounds=2, reference=True) != later
    with pytest.raises(ValueError, match="JudgeConfig.first_draw is -1"):
        JudgeConfig(first_draw=-1)


def test_rows_before_the_shuffled_order_read_back_as_rotated_and_an_unknown_order_is_refused() -> None:
    assert JudgeConfig().order == "shuffled"
    row = {k: v for k, v in dataclasses.asdict(JudgeConfig()).items() if k != "order"}
    assert JudgeConfig.of(row).order == "rotated" != JudgeConfig.of(dataclasses.asdict(JudgeConfig())).order
    with pytest.raises(ValueError, match="JudgeConfig.order is 'random'"):
        JudgeConfig(order="random")


def test_a_rotated_order_keeps_every_plans_neighbour_and_a_shuffled_one_draws_it_anew() -> None:
    names = list("abcdefg")
    assert round_orders(names, 2, 0, 2, "rotated") == [list("cdefgab"), list("defgabc")]
    assert round_orders(names, 2, 1, 2, "rotated") == round_orders(names, 2, 0, 2, "rotated")  # the draw changes nothing
    assert build_order(names, 5, "rotated") == names
    follows = set()
    for visit in range(4):
        for draw in range(2):
            rounds = round_orders(names, visit, draw, len(names), "shuffled")
            assert all(sorted(r) == names for r in rounds)
            assert all(sorted(r[i] for r in rounds) == names for i in range(len(names)))  # each name takes each place once
            assert rounds == round_orders(names, visit, draw, len(names), "shuffled")  # drawn, but the same on a re-run
            follows |= {(r[i - 1], r[i]) for r in rounds for i in range(1, len(names))}
        assert sorted(build_order(names, visit, "shuffled")) == names
    assert len(follows) > 2 * len(names)  # rotated, "a" only ever follows "g"
    assert len({tuple(build_order(names, v, "shuffled")[:1]) for v in range(16)}) > 3  # not always the same plan built first


def test_passes_visit_the_devices_in_opposite_orders() -> None:
    assert device_order(3, 0) == [0, 1, 2] and device_order(3, 1) == [2, 1, 0] and device_order(3, 2) == [0, 1, 2]


def _with_a_replica(plan: Plan, table: str) -> Plan:
    placements = tuple(p if p.table != table else TablePlacement(table, kind=ShardingKind.DATA_PARALLEL) for p in plan.placements)
    return dataclasses.replace(plan, placements=placements)


@pytest.mark.measure
def test_every_device_of_every_plan_is_timed_in_each_pass_draw_and_round_and_resumes() -> None:
    task = generate_task(synthetic_pool(seed=2), 8, 2, TINY, seed=4)
    smallest = min(task.tables, key=lambda t: t.rows * t.dim).name
    plans = {"size": baseline_plan("size", task), "replicating": _with_a_replica(baseline_plan("dim", task), smallest)}
    config = JudgeConfig(passes=2, draws=2, rounds=2, repeats=1)
    draws = [task_lookups(task, draw=k) for k in range(config.draws)]
    appended: list[list[dict]] = []
    rows = judge_plans(task, plans, draws, config, append=appended.append)
    assert [(batch[0]["pass"], batch[0]["device"]) for batch in appended] == [(0, 0), (0, 1), (1, 1), (1, 0)]
    assert len(rows) == config.passes * task.num_devices * config.draws * len(plans)
    for r in rows:
        holds = any(r["device"] in p.devices for p in plans[r["planner"]].placements)
        assert len(r["fused_ms"]) == len(r["replicas_ms"]) == config.rounds
        assert all((ms > 0) == holds for ms in r["fused_ms"])
        assert all((ms > 0) == (r["planner"] == "replicating") for ms in r["replicas_ms"])  # every rank runs the replicas
    for name in plans:
        judged = Judged.of([r for r in rows if r["planner"] == name], task.num_devices, config)
        assert judged.times.shape == (config.units, task.num_devices)
    again = judge_plans(task, plans, draws, config, done=[(0, 0), (0, 1), (1, 1)])
    assert {(r["pass"], r["device"]) for r in again} == {(1, 0)}  # the devices measured before are skipped


@pytest.mark.measure
def test_a_reference_is_timed_in_every_round_beside_the_plans() -> None:
    task = generate_task(synthetic_pool(seed=2), 8, 2, TINY, seed=4)
    plans = {"size": baseline_plan("size", task), "dim": baseline_plan("dim", task)}
    config = JudgeConfig(passes=1, draws=2, rounds=2, repeats=1, reference=True)
    rows = judge_plans(task, plans, [task_lookups(task, draw=k) for k in range(config.draws)], config)
    reference = [r for r in rows if r["planner"] == REFERENCE]
    assert sorted((r["device"], r["draw"]) for r in reference) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(len(r["fused_ms"]) == config.rounds and min(r["fused_ms"]) > 0 and not any(r["replicas_ms"]) for r in reference)
    assert len(rows) == task.num_devices * config.draws * (len(plans) + 1)
    draws = [task_lookups(task, draw=k) for k in range(config.draws)]
    with pytest.raises(ValueError, match="resident sets"):
        judge_plans(task, plans, draws, config, memory_bytes=1e9)
    with pytest.raises(ValueError, match="a plan is named '_reference'"):
        judge_plans(task, {"size": plans["size"], REFERENCE: plans["dim"]}, draws, config)
    replicas_only = dataclasses.replace(plans["size"], placements=tuple(TablePlacement(t.name, kind=ShardingKind.DATA_PARALLEL) for t in task.tables))
    with pytest.raises(ValueError, match=r"the first plan \(replicas\) has no fused kernel on device 0"):
        judge_plans(task, {"replicas": replicas_only, **plans}, draws, config)


@pytest.mark.measure
def test_a_copy_of_the_first_plan_is_built_and_timed_as_one_more_plan() -> None:
    task = generate_task(synthetic_pool(seed=2), 8, 2, TINY, seed=4)
    plans = {"size": baseline_plan("size", task), "dim": baseline_plan("dim", task)}
    config = JudgeConfig(passes=1, draws=1, rounds=2, repeats=1, reference=True, copy=True)
    draws = [task_lookups(task, draw=0)]
    rows = judge_plans(task, plans, draws, config)
    assert [r["planner"] for r in rows if r["device"] == 0] == ["size", "dim", COPY, REFERENCE]
    copied = [r for r in rows if r["planner"] == COPY]
    assert all(len(r["fused_ms"]) == config.rounds and min(r["fused_ms"]) > 0 for r in copied)  # "size" holds tables on both
    assert list(judgements(rows, task.num_devices, config)) == ["size", "dim"]  # the copy is not a plan: it wins no unit
    ratio, low, high = copy_check(rows, task.num_devices, config)
    assert 0 < low <= ratio <= high
    assert copy_check(rows, task.num_devices, dataclasses.replace(config, copy=False)) is not None  # read from the rows, not the flag
    assert copy_check([r for r in rows if r["planner"] != COPY], task.num_devices, config) is None
    with pytest.raises(ValueError, match="a plan is named '_copy'"):
        judge_plans(task, {"size": plans["size"], COPY: plans["dim"]}, draws, config)


def test_the_copy_check_is_the_copys_compute_over_the_first_plans() -> None:
    key = {"passes": 1, "draws": 1, "rounds": 2, "repeats": 1, "copy": True}
    times = np.array([[[[3.0, 4.0], [5.0, 4.0]]]])  # [1, 1, 2, 2]
    rows = [{**key, **r} for r in _rows(times, "first") + _rows(times * 2, "other") + _rows(times * 1.1, COPY)]
    config = JudgeConfig.of(rows[0])
    assert config.copy and list(judgements(rows, 2, config)) == ["first", "other"]
    assert copy_check(rows, 2, config) == pytest.approx((1.1, 1.1, 1.1))


def test_a_plan_steadied_by_the_reference_loses_the_machines_drift() -> None:
    drift = np.random.default_rng(0).uniform(0.5, 2.0, (12, 3))  # [units, devices]: the machine's speed at each timing
    plan, reference = Judged(drift * np.array([[9.0, 10.0, 11.0]])), Judged(drift * 4.0)
    steadied = plan.steadied(reference)
    assert steadied.times == pytest.approx(np.tile([9.0, 10.0, 11.0], (12, 1)) * float(np.median(drift)))
    assert steadied.imbalance == pytest.approx(11.0 / 10.0)
    with pytest.raises(ValueError, match="judge them in one run"):
        plan.steadied(Judged(reference.times[:6]))


def test_a_task_is_steadied_only_where_its_run_timed_a_reference() -> None:
    key = {"pool_seed": 2, "devices": 2, "plans_sha": "x", "passes": 1, "draws": 1, "rounds": 2, "repeats": 1}
    times = np.array([[[[3.0, 4.0], [6.0, 8.0]]]])  # [1, 1, 2, 2]: the second round twice as slow
    assert list(judged_task([{**key, **r} for r in _rows(times)], 2, 2)["p"].per_device) == [4.5, 6.0]  # no reference: as timed
    rows = [{**key, "reference": True, **r} for r in _rows(times) + _rows(times / 3.0, REFERENCE)]
    assert list(judged_task(rows, 2, 2)) == ["p"]  # the reference is not a plan
    assert list(judged_task(rows, 2, 2)["p"].per_device) == pytest.approx([5.0, 5.0])  # 3x the reference, its median 5/3
    assert list(judged_task(rows, 2, 2, steady=False)["p"].per_device) == [4.5, 6.0]


def _rows(times: np.ndarray, planner: str = "p") -> list[dict]:
    """Rows of a [pass, draw, round, device] array of times, split half fused, half replicas."""
    passes, draws, _, devices = times.shape
    return [
        {"pass": p, "draw": k, "device": d, "planner": planner, "fused_ms": list(times[p, k, :, d] / 2), "replicas_ms": list(times[p, k, :, d] / 2)}
        for p in range(passes) for k in range(draws) for d in range(devices)
    ]  # fmt: skip


def test_a_plans_compute_is_its_slowest_devices_median_over_units() -> None:
    config = JudgeConfig(passes=1, draws=2, rounds=3)
    times = np.array([[[[1.0, 4.0], [2.0, 5.0], [3.0, 9.0]], [[2.0, 4.0], [2.0, 4.0], [8.0, 5.0]]]])  # [1, 2, 3, 2]
    judged = Judged.of(_rows(times), 2, config)
    assert list(judged.per_device) == [2.0, 4.5] and judged.compute_ms == 4.5
    assert judged.imbalance == pytest.approx(4.5 / 3.25)
    assert list(judged.unit_compute) == [4.0, 5.0, 9.0, 4.0, 4.0, 8.0]
    assert Judged.of(_rows(times)[:-1], 2, config) is None  # a device of a draw not yet timed: no figure


def test_ratios_come_with_a_paired_interval_and_units_are_won_by_the_least_slowest_device() -> None:
    rng = np.random.default_rng(0)
    drift = rng.uniform(0.5, 2.0, (40, 1))  # [units, 1]: the machine's drift moves both plans alike
    a, b = Judged(drift * np.array([[9.0, 10.0]])), Judged(drift * np.array([[12.0, 11.0]]))
    ratio, low, high = ratio_interval(a, b)
    assert ratio == pytest.approx(10 / 12) and low == pytest.approx(ratio) and high == pytest.approx(ratio)  # paired: drift cancels
    noisy = Judged(b.times * rng.uniform(0.9, 1.1, b.times.shape))
    ratio, low, high = ratio_interval(a, noisy)
    assert low < ratio < high < 1.0
    assert wins({"a": a, "b": b}) == {"a": 40, "b": 0}
    with pytest.raises(ValueError, match="judge them in one run"):
        ratio_interval(a, Judged(b.times[:10]))


def test_runs_pool_as_the_geometric_mean_of_their_ratios_and_narrow_the_interval() -> None:
    rng = np.random.default_rng(1)
    runs = []
    for ratio in (0.8, 0.9, 1.0):  # each run: a's slowest device over b's
        b = Judged(rng.uniform(0.7, 1.3, (8, 1)) * np.array([[10.0, 9.0]]))  # [units, devices]
        runs.append((Judged(b.times * ratio * rng.uniform(0.85, 1.15, b.times.shape)), b))
    point, low, high = runs_ratio_interval(runs)
    assert point == pytest.approx(float(np.exp(np.mean([np.log(a.compute_ms / b.compute_ms) for a, b in runs]))))
    assert low < point < high
    assert high - low < min(h - lo for _, lo, h in (ratio_interval(a, b) for a, b in runs))
    assert runs_ratio_interval(runs[:1]) == pytest.approx(ratio_interval(*runs[0]))  # one run: the run's own


def test_the_rank_correlation_of_devices_is_spearmans() -> None:
    assert rank_correlation([1.0, 2.0, 3.0], [10.0, 30.0, 20.0]) == pytest.approx(0.5)
    assert rank_correlation([3.0, 2.0, 1.0], [1.0, 2.0, 3.0]) == pytest.approx(-1.0)


def test_the_measurement_against_itself_ranks_the_first_passes_devices_against_the_seconds() -> None:
    first = np.array([[1.0, 2.0, 3.0], [1.2, 2.1, 2.9]])  # [units of pass 0, devices]
    assert Judged(np.concatenate([first, first + 0.5])).passes_agree == pytest.approx(1.0)  # the passes agree
    assert Judged(np.concatenate([first, first[:, ::-1]])).passes_agree == pytest.approx(-1.0)  # pass 1 reversed


@pytest.mark.parametrize("units", [8, 7])
def test_the_bootstraps_medians_are_numpys_to_the_bit(units: int) -> None:
    """Each resample's slowest device, its median over the resampled units, is what
    ``np.median`` gives, for an even and an odd count of units."""
    from torchrec_neuroshard.lab.judgement import _resampled_compute

    rng = np.random.default_rng(3)
    times = rng.lognormal(3.0, 0.2, (units, 16))  # [units, devices]
    pick = rng.integers(0, units, (500, units))  # [samples, units]
    assert np.array_equal(_resampled_compute(times, pick), np.median(times[pick], axis=1).max(axis=1))
