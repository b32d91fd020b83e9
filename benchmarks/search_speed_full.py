"""Planning time at production scale: NeuroShard and TorchRec's planner on full-size tasks.

    python -m benchmarks.search_speed --full-size                 # plan every row, then report
    python -m benchmarks.search_speed --full-size --report-only   # the table of the rows kept
    python -m benchmarks.search_speed --full-size --planners neuroshard --tasks 856x8 --profile

Tasks (``task_for``): a synthetic pool at FULL size (``benchmarks.fullsize``: rows as in
the pool, global batch 65,536, H200s of 141 GB in hosts of 8): its 856 tables on D = 8,
16, 32, 64, 128, and the pool drawn with replacement at random widths, 5,000 tables on 256
and 1,024 GPUs and 10,000 on 1,024. ``--pools``: the held-out pools by default
(``HELD_OUT_POOL_SEEDS``, which no training kernel came from); pool 0, the training pool,
is the rows before 2026-11-29.

NeuroShard is timed as a user waits for it: ``NeuroShardPlanner.plan()`` end to end on the
task's ``EmbeddingBagCollection`` (meta device, made before the clock starts), the first
plan of a fresh process (the cost model loaded inside it), each table's pooling factor as a constraint and its access
histogram given (rows before 2026-11-29 timed ``search`` on the task, not ``plan()``).
Each (task, planner) runs in a fresh process on one thread (``--one``), so its peak
resident memory is its own: the row keeps the planning time (wall and CPU), the peak RSS
and the RSS before planning (the interpreter, torch and the task), the code's commit, and
the plan's step as NeuroShard's own H200 model predicts it (``predicted_ms``: the objective
our search minimises, so it compares our code before and after, not us with TorchRec; a
plan with tables on UVM kernels, as TorchRec's may be, is checked in its topology's host
memory and priced with the shipped UVM pricing; rows before 2026-11-27 with the stand-in).
TorchRec runs as its users run it (``benchmarks.fullsize.plan_with``): its default
proposers under its own ``timeout_seconds`` and ``DynamicProgrammingProposer``; a failure
is a row with its error. Re-running resumes: NeuroShard is planned once per commit and
pool, TorchRec once per pool. ``--profile`` adds NeuroShard's cumulative profile (top
entries) to its row.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from threadpoolctl import threadpool_limits

from torchrec_neuroshard.lab.workloads import HELD_OUT_POOL_SEEDS

HERE = Path(__file__).parent
OUT = HERE / "results" / "search_speed_full.jsonl"
TASKS = ((856, 8), (856, 16), (856, 32), (856, 64), (856, 128), (5000, 256), (5000, 1024), (10000, 1024))
PLANNERS = ("neuroshard", "torchrec_dp", "torchrec_timeout")
HBM_BYTES = int(141e9)
TORCHREC_MEMORY_GB = 16
"""Address space a TorchRec run may take (of this machine's 24 GB), so that a run that
would exhaust the machine ends in its own MemoryError, reported as its row."""


def task_for(num_tables: int, num_devices: int, pool: int = 0):
    """The full-size task of ``num_tables`` tables of pool ``pool`` on ``num_devices`` H200s."""
    from benchmarks.fullsize import FULL_SIZE
    from torchrec_neuroshard.lab.workloads import generate_task, synthetic_pool

    task = generate_task(synthetic_pool(seed=pool), num_tables, num_devices, FULL_SIZE, seed=0)
    return dataclasses.replace(task, memory_cap_bytes=HBM_BYTES)


def planner_for(task):
    """NeuroShard's planner for ``task`` as a user sets it up, with what its ``plan()`` takes:
    H200s of ``HBM_BYTES`` in hosts of 8, pooling factors as constraints, access histograms;
    the tables as one meta-device ``EmbeddingBagCollection`` and TorchRec's default sharder."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import ParameterConstraints, Topology

    from benchmarks.fullsize import GPUS_PER_HOST
    from torchrec_neuroshard import NeuroShardPlanner
    from torchrec_neuroshard.tables import module_for_tables

    topology = Topology(
        world_size=task.num_devices, compute_device="cuda", hbm_cap=HBM_BYTES, local_world_size=min(GPUS_PER_HOST, task.num_devices)
    )
    planner = NeuroShardPlanner(
        topology, task.per_rank_batch, constraints={t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in task.tables},
        debug=False, access_hists={t.name: t.access_hist for t in task.tables},
    )  # fmt: skip
    return planner, module_for_tables(task.tables), [EmbeddingBagCollectionSharder()]


def commit() -> str:
    """The commit of the ``torchrec_neuroshard`` this process imports."""
    import torchrec_neuroshard

    where = Path(torchrec_neuroshard.__file__).parent
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True).stdout.strip()


