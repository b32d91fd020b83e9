"""Measured refinement at plan time (issue 43, item 4): the search's plan timed device by
device on the machine that plans it, and shards moved off the slowest measured device
while the measurement says the move pays.

``MeasuredRefiner`` is what ``NeuroShardPlanner(refiner=...)`` takes (its ``PlanRefiner``):

1. Every device of the plan is timed as the judge times it (``judge.time_works``: its
   fused kernels and replicas, one untimed step, the median of ``repeats``, ``rounds``
   rounds; a device's work is built once for its draws of ids); the planner's log gets each device's predicted and measured ms. With
   ``steady`` (the default) a fixed piece of work (the fused kernels of the first device of
   the plan as given that has any, on the first draw) is timed in every round too, and each time is divided
   by it (times its first median), as the judge's reference steadies a run: devices timed
   minutes apart are then compared at one machine speed, not at the speed of their minute.
2. The slowest measured device's work is timed against itself ``checks`` times on each
   draw (the two copies interleaved, as a move's old and new plan are). The spread of
   those ratios, and of a work timed again later (a move times its old plan on its source
   device once more), is the machine's timing noise (``_Noise``); where a move that
   changes nothing would pass every draw more often than ``false_keep`` at ``margin``,
   the margin is widened until it would not (logged at the start and the end). On a quiet
   machine (noise of a few percent) ``margin`` stands.
3. Each device's measured / predicted ratio corrects the model for that device. Of the
   moves off the slowest measured device to one of the ``targets`` least-measured ones
   (``refine_moves``: a table-wise or column shard moved whole; where the table's
   ``choices`` allow columns that narrow, a half or a quarter of its widest shard there
   moved; two shards moved whole; or one moved whole in exchange for one of the
   target's), the one whose
   corrected prediction leaves the two devices least, where that beats the slowest by
   the margin, is tried (where none does, the moves to every other device are looked at),
   draw of ids by draw: the old and the new plan's work on the slow device timed
   interleaved, round by round, then (where the new plan pays there) the new plan's on the
   target. It is kept when on every one of ``draws`` draws the slower of the two new
   devices beats the old slowest by the margin (one draw's ids move a device's time by up
   to 20%, more than the margin), so the first timing it fails ends the move's. A
   move not kept is not tried again, nor is a kept one undone: no table moves
   back to a device it left, directly or round a cycle of devices. The devices timed
   keep their newer measurement.
4. Until no move is predicted to pay by the margin, or ``seconds`` (or the planner's ``timeout_seconds``)
   run out; a budget that ends before every device was timed leaves the plan as it was.

It measures where the kernels run here: a CPU topology on this CPU, a cuda one where torch
sees a GPU. Planning for GPUs on a machine without one, it says so and returns the plan.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from statistics import NormalDist
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from torchrec_neuroshard.lab.evaluate import task_lookups
from torchrec_neuroshard.lab.judge import REFERENCE, DeviceWork, JudgeConfig, time_works
from torchrec_neuroshard.lab.judgement import rank_correlation
from torchrec_neuroshard.lab.refine_moves import PAIRS, Move, best_move, device_compute
from torchrec_neuroshard.types import CostModel, Plan, ShardingKind, TableChoices, Task

logger = logging.getLogger("torchrec_neuroshard")

Timer = Callable[[Task, Mapping[str, Plan], int, int], dict[str, float]]
"""(task, plans, device, draw) -> ms of each plan's work on that device on that draw of
ids, the plans timed interleaved."""


@dataclass(frozen=True)
class MeasuredRefiner:
    """Moves shards off the slowest measured device while measurement says it pays.

    Attributes:
        seconds: the most refinement may take (the planner's ``timeout_seconds`` also bounds it).
        draws: the draws of ids every device and move is timed on (a move must pay on each).
        rounds, repeats: the judge's rounds per draw and timed steps per round.
        targets: the least-measured devices a move may go to.
        margin: the least share by which a move's slower device must beat the old slowest
            (widened where the noise measured asks more: ``checks``, ``false_keep``).
        seed: the seed of the draws of ids.
        steady: every time steadied by a reference timed in the same rounds (see above).
        pairs: the moves of two tables (two to one device, or an exchange) priced exactly
            each step, the best by their tables' marginal cost (``refine_moves.pairs_away``).
        checks: the timings of the slowest device against itself on each draw that begin
            to measure the machine's noise (``_Noise``; 0: the margin is never widened).
        false_keep: the most often a move that changes nothing may pass every draw, at the
            noise measured; the margin is widened to hold it.
    """

    seconds: float = 60.0
    draws: int = 2
    rounds: int = 2
    repeats: int = 3
    targets: int = 2
    margin: float = 0.03
    seed: int = 0
    steady: bool = True
    pairs: int = PAIRS
    checks: int = 2
    false_keep: float = 0.05

    def __post_init__(self) -> None:
        if not self.seconds > 0:
            raise ValueError(f"MeasuredRefiner.seconds is {self.seconds}: give a positive number of seconds")
        for name in ("draws", "rounds", "repeats", "targets"):
            if getattr(self, name) < 1:
                raise ValueError(f"MeasuredRefiner.{name} is {getattr(self, name)}: give at least 1")
        for name, none in (("pairs", "no two-table moves"), ("checks", "the margin never widened")):
            if getattr(self, name) < 0:
                raise ValueError(f"MeasuredRefiner.{name} is {getattr(self, name)}: give 0 ({none}) or more")
        if not 0 < self.false_keep < 1:
            raise ValueError(f"MeasuredRefiner.false_keep is {self.false_keep}: give a probability in (0, 1), such as 0.05")
        if not 0 <= self.margin < 1:
            raise ValueError(f"MeasuredRefiner.margin is {self.margin}: give a share in [0, 1)")

    def refine(
        self, task: Task, model: CostModel, plan: Plan, compute_device: str, deadline: float | None = None,
        choices: Mapping[str, TableChoices] | None = None,
    ) -> Plan:
        """``plan`` refined on this machine's measurement (see the module docstring), or
        ``plan`` itself where its kernels cannot run here; ``choices``: per table, what a
        move may do (absent: what ``TableChoices()`` allows, as the search takes them)."""
        on = _where(compute_device)
        if on is None:
            logger.warning(
                "measured refinement: the plan is for %s devices and this machine has none to time its kernels on; "
                "the search's plan, unrefined", compute_device,
            )  # fmt: skip
            return plan
        stop = _stop(self.seconds, deadline)  # (the draw of ids counts too)
        return self.refine_with(task, model, plan, self._judge_timer(task, plan, on), stop, choices)

    def refine_with(
        self, task: Task, model: CostModel, plan: Plan, timer: Timer, deadline: float | None = None,
        choices: Mapping[str, TableChoices] | None = None,
    ) -> Plan:
        """``refine`` with the devices timed by ``timer``."""
        stop, noise = _stop(self.seconds, deadline), _Noise(self)
        measured = self._measure(task, plan, timer, stop, noise)  # [D]
        if measured is None:
            logger.warning("measured refinement: the budget ran out before every device was timed; the search's plan, unrefined")
            return plan
        predicted = device_compute(model, task, plan)  # [D]
        _log_devices(predicted, measured, "before")
        self._against_itself(task, plan, timer, int(np.argmax(measured)), stop, noise)
        tried: set[Move] = set()
        barred: set[tuple[str, int]] = set()  # (table, device): a kept move took the table off it, never to return
        kept = 0
        while time.perf_counter() < stop:
            margin = noise.margin()
            move = self._next_move(task, model, plan, predicted, measured, tried, choices or {}, barred, margin)
            if move is None:
                break
            candidate, m = move
            tried.add(m)
            old, new, target, why = self._time_move(task, plan, candidate, timer, m, stop, margin)
            logger.info(
                "measured refinement: table %s, %d of its %d columns, from device %d to %d%s: %s and %s ms against %s ms "
                "(by draw); %s", m.table, m.columns, task.table(m.table).dim, m.source, m.target,
                m.describe(), _ms(new), _ms(target), _ms(old), f"not kept ({why})" if why else "kept",
            )  # fmt: skip
            noise.timed(kept, m.source, old)
            measured[m.source] = np.mean(old if why else new)  # the newer measurement
            if not why:
                plan, kept = candidate, kept + 1
                predicted = device_compute(model, task, plan)
                measured[m.target] = np.mean(target)
                noise.timed(kept, m.source, new)
                noise.timed(kept, m.target, target)
                barred.update(m.leaves())  # not undone, directly or round a cycle of devices
        _log_devices(predicted, measured, f"after {kept} measured moves ({len(tried)} tried)")
        noise.log("after the moves")
        return plan

    def _measure(self, task: Task, plan: Plan, timer: Timer, stop: float, noise: _Noise) -> np.ndarray | None:
        """Every device's mean ms over the draws (None: the budget ran out first)."""
        measured = np.zeros(task.num_devices)  # [D]
        for d in range(task.num_devices):
            if time.perf_counter() >= stop:
                return None
            by_draw = [timer(task, {"plan": plan}, d, k)["plan"] for k in range(self.draws)]
            noise.timed(0, d, by_draw)
            measured[d] = np.mean(by_draw)
        return measured

    def _against_itself(self, task: Task, plan: Plan, timer: Timer, device: int, stop: float, noise: _Noise) -> None:
        """``device``'s work timed against itself ``checks`` times on each draw, into ``noise``."""
        for k in [k for k in range(self.draws) for _ in range(self.checks)]:
            if time.perf_counter() >= stop:
                break
            ms = timer(task, {"plan": plan, "again": plan}, device, k)
            noise.against_itself(ms["plan"], ms["again"])
        noise.log(f"device {device} timed against itself")

    def _next_move(
        self, task: Task, model: CostModel, plan: Plan, predicted: np.ndarray, measured: np.ndarray, tried: set[Move],
        choices: Mapping[str, TableChoices], barred: set[tuple[str, int]], margin: float,
    ) -> tuple[Plan, Move] | None:
        """``best_move`` to one of the ``targets`` least-measured devices or, where none is
        predicted to pay by ``margin``, to any device."""
        for targets in dict.fromkeys((self.targets, task.num_devices - 1)):
            move = best_move(model, task, plan, predicted, measured, targets, tried, choices, barred, margin, self.pairs)
            if move is not None:
                return move
        return None

    def _time_move(
        self, task: Task, plan: Plan, candidate: Plan, timer: Timer, move: Move, stop: float, margin: float
    ) -> tuple[list[float], list[float], list[float], str]:
        """ms by draw of the old and the new plan on ``move``'s source and of the new one on
        its target, and why the move does not pay by ``margin`` ("" where it does): timed
        draw by draw, the source device first, until a timing says it does not."""
        old, new, target, slow, fast = [], [], [], move.source, move.target
        for k in range(self.draws):
            if k and time.perf_counter() >= stop:
                return old, new, target, f"the budget ran out after {k} of {self.draws} draws"
            on_slow = timer(task, {"old": plan, "new": candidate}, slow, k)
            old.append(on_slow["old"])
            new.append(on_slow["new"])
            if not new[-1] < old[-1] * (1 - margin):  # the target need not be timed
                return old, new, target, f"the source device slower on draw {k}"
            target.append(timer(task, {"new": candidate}, fast, k)["new"])
            if not target[-1] < old[-1] * (1 - margin):
                return old, new, target, f"the target device slower on draw {k}"
        return old, new, target, ""

    def _judge_timer(self, task: Task, plan: Plan, on: torch.device) -> Timer:
        draws = [task_lookups(task, seed=self.seed, draw=k) for k in range(self.draws)]
        config = JudgeConfig(passes=1, draws=1, rounds=self.rounds, repeats=self.repeats)
        reference = _reference(task, plan, draws[0], on) if self.steady else ()
        level: list[float] = []  # the reference's first median: every time is steadied to it
        built = _BuiltWork(task, on)
        calls = itertools.count()  # each timing's order drawn anew (judge.round_orders)

        def timer(task: Task, plans: Mapping[str, Plan], device: int, draw: int) -> dict[str, float]:
            work = {name: built(plan, device) for name, plan in plans.items()}
            rows = time_works(work, device, [draws[draw]], config, rotation=next(calls), on=on, reference=reference)  # a row per plan
            steadier = next((np.asarray(r["fused_ms"]) for r in rows if r["planner"] == REFERENCE), None)  # [rounds]
            if steadier is not None and not level:
                level.append(float(np.median(steadier)))
            ms = {}
            for r in (r for r in rows if r["planner"] != REFERENCE):
                rounds = np.add(r["fused_ms"], r["replicas_ms"])  # [rounds]
                ms[r["planner"]] = float(np.median(rounds if steadier is None else rounds / steadier * level[0]))
            missing = sorted(set(plans) - set(ms))
            if missing:
                raise RuntimeError(f"the judge returned no time on device {device}, draw {draw}, for plans {missing}")
            return ms

        return timer


class _Noise:
    """The machine's timing noise, read off one work timed twice: the slowest device timed
    against itself (``MeasuredRefiner.checks``), and a device's work timed again, draw by
    draw, by a later timing (a move's old plan on its source device, which the first pass
    or a kept move timed before). It is the log ratio's root mean square: the log of a
    work's time to its own has mean 0."""

    def __init__(self, refiner: MeasuredRefiner) -> None:
        self.refiner = refiner
        self.ratios: list[float] = []  # log ms of a work to its own earlier ms
        self.last: dict[tuple[int, int, int], float] = {}  # (kept moves, device, draw) -> the last ms of that work

    def against_itself(self, first_ms: float, again_ms: float) -> None:
        """One work timed twice in one timing, interleaved."""
        self.ratios.append(math.log(again_ms / first_ms))

    def timed(self, kept: int, device: int, by_draw: Sequence[float]) -> None:
        """The work on ``device`` after ``kept`` moves timed on draws 0, 1, ... (as far as given)."""
        for draw, ms in enumerate(by_draw):
            earlier = self.last.get((kept, device, draw))
            if earlier is not None:
                self.ratios.append(math.log(ms / earlier))
            self.last[kept, device, draw] = ms

    def level(self) -> float:
        return math.sqrt(np.mean(np.square(self.ratios))) if self.ratios else 0.0

    def margin(self) -> float:
        """The refiner's margin, or wider where at this noise a move that changes nothing
        would pass all its draws more often than ``false_keep`` (none: ``checks`` is 0)."""
        r = self.refiner
        if not r.checks:
            return r.margin
        # a null move passes a draw where its log ratio is below log(1 - margin): at most false_keep on all draws
        z = NormalDist().inv_cdf(1 - r.false_keep ** (1 / r.draws))
        return max(r.margin, 1 - math.exp(-z * self.level()))

    def log(self, when: str) -> None:
        r = self.refiner
        if not r.checks:
            return
        logger.log(
            logging.WARNING if self.margin() > r.margin else logging.INFO,
            "measured refinement, %s: %d timings of a work against its own, %s: timing noise %.1f%%, so a move must pay "
            "by %.1f%% on each of %d draws (margin %.1f%%, false_keep %.2f)", when, len(self.ratios),
            "/".join(f"{math.exp(x):.3f}" for x in self.ratios[:8]) + ("/..." if len(self.ratios) > 8 else ""),
            100 * self.level(), 100 * self.margin(), r.draws, 100 * r.margin, r.false_keep,
        )  # fmt: skip


class _BuiltWork:
    """A device's work in a plan (``judge.DeviceWork``), built once for the last ``size``
    (plan's shards there, device) asked for: a move's devices are timed draw by draw, and
    the plan it changes is the one the last timing built."""

    def __init__(self, task: Task, on: torch.device, size: int = 3) -> None:
        self.task, self.on, self.size = task, on, size
        self.built: OrderedDict[tuple, DeviceWork] = OrderedDict()

    def __call__(self, plan: Plan, device: int) -> DeviceWork:
        key = (device, tuple(p for p in plan.placements if device in p.devices or p.kind is ShardingKind.DATA_PARALLEL))
        if key not in self.built:
            while len(self.built) >= self.size:
                self.built.popitem(last=False)  # (its memory goes before the new work takes its own)
            self.built[key] = DeviceWork(self.task, plan, device, self.on)
        self.built.move_to_end(key)
        return self.built[key]


def _reference(task: Task, plan: Plan, lookups: Mapping, on: torch.device) -> list:
    """The steadying reference's steps: the fused kernels of ``plan``'s first device that
    has any; none (timings unsteadied, and logged so) where no device has one."""
    for device in range(task.num_devices):
        steps = DeviceWork(task, plan, device, on).steps(lookups)[0]
        if steps:
            return steps
    logger.warning("measured refinement: the plan has no fused kernel to steady its timings by; timed unsteadied")
    return []


def _ms(by_draw: Sequence[float]) -> str:
    return "/".join(f"{x:.2f}" for x in by_draw)


def _stop(seconds: float, deadline: float | None) -> float:
    """The earlier of ``seconds`` from now and ``deadline``."""
    return time.perf_counter() + seconds if deadline is None else min(deadline, time.perf_counter() + seconds)


def _where(compute_device: str) -> torch.device | None:
    """Where the plan's kernels run on this machine: its CPU for a CPU plan, a GPU for a cuda one (None: none here)."""
    if compute_device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda") if compute_device == "cuda" and torch.cuda.is_available() else None


def _log_devices(predicted: np.ndarray, measured: np.ndarray, when: str) -> None:
    logger.info(
        "measured refinement, %s: slowest device measured %.2f ms (predicted %.2f); predicted / measured rank "
        "correlation %.2f over %d devices", when, measured.max(), predicted[int(np.argmax(measured))],
        rank_correlation(predicted.tolist(), measured.tolist()) if len(measured) > 1 else 1.0, len(measured),
    )  # fmt: skip
    for d, (p, m) in enumerate(zip(predicted, measured)):
        logger.info("measured refinement, %s: device %d predicted %.2f ms, measured %.2f ms", when, d, p, m)
