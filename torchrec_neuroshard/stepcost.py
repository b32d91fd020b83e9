"""The predicted cost of a whole sharded step, per device, for a plan of every kind.

What DistributedModelParallel runs on each rank for one step, as the evaluator
(``lab/evaluate.py``) measures it, priced part by part:

- column groups, one per kind (table-wise, column-wise, table-column-wise: TorchRec gives
  each sharding type its own lookup module): per group, the KJT input distribution, one
  fused kernel over the device's shards at the global batch (the compute net), the pooled
  all-to-all forward (the first group's entered with the device's compute lateness) and
  backward (the comm model). Splitting one table by columns thus adds a second kernel and
  a second set of collectives to a plan of whole tables;
- row-wise group: the bucketised input distribution, one kernel over the device's row
  blocks (each block sees about 1/D of its table's lookups), the reduce-scatter of the
  pooled partial sums forward and their all-gather backward;
- data-parallel tables: the dense kernel at the local batch on every rank, the dense
  gradient and update, and the gradient all-reduce.

The non-kernel parts come from the model's fitted ``StepParts`` (``steparts.py``); a model
without them (measured on one GPU, or before ``neuroshard collect step``) prices those
parts as 0, and the search then never chooses the kinds that need them.

A device's cost: its compute (every group's kernels) + its comm (input distributions,
forward and backward collectives). The step's embedding cost is the max over devices for
one sharded module; a model of several (``Task.modules``: TorchRec shards each
EmbeddingBagCollection apart) pays each module's slowest device in turn, since the
module's collectives hold every rank until the slowest arrives. So the step is the sum
over modules of each one's max over devices, and a plan balanced only in its per-device
totals can still wait on every module (measured: ``benchmarks/module_sync.py``).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, replace
from typing import Callable, Sequence

import numpy as np

from torchrec_neuroshard.steparts import StepParts, collective_features, dp_features, input_dist_features
from torchrec_neuroshard.types import CostModel, DeviceCost, Plan, Shard, ShardingKind, TablePlacement, TableSpec, Task

INDEX_BYTES = 8
LENGTH_BYTES = 4
"""A KJT's indices are int64 and its lengths int32 as it crosses the input all-to-all."""
POOLED_BYTES = 4
"""Pooled embeddings and their gradients travel as fp32."""

Embedder = Callable[[Sequence[Shard]], np.ndarray]


