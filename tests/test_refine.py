"""Measured refinement at plan time (issue 43, item 4): the refiner keeps a move only where
the measurement says it pays, logs predicted against measured per device, runs inside the
planner's budget, and says so where it cannot time the plan's kernels."""

import logging
import re
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints, Topology

from torchrec_neuroshard import NeuroShardPlanner
from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.lab import refine, refine_moves
from torchrec_neuroshard.lab.judge import REFERENCE
from torchrec_neuroshard.lab.refine import MeasuredRefiner
from torchrec_neuroshard.lab.refine_moves import best_move, device_compute
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.search import search
from torchrec_neuroshard.tables import module_for_tables
from torchrec_neuroshard.types import Plan, ShardingError, ShardingKind, TableChoices, TablePlacement, Task


def small_task(devices: int = 4) -> Task:
    return generate_task(synthetic_pool(seed=2), 24, devices, WorkloadScale(64, 1024), seed=1)


def dims_timer(slow_device: int):
    """A machine on which ``slow_device`` runs at a third of the others' speed and a device's
    time is its column count: the model does not know it."""

    def timer(task: Task, plans: dict, device: int, draw: int) -> dict[str, float]:
        return {name: plan.device_dims()[device] * (3.0 if device == slow_device else 1.0) for name, plan in plans.items()}

    return timer


def test_refinement_moves_work_off_the_device_measured_slow(caplog) -> None:
    task, model = small_task(), load_pretrained("cpu")
    plan = search(task, model).plan
    before = np.asarray(plan.device_dims(), dtype=float) * np.asarray([3.0, 1, 1, 1])
    with caplog.at_level(logging.INFO, logger="torchrec_neuroshard"):
        refined = MeasuredRefiner(seconds=30).refine_with(task, model, plan, dims_timer(0))
    refined.validate(task)
    after = np.asarray(refined.device_dims(), dtype=float) * np.asarray([3.0, 1, 1, 1])
    assert after.max() < before.max()  # the slow device gave work away, and no device is now slower
    assert "device 0 predicted" in caplog.text and "rank correlation" in caplog.text


def test_a_move_the_measurement_rejects_is_not_kept() -> None:
    """Where every move measures worse than the plan it changes, the plan comes back unchanged."""
    task, model = small_task(), load_pretrained("cpu")
    plan = search(task, model).plan

    def every_move_slower(task: Task, plans: dict, device: int, draw: int) -> dict[str, float]:
        if "plan" in plans:  # (a device measured, or timed against itself)
            return {n: 50.0 + 10 * device for n in plans}
        return {"old": 50.0, "new": 100.0} if "old" in plans else {"new": 100.0}

    assert MeasuredRefiner(seconds=30).refine_with(task, model, plan, every_move_slower) == plan


def test_a_move_that_pays_on_one_draw_of_ids_only_is_not_kept(caplog) -> None:
    """The draws of ids disagree (the second draw finds every move slower): no move is kept;
    with both draws alike, the same moves are."""
    task, model = small_task(), load_pretrained("cpu")
    plan = search(task, model).plan
    pays = dims_timer(0)

    def second_draw_slower(task: Task, plans: dict, device: int, draw: int) -> dict[str, float]:
        return {n: v * (3.0 if n == "new" and draw == 1 else 1.0) for n, v in pays(task, plans, device, draw).items()}

    with caplog.at_level(logging.INFO, logger="torchrec_neuroshard"):
        assert MeasuredRefiner(seconds=30).refine_with(task, model, plan, second_draw_slower) == plan
    assert "device slower on draw 1)" in caplog.text and "; kept" not in caplog.text
    assert MeasuredRefiner(seconds=30).refine_with(task, model, plan, pays) != plan


def test_a_move_is_timed_only_as_far_as_it_pays() -> None:
    """A move slower on the first draw of ids is never timed on the second, and the old
    plan is never timed on the move's target (the decision does not read it)."""
    task, model = small_task(), load_pretrained("cpu")
    plan = search(task, model).plan
    calls: list[tuple[tuple[str, ...], int, int]] = []

    def first_draw_slower(task: Task, plans: dict, device: int, draw: int) -> dict[str, float]:
        calls.append((tuple(plans), device, draw))
        return {n: 50.0 + 10 * device if "plan" in plans else 100.0 if n == "new" else 50.0 for n in plans}

    assert MeasuredRefiner(seconds=30, draws=3).refine_with(task, model, plan, first_draw_slower) == plan
    moves = [c for c in calls if "plan" not in c[0]]
    assert moves and all(draw == 0 for _, _, draw in moves)
    assert [names for names, _, _ in moves] == [("old", "new")] * len(moves)  # slower on the source: the target is not timed


