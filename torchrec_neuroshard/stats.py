"""The per-rank summary a planner logs, in the spirit of TorchRec's EmbeddingStats, and the
``ShardingOption``s that TorchRec's own ``Stats`` read, built for our plan."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Sequence

from torch import nn
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.distributed.planner.types import ParameterConstraints, ShardingOption, Stats, Topology
from torchrec.distributed.types import ModuleSharder

from torchrec_neuroshard.kernels import ComputeKernel
from torchrec_neuroshard.sharding import DENSE
from torchrec_neuroshard.tables import module_shapes
from torchrec_neuroshard.types import CostModel, DeviceCost, Plan, ShardingError, ShardingKind, TablePlacement, TableSpec, Task


def format_plan_stats(
    plan: Plan,
    tables: Sequence[TableSpec],
    devices: Sequence[DeviceCost],
    memory_cap_bytes: int,
    batch_size: int,
    fallbacks: Mapping[str, str] = {},
    title: str = "NeuroShard plan",
    memory_kind: str = "DDR",
) -> str:
    """A per-rank table in the shape of TorchRec's EmbeddingStats: Rank, memory (``memory_kind``
    GB and % of the cap, as TorchRec counts it at the GLOBAL ``batch_size``), predicted Perf
    (ms) with its fwd/bwd compute and comm, Shards (a shard on a UVM kernel marked
    ``@fused_uvm`` or ``@fused_uvm_caching:<load factor>``; the host memory they take then
    in its own line)."""
    memory = plan.device_memory(tables, batch_size)
    shards: list[list[str]] = [[] for _ in range(plan.num_devices)]
    for p in plan.placements:
        on = "" if not p.kernel.in_host_memory else f"@{p.kernel.value}" + (f":{p.cache_load_factor:g}" if p.kernel.cached else "")
        for w, d in zip(p.widths, p.devices):
            shards[d].append((f"{p.table}[{w}]" if len(p.widths) > 1 else p.table) + on)
        for r, d in zip(p.rows, p.devices):
            shards[d].append(f"{p.table}[{r} rows]{on}")
    bottleneck = max(range(len(devices)), key=lambda d: devices[d].total) if devices else -1
    lines = [
        f"{title}: predicted embedding cost {max((d.total for d in devices), default=0.0):.2f} ms "
        f"(max over {plan.num_devices} ranks)",
        f"{'Rank':>4} {memory_kind + ' (GB)':>9} {'%':>6} {'Perf (ms)':>9} {'fwd_comp':>9} {'bwd_comp':>9} "
        f"{'fwd_comm':>9} {'bwd_comm':>9}  Shards",
    ]
    for d, c in enumerate(devices):
        mark = "*" if d == bottleneck else " "
        names = " ".join(shards[d])
        if len(names) > 100:
            names = names[:97] + "..."
        lines.append(
            f"{d:>3}{mark} {memory[d] / 2**30:9.3f} {100 * memory[d] / memory_cap_bytes:5.1f}% {c.total:9.2f} "
            f"{c.fwd_compute:9.2f} {c.bwd_compute:9.2f} {c.fwd_comm:9.2f} {c.bwd_comm:9.2f}  {names}"
        )
    if plan.data_parallel:
        lines.append(f"data parallel on every rank: {' '.join(plan.data_parallel)}")
    if plan.offloaded():
        host = " ".join(f"{b / 2**30:.3f}" for b in plan.device_host_memory(tables, batch_size))
        lines.append(f"host memory (DDR, GB) by rank, tables on UVM kernels: {host}")
    for table, why in fallbacks.items():
        lines.append(f"{'host memory' if why.startswith('fused_uvm') else 'fallback'}: {table}: {why}")
    return "\n".join(lines)


def torchrec_sharding_options(
    plan: Plan,
    module: nn.Module,
    sharders: Sequence[ModuleSharder[nn.Module]],
    topology: Topology,
    batch_size: int,
    constraints: Mapping[str, ParameterConstraints] | None,
    perfs: Mapping[str, Sequence[DeviceCost]],
) -> tuple[list[ShardingOption], EmbeddingEnumerator]:
    """TorchRec's ``ShardingOption`` of every table of ``plan`` as TorchRec's ``Stats``
    read them (and the enumerator that made them): our sharding type, the fused kernel (the
    dense one for data parallel), our shards with their sizes, offsets and ranks (a
    replicated table one per rank), TorchRec's storage estimate of those shards, and our
    predicted perf: a shard on device d gets ``perfs[table][d]``, its table's own cost there
    (``table_perfs``); a table not in ``perfs`` gets perf 0.

    ``batch_size`` is the per-rank batch, as TorchRec's planner takes it.
    """
    from torchrec.distributed.planner.types import Perf, Shard as TorchRecShard

    shapes = module_shapes(module, sharders, topology.compute_device)
    keys = {(t.path, t.name): t.key for t in shapes}
    placed = {p.table: p for p in plan.placements}
    by_name: dict[str, list[TablePlacement]] = {}  # TorchRec's constraints are keyed by table name alone
    for t in shapes:
        by_name.setdefault(t.name, []).append(placed[t.key])
    cons = {name: _option_constraints((constraints or {}).get(name), ps) for name, ps in by_name.items()}
    enumerator = EmbeddingEnumerator(topology, batch_size, cons, estimator=EmbeddingStorageEstimator(topology, cons))
    chosen = {}
    for option in enumerator.enumerate(module, list(sharders)):
        p = placed.get(keys.get((option.path, option.name), ""))
        if p is not None and (option.sharding_type, option.compute_kernel) == (p.kind.value, _kernel(p)):
            chosen.setdefault(p.table, _with_load_factor(option, p))
    missing = sorted(set(placed) - set(chosen))
    if missing:
        raise ShardingError(f"TorchRec's enumerator offers no option for the planned sharding of tables {missing}")
    def perf(table: str, d: int) -> Perf:
        c = perfs[table][d] if table in perfs else DeviceCost(0.0, 0.0, 0.0, 0.0)
        return Perf(c.fwd_compute, c.fwd_comm, c.bwd_compute, c.bwd_comm)

    for p in plan.placements:
        option = chosen[p.table]
        rows, dim = option.tensor.shape
        if p.kind is ShardingKind.DATA_PARALLEL:
            option.shards = [TorchRecShard([rows, dim], [0, 0], perf=perf(p.table, r), rank=r) for r in range(plan.num_devices)]
            continue
        boxes = (
            [([rows, w], [0, sum(p.widths[:i])]) for i, w in enumerate(p.widths)]
            if p.kind.splits_columns
            else [([r, dim], [sum(p.rows[:i]), 0]) for i, r in enumerate(p.rows)]
        )
        option.shards = [TorchRecShard(size, offset, perf=perf(p.table, d), rank=d) for (size, offset), d in zip(boxes, p.devices)]
    options = [chosen[p.table] for p in plan.placements]
    enumerator.populate_estimates(options)  # its storage estimator, as TorchRec's planner calls it
    return options, enumerator


def _kernel(p: TablePlacement) -> str:
    """The compute kernel TorchRec runs ``p`` on: the dense one for data parallel."""
    return DENSE if p.kind is ShardingKind.DATA_PARALLEL else p.kernel.value


def _option_constraints(given: ParameterConstraints | None, placements: Sequence[TablePlacement]) -> ParameterConstraints:
    """The constraints that make TorchRec's enumerator offer exactly the kinds and kernels
    of ``placements`` (one table name's, in every module holding one)."""
    return replace(
        given or ParameterConstraints(),
        sharding_types=sorted({p.kind.value for p in placements}),
        compute_kernels=sorted({_kernel(p) for p in placements}),
    )


def _with_load_factor(option: ShardingOption, p: TablePlacement) -> ShardingOption:
    """``option`` with ``p``'s cache load factor in its cache params (fused_uvm_caching)."""
    from torchrec.distributed.types import CacheParams

    if p.kernel is ComputeKernel.FUSED_UVM_CACHING:
        option.cache_params = replace(option.cache_params or CacheParams(), load_factor=p.cache_load_factor)
    return option


def table_perfs(model: CostModel, task: Task, plan: Plan) -> dict[str, tuple[DeviceCost, ...]]:
    """Each table's own predicted cost on every device: the table alone in the step, as
    ``predicted_breakdown`` prices a plan (the cost model prices a device's shards as one
    kernel, so the tables' costs on a device need not add up to the device's). A replicated
    table's leaves out the fixed cost every replicated set pays once (``replica_overhead``)."""
    from torchrec_neuroshard.search import predicted_breakdown

    fixed = replica_overhead(model, task)
    perfs = {}
    for p in plan.placements:
        own = predicted_breakdown(model, task.subset([p.table]), plan.subset({p.table}))[1]
        if p.kind is ShardingKind.DATA_PARALLEL:
            own = tuple(
                DeviceCost(max(0.0, c.fwd_compute - fixed.fwd_compute), max(0.0, c.bwd_compute - fixed.bwd_compute),
                           c.fwd_comm, max(0.0, c.bwd_comm - fixed.bwd_comm))
                for c in own
            )  # fmt: skip
        perfs[p.table] = own
    return perfs


def replica_overhead(model: CostModel, task: Task) -> DeviceCost:
    """The fixed cost on every rank of a module's replicated tables, paid once per step
    whatever they are (``stepcost.data_parallel_fixed_ms``): forward and backward of the
    dense kernel, and the gradient all-reduce."""
    from torchrec_neuroshard.stepcost import data_parallel_fixed_ms

    fixed = data_parallel_fixed_ms(model, task)
    return DeviceCost(fixed.get("dp_fwd", 0.0), fixed.get("dp_bwd", 0.0), 0.0, fixed.get("all_reduce", 0.0))


def replica_overhead_line(model: CostModel, task: Task, plan: Plan) -> str:
    """A line (newline-ended) for the plan table naming ``replica_overhead`` once, when
    the plan replicates tables: it is in every rank's perf, and in no table's; "" else."""
    replicated = {p.table for p in plan.placements if p.kind is ShardingKind.DATA_PARALLEL}
    modules = sum(1 for m in task.modules or (tuple(t.name for t in task.tables),) if replicated & set(m))
    if not modules:
        return ""
    fixed = replica_overhead(model, task)
    return (
        f"replicated tables: {fixed.total:.3f} ms a rank fixed per module with any (dense kernel fwd "
        f"{fixed.fwd_compute:.3f}, bwd {fixed.bwd_compute:.3f}, all-reduce {fixed.bwd_comm:.3f}), {modules} module(s): "
        "in the ranks' perf above, in no table's\n"
    )


def empty_device_line(model: CostModel, task: Task, plan: Plan) -> tuple[str, bool] | None:
    """(a line, whether the model prices the empty devices' option below the plan) when
    ``plan`` leaves a device holding no shard (a replica on every rank is none); None else.
    The option priced (``stepcost.predict_step``): where another device holds two or more
    shards, each whole table of the priciest such device moved to the first empty one, the
    cheapest of those moves; where every other device holds one, the priciest device's
    whole table split by rows over every device."""
    from torchrec_neuroshard.stepcost import predict_step

    shards = [0] * plan.num_devices  # [D] shards (table-wise, column or row) on each device
    for p in plan.placements:
        if p.kind is not ShardingKind.DATA_PARALLEL:
            for device in p.devices:
                shards[device] += 1
    empty = [d for d, n in enumerate(shards) if n == 0]
    if not empty:
        return None
    model = model.with_batch_size(task.batch_size)
    planned = predict_step(model, task, plan)
    crowded = [d for d, n in enumerate(shards) if n >= 2]
    used = crowded or [d for d, n in enumerate(shards) if n]
    priciest = max(used, key=lambda d: planned.devices[d].total)
    said = f"the plan leaves {len(empty)} of {plan.num_devices} devices empty (first: {empty[0]}); " + (
        f"{len(crowded)} device(s) hold two or more shards (the priciest, device {priciest}, holds {shards[priciest]}: "
        f"{planned.devices[priciest].total:.3f} ms)" if crowded else f"every other holds one shard (the priciest, device {priciest}: "
        f"{planned.devices[priciest].total:.3f} ms)"
    )  # fmt: skip
    whole = [p for p in plan.placements if p.kind is ShardingKind.TABLE_WISE and p.devices == (priciest,)]
    if not whole:
        return f"{said}; it holds no whole table to move, so no option is priced", False
    options = {p.table: _moved(plan, p, empty[0]) if crowded else _split(plan, p, task) for p in whole}
    priced = {table: predict_step(model, task, option).cost_ms for table, option in options.items()}
    table = min(priced, key=priced.get)
    cheaper = priced[table] < planned.cost_ms
    what = f"moving table {table} to device {empty[0]}" if crowded else f"splitting table {table} by rows over every device"
    return f"{said}; the model prices {what} at {priced[table]:.3f} ms a step, the plan at {planned.cost_ms:.3f} ms" + (
        ": the search missed it" if cheaper else ""
    ), cheaper


def _split(plan: Plan, placement: TablePlacement, task: Task) -> Plan:
    """``plan`` with the table-wise ``placement``'s table split by rows over every device."""
    blocks = TablePlacement.row_blocks(placement.spec_of(task.by_name[placement.table]), range(plan.num_devices))
    return Plan(tuple(blocks if p is placement else p for p in plan.placements), plan.num_devices)


def _moved(plan: Plan, placement: TablePlacement, device: int) -> Plan:
    """``plan`` with the table-wise ``placement`` on ``device`` instead."""
    placements = tuple(replace(p, devices=(device,)) if p is placement else p for p in plan.placements)
    return Plan(placements, plan.num_devices)


def stats_list(stats: object) -> list[Stats]:
    """``stats`` as TorchRec's planner takes it (None, one ``Stats`` or a list of them) as a
    list; anything else is a ``ShardingError`` naming it."""
    items = [] if stats is None else stats if isinstance(stats, list) else [stats]
    bad = [s for s in items if not isinstance(s, Stats)]
    if bad:
        raise ShardingError(
            f"stats={stats!r}: give a TorchRec Stats (torchrec.distributed.planner.types.Stats, e.g. "
            f"torchrec.distributed.planner.stats.EmbeddingStats()) or a list of them; got {type(bad[0]).__name__}"
        )
    return items


def log_stats(
    stats: Sequence[Stats],
    planner: object,
    reservation: object,
    sharders: Sequence[ModuleSharder[nn.Module]],
    sharding_plan: object,
    options: list[ShardingOption],
    enumerator: EmbeddingEnumerator | None,
    num_proposals: int,
    seconds: float,
) -> None:
    """Call every TorchRec ``Stats`` as ``EmbeddingShardingPlanner`` does, with the
    ``NeuroShardPlanner`` ``planner``'s plan as ``options``, the ``StorageReservation`` it
    reserved with, and ``enumerator`` (default: TorchRec's default one)."""
    from torchrec.distributed.planner.types import PlanDebugStats

    batch = planner.batch_size or BATCH_SIZE
    cons = dict(planner.constraints) if planner.constraints else None
    for s in stats:
        s.log(
            sharding_plan=sharding_plan,
            topology=planner.topology,
            batch_size=batch,
            storage_reservation=reservation,
            num_proposals=num_proposals,
            num_plans=1,
            run_time=seconds,
            best_plan=options,
            constraints=cons,
            enumerator=enumerator or EmbeddingEnumerator(planner.topology, batch, cons),
            sharders=list(sharders),
            debug=planner.debug,
            debug_stats=PlanDebugStats(planner_type=type(planner).__name__, timeout_seconds=planner.timeout_seconds),
        )
