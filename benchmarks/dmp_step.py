"""The training step is the judge: step time of a model sharded by each planner under DMP.

    python -m benchmarks.dmp_step --tables 24 40 --pool-seed 0       # generated tasks
    python -m benchmarks.dmp_step --task my_task.json                  # a task file
    python -m benchmarks.dmp_step --quick                              # 2 small tasks, few steps
    python -m benchmarks.dmp_step --calibrated runs/cpu_calibrated.pt  # also NeuroShard with that model
    neuroshard bench dmp_step ...                                      # the same

For every task, every planner (NeuroShard, TorchRec's planner as its docs say, the five
heuristics) plans ONCE, in this process, a model of the task's tables at their own widths:
one or more EmbeddingBagCollections -> pooled embeddings concatenated in table order -> a
small MLP -> BCE loss. Each plan shards its own copy of the model with
``DistributedModelParallel`` on D spawned ranks (gloo on CPUs, NCCL on GPUs, chosen by
``lab.launch.default_device``; one torch thread per rank). The embeddings train with the
fused optimizer (EXACT_SGD in the backward, ``fused_params``), the dense part (and
data-parallel tables) with SGD. Batches are real KJTs from ``lab.workloads.lookups_for``
per table (the synthetic access model), the global batch ``task.batch_size`` split over
the ranks. Training steps run interleaved across plans (A B C, B C A, ...) so drift hits
all alike.

``--calibrated PATH`` (a model file made by ``neuroshard calibrate``, on this machine)
adds the planner ``neuroshard_calibrated``: NeuroShard's search with that model, measured
interleaved with the others; its rows record the file and its sha256 prefix, and the
summary gives its figures beside NeuroShard's. Each NeuroShard variant's "fastest of all
planners" leaves the other variant out, so NeuroShard's figures mean what they mean
without the option (``compare.RIVALS``).

Reported per plan (JSON lines + a markdown table under benchmarks/results/):

- step time: per step, the time from leaving a barrier to the end of the optimizer step
  on each rank; the slowest rank's is the step's time. Median over steps, and its IQR.
- embedding share: on the slowest rank, the time in the sharded embeddings over the step.
  An identity autograd marker on the concatenated pooled embeddings splits the step: the
  sharded forward is barrier -> pooled embeddings ready (KJT input all-to-all, lookups,
  pooled all-to-all); the sharded backward is gradient-reaches-the-embeddings -> end of
  ``loss.backward()`` (gradient all-to-all, fused backward + update, and the wait for the
  dense/data-parallel gradient all-reduce DDP overlaps with it). Dense forward, loss,
  dense backward and the dense SGD step are the rest.
- CPU time: per step, the largest process CPU time of a rank (its gloo threads included),
  a measure of the busiest rank's work that other processes on a shared machine do not
  inflate (CPU runs only; the wall step time is the one that counts).

On a 2-core machine run 2 ranks: more ranks than cores measures contention, not the plan.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.compare import CALIBRATED, RIVALS, CalibratedModel, calibrated_files, check_machine
from torchrec_neuroshard.costmodel import NeuralCostModel, pretrained_for
from torchrec_neuroshard.heuristics import BASELINES
from torchrec_neuroshard.lab.launch import default_device, spawn
from torchrec_neuroshard.lab.measure_compute import Clock, Lookups, Timing
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, lookups_for, synthetic_pool
from torchrec_neuroshard.types import ShardingError, Task

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

HERE = Path(__file__).parent
PLANNERS = ("neuroshard", "torchrec", *BASELINES)
LENGTHS_DTYPE = torch.int32
"""KJT lengths as TorchRec's own data loaders produce them; indices are int64."""


