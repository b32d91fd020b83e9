"""The DMP harness: every planner's plan of a task, each sharding its own copy of the
``StepModel`` with ``DistributedModelParallel`` on D spawned ranks, timed in interleaved
training steps; one report row per plan.

Every planner (NeuroShard, TorchRec's planner as its docs say, the five heuristics) plans
ONCE, in this process. The ranks run gloo on CPUs, NCCL on GPUs (``lab.launch.default_device``;
one torch thread per rank). The dense part (and data-parallel tables) trains with SGD.
Training steps run interleaved across plans (A B C, B C A, ...) so drift hits all alike.

Per plan and step: the time from leaving a barrier to the end of the optimizer step on
each rank (the slowest rank's is the step's time); the sharded forward (barrier -> pooled
embeddings ready: KJT input all-to-all, lookups, pooled all-to-all) and backward
(gradient reaches the embeddings -> end of ``loss.backward()``: gradient all-to-all, fused
backward and update, the wait for DDP's all-reduce) from the model's marker; and the
process CPU time of a rank (its gloo threads included), blind to time the OS gave other
processes (CPU runs only).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from torchrec_neuroshard.costmodel import NeuralCostModel, pretrained_for
from torchrec_neuroshard.heuristics import BASELINES
from torchrec_neuroshard.lab.collect import append_rows
from torchrec_neuroshard.lab.dmp_model import StepConfig, StepModel, local_batch, sharders, task_bags, with_ebcs
from torchrec_neuroshard.lab.launch import default_device, spawn
from torchrec_neuroshard.lab.measure_compute import Clock, Lookups, Timing
from torchrec_neuroshard.lab.planners import CALIBRATED, CalibratedModel
from torchrec_neuroshard.types import Links, ShardingError, Task

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

PLANNERS = ("neuroshard", "torchrec", *BASELINES)

@dataclass(frozen=True)
class PlannedTask:
    """Every planner's TorchRec plan of one task's ``StepModel`` (planned once, here), and
    why a planner has none."""

    task: Task
    label: str
    plans: dict[str, ShardingPlan]
    failures: dict[str, str]
    """planner name -> the reason it has no plan."""
    fits_cap: dict[str, bool]
    """planner name -> whether the plan's weights fit the task's memory cap."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.plans) - set(self.fits_cap))
        if unknown:
            raise ValueError(f"plans {unknown} have no fits_cap entry; plan_task fills both")


def plan_task(
    task: Task, label: str, config: StepConfig, planners: Sequence[str] = PLANNERS, calibrated: NeuralCostModel | None = None
) -> PlannedTask:
    """Plan the task's ``StepModel`` with every planner. TorchRec plans the model itself
    (its own compute kernels); the others' ``Plan``s go through ``to_torchrec``. When
    TorchRec finds no plan within the task's cap, that is its result, and its plan at its
    default topology memory runs as ``torchrec_default_memory``. ``calibrated`` is the
    model ``neuroshard_calibrated`` searches with."""
    from torchrec.distributed.planner.types import PlannerError

    from torchrec_neuroshard.lab.planners import plan_task as plan_ours
    from torchrec_neuroshard.lab.torchrec_baseline import torchrec_plan, topology_for
    from torchrec_neuroshard.sharding import from_torchrec, to_torchrec

    device_type = default_device().type
    # the links NeuroShardPlanner reads off the Topology: collectives the model has not measured priced on them
    task = replace(with_ebcs(task, config), links=Links.of(topology_for(task, device_type)))
    model = StepModel(task, config, torch.device("cpu"))
    cost_model = pretrained_for(device_type)  # the shipped model for this machine (main() checks it)
    plans, failures, fits = {}, {}, {}
    for name in planners:
        try:
            if name == "torchrec":
                try:
                    plans[name] = torchrec_plan(task, device_type, module=model)
                except PlannerError as e:
                    failures[name] = f"no plan within the task's memory cap: {str(e).splitlines()[0]}"
                    plans["torchrec_default_memory"] = torchrec_plan(task, device_type, module=model, default_memory=True)
            else:
                plans[name] = to_torchrec(plan_ours(name, task, cost_model, calibrated), model, device_type)
        except (ShardingError, PlannerError) as e:
            failures[name] = f"{type(e).__name__}: {e}"
    for name, plan in plans.items():
        fits[name] = from_torchrec(plan, task.num_devices).fits(task)
    return PlannedTask(task, label, plans, failures, fits)



