"""The plan evaluator: the measured embedding cost of plans, the ground truth of benchmarks.

It emulates one sharded training step of a D-device cluster on this machine, pricing what
DistributedModelParallel does per rank (``lab.dmp_measure`` measures the real step;
``benchmarks/validate_evaluator.py`` compares the two):

- Compute, timed device by device with the others idle (as the prototype's evaluator
  did): one fused TBE (EXACT_SGD) per lookup group a rank runs. TorchRec gives every
  sharding type of every EmbeddingBagCollection its own lookup module, so a rank holding
  table-wise and column-wise shards runs two kernels. Table and column shards see the
  global batch (a column shard reads every index of its table).
- Data-parallel tables as DMP runs them: FBGEMM's dense TBE at the local batch on every
  rank, a dense gradient, the SGD update of the whole table, and the gradient all-reduce.
- Communication on a real D-rank group (gloo on CPU, NCCL on GPU), per lookup group:
  the input all-to-all of the KJT (a splits exchange, then int32 lengths and int64 indices;
  every column shard of a table receives all the table's indices), the pooled-embedding
  all-to-all forward, entered with each device's compute lateness as skew, and
  the gradient all-to-all backward.
- Row-wise shards (row_wise, table_row_wise) as TorchRec runs them: the KJT input is
  bucketised (rank j receives the indices that fall in its block of rows, and every
  bag's length), each block's kernel pools the global batch's bags over its rows, the
  partial sums are reduce-scattered forward (each rank gets its samples' sums) and the
  gradients all-gathered backward.

A device's cost: input comm + fwd compute + fwd comm + bwd comm + bwd compute (data-parallel
work included); the plan's cost is the max over devices. Several plans are measured
interleaved (A B C A B C ...) so drift hits all alike.

Still left out: the dense part of the model (the same for every plan), the overlap of
collectives with compute (async gloo/NCCL work runs beside the kernels in DMP; here they
are serialised), contention between ranks for cores or memory bandwidth (devices are timed
one at a time), DDP's bucketing of the all-reduce (one all-reduce here), and TorchRec's
per-module Python overheads (KJT permutes, splits, awaitables).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Collection, Mapping, Sequence

import torch
from tqdm import tqdm

from torchrec_neuroshard.lab.launch import default_device, spawn
from torchrec_neuroshard.lab.measure_comm import Exchange, measure_step_comm
from torchrec_neuroshard.lab.measure_compute import Draws, Lookups, Timing, measure_compute, measure_replicated_compute
from torchrec_neuroshard.lab.workloads import lookups_for
from torchrec_neuroshard.types import DeviceCost, Plan, Shard, ShardingKind, Task

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

INDEX_DTYPE = "int64"
LENGTHS_DTYPE = "int32"
"""TorchRec's KJT all-to-all sends each tensor in its own dtype: int64 indices, and
lengths as the data loader made them (int32 in TorchRec's datasets and in dmp_step)."""
SPLITS_PER_PEER = 2
"""Elements of the splits exchange each rank sends each peer before a KJT all-to-all
(the lengths and the values split)."""


@dataclass(frozen=True)
class PlanMeasurement:
    """Measured cost of one plan: per-device medians over rounds, and the embedding cost.

    ``DeviceCost.fwd_comm`` includes the input (KJT) all-to-all, ``input_comm_ms`` shows it
    alone; ``bwd_comm`` includes the data-parallel gradient all-reduce."""

    devices: tuple[DeviceCost, ...]
    cost_ms: float
    """max over devices of fwd/bwd compute + input/fwd/bwd comm (medians), ms."""
    round_costs_ms: tuple[float, ...]
    """the embedding cost of each round, for the spread."""
    input_comm_ms: tuple[float, ...] = ()

    @property
    def spread_ms(self) -> float:
        """Interquartile range of the per-round embedding cost."""
        return Timing.of(self.round_costs_ms).iqr_ms

    @staticmethod
    def of_rounds(
        compute: Sequence[Sequence[tuple[float, float]]], comm: Sequence[tuple[Sequence[float], Sequence[float], Sequence[float]]]
    ) -> "PlanMeasurement":
        """The measurement of R rounds of a plan on D devices: ``compute[r][d]`` the (forward,
        backward) kernel ms of device d in round r, ``comm[r]`` the (input, forward,
        backward) all-to-all ms of each device in round r; per-device medians over rounds."""
        per_round = [
            [DeviceCost(cf, cb, i + ff, fb) for (cf, cb), i, ff, fb in zip(round_compute, *round_comm)]
            for round_compute, round_comm in zip(compute, comm)
        ]  # [R][D]
        fields = ("fwd_compute", "bwd_compute", "fwd_comm", "bwd_comm")
        num_devices = len(compute[0])
        devices = tuple(
            DeviceCost(*(statistics.median(getattr(pr[d], f) for pr in per_round) for f in fields)) for d in range(num_devices)
        )
        return PlanMeasurement(
            devices=devices,
            cost_ms=max(d.total for d in devices),
            round_costs_ms=tuple(max(d.total for d in pr) for pr in per_round),
            input_comm_ms=tuple(statistics.median(inputs[d] for inputs, _, _ in comm) for d in range(num_devices)),
        )


def task_lookups(task: Task, seed: int = 0, draw: int = 0, workers: int = 1, only: Collection[str] | None = None) -> dict[str, Lookups]:
    """Synthetic bags for every table of a task (or those named in ``only``: the same bags),
    reproducing each table's statistics; ``draw`` > 0: another batch of the same tables
    (``workloads.sample_lookups``). ``workers`` threads sample tables side by side (numpy
    lets go of the GIL while it samples; the bags are the same): a full-size task's 887M ids
    take minutes on one."""
    from concurrent.futures import ThreadPoolExecutor

    chosen = [(i, t) for i, t in enumerate(task.tables) if only is None or t.name in only]
    with ThreadPoolExecutor(workers) as pool:
        bags = pool.map(lambda it: lookups_for(it[1], task.batch_size, seed + it[0], draw), chosen)
        return {t.name: b for (_, t), b in zip(chosen, bags)}


def on_kernels(task: Task, plan: Plan) -> Task:
    """``task`` with each table on its placement's compute kernel (``spec_of``): the
    kernels a device's TBE builds for it (``measure_compute.build_kernel``)."""
    return replace(task, tables=tuple(plan.placement(t.name).spec_of(t) for t in task.tables))


def _as_plan(plan: Plan | ShardingPlan, task: Task) -> Plan:
    if not isinstance(plan, Plan):  # a TorchRec ShardingPlan: torchrec is only needed here
        from torchrec_neuroshard.sharding import from_torchrec

        plan = from_torchrec(plan, task.num_devices)
    plan.validate(task)
    return plan


def _local_lookups(lookups: Lookups, rank: int, local_batch: int) -> Lookups:
    """Rank ``rank``'s slice of a global batch's bags."""
    indices, offsets = lookups
    off = offsets[rank * local_batch : (rank + 1) * local_batch + 1]
    return indices[int(off[0]) : int(off[-1])], off - off[0]


@dataclass(frozen=True)
class LookupGroup:
    """The shards of one sharding kind of one EBC: one lookup kernel per rank, one set of
    collectives. ``shards[d]`` lists device d's (table name, width, first row, rows):
    a column shard is (name, width, 0, all rows), a row block (name, dim, start, rows)."""

    kind: ShardingKind
    shards: tuple[tuple[tuple[str, int, int, int], ...], ...]


def lookup_groups(task: Task, plan: Plan, modules: Sequence[Sequence[str]]) -> tuple[list[LookupGroup], list[list[str]]]:
    """The plan's lookup groups, and the data-parallel tables of each module (EBC)."""
    groups, replicated = [], []
    for names in modules:
        replicated.append([n for n in names if plan.placement(n).kind is ShardingKind.DATA_PARALLEL])
        by_kind: dict[ShardingKind, list[list[tuple[str, int, int, int]]]] = {}
        for n in names:
            p, t = plan.placement(n), task.table(n)
            if p.kind is ShardingKind.DATA_PARALLEL:
                continue
            per_device = by_kind.setdefault(p.kind, [[] for _ in range(task.num_devices)])
            if p.kind.splits_columns:
                for w, d in zip(p.widths, p.devices):
                    per_device[d].append((n, w, 0, t.rows))
            else:
                for i, (r, d) in enumerate(zip(p.rows, p.devices)):
                    per_device[d].append((n, t.dim, sum(p.rows[:i]), r))
        groups += [LookupGroup(k, tuple(tuple(s) for s in per)) for k, per in by_kind.items()]
    return groups, replicated


def _row_block(lookups: Lookups, start: int, rows: int) -> Lookups:
    """The bags of a table restricted to rows [start, start + rows), renumbered from 0:
    what a row-wise shard's kernel looks up after bucketisation."""
    indices, offsets = lookups
    keep = (indices >= start) & (indices < start + rows)
    kept_before = torch.cat([torch.zeros(1, dtype=torch.int64, device=indices.device), torch.cumsum(keep.to(torch.int64), 0)])
    return indices[keep] - start, kept_before[offsets]


def group_shards(task: Task, group: LookupGroup, d: int) -> list[Shard]:
    """The shards of device ``d``'s fused kernel of ``group``."""
    return [Shard(task.table(n), w, rows) for n, w, _, rows in group.shards[d]]


def device_kernel(task: Task, group: LookupGroup, d: int, lookups: Mapping[str, Lookups]) -> tuple[list[Shard], Mapping[str, Lookups]]:
    """Device ``d``'s fused kernel of ``group``: its shards and the bags they read (a row
    block reads its own rows' indices; a rank holds one block of a table)."""
    shards = group_shards(task, group, d)
    if not group.kind.splits_rows:
        return shards, lookups
    return shards, {n: _row_block(lookups[n], start, rows) for n, _, start, rows in group.shards[d]}


def _in_rows(lookups: Lookups, rank: int, local: int, start: int, rows: int) -> int:
    """How many of rank ``rank``'s samples' indices fall in rows [start, start + rows)."""
    indices, offsets = lookups
    mine = indices[int(offsets[rank * local]) : int(offsets[(rank + 1) * local])]
    return int(((mine >= start) & (mine < start + rows)).sum())


def step_exchanges(
    task: Task, groups: Sequence[LookupGroup], replicated: Sequence[Sequence[str]], lookups: Mapping[str, Lookups]
) -> tuple[list[Exchange], list[Exchange], list[Exchange]]:
    """The collectives of one step: (input, forward, backward)."""
    world, local = task.num_devices, task.per_rank_batch
    sent = {  # indices of table t in rank r's samples
        name: [int(off[(r + 1) * local] - off[r * local]) for r in range(world)] for name, (_, off) in lookups.items()
    }
    input_, fwd, bwd = [], [], []
    for g in groups:
        lengths = [[local * len(g.shards[j]) for j in range(world)] for _ in range(world)]
        if g.kind.splits_columns:
            values = [[sum(sent[n][r] for n, *_ in g.shards[j]) for j in range(world)] for r in range(world)]
        else:  # bucketised: rank r sends rank j its samples' indices that fall in j's rows
            values = [
                [sum(_in_rows(lookups[n], r, local, start, rows) for n, _, start, rows in g.shards[j]) for j in range(world)]
                for r in range(world)
            ]
        input_ += [
            Exchange("all_to_all", tuple((SPLITS_PER_PEER,) * world for _ in range(world)), INDEX_DTYPE),
            Exchange("all_to_all", tuple(map(tuple, lengths)), LENGTHS_DTYPE),
            Exchange("all_to_all", tuple(map(tuple, values)), INDEX_DTYPE),
        ]
        if g.kind.splits_columns:
            pooled = [[local * sum(w for _, w, *_ in g.shards[r]) for _ in range(world)] for r in range(world)]
            fwd.append(Exchange("all_to_all", tuple(map(tuple, pooled))))
            bwd.append(Exchange("all_to_all", tuple(zip(*pooled))))
        else:  # every rank holds the global batch's partial sums of every row-wise table
            dims = {n: w for shards in g.shards for n, w, *_ in shards}
            chunks = ((local * sum(dims.values()),) * world,)
            fwd.append(Exchange("reduce_scatter", chunks))
            bwd.append(Exchange("all_gather", chunks))
    numel = sum(task.table(n).rows * task.table(n).dim for names in replicated for n in names)
    if numel:
        bwd.append(Exchange("all_reduce", ((numel,),)))
    return input_, fwd, bwd


def _measure_compute_round(
    task: Task,
    groups: Sequence[LookupGroup],
    replicated: Sequence[Sequence[str]],
    lookups: Mapping[str, Lookups] | Draws,
    device: torch.device,
    warmup: int,
    repeats: int,
) -> list[tuple[float, float]]:
    """(forward, backward) compute ms of every device; ``lookups`` several batches
    (``Draws``): each kernel runs them in turn (a UVM cache meets new batches)."""
    draws = [lookups] if isinstance(lookups, Mapping) else list(lookups)
    lookups, local_batch = draws[0], task.per_rank_batch
    fwd_dp = bwd_dp = 0.0
    for names in replicated:  # the same on every rank: time rank 0's samples
        tables = [task.table(n) for n in names]
        m = measure_replicated_compute(
            tables, {n: _local_lookups(lookups[n], 0, local_batch) for n in names}, device, warmup, repeats
        )
        fwd_dp, bwd_dp = fwd_dp + m.fwd.median_ms, bwd_dp + m.bwd.median_ms
    out = []
    for d in range(task.num_devices):
        fwd, bwd = fwd_dp, bwd_dp
        for g in groups:
            if g.shards[d]:
                kernels = [device_kernel(task, g, d, dr) for dr in draws]  # the same shards, each draw's bags
                m = measure_compute(kernels[0][0], [bags for _, bags in kernels], device, warmup, repeats)
                fwd, bwd = fwd + m.fwd.median_ms, bwd + m.bwd.median_ms
        out.append((fwd, bwd))
    return out


def _comm_worker(
    rank: int, world_size: int, jobs: list[tuple[list[Exchange], list[Exchange], list[Exchange], list[float]]]
) -> list[tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]]:
    """Rank body: every (input, forward, backward collectives, skews) job, in order."""
    device = default_device(rank)
    results = []
    for input_, fwd, bwd, skews in jobs:
        m = measure_step_comm(input_, fwd, bwd, skews, device)
        results.append((m.input_ms, m.fwd_ms, m.bwd_ms))
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
    modules: Sequence[Sequence[str]] | None = None,
) -> list[PlanMeasurement]:
    """Measure every plan ``rounds`` times, interleaved; per-plan medians over rounds.

    Args:
        plans: our ``Plan``s or TorchRec ``ShardingPlan``s (every kind ``from_torchrec``
            reads), each validated against the task first.
        lookups: each table's bags; default ``task_lookups(task)``.
        modules: the table names of each EmbeddingBagCollection of the model (each EBC
            runs its own kernels and collectives); default the task's modules, or one EBC
            of all tables. The plan's cost stays the max over devices of their totals: the
            wait of each module for its slowest rank is not emulated (``stepcost`` prices it).
    """
    device = device or default_device()
    ours = [_as_plan(p, task) for p in plans]
    lookups = lookups or task_lookups(task)
    modules = modules or task.modules or [[t.name for t in task.tables]]
    structure = [lookup_groups(task, plan, modules) for plan in ours]
    tasks = [on_kernels(task, plan) for plan in ours]
    exchanges = [step_exchanges(task, g, rep, lookups) for g, rep in structure]
    compute: list[list[list[tuple[float, float]]]] = [[] for _ in ours]
    for _ in tqdm(range(rounds), desc="compute rounds", disable=not progress):
        for k, (groups, replicated) in enumerate(structure):
            compute[k].append(_measure_compute_round(tasks[k], groups, replicated, lookups, device, warmup, repeats))
    jobs = []
    for r in range(rounds):
        for k in range(len(ours)):
            earliest = min(f for f, _ in compute[k][r])
            jobs.append((*exchanges[k], [f - earliest for f, _ in compute[k][r]]))
    if task.num_devices > 1:
        comm = spawn(_comm_worker, task.num_devices, jobs)[0]
    else:
        comm = [((0.0,), (0.0,), (0.0,))] * len(jobs)
    return [PlanMeasurement.of_rounds(compute[k], [comm[r * len(ours) + k] for r in range(rounds)]) for k in range(len(ours))]


def evaluate_plan(task: Task, plan: Plan | ShardingPlan, **kwargs: object) -> PlanMeasurement:
    """``evaluate_plans`` for one plan."""
    return evaluate_plans(task, [plan], **kwargs)[0]  # type: ignore[arg-type]


def format_breakdown(m: PlanMeasurement, title: str = "") -> str:
    """A per-device table of the measured costs (ms); fwd_comm includes the input comm."""
    lines = [title] if title else []
    lines.append("device  fwd_comp  bwd_comp  fwd_comm (input)  bwd_comm    total")
    inputs = m.input_comm_ms or (0.0,) * len(m.devices)
    for d, (c, i) in enumerate(zip(m.devices, inputs)):
        lines.append(
            f"{d:>6}  {c.fwd_compute:8.2f}  {c.bwd_compute:8.2f}  {c.fwd_comm:8.2f} ({i:5.2f})  {c.bwd_comm:8.2f}  {c.total:7.2f}"
        )
    lines.append(f"embedding cost {m.cost_ms:.2f} ms (IQR over rounds {m.spread_ms:.2f} ms)")
    return "\n".join(lines)