@dataclass(frozen=True)
class StepConfig:
    """How each plan's model is built and trained."""

    steps: int = 20
    warmup: int = 3
    batches: int = 2
    """distinct global batches, cycled."""
    num_ebcs: int = 2
    """tables are dealt round-robin into this many EmbeddingBagCollections."""
    hidden: int = 64
    learning_rate: float = 0.01
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batches", "num_ebcs", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"StepConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"StepConfig.warmup must be >= 0, got {self.warmup}")


class _Marker(torch.autograd.Function):
    """Identity that appends a clock mark when the forward reaches it and when its
    gradient arrives in the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: Clock, marks: list) -> torch.Tensor:  # type: ignore[override]
        ctx.clock, ctx.marks = clock, marks
        marks.append(clock.start())
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.marks.append(ctx.clock.start())
        return grad, None, None


def feature_groups(task: Task, config: StepConfig) -> list[list[str]]:
    """The tables (one feature each, named as the table) of each EBC: the task's modules,
    or, for a task without, its tables dealt round-robin into ``config.num_ebcs``."""
    if task.modules:
        return [list(m) for m in task.modules]
    num_ebcs = min(config.num_ebcs, len(task.tables))
    return [[t.name for t in task.tables[i::num_ebcs]] for i in range(num_ebcs)]


def with_ebcs(task: Task, config: StepConfig) -> Task:
    """``task`` with the StepModel's EBCs (``feature_groups``) as its modules, as every
    planner sees it."""
    return replace(task, modules=tuple(map(tuple, feature_groups(task, config))))


def within_task_spearman(figure: dict[tuple[str, str], float], step: dict[tuple[str, str], float]) -> dict[str, float]:
    """Per task of more than two plans: the Spearman of ``figure`` vs ``step``, both keyed
    by (task, planner)."""
    from scipy.stats import spearmanr

    tasks = sorted({t for t, _ in figure})
    return {t: spearmanr([figure[k] for k in keys], [step[k] for k in keys]).statistic
            for t in tasks for keys in [[k for k in figure if k[0] == t]] if len(keys) > 2}  # fmt: skip


class StepModel(nn.Module):
    """EBCs (tables dealt round-robin) -> pooled embeddings in table order -> MLP -> loss.

    The EBCs are built on the meta device (DMP materialises the shards); the MLP on
    ``device``. ``marks`` collects the marker's clock marks of the current step.
    """

    def __init__(self, task: Task, config: StepConfig, device: torch.device) -> None:
        from torchrec.modules.embedding_configs import EmbeddingBagConfig
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        super().__init__()
        self.ebcs = nn.ModuleList(
            EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(name=n, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=[n])
                    for n, t in ((n, task.table(n)) for n in names)
                ],
                device=torch.device("meta"),
            )
            for names in feature_groups(task, config)
        )
        self.table_order = [t.name for t in task.tables]
        torch.manual_seed(config.seed)
        width = sum(t.dim for t in task.tables)
        self.mlp = nn.Sequential(
            nn.Linear(width, config.hidden, device=device), nn.ReLU(), nn.Linear(config.hidden, 1, device=device)
        )
        self.clock = Clock(device)
        self.marks: list = []

    def forward(self, kjts: list, labels: torch.Tensor) -> torch.Tensor:
        pooled: dict[str, torch.Tensor] = {}
        for ebc, kjt in zip(self.ebcs, kjts):
            pooled.update(ebc(kjt).to_dict())  # the sharded EBC's output is index by key
        x = _Marker.apply(torch.cat([pooled[n] for n in self.table_order], dim=1), self.clock, self.marks)
        return F.binary_cross_entropy_with_logits(self.mlp(x).squeeze(1), labels)


def sharders(config: StepConfig) -> list:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    return [
        EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": config.learning_rate}
        )
    ]


# ---------------------------------------------------------------------------- planning


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

    from benchmarks.compare import plan_task as plan_ours
    from torchrec_neuroshard.lab.torchrec_baseline import torchrec_plan
    from torchrec_neuroshard.sharding import from_torchrec, to_torchrec

    task = with_ebcs(task, config)
    device_type = default_device().type
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
        try:
            from_torchrec(plan, task.num_devices).validate(task)
            fits[name] = True
        except ShardingError:
            fits[name] = False
    return PlannedTask(task, label, plans, failures, fits)


def task_bags(task: Task, config: StepConfig) -> list[list[Lookups]]:
    """``config.batches`` global batches: each table's bags (indices, offsets)."""
    return [
        [lookups_for(t, task.batch_size, config.seed + 1000 * b + i) for i, t in enumerate(task.tables)]
        for b in range(config.batches)
    ]


