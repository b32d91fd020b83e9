"""The model a DMP step trains, and its data: a task's tables in EmbeddingBagCollections
-> pooled embeddings concatenated in table order -> a small MLP -> BCE loss.

The EBCs are built on the meta device (DMP materialises each rank's shards); the
embeddings train with the fused optimizer (EXACT_SGD in the backward, ``fused_params``).
Batches are real KJTs from ``lab.workloads.lookups_for`` per table (the synthetic access
model), the global batch ``task.batch_size`` split over the ranks. An identity autograd
marker on the concatenated pooled embeddings splits the step into the sharded embeddings
and the rest (``lab.dmp_measure``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from torchrec_neuroshard.lab.measure_compute import Clock, Lookups
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, lookups_for, synthetic_pool
from torchrec_neuroshard.types import Task

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


def task_bags(task: Task, config: StepConfig) -> list[list[Lookups]]:
    """``config.batches`` global batches: each table's bags (indices, offsets)."""
    return [
        [lookups_for(t, task.batch_size, config.seed + 1000 * b + i) for i, t in enumerate(task.tables)]
        for b in range(config.batches)
    ]


def local_batch(task: Task, config: StepConfig, bags: list[Lookups], rank: int, world: int, device: torch.device, seed: int):
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



def generated_tasks(tables: Sequence[int], pool_seeds: Sequence[int], devices: int, scale: WorkloadScale) -> list[tuple[Task, str]]:
    """A task per (pool seed, table count) from ``generate_task`` (task seed = table count)."""
    out = []
    for ps in pool_seeds:
        pool = synthetic_pool(seed=ps)
        for t in tables:
            out.append((generate_task(pool, t, devices, scale, seed=t), f"T{t}_D{devices}_pool{ps}"))
    return out