def two_wide_tables() -> tuple[Task, Plan]:
    """Two alike 128-wide tables, one a device: whole, neither can move without its target
    ending slower than the slow device was (``weighted_dims_timer``)."""
    task = small_task(2)
    wide = max(task.tables, key=lambda t: (t.dim, t.name))
    assert wide.dim == 128
    a, b = replace(wide, name="a", feature_names=("fa",)), replace(wide, name="b", feature_names=("fb",))
    plan = Plan((TablePlacement("a", (128,), (0,)), TablePlacement("b", (128,), (1,))), 2)
    return replace(task, tables=(a, b), modules=()), plan


def weighted_dims_timer(weights: tuple[float, ...]):
    """A machine on which a device's time is its column count times its weight."""

    def timer(task: Task, plans: dict, device: int, draw: int) -> dict[str, float]:
        return {name: plan.device_dims()[device] * weights[device] for name, plan in plans.items()}

    return timer


def test_a_shard_too_heavy_to_move_whole_has_part_of_its_columns_moved(caplog) -> None:
    """Device 0 runs at 1.8x: moving table a whole makes device 1 slower (256 > 230 ms);
    half of its columns there leaves 115 and 192 ms, a quarter 173 and 160 ms, and the
    refiner finds the quarter (then nothing more: a's rest to device 1 is not a move)."""
    task, plan = two_wide_tables()
    with caplog.at_level(logging.INFO, logger="torchrec_neuroshard"):
        refined = MeasuredRefiner(seconds=30).refine_with(task, load_pretrained("cpu"), plan, weighted_dims_timer((1.8, 1.0)))
    refined.validate(task)
    assert refined.placement("a") == TablePlacement("a", (96, 32), (0, 1), ShardingKind.COLUMN_WISE)
    assert refined.placement("b") == plan.placement("b")
    assert "table a, 32 of its 128 columns, from device 0 to 1" in caplog.text and "128 of its 128 columns" not in caplog.text


def test_a_table_whose_choices_keep_it_whole_is_never_halved() -> None:
    task, plan = two_wide_tables()
    whole = {"a": TableChoices(min_width=128), "b": TableChoices(min_width=128)}
    timer, model = weighted_dims_timer((1.8, 1.0)), load_pretrained("cpu")
    assert MeasuredRefiner(seconds=30).refine_with(task, model, plan, timer, choices=whole) == plan


class SplitsFirstTable:
    """A refiner that records the choices it was given and halves the first table-wise
    table it may split onto another device."""

    def refine(self, task, model, plan, compute_device, deadline=None, choices=None):
        self.choices = choices
        for i, p in enumerate(plan.placements):
            if p.kind is ShardingKind.TABLE_WISE and choices[p.table].min_width <= p.widths[0] // 2:
                half, other = p.widths[0] // 2, (p.devices[0] + 1) % task.num_devices
                split = TablePlacement(p.table, (half, half), (p.devices[0], other))
                return Plan(plan.placements[:i] + (split,) + plan.placements[i + 1 :], plan.num_devices)
        return plan


def test_the_planner_gives_the_refiner_each_tables_choices_and_labels_its_splits() -> None:
    """A table-wise-only constraint reaches the refiner as a table it may not split; a table
    allowed table_column_wise and not column_wise comes back labelled so."""
    task = small_task(2)
    whole, cut = sorted(t.name for t in task.tables if t.dim >= 16)[:2]
    constraints = {
        t.name: ParameterConstraints(sharding_types=["table_wise"] if t.name == whole else ["table_wise", "table_column_wise"])
        for t in task.tables
    }  # fmt: skip
    refiner = SplitsFirstTable()
    planner = NeuroShardPlanner(Topology(world_size=2, compute_device="cpu"), task.per_rank_batch, constraints=constraints, refiner=refiner)
    sharding_plan = planner.plan(module_for_tables(task.tables), [EmbeddingBagCollectionSharder()])
    dims = {t.name: t.dim for t in task.tables}
    assert refiner.choices[whole].min_width == dims[whole] and refiner.choices[cut].min_width < dims[cut]
    split = [p for p in planner.plan_.placements if len(p.widths) > 1]
    assert split and all(p.kind is ShardingKind.TABLE_COLUMN_WISE for p in split)
    shardings = next(iter(sharding_plan.plan.values()))
    assert all(shardings[p.table].sharding_type == "table_column_wise" for p in split)


