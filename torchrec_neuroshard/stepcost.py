"""The predicted cost of a whole sharded step, per device, for a plan of every kind.

What DistributedModelParallel runs on each rank for one step, as the evaluator
(``lab/evaluate.py``) measures it, priced part by part:

- column groups, one per kind (table-wise, column-wise, table-column-wise: TorchRec gives
  each sharding type its own lookup module): per group, the KJT input distribution, one
  fused kernel over the device's shards at the global batch (the compute net), the pooled
  all-to-all forward (the first group's entered with the device's compute lateness) and
  backward (the comm model). Splitting one table by columns thus adds a second kernel and
  a second set of collectives to a plan of whole tables;
- row groups, one per kind: the bucketised input distribution, one kernel over the
  device's row blocks (each block sees about 1 / blocks of its table's lookups), the
  reduce-scatter of the pooled partial sums forward and their all-gather backward: over
  every rank (row-wise), or over the table's host (table-row-wise), whose ranks then trade
  their samples with the ranks of the same place on the other hosts, each way;
- data-parallel tables: the dense kernel at the local batch on every rank, the dense
  gradient and update, and the gradient all-reduce.

The non-kernel parts come from the model's fitted ``StepParts`` (``steparts.py``), measured
within one host. On a task with ``links`` (the planner's topology) each collective also
costs at least the time its bytes across hosts take on the inter-host link, and one the
model did not measure (a GPU model's: they need several GPUs) is priced by the links alone
(``Collectives``). A model without the parts and a task without links price those parts
as 0, and the search then never chooses the kinds that need them.

A device's cost: its compute (every group's kernels) + its comm (input distributions,
forward and backward collectives). The step's embedding cost is the max over devices for
one sharded module; a model of several (``Task.modules``: TorchRec shards each
EmbeddingBagCollection apart) pays each module's slowest device in turn, since the
module's collectives hold every rank until the slowest arrives. So the step is the sum
over modules of each one's max over devices, and a plan balanced only in its per-device
totals can still wait on every module (measured: ``studies/module_sync.py``).
"""

from __future__ import annotations

import functools
from dataclasses import astuple, dataclass, replace
from typing import Callable, Sequence

import numpy as np

from torchrec_neuroshard.comm import AlphaBetaComm, Exchange, OuterExchange, PairExchange
from torchrec_neuroshard.hosts import host_ranks
from torchrec_neuroshard.steparts import StepParts, collective_features, dp_features, input_dist_features
from torchrec_neuroshard.types import (
    CostModel,
    DeviceCost,
    Plan,
    Shard,
    ShardingError,
    ShardingKind,
    TablePlacement,
    TableSpec,
    Task,
)

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


@functools.lru_cache(maxsize=1024)  # a split over 1,024 ranks keeps 1,024 specs
def row_blocks(table: TableSpec, placement: TablePlacement) -> tuple[tuple[int, TableSpec], ...]:
    """(device, ``row_block_spec``) of each non-empty row block of a row-wise ``placement``;
    kept, so that a search pricing one row split in many plans makes its blocks (and
    hashes them, as the embedding cache keys) once."""
    table = placement.spec_of(table)  # on the placement's kernel
    return tuple((d, row_block_spec(table, r, len(placement.devices))) for r, d in zip(placement.rows, placement.devices) if r > 0)


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


DATA_PARALLEL_KERNELS = ("dp_fwd", "dp_bwd")
DATA_PARALLEL_COLLECTIVES = ("all_reduce",)
ROW_WISE_COLLECTIVES = ("input_dist", "reduce_scatter", "all_gather")


