"""The plan evaluator: the measured embedding cost of plans, the ground truth of benchmarks.

Compute is timed device by device on the local hardware (the others idle, as the
prototype's evaluator did): one fused TBE over the device's shards at the global batch,
plus a second kernel at the local batch for data-parallel tables. Communication is
measured on a real D-rank group: the forward all-to-all entered with each device's
compute lateness as skew, the backward all-to-all, and the all-reduce of data-parallel
gradients. Several plans are measured interleaved (A B C A B C ...) so drift hits all alike.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import torch
from tqdm import tqdm

from torchrec_neuroshard.lab.launch import default_device, spawn
from torchrec_neuroshard.lab.measure_comm import measure_allreduce, measure_comm
from torchrec_neuroshard.lab.measure_compute import Lookups, Timing, measure_compute
from torchrec_neuroshard.types import DeviceCost, Plan, Shard, Task
from torchrec_neuroshard.lab.workloads import lookups_for

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan


@dataclass(frozen=True)
class PlanMeasurement:
    """Measured cost of one plan: per-device medians over rounds, and the embedding cost."""

    devices: tuple[DeviceCost, ...]
    cost_ms: float
    """max over devices of fwd/bwd compute + fwd/bwd comm (medians), ms."""
    round_costs_ms: tuple[float, ...]
    """the embedding cost of each round, for the spread."""

    @property
    def spread_ms(self) -> float:
        """Interquartile range of the per-round embedding cost."""
        return Timing.of(self.round_costs_ms).iqr_ms


def task_lookups(task: Task, seed: int = 0) -> dict[str, Lookups]:
    """Synthetic bags for every table of a task, reproducing each table's statistics."""
    return {t.name: lookups_for(t, task.batch_size, seed + i) for i, t in enumerate(task.tables)}


def _as_plan(plan: Plan | ShardingPlan, task: Task) -> Plan:
    if not isinstance(plan, Plan):  # a TorchRec ShardingPlan: torchrec is only needed here
        from torchrec_neuroshard.sharding import from_torchrec

        plan = from_torchrec(plan, task.num_devices)
    plan.validate(task)
    return plan


def _local_lookups(lookups: Lookups, local_batch: int) -> Lookups:
    indices, offsets = lookups
    off = offsets[: local_batch + 1]
    return indices[: int(off[-1])], off


def _measure_compute_round(
    task: Task, plan: Plan, lookups: Mapping[str, Lookups], device: torch.device, warmup: int, repeats: int
) -> list[tuple[float, float]]:
    dp = [t for t in task.tables if t.name in plan.data_parallel]
    local_batch = task.batch_size // task.num_devices
    dp_lookups = {t.name: _local_lookups(lookups[t.name], local_batch) for t in dp}
    out = []
    for shards in plan.device_shards(task.tables):
        m = measure_compute(shards, lookups, device, warmup, repeats)
        fwd, bwd = m.fwd.median_ms, m.bwd.median_ms
        if dp:
            r = measure_compute([Shard(t, t.dim) for t in dp], dp_lookups, device, warmup, repeats)
            fwd, bwd = fwd + r.fwd.median_ms, bwd + r.bwd.median_ms
        out.append((fwd, bwd))
    return out


def _comm_worker(
    rank: int, world_size: int, jobs: list[tuple[list[int], list[float], int]], batch_size: int
) -> list[tuple[tuple[float, ...], tuple[float, ...], float]]:
    """Rank body: every (dims, skews, data-parallel floats) job, in order."""
    device = default_device(rank)
    results = []
    for dims, skews, dp_numel in jobs:
        m = measure_comm(dims, skews, batch_size, device)
        allreduce = measure_allreduce(dp_numel, device) if dp_numel else 0.0
        results.append((m.fwd_ms, m.bwd_ms, allreduce))
    return results


def evaluate_plans(
    task: Task,
    plans: Sequence[Plan | ShardingPlan],
    rounds: int = 3,
    device: torch.device | None = None,
    lookups: Mapping[str, Lookups] | None = None,
    warmup: int = 3,
    repeats: int = 7,
    progress: bool = False,
) -> list[PlanMeasurement]:
    """Measure every plan ``rounds`` times, interleaved; per-plan medians over rounds.

    Args:
        plans: our ``Plan``s or TorchRec ``ShardingPlan``s (table_wise, column_wise,
            table_column_wise, data_parallel), each validated against the task first.
        lookups: each table's bags; default ``task_lookups(task)``.
    """
    device = device or default_device()
    ours = [_as_plan(p, task) for p in plans]
    lookups = lookups or task_lookups(task)
    compute: list[list[list[tuple[float, float]]]] = [[] for _ in ours]
    for _ in tqdm(range(rounds), desc="compute rounds", disable=not progress):
        for k, plan in enumerate(ours):
            compute[k].append(_measure_compute_round(task, plan, lookups, device, warmup, repeats))
    jobs = []
    for r in range(rounds):
        for k, plan in enumerate(ours):
            c = compute[k][r]
            earliest = min(f for f, _ in c)
            dp_numel = sum(t.rows * t.dim for t in task.tables if t.name in plan.data_parallel)
            jobs.append((plan.device_dims(), [f - earliest for f, _ in c], dp_numel))
    if task.num_devices > 1:
        comm = spawn(_comm_worker, task.num_devices, jobs, task.batch_size)[0]
    else:
        comm = [((0.0,), (0.0,), 0.0)] * len(jobs)
    out = []
    for k in range(len(ours)):
        per_round = []
        for r in range(rounds):
            fwd_c, bwd_c, allreduce = comm[r * len(ours) + k]
            per_round.append(
                [
                    DeviceCost(cf, cb, ff, fb + allreduce)
                    for (cf, cb), ff, fb in zip(compute[k][r], fwd_c, bwd_c)
                ]
            )
        devices = tuple(
            DeviceCost(*(statistics.median(getattr(pr[d], f) for pr in per_round) for f in ("fwd_compute", "bwd_compute", "fwd_comm", "bwd_comm")))
            for d in range(task.num_devices)
        )
        out.append(
            PlanMeasurement(
                devices=devices,
                cost_ms=max(d.total for d in devices),
                round_costs_ms=tuple(max(d.total for d in pr) for pr in per_round),
            )
        )
    return out


def evaluate_plan(task: Task, plan: Plan | ShardingPlan, **kwargs: object) -> PlanMeasurement:
    """``evaluate_plans`` for one plan."""
    return evaluate_plans(task, [plan], **kwargs)[0]  # type: ignore[arg-type]


def format_breakdown(m: PlanMeasurement, title: str = "") -> str:
    """A per-device table of the measured costs (ms)."""
    lines = [title] if title else []
    lines.append("device  fwd_comp  bwd_comp  fwd_comm  bwd_comm    total")
    for d, c in enumerate(m.devices):
        lines.append(
            f"{d:>6}  {c.fwd_compute:8.2f}  {c.bwd_compute:8.2f}  {c.fwd_comm:8.2f}  {c.bwd_comm:8.2f}  {c.total:7.2f}"
        )
    lines.append(f"embedding cost {m.cost_ms:.2f} ms (IQR over rounds {m.spread_ms:.2f} ms)")
    return "\n".join(lines)