def test_best_move_respects_memory() -> None:
    """A move to a device with no room left is never proposed; with room, it is."""
    task, model = small_task(2), load_pretrained("cpu")
    plan = search(task, model).plan
    used = plan.device_memory(task.tables, task.batch_size)
    slow = int(np.argmin(used))  # measured slow, while the other device is the fuller one
    predicted = device_compute(model, task, plan)
    measured = predicted * np.where(np.arange(2) == slow, 10.0, 1.0)
    for cap, moves in ((max(used), False), (10 * max(used), True)):
        tight = replace(task, memory_cap_bytes=cap)
        assert (best_move(model, tight, plan, predicted, measured, 1, set(), pairs=0) is not None) is moves
    # a swap that gives the full device back fewer bytes than it takes fits where no move does
    offered = best_move(model, replace(task, memory_cap_bytes=max(used)), plan, predicted, measured, 1, set())
    assert offered is not None and offered[1].swapped is not None
    offered[0].validate(replace(task, memory_cap_bytes=max(used)))


def test_a_swap_evens_two_devices_no_single_move_can() -> None:
    """Device 0 holds a (64 columns) and b (40), device 1 holds c (48) and d (12), every
    device's time its column count: 104 against 60. Moving a table of device 0 whole leaves
    a device at 104 or more, so only an exchange pays (a for c: 88 and 76; b for d: 76 and
    88); the refiner makes one, and then no more (every further move or swap leaves a
    device slower, or takes a table back)."""
    base, _ = two_wide_tables()
    widths = {"a": 64, "b": 40, "c": 48, "d": 12}
    task = replace(base, tables=tuple(replace(base.tables[0], name=n, dim=w, feature_names=(f"f{n}",)) for n, w in widths.items()))
    plan = Plan(tuple(TablePlacement(n, (w,), (int(n in "cd"),)) for n, w in widths.items()), 2)
    choices = {n: TableChoices(min_width=w) for n, w in widths.items()}  # no halving
    refined = MeasuredRefiner(seconds=30, margin=0.05).refine_with(task, load_pretrained("cpu"), plan, weighted_dims_timer((1.0, 1.0)), choices=choices)
    assert sorted(refined.device_dims()) == [76, 88]
    moved = {n for n in widths if refined.placement(n).devices != plan.placement(n).devices}
    assert len(moved) == 2 and len(moved & {"a", "b"}) == 1  # one table each way


def test_planner_refines_with_real_kernels_within_its_budget(caplog) -> None:
    task = small_task(2)
    topology = Topology(world_size=2, compute_device="cpu")
    planner = NeuroShardPlanner(topology, task.per_rank_batch, refiner=MeasuredRefiner(seconds=20, rounds=1, repeats=1), timeout_seconds=60)
    start = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="torchrec_neuroshard"):
        planner.plan(module_for_tables(task.tables), [EmbeddingBagCollectionSharder()])
    assert time.perf_counter() - start < 60 + 10  # the budget bounds refinement (a move's timing may end past it)
    assert "measured refinement, before" in caplog.text and "measured refinement, after" in caplog.text
    planner.plan_.validate(planner.task_)


def test_a_kept_move_is_never_undone(caplog) -> None:
    """On a machine where every move pays yet leaves its target the slowest device, the
    refiner never moves a table back where a kept move took it from: not directly (the way
    back is the plan the move beat), nor round a cycle of three devices."""
    task, model = small_task(3), load_pretrained("cpu")
    plan = search(task, model).plan

    def target_ends_slowest(task: Task, plans: dict, device: int, draw: int) -> dict[str, float]:
        if "plan" in plans:
            return {n: 50.0 + 10 * device for n in plans}
        return {"old": 100.0, "new": 10.0} if "old" in plans else {"new": 90.0}  # the source device, then the target

    with caplog.at_level(logging.INFO, logger="torchrec_neuroshard"):
        MeasuredRefiner(seconds=5).refine_with(task, model, plan, target_ends_slowest)
    kept = re.findall(r"table (\S+), \d+ of its \d+ columns, from device (\d+) to (\d+)(?:, with table (\S+)'s \d+ columns)?(?:, for table (\S+)'s \d+ columns back)?: .*; kept", caplog.text)
    left = [{(t, a)} | ({(also, a)} if also else set()) | ({(back, b)} if back else set()) for t, a, b, also, back in kept]  # what each kept move took off a device
    arrived = [{(t, b)} | ({(also, b)} if also else set()) | ({(back, a)} if back else set()) for t, a, b, also, back in kept]
    assert len(kept) >= 3 and not any(left[i] & arrived[j] for i in range(len(kept)) for j in range(i + 1, len(kept)))
    trials = len(re.findall(r"measured refinement: table ", caplog.text))
    assert f"after {len(kept)} measured moves ({trials} tried)" in caplog.text  # the moves timed, not those barred