@dataclass(frozen=True)
class Collectives:
    """Prices a step's collectives, per rank, from what is known of them.

    A collective the model measured (its ``StepParts``, timed within one host) costs its
    measurement, and never less than its bytes that cross hosts take on the task's
    inter-host links (``AlphaBetaComm.cross_host_ms``; nothing on one host). One the model
    did not measure (e.g. on a GPU model, whose collectives need several GPUs) is priced by
    the links alone, intra- and inter-host apart (``AlphaBetaComm.all_to_all_ms``), the
    stand-in the pooled all-to-all of such a model already uses. With neither, 0: the
    search does not choose the kinds that need it (``prices``).
    """

    parts: StepParts | None
    links: AlphaBetaComm | None
    world: int

    @staticmethod
    def of(model: CostModel, task: Task) -> "Collectives":
        links = None if task.links is None else AlphaBetaComm.from_topology(task.links, task.batch_size)
        return Collectives(model.step_parts, links, task.num_devices)

    def prices(self, *ops: str) -> bool:
        """Whether every collective of ``ops`` has a price (measured, or from the links)."""
        return self.links is not None or (self.parts is not None and self.parts.has(*ops))

    def replicates(self) -> bool:
        """Whether replication is priced: the dense kernel measured, its all-reduce priced."""
        return self.parts is not None and self.parts.has(*DATA_PARALLEL_KERNELS) and self.prices(*DATA_PARALLEL_COLLECTIVES)

    def splits_rows(self) -> bool:
        """Whether row splits are priced: their collectives measured or the links known."""
        return self.prices(*ROW_WISE_COLLECTIVES)

    def cost(self, op: str, features: Sequence[float], send: Exchange) -> np.ndarray:
        """ms [D] of collective ``op``: the measured part at ``features`` (one row for all
        ranks, or one per rank), ``send`` the bytes each rank sends each other."""
        if self.parts is not None and self.parts.has(op):
            measured = np.broadcast_to(self.parts.predict(op, features), (self.world,)).astype(np.float64)
            return measured if self.links is None else np.maximum(measured, self.links.cross_host_ms(send))
        return self.exchange(send)

    def exchange(self, send: Exchange) -> np.ndarray:
        """ms [D] of an exchange no part measures, from the links (0 without them)."""
        return np.zeros(self.world) if self.links is None else self.links.all_to_all_ms(send)


def _everyone_sends(per_peer: np.ndarray) -> OuterExchange:
    """The exchange in which every rank i sends ``per_peer[i]`` bytes to each other rank."""
    return OuterExchange(np.asarray(per_peer, dtype=np.float64), np.ones(len(per_peer)))


def data_parallel_ms(
    parts: StepParts, tables: Sequence[TableSpec], batch_size: int, world: int, links: AlphaBetaComm | None = None
) -> dict[str, float]:
    """ms on every rank of replicating ``tables`` (one dense kernel at the local batch of
    the global ``batch_size``, its backward with the update, one gradient all-reduce priced
    as ``Collectives`` does with the ``links``)."""
    local = batch_size / world
    bpe = max((t.bytes_per_element for t in tables), default=4)
    shape = ([local * t.pooling_factor for t in tables], [t.dim for t in tables], [t.rows for t in tables], local, bpe)
    nbytes = sum(t.rows * t.dim for t in tables) * bpe
    # a reduce-scatter and an all-gather: each rank sends every other 1 / D of the gradient, twice
    send = _everyone_sends(np.full(world, 2 * nbytes / world))
    return {
        "dp_fwd": float(parts.predict("dp_fwd", dp_features("dp_fwd", *shape))[0]),
        "dp_bwd": float(parts.predict("dp_bwd", dp_features("dp_bwd", *shape))[0]),
        "all_reduce": float(Collectives(parts, links, world).cost("all_reduce", collective_features("all_reduce", world, nbytes), send)[0])
        if world > 1
        else 0.0,
    }


def _check_replicates(collectives: Collectives, replicated: Sequence[TableSpec]) -> None:
    """Refuse pricing replicas the model cannot price (never a free data-parallel table)."""
    if collectives.replicates():
        return
    names = ", ".join(sorted(t.name for t in replicated)[:5])
    raise ShardingError(
        f"{len(replicated)} data-parallel table(s) ({names}) but the cost model prices no replicas: it has no "
        f"{' / '.join(DATA_PARALLEL_KERNELS)} step parts or cannot price the all-reduce (no links). Measure them "
        "(`neuroshard collect step --kinds dp dp_small dp_many`, then `python -m torchrec_neuroshard.lab.refit_steps`) "
        "or constrain these tables to other sharding_types"
    )