# ---------------------------------------------------------------------------- measuring


def _local_batch(task: Task, config: StepConfig, bags: list[Lookups], rank: int, world: int, device: torch.device, seed: int):
    """This rank's slice of a global batch: one KJT per EBC, and random labels."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    local = task.batch_size // world
    by_name = {t.name: b for t, b in zip(task.tables, bags)}
    kjts = []
    for names in feature_groups(task, config):
        values, lengths = [], []
        for n in names:
            idx, off = by_name[n]
            lo, hi = int(off[rank * local]), int(off[(rank + 1) * local])
            values.append(idx[lo:hi])
            lengths.append(off[rank * local + 1 : (rank + 1) * local + 1] - off[rank * local : (rank + 1) * local])
        kjts.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=names, values=torch.cat(values), lengths=torch.cat(lengths).to(LENGTHS_DTYPE)
            ).to(device)
        )
    g = torch.Generator().manual_seed(seed)
    return kjts, torch.randint(0, 2, (local,), generator=g).float().to(device)


def _worker(rank: int, world: int, planned: PlannedTask, bags: list[list[Lookups]], config: StepConfig) -> dict:
    """Rank body: shard every plan's model with DMP, then interleaved training steps.
    Returns per plan the per-step (step ms, sharded forward ms, sharded backward ms, CPU ms
    of the process, its communication threads included), or the error DMP raised."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardedModule
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    logging.getLogger().setLevel(logging.ERROR)  # TorchRec's per-table notices, per rank and plan
    device = default_device(rank)
    task = planned.task
    runs, out = {}, {}
    for name, plan in planned.plans.items():
        model = StepModel(task, config, device)
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
        sharded = sum(isinstance(m, ShardedModule) for m in dmp.modules())
        runs[name] = (dmp, model, dense)
        out[name] = {"sharded_modules": sharded, "steps": []}
    batches = [_local_batch(task, config, b, rank, world, device, config.seed + k) for k, b in enumerate(bags)]
    names = list(runs)
    clock = Clock(device)
    for step in range(config.warmup + config.steps):
        kjts, labels = batches[step % len(batches)]
        for name in names[step % len(names):] + names[: step % len(names)]:
            dmp, model, dense = runs[name]
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
            if step >= config.warmup:
                out[name]["steps"].append(
                    (clock.between_ms(t0, t_end), clock.between_ms(t0, fwd_mark), clock.between_ms(bwd_mark, t_bwd), cpu)
                )
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


# ---------------------------------------------------------------------------- tasks and report


def generated_tasks(tables: Sequence[int], pool_seeds: Sequence[int], devices: int, scale: WorkloadScale) -> list[tuple[Task, str]]:
    """A task per (pool seed, table count) from ``generate_task`` (task seed = table count)."""
    out = []
    for ps in pool_seeds:
        pool = synthetic_pool(seed=ps)
        for t in tables:
            out.append((generate_task(pool, t, devices, scale, seed=t), f"T{t}_D{devices}_pool{ps}"))
    return out


def geomean(xs: Sequence[float]) -> float:
    import math

    return math.exp(statistics.mean(math.log(x) for x in xs)) if xs else float("nan")


def _fastest_other(plans: dict[str, dict], name: str) -> dict:
    """The fastest row of a task's plans but ``name`` and its rival variant (``RIVALS``)."""
    return min((r for p, r in plans.items() if p not in (name, RIVALS[name])), key=lambda r: r["step_ms"])


