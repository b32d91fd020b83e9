"""Offload: which tables go to host memory, and how much of each, when a model does not
fit the GPUs' HBM (a cuda topology with ``ddr_cap``: TorchRec's UVM kernels).

Per table, a ladder of kernels (``kernel_options``): fused (all in HBM), fused_uvm_caching
at each of ``LOAD_FACTORS`` (or the load factor its constraints fix), fused_uvm (only the
kernel's buffers in HBM); each point with its HBM and host bytes as TorchRec counts them
for the whole table and its UVM penalty (``uvmcost``, the shipped measured pricing). The choice is
a greedy by cost per byte: every table starts at its cheapest kernel, and the step down a
ladder that adds the least penalty per HBM byte it frees is taken until the tables' HBM
fits the budget (a share of all ranks' HBM, ``HBM_SHARES``) with their host bytes within
all ranks' host memory. Hot tables (high penalty per byte) stay in HBM; cold ones go to
the host, a cache of their hottest rows where that is cheaper per byte.

The tables sent to host memory are then placed here, before the search (``place``): the
costliest first, each table-wise on the device of least predicted load with room in its
host memory and in its share of HBM (row-wise over every rank when its host bytes exceed
one rank's host memory). The search places the tables left in HBM around them, in the
HBM they leave, and prices the whole step with the penalties (``uvmcost.UvmPricedModel``).

``attempts`` yields what the planner tries in turn: first no offload at all (so a model
that fits HBM is planned exactly as without this stage), then the greedy at shrinking
HBM shares until the search places the rest. At each share a second proposal splits by
rows over every rank each table whose weights take over ``ROW_SPLIT_SHARE`` of a rank's
HBM (in HBM or on its UVM kernel): whole, such tables pack the ranks' HBM badly, so the first proposal's share often fails and a smaller one sends
more tables to host memory than the bytes require (as TorchRec's row-wise plans avoid).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Mapping, Sequence

from torchrec_neuroshard.kernels import ComputeKernel, shard_storage
from torchrec_neuroshard.tables import ModuleTable
from torchrec_neuroshard.triage import row_split
from torchrec_neuroshard.types import InfeasibleError, Plan, Shard, ShardingKind, TablePlacement, TableSpec
from torchrec_neuroshard.uvmcost import UvmPricing

LOAD_FACTORS = (0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01)
"""The cache sizes (shares of a table's rows) the greedy tries for fused_uvm_caching."""
HBM_SHARES = (0.99, 0.95, 0.85, 0.7, 0.55, 0.4, 0.25, 0.1, 0.0)
"""Shares of all ranks' HBM the tables' HBM bytes may take, tried in turn: the rest is the
search's room to balance the tables it places."""
WHOLE_MAX_SHARE = 0.95
"""The largest share tried with every table whole (the first proposal of a share): whole
tables never pack all ranks' HBM tighter; row blocks do (the row-wise proposal)."""
ROW_SPLIT_SHARE = 0.25
"""A table whose weights take over this share of one rank's HBM is split by rows over
every rank in the row-wise proposal of each HBM share."""
HOST_SHARE = 0.95
"""Share of all ranks' host memory the offloaded tables may take (room to place them)."""

Price = Callable[[Sequence[TableSpec]], list[float]]
"""Predicted ms (forward + backward, UVM penalty included) of each table alone, table-wise."""


@dataclass(frozen=True)
class KernelOption:
    """One rung of a table's ladder: a kernel (and load factor), the table's HBM and host
    bytes on it (table-wise, as TorchRec counts them) and its UVM penalty (ms per step)."""

    kernel: ComputeKernel
    load_factor: float | None
    hbm: int
    host: int
    penalty_ms: float


@dataclass(frozen=True)
class Offload:
    """One attempt: the placements of the tables sent to host memory (none: plan all in
    HBM), the HBM share it was chosen for and why each table went."""

    placements: tuple[TablePlacement, ...] = ()
    hbm_share: float = 1.0
    reasons: tuple[tuple[str, str], ...] = ()


def offloadable(table: ModuleTable) -> bool:
    """The table may run a UVM kernel and be placed table-wise or row-wise."""
    return bool(table.kernels - {ComputeKernel.FUSED}) and bool(
        table.allowed & {ShardingKind.TABLE_WISE, ShardingKind.ROW_WISE}
    )


def kernel_options(
    table: ModuleTable, batch_size: int, world_size: int, pricing: UvmPricing, hbm_cap: int | None = None, local_world_size: int | None = None
) -> list[KernelOption]:
    """Every kernel ``table`` may run (only fused unless ``offloadable``), each load factor
    of fused_uvm_caching, with its bytes and penalty. A table larger than one rank's HBM
    (``hbm_cap``) in it is split by rows (as ``triage.row_split`` splits it), each
    block holding the pooled output of the whole batch: its bytes are those of its blocks."""
    return tables_kernel_options([table], batch_size, world_size, pricing, hbm_cap, local_world_size)[0]


def tables_kernel_options(
    tables: Sequence[ModuleTable], batch_size: int, world_size: int, pricing: UvmPricing, hbm_cap: int | None = None, local_world_size: int | None = None
) -> list[list[KernelOption]]:
    """``kernel_options`` of each of ``tables``, the same options, their penalties priced
    together (``UvmPricing.whole_table_penalties``) and their bytes counted as
    ``Shard.storage`` counts a whole table's (3,000 tables' options: 1.2 s one by one)."""
    points = [(i, kernel, factor) for i, table in enumerate(tables) for kernel, factor in _kernel_points(table)]
    penalties = pricing.whole_table_penalties([tables[i].spec for i, _, _ in points], [(k, f) for _, k, f in points], batch_size)  # [P]
    io = [Shard(t.spec, t.spec.dim).io_bytes(ShardingKind.TABLE_WISE, batch_size, world_size) for t in tables]  # [T]
    options: list[list[KernelOption]] = [[] for _ in tables]
    for (i, kernel, factor), penalty in zip(points, penalties.tolist()):
        table, spec = tables[i], tables[i].spec
        weights = spec.rows * spec.dim * spec.bytes_per_element
        if weights == 0:
            hbm, host = 0, 0
        elif kernel is ComputeKernel.FUSED:
            hbm, host = weights + math.ceil(weights * spec.optimizer_multiplier) + io[i], 0
        else:
            hbm, host = shard_storage(spec.rows, spec.dim, spec.rows, spec.dim, spec.bytes_per_element, spec.optimizer_multiplier, io[i], kernel, factor)
        if hbm_cap is not None and hbm > hbm_cap and table.allowed & {ShardingKind.ROW_WISE, ShardingKind.TABLE_ROW_WISE}:
            on_kernel = spec.on_kernel(kernel, factor)
            split = row_split(replace(table, spec=on_kernel), world_size, local_world_size or world_size, batch_size, hbm_cap)[2]
            hbm = sum(Plan((split,), world_size).device_memory([on_kernel], batch_size))
        options[i].append(KernelOption(kernel, factor, hbm, host, penalty))
    return options


def _kernel_points(table: ModuleTable) -> list[tuple[ComputeKernel, float | None]]:
    """(kernel, load factor) of every option of ``table`` (see ``kernel_options``), in order."""
    kernels = table.kernels if offloadable(table) else frozenset({ComputeKernel.FUSED})
    points = []
    for kernel in sorted(kernels, key=list(ComputeKernel).index):
        factors: Sequence[float | None] = [None]
        if kernel.cached:
            factors = [float(table.load_factor)] if table.load_factor is not None else LOAD_FACTORS
        points += [(kernel, factor) for factor in factors]
    return points


def ladder(options: Sequence[KernelOption]) -> list[KernelOption]:
    """The rungs worth taking, from the cheapest option down in HBM: the lower convex hull
    of (HBM, penalty), so each step costs at least as much per byte freed as the last."""
    start = min(options, key=lambda o: (o.penalty_ms, -o.hbm))
    rungs = [start]
    for option in sorted((o for o in options if o.hbm < start.hbm), key=lambda o: (-o.hbm, o.penalty_ms)):
        if option.hbm == rungs[-1].hbm:
            continue  # a dearer option of the same bytes
        while len(rungs) >= 2 and (
            option.penalty_ms <= rungs[-1].penalty_ms or _slope(rungs[-1], option) <= _slope(rungs[-2], rungs[-1])
        ):
            rungs.pop()  # above the hull: never the best step
        rungs.append(option)
    return rungs


def _slope(high: KernelOption, low: KernelOption) -> float:
    """Penalty ms added per HBM byte freed going from ``high`` to ``low``."""
    return (low.penalty_ms - high.penalty_ms) / max(1, high.hbm - low.hbm)


def choose_kernels(
    ladders: Mapping[str, Sequence[KernelOption]], hbm_budget: float, host_budget: float
) -> dict[str, KernelOption] | None:
    """Each table's rung after the greedy (see the module docstring); None when no
    choice brings the tables' HBM within ``hbm_budget`` and host bytes within ``host_budget``."""
    step = {name: 0 for name in ladders}
    hbm = sum(rungs[0].hbm for rungs in ladders.values())
    host = sum(rungs[0].host for rungs in ladders.values())
    heap = [(_slope(r[0], r[1]), name) for name, r in sorted(ladders.items()) if len(r) > 1]
    heapq.heapify(heap)
    while hbm > hbm_budget and heap:
        _, name = heapq.heappop(heap)
        rungs, i = ladders[name], step[name]
        here, there = rungs[i], rungs[i + 1]
        if host + there.host - here.host > host_budget:
            continue  # no room left in host memory for this table
        step[name] = i + 1
        hbm, host = hbm + there.hbm - here.hbm, host + there.host - here.host
        if i + 2 < len(rungs):
            heapq.heappush(heap, (_slope(there, rungs[i + 2]), name))
    if hbm > hbm_budget:
        return None
    return {name: ladders[name][i] for name, i in step.items()}


def relax(
    chosen: Mapping[str, KernelOption],
    options: Mapping[str, Sequence[KernelOption]],
    hbm_budget: float,
    host_budget: float,
    movable: set[str],
) -> dict[str, KernelOption]:
    """``chosen`` with each ``movable`` table, the dearest first, moved to its cheapest option
    (any of ``options``, not only the hull's rungs) that keeps the tables within both budgets:
    the greedy's last step down may free more bytes than the budget asks (two tables at a
    cache of 1% of their rows where one at 50% and one at 1% fit)."""
    out = dict(chosen)
    hbm, host = sum(o.hbm for o in out.values()), sum(o.host for o in out.values())
    for name in sorted(movable & set(out), key=lambda n: (-out[n].penalty_ms, n)):
        here = out[name]
        fits = [o for o in options[name] if hbm - here.hbm + o.hbm <= hbm_budget and host - here.host + o.host <= host_budget]
        best = min(fits + [here], key=lambda o: (o.penalty_ms, o.hbm))
        if best.penalty_ms < here.penalty_ms:
            out[name] = best
            hbm, host = hbm - here.hbm + best.hbm, host - here.host + best.host
    return out


def _relax_split(
    chosen: Mapping[str, KernelOption],
    options: Mapping[str, Sequence[KernelOption]],
    budgets: tuple[float, float],
    tables: Sequence[ModuleTable],
    world: int,
    hbm_cap: int,
    share: float,
) -> dict[str, KernelOption]:
    """``relax`` of the tables the row-wise proposal splits: row blocks pack HBM exactly, so
    their kernels may take what the budget leaves, less the slack the whole tables need to
    be placed (what a share of at most ``WHOLE_MAX_SHARE`` leaves them)."""
    movable = {t.spec.name for t in tables if _splits(t, world, hbm_cap)}
    whole = sum(o.hbm for name, o in chosen.items() if name not in movable)
    slack = whole * (1 / min(share, WHOLE_MAX_SHARE) - 1)
    return relax(chosen, options, min(budgets[0], world * hbm_cap - slack), budgets[1], movable)


def shortfall_error(ladders: Mapping[str, Sequence[KernelOption]], hbm_total: int, host_total: int, world: int) -> InfeasibleError:
    """The error of a model beyond HBM + host memory: what each memory lacks, at least."""
    least_hbm = sum(min(o.hbm for o in rungs) for rungs in ladders.values())
    fused = sum(rungs[0].hbm for rungs in ladders.values())
    # every byte leaving HBM takes about one in host memory: the host bytes to bring HBM down
    host_needed = sum(rungs[0].host for rungs in ladders.values()) + max(0, fused - hbm_total)
    return InfeasibleError(
        f"the model does not fit the {world} ranks' HBM and host memory together: its tables need at least "
        f"{least_hbm:,} bytes of HBM (every table that may run a UVM kernel in host memory) against {hbm_total:,} "
        f"(short by {max(0, least_hbm - hbm_total):,}), and about {host_needed:,} bytes of host memory against "
        f"{host_total:,} (short by {max(0, host_needed - host_total):,}); add ranks, HBM or host memory "
        "(Topology hbm_cap / ddr_cap), or shrink the tables"
    )


def attempts(
    tables: Sequence[ModuleTable],
    world: int,
    hbm_cap: int,
    host_cap: int | None,
    batch_size: int,
    pricing: UvmPricing,
    price: Price,
    local_world_size: int | None = None,
) -> Iterator[Offload]:
    """What the planner tries in turn (see the module docstring): when the tables fit all
    ranks' HBM on their cheapest kernels, those (no offload at all unless constraints
    allow a table only UVM kernels); with no host memory, that alone (the search's own
    error then stands); then each ``HBM_SHARES`` budget's choice, its tables whole and
    split by rows (above ``WHOLE_MAX_SHARE``: split only), each proposal once. Raises the
    shortfall error when even the largest share cannot be met."""
    if host_cap is None:
        yield Offload()
        return
    options = tables_kernel_options(tables, batch_size, world, pricing, hbm_cap, local_world_size)
    ladders = {t.spec.name: ladder(o) for t, o in zip(tables, options)}
    cheapest = sum(rungs[0].hbm for rungs in ladders.values())
    seen: list[tuple[bool, dict[str, KernelOption]]] = []  # (split, the greedy's choice) of each proposal made
    unplaced: InfeasibleError | None = None
    tried = False
    every = {t.spec.name: o for t, o in zip(tables, options)}
    for share in ((math.inf,) if cheapest <= world * hbm_cap else ()) + HBM_SHARES:
        budgets = (share * world * hbm_cap, HOST_SHARE * world * host_cap)
        chosen = choose_kernels(ladders, *budgets)
        if chosen is None:
            if not seen:
                raise shortfall_error(ladders, world * hbm_cap, world * host_cap, world)
            break
        for split in (True,) if WHOLE_MAX_SHARE < share < math.inf else (False, True):
            if (split, chosen) in seen:
                continue
            seen.append((split, chosen))
            try:
                picked = _relax_split(chosen, every, budgets, tables, world, hbm_cap, share) if split else chosen
                proposal = _proposal(tables, picked, share, world, (hbm_cap, host_cap), batch_size, price, split)
            except InfeasibleError as e:  # a smaller share sends other tables
                unplaced = e
                continue
            if proposal is not None:
                tried = True
                yield proposal
    if unplaced is not None and not tried:
        raise unplaced


def _proposal(
    tables: Sequence[ModuleTable], chosen: Mapping[str, KernelOption], share: float, world: int, caps: tuple[int, int], batch_size: int, price: Price, split: bool
) -> Offload | None:
    """One share's proposal: the tables ``chosen`` sends to host memory placed by ``place``
    (none: all in HBM, planned exactly as without this stage); with ``split``, first every
    table over ``ROW_SPLIT_SHARE`` of a rank's HBM split by rows over every rank on its
    chosen kernel (None when there is none), the others sent placed in the memory those leave."""
    by_name = {t.spec.name: t for t in tables}
    rows = _row_splits(tables, chosen, world, caps[0]) if split else ()
    if split and not rows:
        return None
    if not split and not any(o.kernel.in_host_memory for o in chosen.values()):
        return Offload()
    split_names = {p.table for p in rows}
    specs = [by_name[p.table].spec.on_kernel(chosen[p.table].kernel, chosen[p.table].load_factor) for p in rows]
    one = Plan(rows, world)
    used_hbm, used_host = (max(m, default=0) for m in (one.device_memory(specs, batch_size), one.device_host_memory(specs, batch_size)))
    whole = sum(o.hbm for n, o in chosen.items() if n not in split_names)
    if split and world * used_hbm + whole / min(share, WHOLE_MAX_SHARE) > world * caps[0]:
        return None  # each block holds the whole batch's pooled output: the blocks leave the whole tables no room
    sent = {n: o for n, o in chosen.items() if o.kernel.in_host_memory and n not in split_names}
    left = (caps[0] - used_hbm, caps[1] - used_host)
    placed = place([by_name[n] for n in sent], sent, world, left, batch_size, price) if sent else ()
    reasons = [(n, _reason(o, share)) for n, o in sorted(sent.items())]
    reasons += [(p.table, _split_reason(chosen[p.table], share, caps[0])) for p in rows]
    return Offload(rows + placed, share, tuple(sorted(reasons)))


def _row_splits(tables: Sequence[ModuleTable], chosen: Mapping[str, KernelOption], world: int, hbm_cap: int) -> tuple[TablePlacement, ...]:
    """Every table whose weights take over ``ROW_SPLIT_SHARE`` of a rank's HBM and that may
    be split by rows, in row blocks over every rank on its chosen kernel (one on a UVM
    kernel too: its penalty then falls on every rank, not on one)."""
    out = []
    for t in sorted(tables, key=lambda t: t.spec.name):
        if _splits(t, world, hbm_cap):
            option = chosen[t.spec.name]
            out.append(TablePlacement.row_blocks(t.spec.on_kernel(option.kernel, option.load_factor), range(world)))
    return tuple(out)


def _splits(table: ModuleTable, world: int, hbm_cap: int) -> bool:
    """Whether the row-wise proposal splits ``table``: its weights over ``ROW_SPLIT_SHARE`` of a rank's HBM, row-wise allowed."""
    spec = table.spec
    return ShardingKind.ROW_WISE in table.allowed and spec.rows >= world and spec.rows * spec.dim * spec.bytes_per_element > ROW_SPLIT_SHARE * hbm_cap


def _split_reason(option: KernelOption, share: float, hbm_cap: int) -> str:
    return (
        f"row-wise over every rank on {_kernel_name(option)}: its weights, over {ROW_SPLIT_SHARE:.0%} of a rank's {hbm_cap:,} "
        f"bytes of HBM, pack the ranks badly whole (the tables fit {share:.0%} of their HBM)"
    )


def _reason(option: KernelOption, share: float) -> str:
    fit = "its constraints allow it no kernel in HBM" if math.isinf(share) else f"the tables fit {share:.0%} of the ranks' HBM with it in host memory"
    return f"{_kernel_name(option)}: {fit}, at a predicted UVM penalty of {option.penalty_ms:.3g} ms per step"


def _kernel_name(option: KernelOption) -> str:
    return option.kernel.value + (f" (cache load factor {option.load_factor:g})" if option.kernel.cached else "")


def place(
    tables: Sequence[ModuleTable],
    chosen: Mapping[str, KernelOption],
    world: int,
    caps: tuple[int, int],
    batch_size: int,
    price: Price,
) -> tuple[TablePlacement, ...]:
    """Placements of the tables sent to host memory (see the module docstring): the
    costliest first, each table-wise on the device of least predicted load (ties to less
    HBM) with room in its host memory and in its HBM share (an even share of these tables'
    HBM plus the largest one's; past that share, any device with room in its HBM); row-wise
    over every rank where it fits no one rank's memory or may not be table-wise. ``caps``:
    each rank's (HBM, host memory). Raises ``InfeasibleError`` naming a table that fits nowhere."""
    hbm_cap, host_cap = caps
    specs = [t.spec.on_kernel(chosen[t.spec.name].kernel, chosen[t.spec.name].load_factor) for t in tables]
    cost = dict(zip((s.name for s in specs), price(specs)))
    load, hbm, host = [0.0] * world, [0] * world, [0] * world
    quota = sum(chosen[s.name].hbm for s in specs) / world + max(chosen[s.name].hbm for s in specs)
    placed = []
    allowed = {t.spec.name: t.allowed for t in tables}
    for spec in sorted(specs, key=lambda s: (-cost[s.name], s.name)):
        option = chosen[spec.name]
        whole = ShardingKind.TABLE_WISE in allowed[spec.name] and option.host <= host_cap
        if whole:
            room = [d for d in range(world) if host[d] + option.host <= host_cap and hbm[d] + option.hbm <= hbm_cap]
            if room:
                d = min(room, key=lambda d: (hbm[d] + option.hbm > quota, load[d], hbm[d], d))
                placement = TablePlacement.whole(spec, d)
            whole = bool(room)
        if not whole:
            if ShardingKind.ROW_WISE not in allowed[spec.name]:
                raise InfeasibleError(f"table {spec.name!r} ({option.host:,} bytes on {option.kernel.value}) fits no rank's host memory")
            placement = TablePlacement.row_blocks(spec, range(world))
        one = Plan((placement,), world)
        for d, (h, g) in enumerate(zip(one.device_memory([spec], batch_size), one.device_host_memory([spec], batch_size))):
            hbm[d], host[d] = hbm[d] + h, host[d] + g
            load[d] += cost[spec.name] * (1.0 if whole else 1.0 / world) * (d in placement.devices)
        placed.append(placement)
    for used, cap, what in ((hbm, hbm_cap, "HBM"), (host, host_cap, "host memory")):
        if max(used) > cap:
            raise InfeasibleError(
                f"the {len(placed)} tables sent to host memory take {max(used):,} bytes of one rank's {what}, over its "
                f"{cap:,}: add ranks or memory"
            )
    return tuple(placed)
