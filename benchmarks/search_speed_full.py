"""Planning time at production scale: NeuroShard and TorchRec's planner on full-size tasks.

    python -m benchmarks.search_speed --full-size                 # plan every row, then report
    python -m benchmarks.search_speed --full-size --report-only   # the table of the rows kept
    python -m benchmarks.search_speed --full-size --planners neuroshard --tasks 856x8 --profile

Tasks (``task_for``): the synthetic pool at FULL size (``benchmarks.fullsize``: rows as in
the pool, global batch 65,536, H200s of 141 GB in hosts of 8): the 856-table task of
``fullsize`` (seed 0) on D = 8, 16, 32, 64, 128, and the pool drawn with replacement at
random widths, 5,000 tables on 256 and 1,024 GPUs and 10,000 on 1,024.

Each (task, planner) runs in a fresh process on one thread (``--one``), so its peak
resident memory is its own: the row keeps the planning time (wall and CPU), the peak RSS
and the RSS before planning (the interpreter, torch and the task), the code's commit, and
the plan's step as NeuroShard's own H200 model predicts it (``predicted_ms``: the objective
our search minimises, so it compares our code before and after, not us with TorchRec; a
plan with tables on UVM kernels, as TorchRec's may be, is checked in its topology's host
memory and priced with the shipped UVM pricing; rows before 2026-11-27 with the stand-in).
TorchRec runs as its users run it (``benchmarks.fullsize.plan_with``): its default
proposers under its own ``timeout_seconds`` and ``DynamicProgrammingProposer``; a failure
is a row with its error. Re-running resumes: NeuroShard is planned once per commit,
TorchRec once. ``--profile`` adds NeuroShard's cumulative profile (top entries) to its row.
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

import torch
from threadpoolctl import threadpool_limits

HERE = Path(__file__).parent
OUT = HERE / "results" / "search_speed_full.jsonl"
TASKS = ((856, 8), (856, 16), (856, 32), (856, 64), (856, 128), (5000, 256), (5000, 1024), (10000, 1024))
PLANNERS = ("neuroshard", "torchrec_dp", "torchrec_timeout")
HBM_BYTES = int(141e9)
TORCHREC_MEMORY_GB = 16
"""Address space a TorchRec run may take (of this machine's 24 GB), so that a run that
would exhaust the machine ends in its own MemoryError, reported as its row."""


def task_for(num_tables: int, num_devices: int):
    """The full-size task of ``num_tables`` tables on ``num_devices`` H200s (seed 0)."""
    from benchmarks.fullsize import FULL_SIZE, full_size_task
    from torchrec_neuroshard.lab.workloads import DLRM_NUM_TABLES, generate_task, synthetic_pool

    if num_tables == DLRM_NUM_TABLES:
        return full_size_task(num_devices, HBM_BYTES)
    task = generate_task(synthetic_pool(), num_tables, num_devices, FULL_SIZE, seed=0)
    return dataclasses.replace(task, memory_cap_bytes=HBM_BYTES)


def commit() -> str:
    """The commit of the ``torchrec_neuroshard`` this process imports."""
    import torchrec_neuroshard

    where = Path(torchrec_neuroshard.__file__).parent
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True).stdout.strip()


def plan_one(num_tables: int, num_devices: int, planner: str, timeout: int, profile: bool) -> dict:
    """One row: plan, time and measure one (task, planner) in this process."""
    from benchmarks.fullsize import as_planned, plan_with, topology_for
    from torchrec_neuroshard.costmodel import cost_model_for, load_pretrained
    from torchrec_neuroshard.search import predicted_breakdown

    if planner != "neuroshard":
        limit = TORCHREC_MEMORY_GB * 2**30
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    task = task_for(num_tables, num_devices)
    model = cost_model_for(topology_for(task), load_pretrained("h200")).with_batch_size(task.batch_size)
    row = {"tables": num_tables, "devices": num_devices, "planner": planner, "commit": commit()}
    row["base_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    profiler = cProfile.Profile() if profile and planner == "neuroshard" else None
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        if profiler:
            profiler.enable()
        plan, about = plan_with(planner, task, model, timeout)
        if profiler:
            profiler.disable()
        row.update(planning_s=round(time.perf_counter() - wall, 2), cpu_s=round(time.process_time() - cpu, 2))
        task, model = as_planned(task, model, plan, topology_for(task))
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


def run_all(tasks: list[tuple[int, int]], planners: list[str], timeout: int, profile: bool, out: Path) -> None:
    """Every (task, planner) not yet in ``out``, each in its own process: NeuroShard once
    per commit of ours, TorchRec's planner once (our commits do not change it)."""
    here = commit()
    done = {(r["tables"], r["devices"], r["planner"], r["commit"] if r["planner"] == "neuroshard" else "") for r in read_rows(out)}
    for tables, devices in tasks:
        for planner in planners:
            if (tables, devices, planner, here if planner == "neuroshard" else "") in done:
                continue
            flags = ["--one", f"{tables}x{devices}", planner, "--torchrec-timeout", str(timeout)] + (["--profile"] if profile else [])
            child = subprocess.run(
                [sys.executable, "-m", "benchmarks.search_speed_full", *flags], cwd=HERE.parent, capture_output=True, text=True
            )
            lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if lines else {
                "tables": tables, "devices": devices, "planner": planner, "commit": here,
                "status": f"no plan: the process ended with code {child.returncode}: {child.stderr.strip()[-300:]}",
            }  # fmt: skip
            print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


def parse_task(text: str) -> tuple[int, int]:
    tables, devices = text.lower().split("x")
    return int(tables), int(devices)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=parse_task, nargs="+", default=list(TASKS), help="TABLESxDEVICES, e.g. 856x8")
    p.add_argument("--planners", nargs="+", default=list(PLANNERS), choices=PLANNERS)
    p.add_argument("--torchrec-timeout", type=int, default=300, help="TorchRec's own timeout_seconds")
    p.add_argument("--profile", action="store_true", help="keep NeuroShard's cumulative profile in its rows")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--one", nargs=2, metavar=("TASK", "PLANNER"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        torch.set_num_threads(1)
        with threadpool_limits(limits=1):
            print(json.dumps(plan_one(*parse_task(args.one[0]), args.one[1], args.torchrec_timeout, args.profile)))
        return
    if not args.report_only:
        run_all(args.tasks, args.planners, args.torchrec_timeout, args.profile, args.out)
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
