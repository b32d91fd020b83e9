"""The per-rank summary a planner logs, in the spirit of TorchRec's EmbeddingStats."""

from __future__ import annotations

from typing import Mapping, Sequence

from torchrec_neuroshard.types import DeviceCost, Plan, TableSpec


def format_plan_stats(
    plan: Plan,
    tables: Sequence[TableSpec],
    devices: Sequence[DeviceCost],
    memory_cap_bytes: int,
    fallbacks: Mapping[str, str] = {},
    title: str = "NeuroShard plan",
) -> str:
    """A per-rank table: predicted fwd/bwd compute and comm (ms), weight memory, shards."""
    memory = plan.device_memory(tables)
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
        f"{'rank':>4} {'fwd_comp':>9} {'bwd_comp':>9} {'fwd_comm':>9} {'bwd_comm':>9} {'total':>8} "
        f"{'mem MB':>9} {'mem %':>6}  shards",
    ]
    for d, c in enumerate(devices):
        mark = "*" if d == bottleneck else " "
        names = " ".join(shards[d])
        if len(names) > 100:
            names = names[:97] + "..."
        lines.append(
            f"{d:>3}{mark} {c.fwd_compute:9.2f} {c.bwd_compute:9.2f} {c.fwd_comm:9.2f} {c.bwd_comm:9.2f} "
            f"{c.total:8.2f} {memory[d] / 2**20:9.1f} {100 * memory[d] / memory_cap_bytes:5.1f}%  {names}"
        )
    if plan.data_parallel:
        lines.append(f"data parallel on every rank: {' '.join(plan.data_parallel)}")
    for table, why in fallbacks.items():
        lines.append(f"fallback: {table}: {why}")
    return "\n".join(lines)
