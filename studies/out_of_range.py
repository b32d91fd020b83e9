"""How the models price the held-out pools' tables that lie outside the features they were
trained on, against those tables timed alone on this machine. Issue 43.

    taskset -c 1 python -m studies.out_of_range

The compute nets clamp every feature into the range they were trained on
(``costmodel.features.RANGE_TOLERANCE``). On the scale benchmark's held-out pools 2-4 (856
tables, rows / 64, global batch 4,096) the shipped ``cpu.pt`` finds nine tables outside it:
seven read more often a sample than any training table, two have fewer rows (and hotter
rows) than any. Each is timed alone, as one fused FBGEMM kernel on one thread (forward and
backward with its update; median of ``REPEATS`` after ``WARMUP``), on the ids the scale
benchmark's judge draws first, and priced by ``cpu.pt`` (the AMD EPYC's, which plans the
scale benchmark) and ``intel_xeon.pt`` (this machine kind's). Beside them, ``IN_RANGE``
in-range tables a pool (its most read ones and a few of every size) give each model's level
on this machine, so an out-of-range table's priced / measured over its model's level says
how far its clamp moved it. Writes ``results/out_of_range.md``.
"""

from __future__ import annotations

import datetime
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.scale import scale_task, task_draws
from torchrec_neuroshard.costmodel import PRETRAINED_DIR, NeuralCostModel
from torchrec_neuroshard.hardware import local_hardware
from torchrec_neuroshard.lab.measure_compute import measure_compute
from torchrec_neuroshard.types import Shard, TableSpec

POOL_SEEDS = (2, 3, 4)
DEVICES = 8
"""The task the tables and ids come from (its tables and batch are the same at every D)."""
IN_RANGE = 6
"""In-range tables timed a pool: the 3 most read (pooling x width) and 3 spread over row counts."""
WARMUP, REPEATS = 5, 10
MODELS = {"cpu.pt": PRETRAINED_DIR / "cpu.pt", "intel_xeon.pt": PRETRAINED_DIR / "intel_xeon.pt"}
OUT = Path(__file__).parent / "results" / "out_of_range.md"


def in_range_sample(tables: list[TableSpec], outside: set[str]) -> list[TableSpec]:
    """``IN_RANGE`` in-range tables: the most read by pooling x width, then some by rows' quantiles."""
    inside = [t for t in tables if t.name not in outside]
    heavy = sorted(inside, key=lambda t: -t.pooling_factor * t.dim)[: IN_RANGE // 2]
    by_rows = sorted((t for t in inside if t not in heavy), key=lambda t: t.rows)
    spread = [by_rows[int(q * (len(by_rows) - 1))] for q in (0.1, 0.5, 0.9)][: IN_RANGE - len(heavy)]
    return heavy + spread


def priced_ms(model: NeuralCostModel, table: TableSpec, batch_size: int) -> float:
    """The model's fwd+bwd ms of ``table`` alone, whole, as the search prices one kernel."""
    fwd, bwd = model.with_batch_size(batch_size).compute_cost([[Shard(table, table.dim)]])[0]
    return fwd + bwd


def rows_of_pool(pool_seed: int, models: dict[str, NeuralCostModel]) -> list[dict]:
    """Every out-of-range table of the pool and its in-range sample, timed and priced."""
    task = scale_task(DEVICES, pool_seed)
    outside = models["cpu.pt"].out_of_range(task.tables)
    lookups = task_draws(DEVICES, pool_seed, 1)[0]
    chosen = [t for t in task.tables if t.name in outside] + in_range_sample(list(task.tables), set(outside))
    rows = []
    for table in tqdm(chosen, desc=f"pool {pool_seed}", leave=False):
        m = measure_compute([Shard(table, table.dim)], lookups, torch.device("cpu"), WARMUP, REPEATS)
        rows.append({
            "pool_seed": pool_seed, "table": table, "outside": outside.get(table.name),
            "measured": m.fwd.median_ms + m.bwd.median_ms,
            "priced": {name: priced_ms(model, table, task.batch_size) for name, model in models.items()},
        })  # fmt: skip
    return rows


def report(rows: list[dict]) -> str:
    level = {name: statistics.median(r["priced"][name] / r["measured"] for r in rows if not r["outside"]) for name in MODELS}
    lines = [
        f"# Out-of-range tables, priced against timed alone, on {local_hardware('cpu').describe()}", "",
        f"`taskset -c 1 python -m studies.out_of_range` (see the study's docstring), {datetime.date.today().isoformat()}. "
        f"A model's level: its median priced / measured over the {sum(not r['outside'] for r in rows)} in-range tables "
        f"({', '.join(f'{n} {v:.2f}' for n, v in level.items())}); / level: a table's priced / measured over it "
        "(1: priced as well as an in-range table).", "",
        "| pool | table | rows | width | pooling | outside the trained range (cpu.pt) | measured ms | "
        + " | ".join(f"{n} ms | {n} / level" for n in MODELS) + " |",
        "|---|---|---|---|---|---|---|" + "---|---|" * len(MODELS),
    ]  # fmt: skip
    for r in rows:
        t = r["table"]
        cells = " | ".join(f"{r['priced'][n]:.1f} | {r['priced'][n] / r['measured'] / level[n]:.2f}" for n in MODELS)
        lines.append(
            f"| {r['pool_seed']} | {t.name} | {t.rows:,} | {t.dim} | {t.pooling_factor:.1f} "
            f"| {'; '.join(r['outside']) if r['outside'] else 'in range'} | {r['measured']:.2f} | {cells} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    torch.set_num_threads(1)
    models = {name: NeuralCostModel.load(path) for name, path in MODELS.items()}
    rows = [r for pool_seed in POOL_SEEDS for r in rows_of_pool(pool_seed, models)]
    text = report(rows)
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
