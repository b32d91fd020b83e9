"""A standing check of NeuroShard's search against its own objective (issue 40): on each task,
TorchRec's plan must not be priced below ours by the model ``NeuroShardPlanner`` planned with.

    taskset -c 1 python -m benchmarks.vs_torchrec_objective            # every task
    taskset -c 1 python -m benchmarks.vs_torchrec_objective --strict   # exit 1 on a FAILURE

Both planners plan each task through their public APIs, as users run them: one
``EmbeddingBagCollection`` on the meta device, TorchRec's default sharders, the task's
``Topology``, the PER-RANK ``batch_size``, every table's pooling factor as
``ParameterConstraints(pooling_factors=[...])``, and NO storage reservation for either
(``FixedPercentageStorageReservation(0.0)`` for TorchRec, ``storage_reservation=0.0`` for
ours), so both plan in the same memory. TorchRec's ``EmbeddingShardingPlanner`` runs with its
default proposers and its own ``timeout_seconds`` (``TORCHREC_TIMEOUT``; a plan it cut short
says so), under no alarm of ours.

Both plans are then priced by OUR model: the planner's own, on the planner's own task
(``NeuroShardPlanner.task_``: the global batch, the topology's links and memory), with the
shipped UVM pricing beyond HBM (``planner._priced_model()``, which prices a fused kernel as
the model alone does), by ``search.predicted_breakdown``. That is the objective our search
minimised, so the price is NO judge of the plans (the GPU measurements are,
``benchmarks/uvm_gpu.py``, ``benchmarks/scale.py``); it checks the search: a planner whose own
objective prefers the baseline's plan has a search hole, and each such task is a FAILURE line.

Writes ``results/vs_torchrec_objective.jsonl`` and ``results/vs_torchrec_objective.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from threadpoolctl import threadpool_limits

from torchrec_neuroshard.hardware import local_hardware

HERE = Path(__file__).parent
OUT = HERE / "results" / "vs_torchrec_objective.jsonl"
GiB = 1024**3
TORCHREC_TIMEOUT = 120
"""TorchRec's own ``timeout_seconds``: past it, its best plan so far (the row says so)."""
PER_RANK_BATCH = 512
"""TorchRec's default ``batch_size`` (per rank); the global batch is it x the world size."""


@dataclass(frozen=True)
class Tables:
    """``count`` tables alike: rows, embedding dim, pooling factor."""

    count: int
    rows: int
    dim: int
    pooling: float


@dataclass(frozen=True)
class Case:
    """One task: its tables, and the topology both planners get."""

    name: str
    tables: tuple[Tables, ...]
    world_size: int
    device: str
    memory_gib: float
    """each rank's memory: hbm on cuda, ddr on cpu."""
    host_gib: float | None = None
    """each rank's host memory (ddr) on cuda, where the UVM kernels keep tables."""
    local_world_size: int | None = None
    """ranks per host (TorchRec's default: all on one)."""

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu") or (self.device == "cpu" and self.host_gib is not None):
            raise ValueError(f"case {self.name}: device 'cuda' (host_gib optional) or 'cpu' (no host_gib), not {self.device!r}")

    def topology(self):
        from torchrec.distributed.planner import Topology

        caps = {"hbm_cap": int(self.memory_gib * GiB)} if self.device == "cuda" else {"ddr_cap": int(self.memory_gib * GiB)}
        if self.host_gib is not None:
            caps["ddr_cap"] = int(self.host_gib * GiB)
        return Topology(self.world_size, self.device, local_world_size=self.local_world_size, **caps)

    def configs(self) -> list:
        """The tables as TorchRec configs, named t0, t1, ... in order."""
        from torchrec.modules.embedding_configs import EmbeddingBagConfig

        sizes = [(group.rows, group.dim) for group in self.tables for _ in range(group.count)]
        return [
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
            for i, (rows, dim) in enumerate(sizes)
        ]

    def constraints(self) -> dict:
        from torchrec.distributed.planner import ParameterConstraints

        poolings = [group.pooling for group in self.tables for _ in range(group.count)]
        return {f"t{i}": ParameterConstraints(pooling_factors=[pooling]) for i, pooling in enumerate(poolings)}


