"""``NeuroShardPlanner``: TorchRec's ``ShardingPlanner`` backed by the neural cost model
and NeuroShard's search. Its plans go straight into ``DistributedModelParallel``::

    planner = NeuroShardPlanner(topology, batch_size=batch_size, constraints=constraints)
    plan = planner.collective_plan(model, sharders, pg)
    model = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingPlanner, ShardingType

from torchrec_neuroshard.costmodel import NeuralCostModel, load_pretrained
from torchrec_neuroshard.search import SearchConfig, SearchResult, search
from torchrec_neuroshard.sharding import row_wise_sharding, to_torchrec
from torchrec_neuroshard.stats import format_plan_stats
from torchrec_neuroshard.tables import find_embedding_bag_collections, tables_from_module
from torchrec_neuroshard.types import Plan, ShardingError, TableSpec, Task

logger = logging.getLogger(__name__)

SEARCHABLE = {ShardingType.TABLE_WISE.value, ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value}
SPLITTABLE = {ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value}
ROW_SPLITS = {ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value, ShardingType.GRID_SHARD.value}
KNOWN_TYPES = {t.value for t in ShardingType}

DEFAULT_STORAGE_RESERVATION = 0.15
"""Share of each rank's memory kept free for activations and buffers (TorchRec's default)."""
MAX_WORLD_SIZE_EXTRAPOLATION = 4
"""Plan for up to this many times the largest world size the comm model was trained on."""


class NeuroShardPlanner(ShardingPlanner):
    """Plans column-wise / table-wise sharding with NeuroShard's pre-trained cost model.

    Args:
        topology: TorchRec ``Topology`` (world size, compute device, per-rank memory:
            hbm on cuda, ddr on cpu).
        batch_size: global batch size; default the one the cost model was trained at.
            Other sizes scale the predictions linearly. Measured on 12 CPU kernels from
            1/4x to 4x the trained batch: the median error of that scaling stays within
            7%, but single kernels deviate by 20-30% at 2x and up to 50% at 1/4x, so for
            accurate plans pre-train at your batch size.
        constraints: TorchRec ``ParameterConstraints`` by table name. Honoured:
            ``sharding_types`` (table_wise only = never split; data_parallel or row_wise
            only = TorchRec's sharding for that table, logged), ``min_partition`` (the
            narrowest column shard), ``pooling_factors`` (summed over features).
            Every planned table uses the fused kernel, the one the cost model was
            trained on: constraints whose ``compute_kernels`` exclude "fused" are an error.
        cost_model: a ``NeuralCostModel``, a path to a model file, or a shipped name;
            default the shipped "cpu" model.
        search_config: the search's knobs (beam width, scales, ...).
        storage_reservation: share of memory kept free on every rank.
        access_hists: measured access histograms by table (``profile_batches``).
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int | None = None,
        constraints: Mapping[str, ParameterConstraints] | None = None,
        cost_model: NeuralCostModel | str | Path | None = None,
        search_config: SearchConfig = SearchConfig(),
        storage_reservation: float = DEFAULT_STORAGE_RESERVATION,
        access_hists: Mapping[str, tuple[float, ...]] | None = None,
    ) -> None:
        self.topology = topology
        self.constraints = dict(constraints or {})
        if cost_model is None:
            cost_model = load_pretrained("cpu")
        elif not isinstance(cost_model, NeuralCostModel):
            path = Path(cost_model)
            cost_model = NeuralCostModel.load(path) if path.suffix == ".pt" or path.exists() else load_pretrained(str(cost_model))
        self.cost_model = cost_model
        self.batch_size = batch_size or cost_model.batch_size
        self.search_config = search_config
        self.storage_reservation = storage_reservation
        self.access_hists = dict(access_hists or {})
        self.last_result: SearchResult | None = None

    # ------------------------------------------------------------------ public API

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """Plan every EmbeddingBagCollection in ``module`` (single process)."""
        world = self.topology.world_size
        device_type = self.topology.compute_device
        self._check_constraints(module)  # also the clear error for a module with no EBC
        model = self._model_for(world)
        pooling = {
            name: float(sum(c.pooling_factors)) for name, c in self.constraints.items() if c.pooling_factors
        }
        tables = tables_from_module(module, self.batch_size, pooling, self.access_hists)
        cap = self._memory_cap(device_type)

        searchable: list[TableSpec] = []
        data_parallel: list[str] = []
        decided = {}
        fallbacks: dict[str, str] = {}
        min_width: dict[str, int] = {}
        for t in tables:
            allowed = self._allowed_types(t.name)
            if allowed & SEARCHABLE and t.size_bytes() <= cap:
                searchable.append(t)
                c = self.constraints.get(t.name)
                if not allowed & SPLITTABLE:
                    min_width[t.name] = t.dim
                elif c is not None and c.min_partition:
                    min_width[t.name] = int(c.min_partition)
            elif allowed & ROW_SPLITS or (t.size_bytes() > cap and not self.constraints.get(t.name, ParameterConstraints()).sharding_types):
                if -(-t.rows // world) * t.dim * t.bytes_per_element > cap:
                    raise ShardingError(
                        f"table {t.name!r} ({t.size_bytes():,} bytes) does not fit even row-wise "
                        f"over {world} ranks of {cap:,} bytes; add ranks or memory"
                    )
                decided[t.name] = row_wise_sharding(t.rows, t.dim, world, device_type, self.topology.local_world_size)
                why = (
                    "restricted to row-wise sharding"
                    if not allowed & SEARCHABLE
                    else f"larger than one rank's memory ({t.size_bytes():,} > {cap:,} bytes)"
                )
                cap -= -(-t.rows // world) * t.dim * t.bytes_per_element
                fallbacks[t.name] = f"{why}: row_wise over all {world} ranks (TorchRec's sharding; not in the predicted cost)"
            elif ShardingType.DATA_PARALLEL.value in allowed:
                data_parallel.append(t.name)
                cap -= t.size_bytes()
                fallbacks[t.name] = "restricted to data_parallel: replicated on every rank (TorchRec's sharding; not in the predicted cost)"
            else:
                raise ShardingError(
                    f"table {t.name!r} ({t.size_bytes():,} bytes) is larger than one rank's memory "
                    f"({cap:,} bytes after reservations) and its constraints allow only "
                    f"{sorted(allowed)}; allow column_wise or row_wise, or add memory"
                )
        if cap <= 0:
            raise ShardingError(
                f"the topology's memory fits nothing: {self._memory_cap(device_type):,} bytes per rank "
                f"after a {self.storage_reservation:.0%} reservation, all taken by replicated or row-wise tables"
            )
        for name, why in fallbacks.items():
            logger.info("table %s: %s", name, why)

        if searchable:
            task = Task(tuple(searchable), world, cap, self.batch_size)
            result = search(task, model, self.search_config, min_width)
            self.last_result = result
            plan = Plan(result.plan.placements, world, tuple(data_parallel))
            logger.info(
                "%s",
                format_plan_stats(plan, tables, result.devices, cap, fallbacks)
                + f"\nsearched {result.states_evaluated} split states in {result.seconds:.2f} s",
            )
        else:
            plan = Plan((), world, tuple(data_parallel))
        return to_torchrec(plan, module, device_type, self.topology.local_world_size, decided)

    def collective_plan(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]] | None = None,
        pg: dist.ProcessGroup | None = None,
    ) -> ShardingPlan:
        """Plan on rank 0 of ``pg`` (default: the world) and broadcast: every rank gets the
        identical plan. An error on rank 0 is raised on every rank."""
        if sharders is None:
            from torchrec.distributed.sharding_plan import get_default_sharders

            sharders = get_default_sharders()
        if not dist.is_initialized():
            raise ShardingError(
                "collective_plan needs an initialised process group "
                "(torch.distributed.init_process_group); use plan() in a single process"
            )
        pg = pg or dist.GroupMember.WORLD
        box: list[object] = [None]
        if dist.get_rank(pg) == 0:
            try:
                box[0] = self.plan(module, sharders)
            except ShardingError as e:
                box[0] = e
        src = dist.get_global_rank(pg, 0) if pg is not dist.GroupMember.WORLD else 0
        dist.broadcast_object_list(box, src=src, group=pg, device=_broadcast_device(pg))
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]  # type: ignore[return-value]

    # ------------------------------------------------------------------ helpers

    def _model_for(self, world: int) -> NeuralCostModel:
        model = self.cost_model
        trained = model.meta.get("world_sizes_trained", [])
        if world > 1 and trained and world not in trained:
            if world > MAX_WORLD_SIZE_EXTRAPOLATION * max(trained):
                raise ShardingError(
                    f"world size {world} is far beyond the world sizes the comm model was trained "
                    f"on ({trained}); collect comm samples at this size (`neuroshard collect comm "
                    f"--world-size {world}`) and re-train (`neuroshard pretrain`)"
                )
            logger.warning(
                "world size %d was not in the comm model's training data %s; the equivariant "
                "model extrapolates", world, trained,
            )
        if self.batch_size != model.batch_size:
            logger.info(
                "batch size %d differs from the cost model's %d: predictions scaled by %.3g",
                self.batch_size, model.batch_size, self.batch_size / model.batch_size,
            )
            model = model.with_batch_size(self.batch_size)
        hw = model.meta.get("hardware", {}).get("device")
        if hw and hw != self.topology.compute_device:
            logger.warning(
                "the cost model was trained on %s but the topology is %s: pre-train one on this "
                "hardware for accurate plans (README: pre-training for your GPUs)", hw, self.topology.compute_device,
            )
        return model

    def _memory_cap(self, device_type: str) -> int:
        field = "hbm" if device_type == "cuda" else "ddr"
        cap = min(getattr(d.storage, field) for d in self.topology.devices)
        return int(cap * (1.0 - self.storage_reservation))

    def _allowed_types(self, table: str) -> set[str]:
        c = self.constraints.get(table)
        if c is None or not c.sharding_types:
            return SEARCHABLE | ROW_SPLITS | {ShardingType.DATA_PARALLEL.value}
        return set(c.sharding_types)

    def _check_constraints(self, module: nn.Module) -> None:
        names = {c.name for ebc in find_embedding_bag_collections(module).values() for c in ebc.embedding_bag_configs()}
        for table, c in self.constraints.items():
            if table not in names:
                logger.warning("constraints name table %r, which the module does not have", table)
            for st in c.sharding_types or []:
                if st not in KNOWN_TYPES:
                    raise ShardingError(
                        f"table {table!r}: unknown sharding type {st!r} in ParameterConstraints; "
                        f"known types: {sorted(KNOWN_TYPES)}"
                    )
            if c.compute_kernels and "fused" not in c.compute_kernels:
                raise ShardingError(
                    f"table {table!r}: constraints allow compute kernels {list(c.compute_kernels)}; "
                    "NeuroShardPlanner plans the fused kernel its cost model was trained on: "
                    "allow 'fused', or plan this model with TorchRec's planner"
                )
            if c.min_partition is not None and (c.min_partition <= 0 or c.min_partition % 4):
                raise ShardingError(
                    f"table {table!r}: min_partition {c.min_partition} must be a positive multiple of 4"
                )


def _broadcast_device(pg: dist.ProcessGroup) -> torch.device:
    """The device a collective on ``pg`` runs on: this rank's GPU under NCCL, else the CPU."""
    if dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_model(
    model: nn.Module,
    planner: ShardingPlanner | None = None,
    sharders: list[ModuleSharder[nn.Module]] | None = None,
    device: torch.device | None = None,
    pg: dist.ProcessGroup | None = None,
    batch_size: int | None = None,
) -> nn.Module:
    """Plan with ``planner`` (default: a NeuroShardPlanner for the current group) and wrap
    ``model`` in ``DistributedModelParallel`` with that plan. Call on every rank."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import get_default_sharders

    device = device or _broadcast_device(pg or dist.GroupMember.WORLD)
    sharders = sharders or get_default_sharders()
    if planner is None:
        world = dist.get_world_size(pg)
        topology = Topology(world_size=world, compute_device=device.type, local_world_size=world)
        planner = NeuroShardPlanner(topology, batch_size=batch_size)
    plan = planner.collective_plan(model, sharders, pg)
    return DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