def test_a_machine_slowing_between_two_timings_reads_the_same_when_steadied(monkeypatch) -> None:
    """The refiner's judge timer divides each round by the reference's in the same round:
    a machine running at half speed for the second device's timing does not make it slow."""
    task, model = small_task(2), load_pretrained("cpu")
    plan = search(task, model).plan
    speed = iter([1.0, 2.0, 1.0, 2.0])  # the machine's ms factor at each call

    def drifting(work, device, draws, config, rotation, on, reference):
        factor, rounds = next(speed), config.rounds
        timed = {**({REFERENCE: (10.0, 0.0)} if reference else {}), **{n: (5.0, 1.0) for n in work}}  # (fused, replicas) ms
        return [
            {"draw": k, "planner": n, "fused_ms": [fused * factor] * rounds, "replicas_ms": [replicas * factor] * rounds}
            for k in range(len(draws)) for n, (fused, replicas) in timed.items()
        ]  # fmt: skip

    monkeypatch.setattr(refine, "time_works", drifting)
    steady = MeasuredRefiner(rounds=2)._judge_timer(task, plan, torch.device("cpu"))
    assert steady(task, {"plan": plan}, 0, 0) == steady(task, {"plan": plan}, 1, 0) == {"plan": 6.0}
    plain = MeasuredRefiner(rounds=2, steady=False)._judge_timer(task, plan, torch.device("cpu"))
    assert plain(task, {"plan": plan}, 0, 1) == {"plan": 6.0} and plain(task, {"plan": plan}, 1, 1) == {"plan": 12.0}


def test_refiner_says_so_where_it_cannot_time_the_kernels(caplog) -> None:
    task, model = small_task(2), load_pretrained("cpu")
    plan = search(task, model).plan
    with caplog.at_level(logging.WARNING, logger="torchrec_neuroshard"):
        same = MeasuredRefiner().refine(task, model, plan, "mtia")
    assert same is plan and "unrefined" in caplog.text


def test_refiner_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="seconds"):
        MeasuredRefiner(seconds=0)
    with pytest.raises(ValueError, match="MeasuredRefiner.draws is 0"):
        MeasuredRefiner(draws=0)
    with pytest.raises(ValueError, match="MeasuredRefiner.pairs is -1"):
        MeasuredRefiner(pairs=-1)
    with pytest.raises(ValueError, match="MeasuredRefiner.checks is -1"):
        MeasuredRefiner(checks=-1)
    for false_keep in (0.0, 1.0):
        with pytest.raises(ValueError, match="MeasuredRefiner.false_keep"):
            MeasuredRefiner(false_keep=false_keep)
    with pytest.raises(ShardingError, match="PlanRefiner"):
        NeuroShardPlanner(Topology(world_size=2, compute_device="cpu"), refiner=object())


def test_a_devices_work_is_built_once_for_its_draws(monkeypatch) -> None:
    """The refiner's timer builds a device's work in a plan once for every draw it times it
    on (a build takes seconds at 107 tables a device), and the move's other plan beside it."""
    task, model = small_task(2), load_pretrained("cpu")
    plan = search(task, model).plan
    built: list[int] = []

    class Counted(refine.DeviceWork):
        def __init__(self, task, plan, device, on) -> None:
            built.append(device)
            super().__init__(task, plan, device, on)

    monkeypatch.setattr(refine, "DeviceWork", Counted)
    timer = MeasuredRefiner(rounds=1, repeats=1)._judge_timer(task, plan, torch.device("cpu"))
    built.clear()  # (the reference's work)
    moved = next(c for c, _ in refine_moves.one_move_away(task, plan, 0, [1], {}))
    for draw in (0, 1):
        assert set(timer(task, {"old": plan, "new": moved}, 0, draw)) == {"old", "new"}
    assert built == [0, 0]
    timer(task, {"new": moved}, 1, 0)
    timer(task, {"old": plan}, 0, 0)
    assert built == [0, 0, 1]