def _shard_all(planned: PlannedTask, config: StepConfig, device: torch.device, world: int) -> tuple[dict, dict]:
    """Every plan's model sharded with DMP on this rank: (plan -> (dmp, model, dense
    optimizer), plan -> its result so far: sharded module count, or the error DMP raised
    on any rank)."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardedModule
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    runs, out = {}, {}
    for name, plan in planned.plans.items():
        model = StepModel(planned.task, config, device)
        try:
            dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders(config))
            error = ""
        except Exception as e:  # noqa: BLE001 - a plan DMP cannot run is a result
            error = f"{type(e).__name__}: {str(e)[:300]}"
        errors = [None] * world
        dist.all_gather_object(errors, error)
        if any(errors):
            out[name] = {"error": next(e for e in errors if e)}
            continue
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(dmp.named_parameters())),
            lambda params: torch.optim.SGD(params, lr=config.learning_rate),
        )
        runs[name] = (dmp, model, dense)
        out[name] = {"sharded_modules": sum(isinstance(m, ShardedModule) for m in dmp.modules()), "steps": []}
    return runs, out


def _timed_step(run: tuple, kjts: list, labels: torch.Tensor, clock: Clock, device: torch.device) -> tuple[float, ...]:
    """One training step of one plan's model from a barrier: (step ms, sharded forward ms,
    sharded backward ms, CPU ms of the process)."""
    import torch.distributed as dist

    dmp, model, dense = run
    model.marks.clear()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0, cpu0 = clock.start(), time.process_time()
    loss = dmp(kjts, labels)
    loss.backward()
    t_bwd = clock.start()
    dense.step()
    dense.zero_grad()
    t_end, cpu = clock.start(), (time.process_time() - cpu0) * 1e3
    fwd_mark, bwd_mark = model.marks
    return clock.between_ms(t0, t_end), clock.between_ms(t0, fwd_mark), clock.between_ms(bwd_mark, t_bwd), cpu


def _worker(rank: int, world: int, planned: PlannedTask, bags: list[list[Lookups]], config: StepConfig) -> dict:
    """Rank body: shard every plan's model with DMP, then interleaved training steps.
    Returns per plan the per-step (step ms, sharded forward ms, sharded backward ms, CPU ms
    of the process, its communication threads included), or the error DMP raised."""
    import torch.distributed as dist

    logging.getLogger().setLevel(logging.ERROR)  # TorchRec's per-table notices, per rank and plan
    device = default_device(rank)
    runs, out = _shard_all(planned, config, device, world)
    batches = [local_batch(planned.task, config, b, rank, world, device, config.seed + k) for k, b in enumerate(bags)]
    names = list(runs)
    clock = Clock(device)
    for step in range(config.warmup + config.steps):
        kjts, labels = batches[step % len(batches)]
        for name in names[step % len(names):] + names[: step % len(names)]:
            timed = _timed_step(runs[name], kjts, labels, clock, device)
            if step >= config.warmup:
                out[name]["steps"].append(timed)
    runs.clear()
    dist.barrier()
    return out


@dataclass(frozen=True)
class StepResult:
    """One plan's training step, from every rank's per-step timings."""

    step: Timing
    """per step, the slowest rank's step time (ms)."""
    embedding_ms: float
    """median over steps of the slowest rank's time in the sharded embeddings."""
    embedding_share: float
    """median over steps of that time over the step time."""
    cpu: Timing
    """per step, the largest CPU time of a rank's process (ms): the work of the busiest
    rank, blind to time the OS gave other processes (meaningless on a GPU)."""

    @staticmethod
    def of(per_rank: Sequence[Sequence[tuple[float, float, float, float]]]) -> "StepResult":
        steps = list(zip(*per_rank))
        slowest = [max(s, key=lambda r: r[0]) for s in steps]
        emb = [f + b for _, f, b, _ in slowest]
        return StepResult(
            Timing.of([s[0] for s in slowest]),
            statistics.median(emb),
            statistics.median(e / s[0] for e, s in zip(emb, slowest)),
            Timing.of([max(r[3] for r in s) for s in steps]),
        )