def _variant(tasks: dict[str, dict[str, dict]], name: str) -> dict:
    """A NeuroShard variant's figures over the tasks where it and TorchRec both ran: tasks,
    fastest of all planners but its rival variant (``RIVALS``), / TorchRec and / best
    heuristic (geomean of median step times)."""
    both = [v for v in tasks.values() if name in v and "torchrec" in v]
    fastest = [v[name]["step_ms"] < _fastest_other(v, name)["step_ms"] for v in both]
    vs_torchrec = [v[name]["step_ms"] / v["torchrec"]["step_ms"] for v in both]
    vs_heuristic = [v[name]["step_ms"] / min(v[b]["step_ms"] for b in BASELINES if b in v) for v in both if any(b in v for b in BASELINES)]
    return {
        "tasks": len(both),
        "fastest": sum(fastest),
        "over_torchrec": geomean(vs_torchrec),
        "over_best_heuristic": geomean(vs_heuristic),
    }


def ok_by_task(rows: Sequence[dict]) -> dict[str, dict[str, dict]]:
    """task -> planner -> row, of the plans that ran."""
    tasks: dict[str, dict[str, dict]] = {}
    for r in rows:
        if r["status"] == "ok":
            tasks.setdefault(r["task"], {})[r["planner"]] = r
    return tasks