def plan_one(num_tables: int, num_devices: int, pool: int, planner: str, timeout: int, profile: bool) -> dict:
    """One row: plan, time and measure one (task, planner) in this process."""
    from benchmarks.fullsize import as_planned, plan_with, topology_for
    from torchrec_neuroshard.costmodel import cost_model_for, load_pretrained
    from torchrec_neuroshard.search import predicted_breakdown
    from torchrec_neuroshard.types import Links

    if planner != "neuroshard":
        limit = TORCHREC_MEMORY_GB * 2**30
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    task = task_for(num_tables, num_devices, pool)
    row = {"tables": num_tables, "devices": num_devices, "pool_seed": pool, "planner": planner, "commit": commit()}
    planner_args = planner_for(task) if planner == "neuroshard" else None  # the model a user already has
    row["base_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    profiler = cProfile.Profile() if profile and planner == "neuroshard" else None
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        if profiler:
            profiler.enable()
        if planner_args is not None:
            ours, module, sharders = planner_args
            ours.plan(module, sharders)
            plan, about = ours.plan_, {"note": f"{ours.search_result_.states_evaluated} split states"}
        else:
            plan, about = plan_with(planner, task, None, timeout)
        if profiler:
            profiler.disable()
        row.update(planning_s=round(time.perf_counter() - wall, 2), cpu_s=round(time.process_time() - cpu, 2))
        topology = topology_for(task)
        task = dataclasses.replace(task, links=Links.of(topology))  # replicas' all-reduce priced on the links, as the planner does
        model = cost_model_for(topology, load_pretrained("h200")).with_batch_size(task.batch_size)
        task, model = as_planned(task, model, plan, topology)
        plan.validate(task)
        row.update(status="ok", note=about["note"], predicted_ms=predicted_breakdown(model, task, plan)[0])
    except Exception as e:  # noqa: BLE001 - a planner failing is a result
        row.setdefault("planning_s", round(time.perf_counter() - wall, 2))
        row["status"] = f"no plan: {type(e).__name__}: {str(e)[:300]}"
    row["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(14)
        row["profile"] = "ncalls" + text.getvalue().split("ncalls", 1)[1].rstrip()
    return row


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_all(tasks: list[tuple[int, int]], planners: list[str], timeout: int, profile: bool, out: Path, pools: Sequence[int] = (0,)) -> None:
    """Every (task, pool, planner) not yet in ``out``, each in its own process: NeuroShard
    once per commit of ours, TorchRec's planner once (our commits do not change it)."""
    here = commit()
    done = {_key(r, here) for r in read_rows(out)}
    for pool in pools:
        for tables, devices in tasks:
            for planner in planners:
                row = {"tables": tables, "devices": devices, "pool_seed": pool, "planner": planner, "commit": here}
                if _key(row, here) in done:
                    continue
                flags = ["--one", f"{tables}x{devices}", planner, "--pools", str(pool), "--torchrec-timeout", str(timeout)]
                child = subprocess.run(
                    [sys.executable, "-m", "benchmarks.search_speed_full", *flags, *(["--profile"] if profile else [])],
                    cwd=HERE.parent, capture_output=True, text=True,
                )
                lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
                row = json.loads(lines[-1]) if lines else {**row, "status": f"no plan: the process ended with code {child.returncode}: {child.stderr.strip()[-300:]}"}
                print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")


def _key(row: dict, here: str) -> tuple:
    """What a row is kept under: its task, pool (rows without one: pool 0) and planner, and
    for NeuroShard the commit (``here`` standing for any other planner's)."""
    return (row["tables"], row["devices"], row.get("pool_seed", 0), row["planner"], row["commit"] if row["planner"] == "neuroshard" else here)


def parse_task(text: str) -> tuple[int, int]:
    tables, devices = text.lower().split("x")
    return int(tables), int(devices)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=parse_task, nargs="+", default=list(TASKS), help="TABLESxDEVICES, e.g. 856x8")
    p.add_argument("--planners", nargs="+", default=list(PLANNERS), choices=PLANNERS)
    p.add_argument("--pools", type=int, nargs="+", default=list(HELD_OUT_POOL_SEEDS[:3]), help="pool seeds (0: the training pool)")
    p.add_argument("--torchrec-timeout", type=int, default=300, help="TorchRec's own timeout_seconds")
    p.add_argument("--profile", action="store_true", help="keep NeuroShard's cumulative profile in its rows")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--one", nargs=2, metavar=("TASK", "PLANNER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        torch.set_num_threads(1)
        with threadpool_limits(limits=1):
            print(json.dumps(plan_one(*parse_task(args.one[0]), args.pools[0], args.one[1], args.torchrec_timeout, args.profile)))
        return
    if not args.report_only:
        run_all(args.tasks, args.planners, args.torchrec_timeout, args.profile, args.out, args.pools)
    from benchmarks.search_speed_report import report
    from torchrec_neuroshard.hardware import local_hardware

    text = (
        f"# Planning at production scale\n\n`python -m benchmarks.search_speed --full-size` "
        f"(rows in [{args.out.name}]({args.out.name}); this table: `--report-only`), written "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {local_hardware('cpu').describe()}, "
        "each planner on one thread in its own process.\n\n" + report(read_rows(args.out)) + "\n"
    )
    print(text)
    args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
