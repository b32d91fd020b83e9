"""Train TorchRec's DLRM sharded by a chosen planner, and measure its throughput.

    torchrun --standalone --nproc_per_node 2 examples/dlrm_torchrun.py \
        --planner neuroshard,torchrec --tables 16 --steps 30

Tables come from a synthetic DLRM-like pool (``--pool``, default one no shipped model
trained on) or a task JSON, all at one width (DLRM needs that). Batches follow each
table's pooling factor and access distribution. The backend is NCCL on GPUs and gloo on
CPUs, chosen by the device. With several planners,
every model is built and the training steps are interleaved (A B A B ...), so machine
drift hits all alike; rank 0 prints each plan and the median samples/s per rank.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.distributed.types import ShardingPlan
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_neuroshard.heuristics import BASELINES, baseline_plan
from torchrec_neuroshard.lab.launch import init_from_env
from torchrec_neuroshard.planner import NeuroShardPlanner
from torchrec_neuroshard.sharding import from_torchrec, to_torchrec
from torchrec_neuroshard.types import TableSpec, Task
from torchrec_neuroshard.lab.torchrec_baseline import topology_for
from torchrec_neuroshard.lab.workloads import HELD_OUT_POOL_SEEDS, WorkloadScale, lookups_for, memory_cap, synthetic_pool, table_spec

PLANNERS = ("neuroshard", "torchrec", *BASELINES)
DENSE_FEATURES = 13


def build_task(args: argparse.Namespace, world: int) -> Task:
    if args.task:
        task = Task.load(args.task)
        tables = tuple(TableSpec(t.name, t.rows, args.dim, t.pooling_factor, t.access_hist) for t in task.tables)
        return Task(tables, world, task.memory_cap_bytes, args.batch_size)
    pool = synthetic_pool(seed=args.pool)
    rng = np.random.default_rng(args.seed)
    scale = WorkloadScale(row_divisor=args.row_divisor, batch_size=args.batch_size)
    chosen = rng.choice(len(pool), args.tables, replace=False)
    tables = tuple(table_spec(pool[i], args.dim, scale, name=f"t{i}") for i in chosen)
    return Task(tables, world, memory_cap(tables, world, args.batch_size), args.batch_size)


def make_model(task: Task, device: torch.device) -> DLRMTrain:
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=[t.name])
            for t in task.tables
        ],
        device=torch.device("meta"),
    )
    dim = task.tables[0].dim
    return DLRMTrain(DLRM(ebc, DENSE_FEATURES, [128, dim], [128, 64, 1], dense_device=device))


def make_plan(name: str, task: Task, model: torch.nn.Module, sharders: list, device: torch.device) -> ShardingPlan:
    world = task.num_devices
    local = get_local_size(world)  # ranks per host, as the launcher set them
    topology = topology_for(task, device.type, local)
    constraints = {t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in task.tables}
    if name == "neuroshard":
        planner = NeuroShardPlanner(topology, batch_size=task.batch_size // world, constraints=constraints, storage_reservation=0.0)
        return planner.collective_plan(model, sharders)
    if name == "torchrec":
        # TorchRec's planner as its docs say: per-rank batch, pooling factors as
        # constraints, the task's memory as the topology's (lab.torchrec_baseline).
        from torchrec_neuroshard.lab.torchrec_baseline import torchrec_plan

        from torchrec.distributed.planner.types import PlannerError

        box: list[object] = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = torchrec_plan(task, device.type, module=model, local_world_size=local)
            except PlannerError as e:
                print(
                    f"TorchRec's planner found no plan within the task's {task.memory_cap_bytes:,} bytes "
                    f"per rank ({str(e).splitlines()[0]}); running its plan at its default topology memory"
                )
                box[0] = torchrec_plan(task, device.type, module=model, default_memory=True, local_world_size=local)
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return to_torchrec(baseline_plan(name, task), model, device.type, local)


def make_batches(task: Task, rank: int, world: int, count: int, device: torch.device, seed: int) -> list[Batch]:
    """Local slices of ``count`` global batches; each table's bags follow its statistics."""
    local = task.batch_size // world
    batches = []
    for b in range(count):
        lengths, values = [], []
        for i, t in enumerate(task.tables):
            idx, off = lookups_for(t, task.batch_size, seed + 1000 * b + i)
            lo, hi = int(off[rank * local]), int(off[(rank + 1) * local])
            values.append(idx[lo:hi])
            lengths.append(off[rank * local + 1 : (rank + 1) * local + 1] - off[rank * local : (rank + 1) * local])
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[t.name for t in task.tables], values=torch.cat(values), lengths=torch.cat(lengths)
        )
        g = torch.Generator().manual_seed(seed + b)
        batches.append(
            Batch(
                dense_features=torch.rand(local, DENSE_FEATURES, generator=g),
                sparse_features=kjt,
                labels=torch.randint(0, 2, (local,), generator=g).float(),
            ).to(device)
        )
    return batches


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--planner", default="neuroshard", help=f"comma-separated, from {list(PLANNERS)}")
    p.add_argument("--tables", type=int, default=16, help="tables drawn from the synthetic pool")
    p.add_argument("--pool", type=int, default=HELD_OUT_POOL_SEEDS[0], help="the pool's seed (default one no shipped model trained on)")
    p.add_argument("--task", help="a task JSON instead (its tables at --dim)")
    p.add_argument("--dim", type=int, default=64, help="embedding width of every table (DLRM needs one)")
    p.add_argument("--batch-size", type=int, default=4096, help="global batch size")
    p.add_argument("--row-divisor", type=int, default=256, help="shrink the pool's row counts by this")
    p.add_argument("--steps", type=int, default=20, help="timed training steps per planner")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for n in args.planner.split(","):
        if n not in PLANNERS:
            p.error(f"unknown planner {n!r}; choose from {list(PLANNERS)}")
    return args


