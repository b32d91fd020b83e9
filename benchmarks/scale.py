"""856 tables on 8 to 128 devices, MEASURED device by device, on pools the model never saw.

    python -m benchmarks.scale plan      # every planner plans every (pool, D): results/scale_planned.jsonl.gz
    python -m benchmarks.scale keep --planners neuroshard --as neuroshard_LABEL  # before a re-plan: judge both
    python -m benchmarks.scale measure   # the judge times every device here (resumable): results/scale_measured.jsonl.gz
    python -m benchmarks.scale final     # each plan's slowest devices timed side by side (lab.final_round), beside the rows
    python -m benchmarks.scale report    # benchmarks/results/scale.md

The tasks: 856 tables of a synthetic pool at the CPU scale (rows / 64, global batch 4,096,
each table at a random width, ``generate_task`` seed 1: the same tables at every D), per
device memory 1.3 x an even share. By default the pools are the first three held-out seeds
(``workloads.HELD_OUT_POOL_SEEDS``), never seen by a training kernel; ``--pool-seeds 0``
adds the training pool, whose rows the report labels so.

Planners: NeuroShard (``search`` with the shipped CPU model, or ``--model``, its collectives
priced by the topology's links as TorchRec's are: ``priced_by_links``; the model's own comm
prices gloo on this machine's loopback, which an emulated cluster's devices would not pay
and the judge does not time; planned with it, NeuroShard traded kernel time for it); TorchRec's
``EmbeddingShardingPlanner`` as its users run it (per-rank batch, pooling factors as
constraints, its own ``timeout_seconds``, default proposers) on the task's CPU topology,
and on a cuda topology of the same memory (``torchrec_gpu_topology``: the plan a GPU user
gets; it sends tables to UVM kernels, so it is planned, not timed);
``DynamicProgrammingProposer`` (a CPU topology makes it divide by zero: its row says so); the five heuristics. Each planning row records the 1-min
load average before and after it, so a TorchRec plan made on a busy machine shows.

The judge is not our cost model: ``lab.judge`` times each device of every plan here, as
DMP runs it (fused kernels, the data-parallel tables' dense kernel and update), in passes
of opposite device order, draws of ids and interleaved rounds, each time divided by a fixed
reference's in the same round (``--no-reference``: not), and the first plan (NeuroShard's)
built and timed twice, the run's A/A check (``--no-copy``: not). ``final`` then times each
plan's ``--top`` slowest devices by the passes together, in the same rounds, with no
reference (``--top 1`` at D = 8 on a 24 GB machine: the contenders are built at once).
Plans are kept with their rows, so a re-measure never re-plans.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import torch
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from benchmarks.fullsize import PLANNERS as FULLSIZE_PLANNERS
from benchmarks.fullsize import plan_with
from benchmarks.search_speed_full import commit
from benchmarks.scale_report import MEASURED, PLANNED, file_sha256, last_judged, latest_plans, ok_rows, plans_digest, write_report
from torchrec_neuroshard.costmodel import cost_model_for, model_file
from torchrec_neuroshard.costmodel.shipped import priced_by_links
from torchrec_neuroshard.hardware import local_hardware, vector_isa
from torchrec_neuroshard.lab.collect import append_rows, read_rows
from torchrec_neuroshard.lab.evaluate import task_lookups
from torchrec_neuroshard.lab.final_round import contenders, free_memory_bytes, time_final
from torchrec_neuroshard.lab.judge import COPY, FINAL, REFERENCE, JudgeConfig, judge_plans, with_copy
from torchrec_neuroshard.lab.judgement import judgements
from torchrec_neuroshard.lab.measure_compute import cpu_threads
from torchrec_neuroshard.lab.torchrec_baseline import topology_for as torchrec_topology
from torchrec_neuroshard.lab.workloads import DLRM_NUM_TABLES, HELD_OUT_POOL_SEEDS, WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.search import predicted_breakdown
from torchrec_neuroshard.types import Links, Plan, Task

DEVICES = (8, 16, 32, 64, 128)
POOL_SEEDS = HELD_OUT_POOL_SEEDS[:3]
TASK_SEED = 1
GPU_TOPOLOGY = "torchrec_gpu_topology"
PLANNERS = (*FULLSIZE_PLANNERS, GPU_TOPOLOGY)
MEASURED_PLANNERS = ("neuroshard", "neuroshard_measured_comm", "torchrec_timeout", "lookup", "size_lookup")
"""Timed by default (those with a plan): the two heuristics that were the best at every D on
pool 0 (the others' plans are kept, and ``--planners`` times them too). TorchRec's plans for
the GPU topology put tables on UVM kernels (at this scale's memory), which a CPU cannot time."""


def scale_task(num_devices: int, pool_seed: int, scale: WorkloadScale = WorkloadScale()) -> Task:
    """The benchmark's task: 856 tables of pool ``pool_seed`` on ``num_devices``, at ``scale``
    (the CPU's rows / 64 by default; ``benchmarks.scale_full`` takes them at full size)."""
    return generate_task(synthetic_pool(seed=pool_seed), DLRM_NUM_TABLES, num_devices, scale, seed=TASK_SEED)


# ---------------------------------------------------------------- plan


def _plan_one(name: str, task: Task, model, torchrec_timeout: int) -> tuple[Plan, dict]:
    if name.startswith("neuroshard"):
        return plan_with("neuroshard", task, model, torchrec_timeout)
    if name == GPU_TOPOLOGY:
        return plan_with("torchrec_timeout", task, model, torchrec_timeout, device_type="cuda")
    return plan_with(name, task, model, torchrec_timeout, device_type="cpu")


def planning_model(num_devices: int, pool_seed: int, model_path: str | None = None, measured_comm: bool = False):
    """(the task as NeuroShardPlanner gets it, the model that plans and prices it)."""
    task = scale_task(num_devices, pool_seed)
    topology = torchrec_topology(task, "cpu")
    task = dataclasses.replace(task, links=Links.of(topology))
    model = cost_model_for(topology, model_path or "cpu").with_batch_size(task.batch_size)
    if not measured_comm:  # the emulated devices' collectives run on a cluster's links, not this machine's loopback
        model = priced_by_links(model, topology)
    return task, model


def price_with_shipped(pool_seed: int, num_devices: int, rows: dict[str, dict]) -> None:
    """Every plan in ``rows`` (a task's last row per planner) whose predictions are not the
    shipped model's of now (the baselines', an older shipped file's) priced again by it,
    in place, as ``plan_all`` prices; rows of another ``--model`` file keep their own."""
    sha = file_sha256(model_file("cpu"))
    stale = [n for n, r in rows.items() if r["status"] == "ok" and r.get("model", "shipped cpu.pt") == "shipped cpu.pt" and r.get("model_sha256") != sha]
    if not stale:
        return
    task, model = planning_model(num_devices, pool_seed)
    for name in stale:
        _, devices = predicted_breakdown(model, task, Plan.from_dict(rows[name]["plan"]))
        rows[name] = {**rows[name], "model_sha256": sha, "predicted_ms": [round(d.compute, 4) for d in devices]}


def planned_row(row: dict, plan_one: Callable[[], tuple[Plan, dict]], priced: Callable[[Plan], tuple[Task, object]]) -> dict:
    """``row`` completed by one planner's run: planning time, the 1-min load average before
    and after, and either its plan (checked and priced per device by ``priced(plan)``'s task
    and model) or how it failed. Printed as it ends."""
    row = {**row, "load_before": round(os.getloadavg()[0], 2)}
    t0 = time.perf_counter()
    try:
        plan, about = plan_one()
        row["planning_s"] = round(time.perf_counter() - t0, 2)
        task, model = priced(plan)
        plan.validate(task)
        _, devices = predicted_breakdown(model, task, plan)
        row.update(
            status="ok", note=about["note"], kinds=dict(Counter(p.kind.value for p in plan.placements)),
            predicted_ms=[round(d.compute, 4) for d in devices], plan=plan.to_dict(),
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - a planner failing is a result
        row.setdefault("planning_s", round(time.perf_counter() - t0, 2))
        row["status"] = f"no plan: {type(e).__name__}: {str(e)[:300]}"
    row["load_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps({k: v for k, v in row.items() if k not in ("predicted_ms", "plan")}), flush=True)
    return row


def plan_all(
    num_devices: int, pool_seed: int, torchrec_timeout: int, planners: Sequence[str], model_path: str | None, measured_comm: bool = False
) -> None:
    """``planners`` on one task: a row each, with its plan, appended to ``PLANNED`` (the
    report and the judge read the last row of each). ``measured_comm``: NeuroShard prices
    collectives by its model's own (gloo) comm, not the topology's links."""
    task, model = planning_model(num_devices, pool_seed, model_path, measured_comm)
    planned_by = {"commit": commit(), "cpu": judged_on()}
    for name in planners:
        row = {"pool_seed": pool_seed, "devices": num_devices, "planner": name, **planned_by}
        if name.startswith("neuroshard"):
            row.update(
                model=str(model_path or "shipped cpu.pt"), model_sha256=file_sha256(model_file(model_path or "cpu")),
                comm="the model's (gloo)" if measured_comm else "the topology's links",
            )  # fmt: skip
        append_rows(PLANNED, [planned_row(row, lambda: _plan_one(name, task, model, torchrec_timeout), lambda plan: (task, model))])


def keep(num_devices: int, pool_seed: int, planner: str, label: str) -> None:
    """The last plan of ``planner`` on one task appended again as planner ``label``, its
    model named by its digest: so a re-plan by a changed model is judged beside the plan it
    replaces (``plan`` after ``keep``)."""
    row = latest_plans(read_rows(PLANNED), pool_seed, num_devices)[planner]
    kept = {**row, "planner": label, "model": f"{row.get('model', 'shipped cpu.pt')} of sha256 {row.get('model_sha256', '?')}"}
    kept["note"] = "; ".join(filter(None, [row.get("note"), f"{planner}'s plan, kept"]))
    append_rows(PLANNED, [kept])


# ---------------------------------------------------------------- measure


def measure(num_devices: int, pool_seed: int, planners: Sequence[str], config: JudgeConfig, draws: list) -> None:
    """The judge over the last plans of ``planners`` (those with one) on one task, rows
    appended to ``MEASURED`` (``judge_task``)."""
    judge_task(num_devices, pool_seed, stored_plans(num_devices, pool_seed, planners), config, draws, MEASURED)


def stored_plans(num_devices: int, pool_seed: int, planners: Sequence[str]) -> dict[str, Plan]:
    """The last plans of ``planners`` on one task, those that made one (``scale_report.ok_rows``)."""
    return {n: Plan.from_dict(r["plan"]) for n, r in ok_rows(read_rows(PLANNED), pool_seed, num_devices, planners).items()}


def task_draws(num_devices: int, pool_seed: int, draws: int, first: int = 0) -> list:
    """The ``draws`` draws of ids of one task the judge times every plan on, from draw ``first``."""
    return [task_lookups(scale_task(num_devices, pool_seed), draw=k) for k in range(first, first + draws)]


def plans_sha(plans: dict[str, Plan]) -> str:
    """The digest of a task's plans by planner name that ``judge_task``'s rows carry."""
    return plans_digest({n: p.to_dict() for n, p in plans.items()})


def judged_on() -> str:
    """The CPU a judge's and a plan's rows name: this machine and the vector instructions
    torch's CPU kernels use on it (``hardware.vector_isa``; two such EPYCs also made two
    near-tie plans)."""
    return f"{local_hardware('cpu').describe()}, {vector_isa()}"


def judge_task(num_devices: int, pool_seed: int, plans: dict[str, Plan], config: JudgeConfig, draws: list, out: Path) -> None:
    """The judge over ``plans`` of one task; rows appended to ``out`` with the digest of the
    plans (``plans_sha``), the judge's configuration and the CPU timing them, a device
    already measured for these plans on this CPU by this configuration skipped (re-run to
    resume; re-planned, on another machine or otherwise judged, all are timed again)."""
    sha = plans_sha(plans)
    key = {"pool_seed": pool_seed, "devices": num_devices, "plans_sha": sha, "cpu": judged_on()}
    done = {(r["pass"], r["device"]) for r in read_rows(out) if all(r.get(k) == v for k, v in key.items()) and JudgeConfig.of(r) == config}
    config_row = dataclasses.asdict(config)
    judge_plans(
        scale_task(num_devices, pool_seed), plans, draws, config, done,
        append=lambda measured: append_rows(out, [{**key, **config_row, **r} for r in measured]),
        progress=lambda it: tqdm(it, desc=f"pool {pool_seed} D={num_devices} devices"),
    )  # fmt: skip


def final_round(num_devices: int, pool_seed: int, plans: dict[str, Plan], top: int, out: Path, rounds: int = 6) -> None:
    """The final round (``lab.final_round``) of the task's last judged run in ``out``, over
    its ``plans``: each plan's ``top`` slowest devices by the run's passes (steadied where it
    timed a reference; the copy takes its plan's) timed side by side in ``rounds`` rounds on the
    run's draws of ids, rows appended beside the run's; nothing where the run holds its final round."""
    run = last_judged(read_rows(out), pool_seed, num_devices)
    if not run:
        raise ValueError(f"pool {pool_seed}, D = {num_devices}: no judged run in {out}: run measure first")
    config, cpu, sha = JudgeConfig.of(run[0]), judged_on(), run[0]["plans_sha"]
    if any(r.get("stage") == FINAL for r in run):
        return
    if (run[0].get("cpu"), plans_sha(plans)) != (cpu, sha):
        raise ValueError(f"pool {pool_seed}, D = {num_devices}: the last run timed plans {sha} on {run[0].get('cpu')}, not these plans on {cpu}: hold its final round there, on its plans")
    judged = judgements(run, num_devices, config)
    if set(judged) != set(plans):
        raise ValueError(f"pool {pool_seed}, D = {num_devices}: the run measured {sorted(judged)} in full, of {sorted(plans)}: run measure to the end first")
    chosen = contenders(judged, top)
    if config.copy:  # the copy's contenders are its plan's
        plans, chosen = with_copy(plans), {**chosen, COPY: chosen[next(iter(plans))]}
    draws = task_draws(num_devices, pool_seed, config.draws, config.first_draw)
    rows = time_final(scale_task(num_devices, pool_seed), plans, chosen, draws, config, memory_bytes=0.8 * free_memory_bytes(), rounds=rounds)
    key = {"pool_seed": pool_seed, "devices": num_devices, "plans_sha": sha, "cpu": cpu, **dataclasses.asdict(config), "top": top}
    append_rows(out, [{**key, **r} for r in rows])


def _planner_name(name: str) -> str:
    if name in PLANNERS or name.startswith("neuroshard_"):
        return name
    raise argparse.ArgumentTypeError(f"planner {name!r}: choose from {', '.join(PLANNERS)}, or neuroshard_LABEL")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["plan", "keep", "measure", "final", "report"])
    p.add_argument("--devices", type=int, nargs="+", default=list(DEVICES))
    p.add_argument("--pool-seeds", type=int, nargs="+", default=list(POOL_SEEDS))
    p.add_argument(
        "--planners", nargs="+", type=_planner_name,
        help="plan: these (default all of PLANNERS); measure: these (default MEASURED_PLANNERS). A name "
        "neuroshard_LABEL is NeuroShard planning with --model, kept beside the shipped model's plans",
    )  # fmt: skip
    p.add_argument("--model", help="plan: NeuroShard's cost model file (default the shipped CPU model)")
    p.add_argument("--as", dest="label", type=_planner_name, help="keep: the name the last plan of --planners (one) is kept under")
    p.add_argument("--measured-comm", action="store_true", help="plan: NeuroShard prices collectives by its model's comm (gloo here)")
    p.add_argument("--torchrec-timeout", type=int, default=300, help="TorchRec's own timeout_seconds")
    p.add_argument("--passes", type=int, default=JudgeConfig.passes)
    p.add_argument("--draws", type=int, default=JudgeConfig.draws)
    p.add_argument("--rounds", type=int, default=JudgeConfig.rounds)
    p.add_argument(
        "--first-draw", type=int, default=JudgeConfig.first_draw,
        help="measure: the first draw of ids; plans already judged are judged again as a new run on draws not timed before",
    )  # fmt: skip
    p.add_argument("--no-reference", dest="reference", action="store_false", help="measure: time no reference to steady the plans by")
    p.add_argument("--no-copy", dest="copy", action="store_false", help="measure: time no second copy of the first plan (the A/A check)")
    p.add_argument("--top", type=int, default=2, help="final: each plan's slowest devices timed side by side")
    p.add_argument("--final-rounds", type=int, default=6, help="final: rounds a draw")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with threadpool_limits(limits=1), cpu_threads(1):
        for pool_seed in args.pool_seeds if args.step != "report" else []:
            if args.step == "plan":
                for d in args.devices:
                    plan_all(d, pool_seed, args.torchrec_timeout, args.planners or PLANNERS, args.model, args.measured_comm)
                continue
            if args.step == "keep":
                if not args.label or len(args.planners or []) != 1:
                    p.error("keep: name one planner (--planners NAME) and the name to keep its plan as (--as neuroshard_LABEL)")
                for d in args.devices:
                    keep(d, pool_seed, args.planners[0], args.label)
                continue
            if args.step == "final":
                for d in args.devices:
                    run = [n for n in dict.fromkeys(r["planner"] for r in last_judged(read_rows(MEASURED), pool_seed, d)) if n not in (COPY, REFERENCE)]
                    final_round(d, pool_seed, stored_plans(d, pool_seed, run), args.top, MEASURED, args.final_rounds)
                continue
            config = JudgeConfig(args.passes, args.draws, args.rounds, reference=args.reference, first_draw=args.first_draw, copy=args.copy)
            draws = task_draws(args.devices[0], pool_seed, config.draws, config.first_draw)
            for d in args.devices:  # the same tables and batch at every D (tests check)
                measure(d, pool_seed, args.planners or MEASURED_PLANNERS, config, draws)
        if args.step == "report":
            print(write_report(local_hardware("cpu").describe(), price_with_shipped))


if __name__ == "__main__":
    main()
