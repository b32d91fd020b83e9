"""The judge of plans: each device of every plan timed on this machine (its CPU, or one GPU)
as DMP runs it, one device at a time, so that plans for many devices are compared on one.

A device's work in a plan: one fused TBE per sharding kind (its column shards over the
global batch, its row blocks over their own rows' indices) and the plan's data-parallel
tables as DMP runs them (the dense TBE over the device's local batch, backward to the
whole-table gradient, and its SGD update). The protocol, for a noisy machine (issue 43):

- devices are visited in ``passes`` passes, each in the opposite order to the one before,
  so the machine's drift over a pass falls on opposite devices;
- at a device every plan's kernels are built once, then for each of ``draws`` draws of
  ids (other batches of the same tables, ``workloads.sample_lookups``) ``rounds`` rounds
  time every plan's device once each (one untimed step, then the median of ``repeats``
  timed ones), the plans' order rotated from round to round;
- what a plan's place in that order brings (which work is built first, which it follows)
  is drawn anew at every device and draw (``JudgeConfig.order``: two copies of one plan
  built first and sixth read 2-3% apart under a fixed order, research log);
- with ``reference`` on, one fixed piece of work (the first plan's device 0 on the first
  draw) is timed in every round beside the plans: the machine's speed at that moment,
  which ``judgement.Judged.steadied`` divides out of the plans' times;
- with ``copy`` on, the first plan's work is built a second time and timed as one more
  plan: the run's A/A check (``copy_check``), since two copies of one plan differ only by
  the judge's own error;
- a unit is one (pass, draw, round): ``judgement`` reads the rows into each plan's compute
  and ratios with their intervals;
- a final round (``lab.final_round``) may then time each plan's slowest devices side by
  side, where plans whose slowest devices differ are compared within one visit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from torchrec_neuroshard.lab.evaluate import _local_lookups, device_kernel, group_shards, lookup_groups, on_kernels
from torchrec_neuroshard.lab.measure_compute import Lookups, Step, build_kernel, dense_kernel, fused_step, replicated_step, time_forward_backward
from torchrec_neuroshard.types import Plan, Task

CPU = torch.device("cpu")
REFERENCE = "_reference"
"""The rows of the reference work (``JudgeConfig.reference``), beside the plans'."""
COPY = "_copy"
"""The rows of the first plan's second copy (``JudgeConfig.copy``), beside the plans'."""
FINAL = "final"
"""The ``stage`` of the final round's rows (``lab.final_round``), beside the passes' rows."""


@dataclass(frozen=True)
class JudgeConfig:
    """How many passes over the devices, draws of ids, rounds per draw and timed steps per
    round, whether a fixed reference is timed in every round (rows named ``REFERENCE``), the
    first draw of ids (``first_draw``: the draws are ``first_draw`` on, a row's ``draw``
    counts from it, so that a plan chosen by timing some draws is judged on others), and
    whether the first plan is timed twice, as built twice (rows of the copy named ``COPY``),
    and the order plans are built and timed in at a device (``round_orders``): "shuffled",
    or "rotated" (every run before 2026-12-03; rows without ``order`` read as it)."""

    passes: int = 2
    draws: int = 2
    rounds: int = 3
    repeats: int = 3
    reference: bool = False
    first_draw: int = 0
    copy: bool = False
    order: str = "shuffled"

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"JudgeConfig.order is {self.order!r}: choose one of {', '.join(ORDERS)}")
        for name in ("passes", "draws", "rounds", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"JudgeConfig.{name} is {getattr(self, name)}: give at least 1")
        if self.first_draw < 0:
            raise ValueError(f"JudgeConfig.first_draw is {self.first_draw}: give a draw index of 0 or more")

    @staticmethod
    def of(row: dict) -> "JudgeConfig":
        """The configuration a judge's row was timed by (rows before ``reference``,
        ``first_draw`` and ``copy``: without a reference, from draw 0, without a copy)."""
        return JudgeConfig(
            row["passes"], row["draws"], row["rounds"], row["repeats"], row.get("reference", False), row.get("first_draw", 0),
            row.get("copy", False), row.get("order", "rotated"),
        )  # fmt: skip

    @property
    def units(self) -> int:
        return self.passes * self.draws * self.rounds


ORDERS = ("shuffled", "rotated")


def round_orders(names: Sequence[str], visit: int, draw: int, rounds: int, order: str) -> list[list[str]]:
    """The order each of ``rounds`` rounds of one draw times ``names`` in, at the ``visit``-th
    device visited. "rotated": round r starts at name (visit + r) mod n, so every name always
    follows the same one. "shuffled": a permutation drawn for (visit, draw), rotated by one a
    round: each name takes each place once in n rounds and follows a name drawn anew."""
    names = list(names)
    if order == "shuffled":
        names = [names[i] for i in np.random.default_rng([2, visit, draw]).permutation(len(names))]
        visit = 0
    return [names[(visit + r) % len(names) :] + names[: (visit + r) % len(names)] for r in range(rounds)]


