"""Triage: which tables the search places, and which are decided before it.

A pure step, one decision per table from that table alone (its size, the memory cap and
the kinds its constraints allow; the host of a table-row-wise table from the set of them),
so the plan does not depend on the order of tables or modules. The search then places the searched tables in the memory the decided ones leave.

- searched: table-wise or column-wise is allowed and the table fits one rank;
- split by rows: row splits are allowed and the table is larger than a rank, or row
  splits are all its constraints allow; row-wise over all ranks, or table-row-wise over
  one host's ranks where that takes fewer bytes in all (across hosts a row-wise block
  holds the pooled output of the whole batch) or row-wise is not allowed, such tables
  spread over the hosts by their bytes (``row_split``);
- data-parallel: replication is all its constraints allow;
- anything else is an error naming the table, its bytes and what to change.

What the search (and a refiner after it) may do with each searched table is
``search_choices``; ``labelled`` names a column split as the table's constraints allow it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from torchrec_neuroshard.hosts import spread_over_hosts
from torchrec_neuroshard.tables import ModuleTable
from torchrec_neuroshard.types import InfeasibleError, Plan, ShardingKind, TableChoices, TablePlacement

COLUMN_KINDS = frozenset(k for k in ShardingKind if k.splits_columns)
ROW_KINDS = frozenset(k for k in ShardingKind if k.splits_rows)


@dataclass(frozen=True)
class Triage:
    """The searched tables (sorted by name), the decided placements and why each decided
    table was decided."""

    searched: tuple[ModuleTable, ...]
    decided: tuple[TablePlacement, ...]
    reasons: tuple[tuple[str, str], ...]


def triage(
    tables: Sequence[ModuleTable], world_size: int, local_world_size: int, cap_bytes: int, batch_size: int
) -> Triage:
    """Decide every table that the search does not place; see the module docstring.
    Memory is counted as TorchRec counts it, at the GLOBAL ``batch_size``."""
    searched: list[ModuleTable] = []
    decided: list[TablePlacement] = []
    reasons: list[tuple[str, str]] = []
    for t in sorted(tables, key=lambda t: t.spec.name):
        spec = t.spec
        memory = spec.memory_bytes(batch_size, world_size)
        fits = memory <= cap_bytes
        if fits and t.allowed & COLUMN_KINDS:
            searched.append(t)
        elif t.allowed & ROW_KINDS:
            kind, ranks, placement, block = row_split(t, world_size, local_world_size, batch_size, cap_bytes)
            if block > cap_bytes:
                raise InfeasibleError(
                    f"table {spec.name!r} ({memory:,} bytes) does not fit even {kind.value} "
                    f"over {ranks} ranks of {cap_bytes:,} bytes; add ranks or memory"
                )
            decided.append(placement)
            why = "restricted to row splits" if fits else f"larger than one rank's memory ({memory:,} > {cap_bytes:,} bytes)"
            where = f"the {ranks} ranks of a host" if kind.within_host else f"{ranks} ranks"
            reasons.append((spec.name, f"{why}: {kind.value} over {where}"))
        elif fits and ShardingKind.DATA_PARALLEL in t.allowed:
            decided.append(TablePlacement.data_parallel(spec.name))
            reasons.append((spec.name, "restricted to data_parallel: replicated on every rank"))
        else:
            raise InfeasibleError(
                f"table {spec.name!r} ({memory:,} bytes) is larger than one rank's memory "
                f"({cap_bytes:,} bytes after reservations) and its constraints allow only "
                f"{sorted(k.value for k in t.allowed)}; allow column_wise or row_wise, or add memory"
            )
    decided = _spread_over_hosts(decided, tables, world_size, local_world_size, batch_size)
    decided_names = {p.table for p in decided}
    fixed_tables = [t.spec for t in tables if t.spec.name in decided_names]
    fixed_memory = max(Plan(tuple(decided), world_size).device_memory(fixed_tables, batch_size), default=0)
    if searched and fixed_memory >= cap_bytes:
        raise InfeasibleError(
            f"the topology's memory fits nothing: {cap_bytes:,} bytes per rank after reservations, "
            f"all taken by replicated or row-wise tables ({fixed_memory:,} bytes on the fullest rank)"
        )
    return Triage(tuple(searched), tuple(decided), tuple(reasons))


def search_choices(searched: Sequence[ModuleTable], hosts: bool) -> dict[str, TableChoices]:
    """What the search may do with each of the ``searched`` tables (``hosts``: the task spans
    several hosts). The step parts were measured on pooled kernels, so a sequence table
    stays table- or column-wise; the search places column shards anywhere, so across hosts
    a table that may only be cut within one (table_column_wise) stays whole; a replica runs
    in HBM, so a table on a host-memory kernel is not replicated."""
    return {
        t.spec.name: TableChoices.of(
            (t.allowed if t.pooled else t.allowed & COLUMN_KINDS)
            - ({ShardingKind.TABLE_COLUMN_WISE} if hosts else set())
            - ({ShardingKind.DATA_PARALLEL} if t.spec.kernel.in_host_memory else set()),
            t.spec.dim, t.min_width,
        )
        for t in searched
    }


def labelled(plan: Plan, searched: Sequence[ModuleTable]) -> Plan:
    """``plan`` with each column-split table of ``searched`` whose constraints allow
    table_column_wise and not the split's kind labelled table_column_wise (the search and
    a refiner split columns as column_wise)."""
    allowed = {t.spec.name: t.allowed for t in searched}

    def label(p: TablePlacement) -> TablePlacement:
        kinds = allowed.get(p.table, {p.kind})
        if p.kind.splits_columns and p.kind not in kinds and ShardingKind.TABLE_COLUMN_WISE in kinds:
            return replace(p, kind=ShardingKind.TABLE_COLUMN_WISE)
        return p

    return Plan(tuple(map(label, plan.placements)), plan.num_devices)


def row_split(
    table: ModuleTable, world_size: int, local_world_size: int, batch_size: int, cap_bytes: int | None = None
) -> tuple[ShardingKind, int, TablePlacement, int]:
    """(kind, ranks, placement, fullest block's bytes) of a row split: of row_wise over
    every rank and table_row_wise over one host's ranks (those the table allows), the one
    taking the fewest bytes over all ranks whose fullest block fits ``cap_bytes`` (row_wise
    on a tie; where none fits, the one of the smaller block). Across hosts a row-wise
    block holds the pooled output of the whole batch, a table-row-wise one of its host's."""
    splits = []  # (doesn't fit, bytes over all ranks or fullest block, kind, ranks, placement, fullest block)
    for kind in (ShardingKind.ROW_WISE, ShardingKind.TABLE_ROW_WISE):
        ranks = world_size if kind is ShardingKind.ROW_WISE else min(local_world_size, world_size)
        if kind not in table.allowed or any(s[3] == ranks for s in splits):
            continue
        placement = TablePlacement.row_blocks(table.spec, range(ranks), kind)
        memory = Plan((placement,), world_size).device_memory([table.spec], batch_size)
        over = cap_bytes is not None and max(memory) > cap_bytes
        splits.append((over, max(memory) if over else sum(memory), len(splits), kind, ranks, placement, max(memory)))
    return min(splits)[3:]


def _spread_over_hosts(
    decided: list[TablePlacement], tables: Sequence[ModuleTable], world_size: int, local_world_size: int, batch_size: int
) -> list[TablePlacement]:
    """Table-row-wise tables (decided on the first host) spread over the full hosts, the
    largest first onto the host holding the fewest of their bytes: a rule of the set of
    tables, not of their order."""
    spec = {t.spec.name: t.spec for t in tables}
    spread = [spec[p.table] for p in decided if p.kind is ShardingKind.TABLE_ROW_WISE]
    if world_size // local_world_size < 2 or not spread:
        return decided
    size = {t.name: t.memory_bytes(batch_size, world_size) for t in spread}
    spread.sort(key=lambda t: (-size[t.name], t.name))
    moved = {p.table: p for p in spread_over_hosts(spread, lambda t: size[t.name], world_size, local_world_size)}
    return [moved.get(p.table, p) for p in decided]