def data_parallel_fixed_ms(model: CostModel, task: Task) -> dict[str, float]:
    """What replicating any tables at all costs every rank, per module, before a byte of
    them: the dense kernel's fixed forward and backward and the all-reduce's
    (``data_parallel_ms`` of no tables). Empty when the model does not price replicas."""
    collectives = Collectives.of(model, task)
    if not collectives.replicates():
        return {}
    return data_parallel_ms(model.step_parts, [], task.batch_size, task.num_devices, collectives.links)


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
    collectives = Collectives.of(model, task)
    by_name = task.by_name
    column, row, replicated = _lookup_groups(plan, by_name, world)

    # every group's kernel on every device, in one prediction: [G * D, 2] -> [D, 2]
    def kernels(of: list[list[list[Shard]]]) -> np.ndarray:
        cost = model.compute_cost([dev for group in of for dev in group], embed)
        return np.asarray(cost, dtype=np.float64).reshape(len(of), world, 2).sum(0)

    col, rw = kernels(column), kernels(row)
    out: dict[str, np.ndarray] = {
        "column_fwd": col[:, 0], "column_bwd": col[:, 1], "row_fwd": rw[:, 0], "row_bwd": rw[:, 1],
    }  # fmt: skip

    # data-parallel: the same dense kernel and all-reduce on every rank
    zeros = np.zeros(world)
    out["dp_fwd"] = out["dp_bwd"] = out["all_reduce"] = zeros
    if replicated:
        _check_replicates(collectives, replicated)
        for name, ms in data_parallel_ms(parts, replicated, task.batch_size, world, collectives.links).items():
            out[name] = np.full(world, ms)

    # input distributions
    out["input_dist"] = zeros
    if world > 1 and collectives.prices("input_dist"):
        out["input_dist"] = sum((_input_dist(collectives, g, local) for g in (*column, *row)), zeros)

    # row splits: the pooled partial sums of the global batch, reduce-scattered forward and
    # all-gathered backward: over all ranks (row-wise), over the table's host (table-row-wise,
    # then its host's ranks trade their samples with the ranks of the same place on other hosts)
    out["reduce_scatter"], out["all_gather"], out["cross_host"] = zeros, zeros.copy(), zeros.copy()
    if world > 1 and row and collectives.splits_rows():
        out.update(_row_collectives(collectives, task, plan, by_name))

    fwd_ready = out["input_dist"] + col[:, 0] + rw[:, 0] + out["dp_fwd"]
    a2a = _pooled_all_to_alls(model, collectives, column, fwd_ready, local) if world > 1 else np.zeros((world, 2))
    out["a2a_fwd"], out["a2a_bwd"] = a2a[:, 0], a2a[:, 1]

    fwd_compute = col[:, 0] + rw[:, 0] + out["dp_fwd"]
    bwd_compute = col[:, 1] + rw[:, 1] + out["dp_bwd"]
    fwd_comm = out["input_dist"] + out["a2a_fwd"] + out["reduce_scatter"] + out["cross_host"]
    bwd_comm = out["a2a_bwd"] + out["all_gather"] + out["cross_host"] + out["all_reduce"]
    devices = tuple(DeviceCost(*map(float, v)) for v in zip(fwd_compute, bwd_compute, fwd_comm, bwd_comm))
    return StepPrediction(
        cost_ms=max(d.total for d in devices),
        devices=devices,
        parts={k: tuple(float(x) for x in v) for k, v in out.items()},
    )


def _lookup_groups(
    plan: Plan, by_name: dict[str, TableSpec], world: int
) -> tuple[list[list[list[Shard]]], list[list[list[Shard]]], list[TableSpec]]:
    """The plan's lookup groups, one per sharding kind (TorchRec runs a kernel and a set of
    collectives for each), each the shards of every device [D][shards]: the column kinds'
    groups, the row kinds' groups (in ``ShardingKind`` order), and the replicated tables."""
    groups: dict[ShardingKind, list[list[Shard]]] = {}
    replicated: list[TableSpec] = []
    for p in plan.placements:
        table = p.spec_of(by_name[p.table])  # on the placement's kernel
        if p.kind is ShardingKind.DATA_PARALLEL:
            replicated.append(table)
            continue
        if p.kind not in groups:  # (not setdefault: its default would be built for every table)
            groups[p.kind] = [[] for _ in range(world)]
        group = groups[p.kind]
        if p.kind.splits_columns:
            for w, d in zip(p.widths, p.devices):
                group[d].append(Shard(table, w))
        else:
            for d, block in row_blocks(table, p):
                group[d].append(Shard(block, table.dim))
    column = [groups[k] for k in ShardingKind if k in groups and k.splits_columns]
    row = [groups[k] for k in ShardingKind if k in groups and k.splits_rows]
    return column, row, replicated