def build_order(names: Sequence[str], visit: int, order: str) -> list[str]:
    """The order the plans' work is built in at the ``visit``-th device visited: as given
    ("rotated"), or a permutation drawn for the visit ("shuffled")."""
    if order == "rotated":
        return list(names)
    return [names[i] for i in np.random.default_rng([1, visit]).permutation(len(names))]


def device_order(num_devices: int, pass_index: int) -> list[int]:
    """The devices of a pass: ascending in even passes, descending in odd ones."""
    order = list(range(num_devices))
    return order if pass_index % 2 == 0 else order[::-1]


class DeviceWork:
    """What one device runs in one plan, built once on ``on`` (a CPU, or a GPU where each
    shard sits where its table's kernel keeps it: ``build_kernel``): its fused kernels and
    its replicas."""

    def __init__(self, task: Task, plan: Plan, device: int, on: torch.device = CPU) -> None:
        self.task, self.device, self.on = on_kernels(task, plan), device, on
        groups, (replicated,) = lookup_groups(self.task, plan, [[t.name for t in task.tables]])
        self.groups = [g for g in groups if g.shards[device]]
        self.kernels = [build_kernel(group_shards(self.task, g, device), on) for g in self.groups]
        self.replicas = [self.task.table(n) for n in replicated]
        self.dense = dense_kernel(self.replicas, on) if self.replicas else None

    def steps(self, lookups: Mapping[str, Lookups]) -> tuple[list[Step], list[Step]]:
        """(the fused kernels' steps, the replicas' step) on one draw's bags."""
        fused = []
        for group, kernel in zip(self.groups, self.kernels):
            shards, bags = device_kernel(self.task, group, self.device, lookups)
            fused.append(fused_step(kernel, shards, bags, self.on))
        if self.dense is None:
            return fused, []
        local = {t.name: _local_lookups(lookups[t.name], self.device, self.task.per_rank_batch) for t in self.replicas}
        return fused, [replicated_step(self.dense, self.replicas, local, self.on)]


def time_steps(steps: Sequence[Step], repeats: int, on: torch.device) -> float:
    """ms of one round of ``steps``: each one untimed, then the median of ``repeats``, summed."""
    return sum(time_forward_backward(*s, on, 1, repeats).total_ms for s in steps)


def resident_sets(task: Task, plans: Mapping[str, Plan], device: int, memory_bytes: float | None) -> list[list[str]]:
    """The plans in sets whose work on ``device`` fits ``memory_bytes`` together (as TorchRec
    counts a device's bytes, ``Plan.device_memory``), in order; one set when None."""
    if memory_bytes is None:
        return [list(plans)]
    sets: list[list[str]] = []
    used = memory_bytes
    for name, plan in plans.items():
        need = plan.device_memory(on_kernels(task, plan).tables, task.batch_size)[device]
        if used + need > memory_bytes:
            sets.append([])
            used = 0
        sets[-1].append(name)
        used += need
    return sets


def time_device(
    task: Task,
    plans: Mapping[str, Plan],
    device: int,
    draws: Sequence[Mapping[str, Lookups]],
    config: JudgeConfig,
    rotation: int = 0,
    on: torch.device = CPU,
    memory_bytes: float | None = None,
    reference: Sequence[Step] = (),
) -> list[dict]:
    """Every plan's work on ``device`` in ``config.rounds`` interleaved rounds per draw:
    a row per (draw, plan) with the fused kernels' and the replicas' ms of each round, and
    one per draw of ``reference``'s steps (named ``REFERENCE``) timed among them when given.
    Plans are built together as ``resident_sets`` allows, interleaved within a set (the
    rows' ``set``); a set the GPU runs out of memory for is timed again plan by plan."""
    rows: list[dict] = []
    sets = resident_sets(task, plans, device, memory_bytes)
    while sets:
        names = sets.pop(0)
        try:
            rows += _time_set(task, {n: plans[n] for n in names}, device, draws, config, rotation, on, len(rows), reference)
        except torch.cuda.OutOfMemoryError:
            if len(names) == 1:
                raise
            sets[:0] = [[n] for n in names]
        finally:
            if on.type == "cuda":
                torch.cuda.empty_cache()  # the next set's kernels get the memory this one held
    return rows


