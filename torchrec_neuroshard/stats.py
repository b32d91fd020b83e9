"""The per-rank summary a planner logs, in the spirit of TorchRec's EmbeddingStats."""

from __future__ import annotations

from typing import Mapping, Sequence

from torchrec_neuroshard.types import DeviceCost, Plan, TableSpec


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
    (ms) with its fwd/bwd compute and comm, Shards."""
    memory = plan.device_memory(tables, batch_size)
    shards: list[list[str]] = [[] for _ in range(plan.num_devices)]
    for p in plan.placements:
        for w, d in zip(p.widths, p.devices):
            shards[d].append(f"{p.table}[{w}]" if len(p.widths) > 1 else p.table)
        for r, d in zip(p.rows, p.devices):
            shards[d].append(f"{p.table}[{r} rows]")
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
    for table, why in fallbacks.items():
        lines.append(f"fallback: {table}: {why}")
    return "\n".join(lines)