def _pooled_all_to_alls(
    model: CostModel, collectives: Collectives, column: list[list[list[Shard]]], fwd_ready: np.ndarray, local: float
) -> np.ndarray:
    """(forward, backward) ms [D, 2] of each column group's pooled all-to-all, the devices
    ready for the first at ``fwd_ready`` [D]: the first is entered when the device's forward
    is done (its lateness is waited for once), the others follow in step."""
    world = len(fwd_ready)
    a2a = np.zeros((world, 2))
    skew = fwd_ready - fwd_ready.min()
    for group in column:
        dims = np.asarray([[sum(s.width for s in dev) for dev in group]], dtype=np.float64)  # [1, D]
        cost = model.comm_cost_array(dims, skew[None])[0].astype(np.float64)  # [D, 2]
        if collectives.links is not None:  # never below its bytes across hosts
            cost = np.maximum(cost, collectives.links.cross_host_ms(_everyone_sends(dims[0] * local * POOLED_BYTES))[:, None])
        a2a = a2a + cost
        skew = np.zeros(world)
    return a2a

def _row_collectives(
    collectives: Collectives, task: Task, plan: Plan, by_name: dict[str, TableSpec]
) -> dict[str, np.ndarray]:
    """ms [D] of the row splits' "reduce_scatter" (forward), "all_gather" (backward) and
    "cross_host" (table-row-wise's exchange between hosts, each way)."""
    world, local = task.num_devices, task.batch_size / task.num_devices
    out = {name: np.zeros(world) for name in ("reduce_scatter", "all_gather", "cross_host")}
    # the ranks each row group reduces over: every rank (row-wise), a host (table-row-wise)
    span = task.links.local_world_size if task.links is not None else world
    dims: dict[tuple[int, ...], int] = {}
    for p in plan.placements:
        if p.kind.splits_rows:
            ranks = tuple(host_ranks(min(p.devices), span, world) if p.kind.within_host else range(world))
            dims[ranks] = dims.get(ranks, 0) + by_name[p.table].dim
    for ranks, dim in dims.items():
        n, nbytes = len(ranks), task.batch_size * dim * POOLED_BYTES
        if n > 1:
            mine = np.zeros(world, dtype=bool)
            mine[list(ranks)] = True
            send = OuterExchange(np.where(mine, nbytes / n, 0.0), mine.astype(np.float64))  # among the ranks
            for op in ("reduce_scatter", "all_gather"):
                out[op] += np.where(mine, collectives.cost(op, collective_features(op, n, nbytes), send), 0.0)
        if n < world:  # rank k of the host sends each other host's rank k its local samples
            pairs = [(r, q) for r in ranks for q in range(r % span, world, span) if q not in ranks]
            src, dst = np.asarray(pairs, dtype=np.int64).reshape(-1, 2).T
            out["cross_host"] += collectives.exchange(PairExchange(world, src, dst, local * dim * POOLED_BYTES))
    return out


def _input_dist(collectives: Collectives, devices: Sequence[Sequence[Shard]], local: float) -> np.ndarray:
    """ms [D] of one group's KJT input distribution on each rank.

    Rank r sends rank j its local samples' bags of every shard j holds: their lengths and,
    for a column shard, every index of its table; for a row block (bucketised), the
    indices falling in the block (``row_block_spec`` already holds its share of the lookups).
    """
    world = len(devices)
    if not any(devices):
        return np.zeros(world)
    # bytes one rank sends to the holder of each device's shards: [D]
    to_device = np.asarray(
        [sum(local * (s.table.pooling_factor * INDEX_BYTES + LENGTH_BYTES) for s in dev) for dev in devices]
    )
    sent, received = to_device.sum() - to_device, (world - 1) * to_device  # [D] each
    x = [input_dist_features(world, s, r) for s, r in zip(sent, received)]
    return collectives.cost("input_dist", x, OuterExchange(np.ones(world), to_device))  # rank r sends rank j to_device[j]