def paired_bootstrap(rows: Sequence[dict], name: str = "neuroshard", draws: int = 2000, level: float = 0.9, seed: int = 0) -> dict:
    """How sure ``name``'s target figures are, from the spread of the timed steps.

    A task's plans ran their k-th timed step in the same round (interleaved), so one draw
    of step indices, with replacement, resamples every plan of the task alike (a paired
    bootstrap); each draw recomputes the median step times and ``_variant``'s figures.
    Returns each figure's interval at ``level`` (``*_interval``: low, high) and per task
    ``name`` / the fastest other planner (median steps) with its interval and the share of
    draws in which ``name`` was the fastest (``per_task``). Tasks whose rows lack
    ``step_samples_ms`` are left out."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tasks = {
        label: plans
        for label, plans in ok_by_task(rows).items()
        if name in plans and "torchrec" in plans and all(r.get("step_samples_ms") for r in plans.values())
    }
    medians = {}  # task -> planner -> (draws,) median step ms of each draw
    for label, plans in tasks.items():
        steps = min(len(r["step_samples_ms"]) for r in plans.values())
        picks = rng.integers(0, steps, (draws, steps))  # step indices, shared by the task's plans
        medians[label] = {p: np.median(np.asarray(r["step_samples_ms"][:steps])[picks], axis=1) for p, r in plans.items()}
    figures: dict[str, list[float]] = {"fastest": [], "over_torchrec": [], "over_best_heuristic": []}
    per_task: dict[str, list[tuple[float, bool]]] = {label: [] for label in tasks}
    for draw in range(draws):
        drawn = {}
        for label, plans in medians.items():
            drawn[label] = {p: {"planner": p, "step_ms": float(m[draw])} for p, m in plans.items()}
            other = _fastest_other(drawn[label], name)["step_ms"]
            per_task[label].append((drawn[label][name]["step_ms"] / other, drawn[label][name]["step_ms"] < other))
        for figure, value in _variant(drawn, name).items():
            if figure in figures:
                figures[figure].append(value)
    tail = 100 * (1 - level) / 2
    interval = lambda xs: tuple(float(q) for q in np.percentile(xs, [tail, 100 - tail]))  # noqa: E731
    out: dict = {f"{k}_interval": interval(v) for k, v in figures.items() if v}
    out["per_task"] = {
        label: {
            "fastest_other": (other := _fastest_other(tasks[label], name))["planner"],
            "ratio": tasks[label][name]["step_ms"] / other["step_ms"],
            "ratio_interval": interval([r for r, _ in drawn_pairs]),
            "fastest_share": sum(f for _, f in drawn_pairs) / len(drawn_pairs),
        }
        for label, drawn_pairs in per_task.items()
    }
    return {"draws": draws, "level": level, **out}


def summary(rows: Sequence[dict]) -> dict:
    """The targets' figures over tasks where NeuroShard and TorchRec both ran: NeuroShard
    fastest of all planners (tasks), NeuroShard / TorchRec and / best heuristic (geomean of
    median step times), and the Spearman of predicted vs measured step over (task, plan)
    pairs, overall and within a task (median), beside the measurement's own within-task
    Spearman (odd vs even timed steps, median over tasks). With calibrated rows, the same figures of
    ``neuroshard_calibrated`` (``neuroshard_calibrated_...``) and its step time over
    NeuroShard's (geomean over the tasks both ran)."""
    from scipy.stats import spearmanr

    tasks = ok_by_task(rows)
    out = {("tasks" if k == "tasks" else f"neuroshard_{k}"): v for k, v in _variant(tasks, "neuroshard").items()}
    if any(CALIBRATED in v for v in tasks.values()):
        out.update({f"{CALIBRATED}_{k}": v for k, v in _variant(tasks, CALIBRATED).items()})
        pairs = [v[CALIBRATED]["step_ms"] / v["neuroshard"]["step_ms"] for v in tasks.values() if CALIBRATED in v and "neuroshard" in v]
        out[f"{CALIBRATED}_over_neuroshard"] = geomean(pairs)
    pairs = [(r["predicted_ms"], r["step_ms"]) for v in tasks.values() for r in v.values() if "predicted_ms" in r]

    def figure(of, keep=lambda r: True) -> dict[tuple[str, str], float]:
        """(task, planner) -> ``of(row)``, over the tasks whose every row passes ``keep``."""
        return {(label, p): of(r) for label, v in tasks.items() if all(map(keep, v.values())) for p, r in v.items()}

    step = figure(lambda r: r["step_ms"])
    within = list(within_task_spearman(figure(lambda r: r["predicted_ms"], lambda r: "predicted_ms" in r), step).values())
    split = lambda r: len(r.get("step_samples_ms", ())) >= 2  # noqa: E731
    odd = figure(lambda r: statistics.median(r["step_samples_ms"][0::2]), split)
    halves = list(within_task_spearman(odd, figure(lambda r: statistics.median(r["step_samples_ms"][1::2]), split)).values())
    return {
        **out,
        "spearman_predicted_vs_step": spearmanr(*zip(*pairs)).statistic if len(pairs) > 2 else float("nan"),
        "spearman_within_task_median": statistics.median(within) if within else float("nan"),
        "spearman_split_half_median": statistics.median(halves) if halves else float("nan"),
    }


def _calibrated_line(rows: Sequence[dict], s: dict) -> list[str]:
    """The summary's line of NeuroShard with the calibrated model and the file it planned with."""
    if f"{CALIBRATED}_tasks" not in s:
        return []
    return [
        f"- NeuroShard with the calibrated model ({calibrated_files([r for r in rows if r['planner'] == CALIBRATED])}) "
        f"fastest of all planners (shipped-model NeuroShard left out) on **{s[f'{CALIBRATED}_fastest']} of "
        f"{s[f'{CALIBRATED}_tasks']}** tasks; / TorchRec **{s[f'{CALIBRATED}_over_torchrec']:.3f}**, / best heuristic "
        f"**{s[f'{CALIBRATED}_over_best_heuristic']:.3f}**, / NeuroShard (shipped model) "
        f"**{s[f'{CALIBRATED}_over_neuroshard']:.3f}** (geomean of median step times)."
    ]