def test_a_move_predicted_to_pay_less_than_the_margin_is_not_tried() -> None:
    """The refiner keeps a move only when it pays by its margin, so a move its corrected
    model says pays less is not worth a timing: with a margin above every move's predicted
    gain, best_move offers none; with none, it offers one."""
    task, model = small_task(2), load_pretrained("cpu")
    plan = search(task, model).plan
    predicted = device_compute(model, task, plan)
    measured = predicted * np.asarray([1.2, 1.0])  # device 0 slowest: no move leaves less than the two devices' mean, about 0.88 of it
    assert best_move(model, task, plan, predicted, measured, 1, set(), margin=0.0) is not None
    assert best_move(model, task, plan, predicted, measured, 1, set(), margin=0.2) is None


def again_timer(timer, factors: tuple[float, ...]):
    """``timer`` on a machine where a work timed against itself on draw k reads ``factors[k]``
    of its first time."""

    def noisy(task: Task, plans: dict, device: int, draw: int) -> dict[str, float]:
        ms = timer(task, plans, device, draw)
        return {**ms, "again": ms["again"] * factors[draw]} if "again" in ms else ms

    return noisy


def test_the_margin_widens_where_the_machine_times_one_work_apart(caplog) -> None:
    """Device 0 against itself reads 1.1x and 1/1.1x on the two draws: a log-ratio noise of
    9.5%, at which a move that changes nothing passes both draws by 3% about 0.36^2 = 13% of
    the time; the margin widens to 7.0% (a null move then passes a draw 22% of the time,
    both 5%), so a move paying 6% on the slow device is not kept, though it was at 3%.
    On a machine that times one work alike the margin stays 3%."""
    task, plan = two_wide_tables()
    model, slow = load_pretrained("cpu"), weighted_dims_timer((1.0 / 0.94 * 2, 1.0))  # device 0 the slow one

    def pays_six_percent(task: Task, plans: dict, device: int, draw: int) -> dict[str, float]:
        """Whatever a move takes off device 0, the new plan there takes 0.94 of the plan's time."""
        before = slow(task, {"plan": plan}, device, draw)["plan"]
        return {n: 0.94 * before if n == "new" and device == 0 else ms for n, ms in slow(task, plans, device, draw).items()}

    with caplog.at_level(logging.INFO, logger="torchrec_neuroshard"):
        quiet = MeasuredRefiner(seconds=30, targets=1).refine_with(task, model, plan, again_timer(pays_six_percent, (1.0, 1.0)))
    assert "timing noise 0.0%, so a move must pay by 3.0% on each of 2 draws" in caplog.text and quiet != plan
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torchrec_neuroshard"):
        noisy = MeasuredRefiner(seconds=30, targets=1).refine_with(task, model, plan, again_timer(pays_six_percent, (1.1, 1 / 1.1)))
    assert "against its own, 1.100/1.100/0.909/0.909: timing noise 9.5%, so a move must pay by 7.0%" in caplog.text
    assert noisy == plan and "source device slower on draw 0" in caplog.text


def test_on_a_noisy_machine_a_widened_margin_keeps_fewer_moves_that_change_nothing(caplog) -> None:
    """Device 0 takes 200 ms whatever it holds, the others 50, and each timing scatters by
    10% (seeded): a move off device 0 that passes passes on noise alone. At a fixed 3% such
    moves are kept (7 of 44 tried); with the margin widened from the refiner's own timings
    of one work against itself and again, fewer are (1 of 36), and its noise ends near the
    14% of a ratio of two timings."""
    task, model = small_task(4), load_pretrained("cpu")
    plan = search(task, model).plan

    def kept(checks: int) -> tuple[int, int]:
        rng = np.random.default_rng(0)

        def null(task: Task, plans: dict, device: int, draw: int) -> dict[str, float]:
            return {n: (200.0 if device == 0 else 50.0) * float(np.exp(rng.normal(0.0, 0.1))) for n in plans}

        caplog.clear()
        with caplog.at_level(logging.INFO, logger="torchrec_neuroshard"):
            MeasuredRefiner(seconds=30, checks=checks).refine_with(task, model, plan, null)
        return caplog.text.count("; kept"), caplog.text.count("measured refinement: table ")

    (fixed, tried_fixed), (widened, tried_widened) = kept(0), kept(2)
    assert "so a move must pay by 8.5%" in caplog.text  # from the 4 timings against itself, then from every timing again
    end = re.search(r"after the moves: (\d+) timings .* timing noise ([\d.]+)%", caplog.text)
    assert end and int(end[1]) > 20 and 12 < float(end[2]) < 17  # a log ratio of two timings: 10% x sqrt(2)
    assert fixed > 0 and widened / tried_widened < fixed / tried_fixed, (fixed, tried_fixed, widened, tried_widened)