class CachedEmbedder:
    """``model.embed_shards`` memoised by shard: a search embeds each distinct shard once."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self.rows: dict[Shard, np.ndarray] = {}

    def __call__(self, shards: Sequence[Shard]) -> np.ndarray:
        new = [s for s in dict.fromkeys(shards) if s not in self.rows]
        if new:
            self.rows.update(zip(new, self.model.embed_shards(new)))
        return np.stack([self.rows[s] for s in shards])


@dataclass(frozen=True)
class StepPrediction:
    """Per device: ``devices`` (compute includes every kernel; ``fwd_comm`` the input
    distributions, the pooled all-to-all and the reduce-scatter; ``bwd_comm`` the backward
    all-to-all, the all-gather and the data-parallel all-reduce); ``parts`` the same ms
    split by part name (both summed over the task's modules); ``cost_ms`` the max over
    devices of the total, summed over the modules."""

    cost_ms: float
    devices: tuple[DeviceCost, ...]
    parts: dict[str, tuple[float, ...]]


def row_block_spec(table: TableSpec, rows: int, world_size: int) -> TableSpec:
    """A row block as the compute net sees it: ``rows`` rows, each bag's lookups spread
    over the D blocks (about pooling / D of them land in one block)."""
    return replace(table, rows=max(1, rows), pooling_factor=table.pooling_factor / world_size)


def row_blocks(table: TableSpec, placement: TablePlacement) -> list[tuple[int, TableSpec]]:
    """(device, ``row_block_spec``) of each non-empty row block of a row-wise ``placement``."""
    return [(d, row_block_spec(table, r, len(placement.devices))) for r, d in zip(placement.rows, placement.devices) if r > 0]


def priced_tables(tables: Sequence[TableSpec], plan: Plan) -> list[TableSpec]:
    """``tables`` as the compute net prices them in ``plan`` (``predict_step``): a row-wise
    table as each of its row blocks, any other table whole. What
    ``costmodel.feature_range_warning`` checks, so that a table whose blocks lie outside
    the model's training data is named with the rest."""
    placement = {p.table: p for p in plan.placements}
    out: list[TableSpec] = []
    for t in tables:
        p = placement.get(t.name)
        out += [spec for _, spec in row_blocks(t, p)] if p is not None and p.kind.splits_rows else [t]
    return out


DATA_PARALLEL_PARTS = ("dp_fwd", "dp_bwd", "all_reduce")
ROW_WISE_PARTS = ("input_dist", "reduce_scatter", "all_gather")


def data_parallel_ms(parts: StepParts, tables: Sequence[TableSpec], batch_size: int, world: int) -> dict[str, float]:
    """ms on every rank of replicating ``tables`` (one dense kernel at the local batch of
    the global ``batch_size``, its backward with the update, one gradient all-reduce)."""
    local = batch_size / world
    bpe = max((t.bytes_per_element for t in tables), default=4)
    shape = ([local * t.pooling_factor for t in tables], [t.dim for t in tables], [t.rows for t in tables], local, bpe)
    elements = sum(t.rows * t.dim for t in tables)
    return {
        "dp_fwd": float(parts.predict("dp_fwd", dp_features("dp_fwd", *shape))[0]),
        "dp_bwd": float(parts.predict("dp_bwd", dp_features("dp_bwd", *shape))[0]),
        "all_reduce": float(parts.predict("all_reduce", collective_features("all_reduce", world, elements * bpe))[0])
        if world > 1
        else 0.0,
    }


def predict_step(model: CostModel, task: Task, plan: Plan, embed: Embedder | None = None) -> StepPrediction:
    """The predicted per-device cost of ``plan``'s step at the task's global batch, each of
    the task's modules priced as DMP runs it and paid at its slowest device.

    ``model`` must already predict at ``task.batch_size`` (``model.with_batch_size``);
    ``embed`` (default ``model.embed_shards``) lets the search reuse cached embeddings.
    """
    if len(task.modules) < 2:
        return _module_step(model, task, plan, embed)
    placed = {p.table for p in plan.placements}
    per = [
        _module_step(model, task.subset(names), plan.subset(names), embed)
        for names in (set(m) & placed for m in task.modules)
        if names
    ]
    world = task.num_devices
    return StepPrediction(
        cost_ms=sum(p.cost_ms for p in per),
        devices=tuple(DeviceCost(*np.sum([astuple(p.devices[d]) for p in per], axis=0).tolist()) for d in range(world)),
        parts={k: tuple(np.sum([p.parts[k] for p in per], axis=0).tolist()) for k in per[0].parts},
    )


def _module_step(model: CostModel, task: Task, plan: Plan, embed: Embedder | None) -> StepPrediction:
    """``predict_step`` of the tables of one module."""
    world = task.num_devices
    local = task.batch_size / world
    parts = model.step_parts
    by_name = {t.name: t for t in task.tables}

    # one lookup group per column kind (TorchRec runs a kernel and a set of collectives for each)
    column: dict[ShardingKind, list[list[Shard]]] = {}
    blocks: list[list[Shard]] = [[] for _ in range(world)]
    replicated: list[TableSpec] = []
    for p in plan.placements:
        table = by_name[p.table]
        if p.kind is ShardingKind.DATA_PARALLEL:
            replicated.append(table)
        elif p.kind.splits_columns:
            group = column.setdefault(p.kind, [[] for _ in range(world)])
            for w, d in zip(p.widths, p.devices):
                group[d].append(Shard(table, w))
        else:
            for d, block in row_blocks(table, p):
                blocks[d].append(Shard(block, table.dim))
    groups = [column[k] for k in ShardingKind if k in column]

    # every group's kernel on every device, in one prediction: [G * D, 2] -> [D, 2]
    kernels = model.compute_cost([dev for group in groups for dev in group], embed)
    col = np.asarray(kernels, dtype=np.float64).reshape(len(groups), world, 2).sum(0)
    rw = np.asarray(model.compute_cost(blocks, embed), dtype=np.float64)  # [D, 2]
    out: dict[str, np.ndarray] = {
        "column_fwd": col[:, 0], "column_bwd": col[:, 1], "row_fwd": rw[:, 0], "row_bwd": rw[:, 1],
    }  # fmt: skip

    # data-parallel: the same dense kernel and all-reduce on every rank
    zeros = np.zeros(world)
    out["dp_fwd"] = out["dp_bwd"] = out["all_reduce"] = zeros
    if replicated and parts is not None and parts.has(*DATA_PARALLEL_PARTS):
        for name, ms in data_parallel_ms(parts, replicated, task.batch_size, world).items():
            out[name] = np.full(world, ms)

    # input distributions
    out["input_dist"] = zeros
    if world > 1 and parts is not None and parts.has("input_dist"):
        out["input_dist"] = sum((_input_dist(parts, g, world, local) for g in (*groups, blocks)), zeros)

    # row-wise collectives: every rank holds the global batch's partial sums of every block
    out["reduce_scatter"] = out["all_gather"] = zeros
    rw_dims = sum(by_name[p.table].dim for p in plan.placements if p.kind.splits_rows)
    if world > 1 and rw_dims and parts is not None and parts.has(*ROW_WISE_PARTS):
        nbytes = task.batch_size * rw_dims * POOLED_BYTES
        for op in ("reduce_scatter", "all_gather"):
            out[op] = np.full(world, parts.predict(op, collective_features(op, world, nbytes))[0])

    # each column group's pooled all-to-all; the first is entered when the device's forward
    # is done (its lateness is waited for once), the others follow in step
    fwd_ready = out["input_dist"] + col[:, 0] + rw[:, 0] + out["dp_fwd"]
    a2a = np.zeros((world, 2))
    if world > 1:
        skew = fwd_ready - fwd_ready.min()
        for group in groups:
            dims = np.asarray([[sum(s.width for s in dev) for dev in group]], dtype=np.float64)  # [1, D]
            a2a = a2a + model.comm_cost_array(dims, skew[None])[0]
            skew = np.zeros(world)
    out["a2a_fwd"], out["a2a_bwd"] = a2a[:, 0].astype(np.float64), a2a[:, 1].astype(np.float64)

    fwd_compute = col[:, 0] + rw[:, 0] + out["dp_fwd"]
    bwd_compute = col[:, 1] + rw[:, 1] + out["dp_bwd"]
    fwd_comm = out["input_dist"] + out["a2a_fwd"] + out["reduce_scatter"]
    bwd_comm = out["a2a_bwd"] + out["all_gather"] + out["all_reduce"]
    devices = tuple(DeviceCost(*map(float, v)) for v in zip(fwd_compute, bwd_compute, fwd_comm, bwd_comm))
    return StepPrediction(
        cost_ms=max(d.total for d in devices),
        devices=devices,
        parts={k: tuple(float(x) for x in v) for k, v in out.items()},
    )


def _input_dist(parts: StepParts, devices: Sequence[Sequence[Shard]], world: int, local: float) -> np.ndarray:
    """ms [D] of one group's KJT input distribution on each rank.

    Rank r sends rank j its local samples' bags of every shard j holds: their lengths and,
    for a column shard, every index of its table; for a row block (bucketised), the
    indices falling in the block (``row_block_spec`` already holds 1/D of the lookups).
    """
    if not any(devices):
        return np.zeros(world)
    # bytes one rank sends to the holder of each device's shards: [D]
    to_device = np.asarray(
        [sum(local * (s.table.pooling_factor * INDEX_BYTES + LENGTH_BYTES) for s in dev) for dev in devices]
    )
    total = to_device.sum()
    send = total - to_device  # rank r sends every other rank j its to_device[j]
    recv = to_device * (world - 1)  # rank j receives to_device[j] from each other rank
    x = np.asarray([input_dist_features(world, s, r) for s, r in zip(send, recv)])
    return parts.predict("input_dist", x)