def measure_task(planned: PlannedTask, config: StepConfig) -> list[dict]:
    """Run every plan of ``planned`` under DMP on D ranks; one report row per planner."""
    from torchrec_neuroshard.sharding import from_torchrec

    from torchrec_neuroshard.stepcost import predict_step

    task = planned.task
    cost_model = pretrained_for(default_device().type).with_batch_size(task.batch_size)
    load_before = os.getloadavg()[0]
    per_rank = spawn(_worker, task.num_devices, planned, task_bags(task, config), config) if planned.plans else []
    rows = []
    base = {
        "task": planned.label,
        "tables": len(task.tables),
        "devices": task.num_devices,
        "batch_size": task.batch_size,
        # the machine's 1-minute load average before and after: how shared the cores were
        "load_average": [load_before, os.getloadavg()[0]],
    }
    for name, reason in planned.failures.items():
        rows.append({**base, "planner": name, "status": f"invalid: {reason}"})
    for name, plan in planned.plans.items():
        ours = from_torchrec(plan, task.num_devices)
        row = {
            **base,
            "planner": name,
            "fits_cap": planned.fits_cap[name],
            "splits": sum(len(p.widths) > 1 for p in ours.placements),
            "data_parallel": len(ours.data_parallel),
            "row_wise": sum(p.kind.splits_rows for p in ours.placements),
            # the shipped model's whole-step prediction of the plan (each EBC paid at its slowest rank)
            "predicted_ms": predict_step(cost_model, task, ours).cost_ms,
            "plan": ours.to_dict(),
        }
        results = [r[name] for r in per_rank]
        if "error" in results[0]:
            row["status"] = f"failed under DMP: {results[0]['error']}"
        else:
            m = StepResult.of([r["steps"] for r in results])
            row.update(
                status="ok",
                sharded_modules=results[0]["sharded_modules"],
                steps=len(results[0]["steps"]),
                step_ms=m.step.median_ms,
                step_iqr_ms=m.step.iqr_ms,
                embedding_ms=m.embedding_ms,
                embedding_share=m.embedding_share,
                step_cpu_ms=m.cpu.median_ms,
                step_cpu_iqr_ms=m.cpu.iqr_ms,
                step_samples_ms=list(m.step.samples_ms),
            )
        rows.append(row)
    return rows



def run(
    tasks: Sequence[tuple[Task, str]],
    config: StepConfig,
    planners: Sequence[str] = PLANNERS,
    out: Path | None = None,
    progress: bool = True,
    calibrated: CalibratedModel | None = None,
) -> list[dict]:
    """Plan and measure every task; append the rows to ``out`` (JSON lines, gzipped when
    it ends in .gz) if given.
    ``calibrated`` plans ``neuroshard_calibrated``; each of its rows records the file."""
    from tqdm import tqdm

    rows = []
    for task, label in tqdm(tasks, desc="dmp_step tasks", disable=not progress):
        planned = plan_task(task, label, config, planners, calibrated.model if calibrated else None)
        task_rows = measure_task(planned, config)
        for r in task_rows:
            if r["planner"] == CALIBRATED and calibrated is not None:
                r["cost_model_file"] = calibrated.record()
        rows.extend(task_rows)
        if out is not None:
            append_rows(out, [{**r, "config": asdict(config)} for r in task_rows])
    return rows