def sharded_runs(names: list[str], task: Task, sharders: list, device: torch.device) -> dict[str, tuple]:
    """Per planner: (DMP model, dense optimizer, plan, planning seconds, step times to fill)."""
    runs = {}
    for name in names:
        model = make_model(task, device)
        t0 = time.perf_counter()
        plan = make_plan(name, task, model, sharders, device)
        planning_s = time.perf_counter() - t0
        dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(dmp.named_parameters())),
            lambda params: torch.optim.SGD(params, lr=0.01),
        )
        runs[name] = (dmp, dense, plan, planning_s, [])
    return runs


def train_interleaved(runs: dict[str, tuple], batches: list[Batch], warmup: int, steps: int, device: torch.device) -> None:
    """One training step of each planner's model in turn (A B A B ...), each timed after ``warmup``."""
    for step in range(warmup + steps):
        for dmp, opt, _, _, times in runs.values():
            batch = batches[step % len(batches)]
            dist.barrier()
            t0 = time.perf_counter()
            loss, _ = dmp(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= warmup:
                times.append(time.perf_counter() - t0)


def print_report(runs: dict[str, tuple], task: Task, args: argparse.Namespace, device: torch.device) -> None:
    """Every rank's median samples/s (and interquartile range) per planner, printed on rank 0 with the plans."""
    report = {
        name: (statistics.median(t), statistics.quantiles(t, n=4) if len(t) > 1 else [t[0]] * 3)
        for name, (_, _, _, _, t) in runs.items()
    }
    world = dist.get_world_size()
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    if dist.get_rank() != 0:
        return
    print(f"DLRM, {len(task.tables)} tables x dim {args.dim} (pool {args.pool}), global batch {task.batch_size}, "
          f"{world} ranks ({device.type}, {dist.get_backend()}), {args.steps} timed steps interleaved")
    for name, (_, _, plan, planning_s, _) in runs.items():
        print(f"\n== {name} plan (planned in {planning_s:.2f} s) ==")
        print(from_torchrec(plan, world).describe())
    print("\nplanner        " + "  ".join(f"rank{r} samples/s (IQR)" for r in range(world)))
    for name in runs:
        cells = []
        for r in range(world):
            med, q = gathered[r][name]
            cells.append(f"{task.batch_size / med:10.0f} ({task.batch_size / q[2]:.0f}-{task.batch_size / q[0]:.0f})")
        print(f"{name:<14} " + "  ".join(cells))


def main() -> None:
    args = parse_args()
    rank, world, device = init_from_env()
    torch.set_num_threads(1)
    # NeuroShard's per-rank plan table (predicted ms, memory, shards) from rank 0 only;
    # TorchRec's own planner logs are kept to errors.
    logging.basicConfig(level=logging.ERROR, format="%(message)s")
    logging.getLogger("torchrec").setLevel(logging.ERROR)
    logging.getLogger("torchrec_neuroshard").setLevel(logging.INFO if rank == 0 else logging.ERROR)
    task = build_task(args, world)
    sharders = [EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.01})]
    runs = sharded_runs(args.planner.split(","), task, sharders, device)
    train_interleaved(runs, make_batches(task, rank, world, 4, device, args.seed), args.warmup, args.steps, device)
    print_report(runs, task, args, device)
    # Free the sharded models (and their communication state) on every rank before the
    # group goes away; tearing gloo down under live DMP modules can abort at exit.
    runs.clear()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