def _time_set(
    task: Task,
    plans: Mapping[str, Plan],
    device: int,
    draws: Sequence[Mapping[str, Lookups]],
    config: JudgeConfig,
    rotation: int,
    on: torch.device,
    set_id: int,
    reference: Sequence[Step],
) -> list[dict]:
    """``time_device``'s rounds over one set of plans built together, in ``build_order``."""
    built = {name: DeviceWork(task, plans[name], device, on) for name in build_order(list(plans), rotation, config.order)}
    return time_works({name: built[name] for name in plans}, device, draws, config, rotation, on, set_id, reference)


def time_works(
    work: Mapping[str, DeviceWork],
    device: int,
    draws: Sequence[Mapping[str, Lookups]],
    config: JudgeConfig,
    rotation: int = 0,
    on: torch.device = CPU,
    set_id: int = 0,
    reference: Sequence[Step] = (),
) -> list[dict]:
    """``time_device``'s rounds over plans' work on ``device`` already built on ``on``
    (``DeviceWork``), rows as there; ``rotation`` is the visit's index (``round_orders``)."""
    names, rows = list(work) + ([REFERENCE] if reference else []), []
    for draw, lookups in enumerate(draws):
        steps = {name: work[name].steps(lookups) for name in build_order(list(work), rotation, config.order)}
        steps |= {REFERENCE: (list(reference), [])} if reference else {}
        fused: dict[str, list[float]] = {n: [] for n in names}
        replicas: dict[str, list[float]] = {n: [] for n in names}
        for in_order in round_orders(names, rotation, draw, config.rounds, config.order):
            for name in in_order:
                fused[name].append(round(time_steps(steps[name][0], config.repeats, on), 4))
                replicas[name].append(round(time_steps(steps[name][1], config.repeats, on), 4))
        rows += [{"device": device, "draw": draw, "planner": n, "fused_ms": fused[n], "replicas_ms": replicas[n], "set": set_id} for n in names]
    return rows


def _reference(task: Task, plans: Mapping[str, Plan], lookups: Mapping[str, Lookups], on: torch.device, memory_bytes: float | None) -> list[Step]:
    """``JudgeConfig.reference``'s work: the first plan's fused kernels on device 0, on ``lookups``."""
    first = next(iter(plans))
    if REFERENCE in plans:
        raise ValueError(f"JudgeConfig.reference: a plan is named {REFERENCE!r}, the reference's rows; rename the plan")
    if memory_bytes is not None:
        raise ValueError(f"JudgeConfig.reference with memory_bytes={memory_bytes}: plans timed in resident sets would each need their own reference; judge without it")
    steps = DeviceWork(task, plans[first], 0, on).steps(lookups)[0]
    if not steps:
        raise ValueError(f"JudgeConfig.reference: the first plan ({first}) has no fused kernel on device 0 to time as the reference; put another plan first")
    return steps


def judge_plans(
    task: Task,
    plans: Mapping[str, Plan],
    draws: Sequence[Mapping[str, Lookups]],
    config: JudgeConfig,
    done: Iterable[tuple[int, int]] = (),
    append: Callable[[list[dict]], None] = lambda rows: None,
    progress: Callable[[Iterable], Iterable] = lambda it: it,
    on: torch.device = CPU,
    memory_bytes: float | None = None,
    devices: Sequence[int] | None = None,
) -> list[dict]:
    """Time every device of ``plans`` (or of ``devices``, a subset) by the protocol on ``on``;
    each device's rows (with their ``pass``) go to ``append`` as measured, a (pass, device)
    in ``done`` is skipped; ``progress`` may stop early (a budget). Returns the rows measured here."""
    if len(draws) != config.draws:
        raise ValueError(f"{len(draws)} draws of ids given for a JudgeConfig of {config.draws}")
    plans = with_copy(plans) if config.copy else plans
    skip, out = set(done), []
    reference = _reference(task, plans, draws[0], on, memory_bytes) if config.reference else ()
    wanted = set(range(task.num_devices) if devices is None else devices)
    visits = [(p, d) for p in range(config.passes) for d in device_order(task.num_devices, p) if d in wanted]
    for k, (p, d) in enumerate(progress(visits)):
        if (p, d) in skip:
            continue
        rows = [{**row, "pass": p} for row in time_device(task, plans, d, draws, config, k, on, memory_bytes, reference)]
        append(rows)
        out += rows
    return out


def with_copy(plans: Mapping[str, Plan]) -> dict[str, Plan]:
    """``plans`` and, after them, the first one again as ``COPY`` (``JudgeConfig.copy``)."""
    if COPY in plans:
        raise ValueError(f"JudgeConfig.copy: a plan is named {COPY!r}, the copy's rows; rename the plan")
    return {**plans, COPY: next(iter(plans.values()))}