def _spread_lines(rows: Sequence[dict]) -> list[str]:
    """The summary's spread: NeuroShard's figures under ``paired_bootstrap``, and per task
    NeuroShard against the fastest other planner."""
    b = paired_bootstrap(rows)
    if "fastest_interval" not in b:
        return []
    pct = f"{100 * b['level']:.0f}%"
    lines = [
        f"- Spread ({b['draws']} paired bootstrap draws of the timed steps, {pct} intervals): NeuroShard / TorchRec "
        f"**{b['over_torchrec_interval'][0]:.3f}-{b['over_torchrec_interval'][1]:.3f}**, / best heuristic "
        f"**{b['over_best_heuristic_interval'][0]:.3f}-{b['over_best_heuristic_interval'][1]:.3f}**, fastest on "
        f"**{b['fastest_interval'][0]:.0f}-{b['fastest_interval'][1]:.0f}** tasks.",
        "",
        f"| task | fastest other planner | NeuroShard / it | {pct} interval | NeuroShard fastest in (share of draws) |",
        "|---|---|---|---|---|",
    ]
    for label, t in b["per_task"].items():
        low, high = t["ratio_interval"]
        lines.append(f"| {label} | {t['fastest_other']} | {t['ratio']:.3f} | {low:.3f}-{high:.3f} | {100 * t['fastest_share']:.0f}% |")
    return lines


