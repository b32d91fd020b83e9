"""Hosts of a world: which ranks share one, and tables spread over them row-wise.

Rank ``r`` sits on host ``r // local_world_size`` (TorchRec's ``Topology``).
"""

from __future__ import annotations

from typing import Callable, Sequence

from torchrec_neuroshard.types import ShardingKind, TablePlacement, TableSpec


def host_ranks(rank: int, local_world_size: int, world_size: int) -> range:
    """The ranks of the host of ``rank``."""
    first = rank // local_world_size * local_world_size
    return range(first, min(world_size, first + local_world_size))


def spread_over_hosts(
    tables: Sequence[TableSpec], weight: Callable[[TableSpec], float], world_size: int, local_world_size: int
) -> tuple[TablePlacement, ...]:
    """``tables`` table-row-wise, each in the order given onto the full host that holds the
    least ``weight`` of those before it (the first such host on ties)."""
    held = [0.0] * (world_size // local_world_size)
    placed = []
    for t in tables:
        host = held.index(min(held))
        held[host] += weight(t)
        ranks = host_ranks(host * local_world_size, local_world_size, world_size)
        placed.append(TablePlacement.row_blocks(t, ranks, ShardingKind.TABLE_ROW_WISE))
    return tuple(placed)