def _cases() -> tuple[Case, ...]:
    big = Tables(12, 50_000_000, 128, 20.0)
    issue = dict(world_size=8, device="cuda", memory_gib=32, host_gib=512)  # issue 40's topology
    return (
        Case("12 x 50M", (big,), **issue),
        Case("16 x 50M", (Tables(16, 50_000_000, 128, 20.0),), **issue),
        Case("24 x 50M", (Tables(24, 50_000_000, 128, 20.0),), **issue),
        Case("12 x 50M + 40 x 1M", (big, Tables(40, 1_000_000, 128, 20.0)), **issue),
        Case("16 x 50M, pooling 2", (Tables(16, 50_000_000, 128, 2.0),), **issue),
        Case("2 TB: 40 x 100M", (Tables(40, 100_000_000, 128, 20.0),), 64, "cuda", 80, 1024, 8),
        Case("in HBM: 48 mixed", (Tables(16, 10_000_000, 128, 20.0), Tables(32, 500_000, 64, 5.0)), 16, "cuda", 80, 512, 8),
        Case("128 GPUs: 64 x 20M", (Tables(64, 20_000_000, 128, 20.0),), 128, "cuda", 80, 1024, 8),
        Case("cpu: 26 mixed", (Tables(6, 5_000_000, 64, 10.0), Tables(20, 100_000, 64, 2.0)), 8, "cpu", 64),
        Case("cpu: 32 x 2M", (Tables(32, 2_000_000, 128, 20.0),), 16, "cpu", 16),
    )


CASES = _cases()


def plan_ours(case: Case, module, sharders) -> tuple:
    """(``NeuroShardPlanner`` after planning, planning seconds)."""
    from torchrec_neuroshard.planner import NeuroShardPlanner

    start = time.perf_counter()
    planner = NeuroShardPlanner(
        case.topology(), PER_RANK_BATCH, storage_reservation=0.0, constraints=case.constraints(), debug=False
    )  # fmt: skip
    planner.plan(module, sharders)
    return planner, time.perf_counter() - start


def plan_theirs(case: Case, module, sharders):
    """TorchRec's planner run once (``lab.torchrec_baseline.timed_run``)."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation

    from torchrec_neuroshard.lab.torchrec_baseline import timed_run

    return timed_run(
        lambda: EmbeddingShardingPlanner(
            case.topology(), PER_RANK_BATCH, storage_reservation=FixedPercentageStorageReservation(0.0),
            constraints=case.constraints(), timeout_seconds=TORCHREC_TIMEOUT,
        ),
        module, sharders,
    )  # fmt: skip


def about(plan, task, model) -> dict:
    """A plan priced by ``model`` on ``task`` (ms), its kinds/kernels, and its empty devices:
    those holding no shard (a replica on every rank does not count)."""
    from torchrec_neuroshard.search import predicted_breakdown
    from torchrec_neuroshard.types import ShardingKind

    cost, _ = predicted_breakdown(model, task, plan)
    used = {d for p in plan.placements if p.kind is not ShardingKind.DATA_PARALLEL for d in p.devices}
    return {
        "ms": cost,
        "kernels": dict(Counter(f"{p.kind.value}/{p.kernel.value}" for p in plan.placements)),
        "empty_devices": plan.num_devices - len(used),
    }


def run_case(case: Case) -> dict:
    """Both planners on ``case``, both plans priced by our planner's own model and task."""
    from torchrec.distributed.sharding_plan import get_default_sharders
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_neuroshard.sharding import from_torchrec, sharder_load_factors

    module = EmbeddingBagCollection(tables=case.configs(), device=torch.device("meta"))
    sharders = get_default_sharders()
    row: dict = {"case": case.name, "devices": case.world_size, "device": case.device, "tables": len(case.configs())}
    theirs = plan_theirs(case, module, sharders)
    row["torchrec_s"], row["torchrec_status"] = round(theirs.seconds, 2), theirs.status
    planner, seconds = plan_ours(case, module, sharders)
    row["neuroshard_s"] = round(seconds, 2)
    task, model = planner.task_, planner._priced_model()
    row["neuroshard"] = about(planner.plan_, task, model)
    if planner.search_result_ is not None:  # its search's own price: the same (none when the offload stage decided every table)
        row["neuroshard"]["searched_ms"] = planner.search_result_.predicted_cost_ms
    if theirs.plan is not None:
        plan = from_torchrec(theirs.plan, case.world_size, sharder_load_factors(module, sharders))
        row["torchrec"] = about(plan, task, model)
        row["ratio"] = row["neuroshard"]["ms"] / row["torchrec"]["ms"]
    return row