def report(rows: Sequence[dict]) -> str:
    """Markdown: the summary, then per task every planner's step time, IQR, embedding share,
    ratio to TorchRec and the model's predicted step."""
    s = summary(rows)
    lines = [
        f"- NeuroShard fastest of all planners{' (the calibrated variant left out)' if f'{CALIBRATED}_tasks' in s else ''} "
        f"on **{s['neuroshard_fastest']} of {s['tasks']}** tasks; "
        f"NeuroShard / TorchRec **{s['neuroshard_over_torchrec']:.3f}**, NeuroShard / best heuristic "
        f"**{s['neuroshard_over_best_heuristic']:.3f}** (geomean of median step times).",
        *_calibrated_line(rows, s),
        f"- Predicted (shipped model, whole step) vs measured step time: Spearman **{s['spearman_predicted_vs_step']:.3f}** "
        f"over all (task, plan) pairs, **{s['spearman_within_task_median']:.3f}** within a task (median). "
        f"The measurement against itself within a task (median step of the odd vs the even timed steps, "
        f"interleaved alike): Spearman **{s['spearman_split_half_median']:.3f}** (median), the agreement that "
        f"half the steps allow.",
        *_spread_lines(rows),
        "",
        "| task | planner | step ms (median) | IQR ms | embedding ms | embedding share | step CPU ms | / TorchRec | predicted ms | DP / RW / splits | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label in dict.fromkeys(r["task"] for r in rows):
        task_rows = [r for r in rows if r["task"] == label]
        tr = next((r for r in task_rows if r["planner"] == "torchrec" and r["status"] == "ok"), None)
        for r in task_rows:
            if r["status"] != "ok":
                lines.append(f"| {label} | {r['planner']} | | | | | | | | | {r['status'][:120]} |")
                continue
            ratio = f"{r['step_ms'] / tr['step_ms']:.3f}" if tr else ""
            cap = "" if r["fits_cap"] else " (over the task's cap)"
            lines.append(
                f"| {label} | {r['planner']} | {r['step_ms']:.1f} | {r['step_iqr_ms']:.1f} | {r['embedding_ms']:.1f} | "
                f"{100 * r['embedding_share']:.0f}% | {r['step_cpu_ms']:.1f} | {ratio} | {r.get('predicted_ms', float('nan')):.1f} | "
                f"{r['data_parallel']} / {r.get('row_wise', 0)} / {r['splits']} | ok{cap} |"
            )
    return "\n".join(lines)


def run(
    tasks: Sequence[tuple[Task, str]],
    config: StepConfig,
    planners: Sequence[str] = PLANNERS,
    out: Path | None = None,
    progress: bool = True,
    calibrated: CalibratedModel | None = None,
) -> list[dict]:
    """Plan and measure every task; append the rows to ``out`` (JSON lines) if given.
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
            out.parent.mkdir(parents=True, exist_ok=True)
            with open(out, "a") as f:
                for r in task_rows:
                    f.write(json.dumps({**r, "config": asdict(config)}) + "\n")
    return rows


QUICK_SCALE = WorkloadScale(row_divisor=1024, batch_size=512)
QUICK_CONFIG = StepConfig(steps=3, warmup=1, batches=1)
QUICK_TABLES = (6, 10)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", type=Path, nargs="*", default=[], help="task JSON files")
    p.add_argument("--tables", type=int, nargs="*", default=[24], help="generated tasks: table counts")
    p.add_argument("--pool-seed", type=int, nargs="*", default=[0], help="generated tasks: pool seeds")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--row-divisor", type=int, default=WorkloadScale().row_divisor)
    p.add_argument("--batch-size", type=int, default=WorkloadScale().batch_size, help="global batch")
    p.add_argument("--steps", type=int, default=StepConfig().steps)
    p.add_argument("--warmup", type=int, default=StepConfig().warmup)
    p.add_argument("--planners", default=",".join(PLANNERS))
    p.add_argument("--quick", action="store_true", help="2 small tasks, few steps (the smoke test)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="directory for dmp_step.jsonl / .md")
    p.add_argument("--name", default="dmp_step", help="results file stem (resumes: tasks already in it are skipped)")
    p.add_argument("--allow-mismatch", action="store_true", help="plan with a model of other hardware than this machine")
    p.add_argument("--calibrated", type=Path, help=f"a model file made by `neuroshard calibrate`: adds the planner {CALIBRATED}")
    args = p.parse_args(argv)
    planners = args.planners.split(",")
    if args.calibrated and CALIBRATED not in planners:
        planners.append(CALIBRATED)
    unknown = sorted(set(planners) - set(PLANNERS) - ({CALIBRATED} if args.calibrated else set()))
    if unknown:
        p.error(f"unknown planners {unknown}; choose from {list(PLANNERS)}, or {CALIBRATED} with --calibrated PATH")
    check_machine(pretrained_for(default_device().type), args.allow_mismatch)
    calibrated = CalibratedModel.load(args.calibrated) if args.calibrated else None
    if calibrated is not None:
        check_machine(calibrated.model, args.allow_mismatch, f"{args.calibrated}: ")
    logging.getLogger("torchrec").setLevel(logging.ERROR)  # its topology notice, once per plan
    if args.quick:
        config = QUICK_CONFIG
        tasks = generated_tasks(QUICK_TABLES, [0], args.devices, QUICK_SCALE)
    else:
        config = StepConfig(steps=args.steps, warmup=args.warmup)
        scale = WorkloadScale(args.row_divisor, args.batch_size)
        tasks = [(Task.load(path), path.stem) for path in args.task]
        if not args.task:
            tasks = generated_tasks(args.tables, args.pool_seed, args.devices, scale)
    name = "dmp_step_quick" if args.quick else args.name
    path = args.out / f"{name}.jsonl"
    done = {json.loads(line)["task"] for line in path.read_text().splitlines()} if path.exists() and not args.quick else set()
    rows = [json.loads(line) for line in path.read_text().splitlines()] if done else []
    if calibrated is not None:
        calibrated.check_resumes(rows, path)
    rows += run([(t, label) for t, label in tasks if label not in done], config, planners, path, calibrated=calibrated)
    device = default_device()
    text = (
        f"# Training step time under DistributedModelParallel\n\n"
        f"Date: {datetime.date.today()}. {args.devices} ranks ({device.type}), one torch thread each; "
        f"{config.steps} timed steps after {config.warmup} warm-up, interleaved across plans; "
        f"`python -m benchmarks.dmp_step {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
        f"{report(rows)}\n"
    )
    (args.out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