def line(row: dict) -> str:
    """One row as printed; a FAILURE line where TorchRec's plan is priced below ours."""
    ours = row["neuroshard"]
    if "torchrec" not in row:
        return f"{row['case']}: ours {ours['ms']:.3f} ms; TorchRec {row['torchrec_status']}"
    theirs = row["torchrec"]
    text = (
        f"{row['case']}: ours {ours['ms']:.3f} ms, TorchRec's {theirs['ms']:.3f} ms, ratio {row['ratio']:.3f}; "
        f"planning s {row['neuroshard_s']} / {row['torchrec_s']}; empty devices {ours['empty_devices']} / {theirs['empty_devices']}; "
        f"ours {_plan(ours)}; TorchRec's {_plan(theirs)}"
    )
    return ("FAILURE: TorchRec's plan priced below ours: " if failed(row) else "") + text


def report(rows: list[dict]) -> str:
    """The table of ``rows``: both prices, ratio, planning s, plans and empty devices."""
    lines = [
        "| task | D | device | tables | ours ms | TorchRec's ms | ours / TorchRec's | planning s ours / TorchRec | "
        "our plan | TorchRec's plan | empty devices ours / TorchRec's |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ours, theirs = r["neuroshard"], r.get("torchrec")
        status = "" if r["torchrec_status"] == "ok" else f" ({r['torchrec_status']})"
        if theirs is None:
            priced = "- | -"
        else:
            ratio = f"{r['ratio']:.3f}"
            priced = f"{theirs['ms']:.3f} | {f'**{ratio}**' if r['ratio'] > 1 else ratio}"
        lines.append(
            f"| {r['case']} | {r['devices']} | {r['device']} | {r['tables']} | {ours['ms']:.3f} | {priced} "
            f"| {r['neuroshard_s']} / {r['torchrec_s']}{status} | {_plan(ours)} | {_plan(theirs) if theirs else '-'} "
            f"| {ours['empty_devices']} / {theirs['empty_devices'] if theirs else '-'} |"
        )
    failures = sum(1 for r in rows if failed(r))
    return "\n".join(lines) + f"\n\n{failures} of {len(rows)} tasks: TorchRec's plan priced below ours (ratio > 1, in bold).\n"


def failed(row: dict) -> bool:
    """Whether our model prices TorchRec's plan below ours: a hole in our search."""
    return "ratio" in row and row["ratio"] > 1


def _plan(priced: dict) -> str:
    return ", ".join(f"{kernel} {count}" for kernel, count in sorted(priced["kernels"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", help="run only the tasks of these names (default all)")
    p.add_argument("--strict", action="store_true", help="exit 1 when any task is a FAILURE")
    p.add_argument("--out", type=Path, default=OUT, help="rows (jsonl); the report goes beside it (.md)")
    args = p.parse_args(argv)
    cases = [c for c in CASES if args.cases is None or c.name in args.cases]
    if args.cases and len(cases) != len(args.cases):
        p.error(f"--cases: unknown names {sorted(set(args.cases) - {c.name for c in CASES})}; known: {[c.name for c in CASES]}")
    logging.disable(logging.WARNING)  # TorchRec's topology warning, once per plan
    torch.set_num_threads(1)
    rows = []
    with threadpool_limits(limits=1):
        for case in cases:
            rows.append(run_case(case))
            print(line(rows[-1]), flush=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    command = "python -m benchmarks.vs_torchrec_objective " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (
        "# NeuroShard's search against its own objective: TorchRec's plans priced by our model (issue 40)\n\n"
        f"`{command.strip()}` ({time.strftime('%Y-%m-%d')}, {local_hardware('cpu').describe()}, one thread). Both plans "
        "priced by the model and task NeuroShardPlanner planned with (PREDICTED ms, our objective: no judge of the "
        f"plans, a check of the search); per-rank batch {PER_RANK_BATCH}, no storage reservation, TorchRec's default "
        f"proposers with timeout_seconds={TORCHREC_TIMEOUT}. Empty devices: holding no shard.\n\n" + report(rows)
    )
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 1 if args.strict and any(failed(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
