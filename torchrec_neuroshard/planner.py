"""``NeuroShardPlanner``: TorchRec's ``ShardingPlanner`` backed by the neural cost model
and NeuroShard's search. Its plans go straight into ``DistributedModelParallel``::

    planner = NeuroShardPlanner(topology, batch_size=batch_size, constraints=constraints)
    plan = planner.collective_plan(model, sharders, pg)
    model = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from dataclasses import replace
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.planners import to_sharding_plan
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    PlanLoader,
    ShardingOption,
    StorageReservation,
    Topology,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan, ShardingPlanner

from torchrec_neuroshard.dmp import broadcast_device
from torchrec_neuroshard.costmodel import NeuralCostModel, check_world_size, cost_model_for, feature_range_warning, kernel_size_warning
from torchrec_neuroshard.estimators import global_batch
from torchrec_neuroshard.planner_args import (
    Callback,
    PlanRefiner,
    apply_callbacks,
    check_callbacks,
    check_constraints,
    check_modules_planned,
    check_plan_loader,
    check_refiner,
    check_table_constraints,
    check_timeout,
    check_topology,
    default_topology,
    lookups_per_sample,
    portable as _portable,
    refuse_replaced,
    refuse_weighted,
    reservation_of,
)
from torchrec_neuroshard.plan_loading import load_plan, planner_context
from torchrec_neuroshard.planner_memory import MemoryPlanning
from torchrec_neuroshard.search import SearchConfig, SearchResult, search
from torchrec_neuroshard.sharding import from_torchrec, sharder_load_factors, to_torchrec
from torchrec_neuroshard.stats import empty_device_line, format_plan_stats, log_stats, replica_overhead_line, stats_list
from torchrec_neuroshard.stats import table_perfs, torchrec_sharding_options
from torchrec_neuroshard.stepcost import priced_tables
from torchrec_neuroshard.tables import ModuleTable, module_tables, shardable_modules
from torchrec_neuroshard.triage import Triage, labelled, search_choices
from torchrec_neuroshard.types import Links, Plan, ShardingError, ShardingKind, TableSpec, Task

logger = logging.getLogger(__name__)
STATS_LOGGER = logging.getLogger("torchrec.distributed.planner.stats")
"""Where TorchRec's planner logs its EmbeddingStats table: the plan table goes there too."""


class NeuroShardPlanner(MemoryPlanning, ShardingPlanner):
    """Plans every sharding kind TorchRec's sharders offer with NeuroShard's pre-trained
    cost model: table-wise and column-wise splits by NeuroShard's search; replication and
    row-wise splits (over all ranks, or table-row-wise over one host's when the topology
    has several) where the model prices them (``stepcost``: a collective it did not measure
    is priced from the topology's links).

    Takes ``EmbeddingShardingPlanner``'s parameters in its order with its defaults, then
    NeuroShard's own by keyword; each is checked when the planner is made.

    Args:
        topology: TorchRec ``Topology`` (world size, compute device, per-rank memory:
            hbm on cuda, ddr on cpu; ranks per host and the intra- and inter-host
            bandwidths price the collectives' bytes over the links). None: TorchRec's
            default for this process (``planner_args.default_topology``).
        batch_size: the PER-RANK batch size, exactly as ``EmbeddingShardingPlanner``
            defines it (default TorchRec's, 512). A table-wise shard's kernel sees the
            global batch, ``batch_size x world_size``. The shipped CPU model learned the
            batch (global 256-65,536, benchmarks/batch_curve.py); a model trained at one
            batch (h200, intel_xeon) scales linearly from it, as every model does beyond
            the batches it learned, and its comm (``NeuralCostModel.batch_note`` logs which).
        enumerator, proposer, partitioner, performance_model: refused (a ``ShardingError``):
            NeuroShard's search and cost model replace them; to use NeuroShard's cost model
            inside TorchRec's own planner see examples/estimator_in_torchrec.py.
        storage_reservation: a TorchRec ``StorageReservation`` (e.g. its default planner's
            ``HeuristicalStorageReservation(percentage=0.15)``), or a fraction of every rank's
            memory kept free (default None: 0.15, ``FixedPercentageStorageReservation``).
        stats: a TorchRec ``Stats`` (e.g. ``EmbeddingStats()``) or a list of them, as
            ``EmbeddingShardingPlanner`` takes it; default none (NeuroShard's own table comes
            with ``debug``). After each plan every one is called with TorchRec's arguments
            and our plan as TorchRec ``ShardingOption``s (``stats.torchrec_sharding_options``:
            our shards and ranks, TorchRec's storage estimate of them, each table's own
            predicted perf, ``stats.table_perfs``; 0 when no table was searched).
        constraints: TorchRec ``ParameterConstraints`` by table name; each field honoured
            or refused by name (``planner_args.CONSTRAINT_FIELDS``): those that need no
            table checked here, the rest when planning.
        debug: log the plan table (per rank: memory, predicted perf and its parts,
            shards) on TorchRec's planner-stats logger, where TorchRec's own planner logs
            its table, so the same logging set-up shows both; off: logged at DEBUG.
        callbacks: functions called as TorchRec calls them, ``options = callback(options)``
            on the plan as TorchRec ``ShardingOption``s, before the ``ShardingPlan`` is built
            from what the last one returns.
        timeout_seconds: a budget (positive seconds) for the whole ``plan()`` call: past it
            no stage refines further (no more offload proposals screened, kinds chosen,
            splits searched or shards moved: ``SearchConfig.deadline``), and the plan is
            the best found by then, logged as such; the greedy placement of whole tables and
            the heuristics' plans are always made, so there is always a complete plan.
        plan_loader: a TorchRec ``PlanLoader``; a plan it loads is used as TorchRec's planner
            uses it (``plan_loading.load_plan``: the context hash checked, no search); our
            own plans too, saved with ``hash_planner_context_inputs_str()``.
        cost_model: a ``NeuralCostModel``, a path to a model file, or a shipped name;
            default the shipped model for the topology's compute device and this machine
            (``costmodel.cost_model_for``: a hardware mismatch is warned about, a GPU model
            without comm gets the alpha-beta stand-in from the topology). Loaded on the
            first plan. Tables outside the data it was trained on are priced as the
            nearest shards it learned, and one warning per plan names them, a row-wise
            table by its row blocks (``costmodel.feature_range_warning`` of
            ``stepcost.priced_tables``).
        search_config: the search's knobs (beam width, scales, ...).
        access_hists: measured access histograms by table (``profile_batches``).
        refiner: opt-in, refines the searched plan (``planner_args.PlanRefiner``, e.g. ``lab.refine.MeasuredRefiner``).

    After ``plan``: ``plan_`` (our ``Plan``; a loaded plan's too where a ``Plan`` records
    its kinds, else None), ``task_`` (every table as a ``Task`` at the global batch) and
    ``search_result_`` (None for both when no table was searched or the plan was loaded).
    """

    def __init__(
        self,
        topology: Topology | None = None,
        batch_size: int | None = None,
        enumerator: object = None,
        storage_reservation: StorageReservation | float | None = None,
        proposer: object = None,
        partitioner: object = None,
        performance_model: object = None,
        stats: object = None,
        constraints: Mapping[str, ParameterConstraints] | None = None,
        debug: bool = True,
        callbacks: list[Callback] | None = None,
        timeout_seconds: float | None = None,
        plan_loader: PlanLoader | None = None,
        *,
        cost_model: NeuralCostModel | str | Path | None = None,
        search_config: SearchConfig = SearchConfig(),
        access_hists: Mapping[str, tuple[float, ...]] | None = None,
        refiner: PlanRefiner | None = None,
    ) -> None:
        refuse_replaced(enumerator=enumerator, proposer=proposer, partitioner=partitioner, performance_model=performance_model)
        self.topology = default_topology() if topology is None else check_topology(topology)
        self.batch_size = batch_size
        self.storage_reservation = storage_reservation
        self._reserved_by = reservation_of(storage_reservation)
        self.stats = stats
        self._stats = stats_list(stats)
        check_constraints(constraints, self.topology.compute_device)
        self.constraints = constraints
        self.debug = debug
        self.callbacks = check_callbacks(callbacks)
        self.timeout_seconds = check_timeout(timeout_seconds)
        self.plan_loader = check_plan_loader(plan_loader)
        self.cost_model = cost_model
        self.search_config = search_config
        self.access_hists = access_hists
        self.refiner = check_refiner(refiner)

    # ------------------------------------------------------------------ public API

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """Plan every module of ``module`` that one of ``sharders`` shards (single process)."""
        start = time.perf_counter()
        self.search_result_ = self.task_ = None
        self._planned = (module, list(sharders))
        if self.plan_loader is not None:
            context = planner_context(
                self.topology, self._per_rank_batch(), self._reserved_by, self.constraints, module, sharders
            )  # fmt: skip
            loaded = load_plan(self.plan_loader, context)
            if loaded is not None:
                return self._finish(module, sharders, None, loaded, start)
        if not shardable_modules(module, sharders):
            logger.warning(
                "nothing to plan: %s holds no module that one of the %d sharders shards; an empty plan, as "
                "TorchRec's planner gives", type(module).__name__, len(sharders),
            )  # fmt: skip
            return ShardingPlan(plan={})
        tables = module_tables(
            module, self._global_batch(), lookups_per_sample(self.constraints, self._per_rank_batch()),
            self.access_hists, sharders, self.topology.compute_device,
        )  # fmt: skip
        refuse_weighted(module, sharders)
        check_table_constraints(tables, self.constraints)
        if not tables:
            logger.warning("nothing to plan: no module of the model has a sharder offering a sharding type here")
            return ShardingPlan(plan={})
        self._base_model = None
        self._plan_in_memory(tables, self._memory_cap(module, sharders), start)
        return self._finish(module, sharders, tables, None, start)

    def collective_plan(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]] | None = None,
        pg: dist.ProcessGroup | None = None,
    ) -> ShardingPlan:
        """Plan on rank 0 of ``pg`` (default: the world) and broadcast: every rank gets the
        identical plan. Any error planning on rank 0 is raised on every rank, the same
        type and message (``_portable``); rank 0 raises the original, with its traceback."""
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
        error: Exception | None = None
        if dist.get_rank(pg) == 0:
            try:
                box[0] = self.plan(module, sharders)
            except Exception as e:  # every rank must leave the broadcast below, then raise it
                error, box[0] = e, _portable(e)
        src = dist.get_global_rank(pg, 0) if pg is not dist.GroupMember.WORLD else 0
        dist.broadcast_object_list(box, src=src, group=pg, device=broadcast_device(pg))
        if error is not None:
            raise error
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]  # type: ignore[return-value]

    def hash_planner_context_inputs_str(self) -> str:
        """The planner-context hash of the last ``plan``'s inputs, as TorchRec's planner's
        method of this name gives it (``plan_loading.planner_context``). Store it with the
        plan's ``ShardingOption``s (e.g. kept by a callback): a ``PlanLoader`` returning both
        gives that plan back from ``plan`` with no search, column splits and load factors
        included, and refuses it for other inputs."""
        if getattr(self, "_planned", None) is None:
            raise ShardingError("hash_planner_context_inputs_str() hashes the last plan's inputs: call plan() first")
        module, sharders = self._planned
        reservation, constraints = self._reserved_by, self.constraints
        return planner_context(self.topology, self._per_rank_batch(), reservation, constraints, module, sharders)[1]

    # ------------------------------------------------------------------ helpers

    def _finish(
        self,
        module: nn.Module,
        sharders: Sequence[ModuleSharder[nn.Module]],
        tables: Sequence[ModuleTable] | None,
        options: list[ShardingOption] | None,
        start: float,
    ) -> ShardingPlan:
        """The ``ShardingPlan`` of ``plan_`` (of ``tables``), or of loaded ``options``, as
        TorchRec's planner ends: the callbacks on the plan's ``ShardingOption``s, the
        plan built from what they return, every ``Stats`` called, TorchRec's check that no
        module a sharder shards is missing."""
        enumerator = None
        if options is None and (self.callbacks or self._stats):
            perfs = table_perfs(self._model, self.task_, self.plan_) if self.task_ is not None else {}
            options, enumerator = torchrec_sharding_options(
                self.plan_, module, sharders, self.topology, self._per_rank_batch(), self.constraints, perfs
            )
        if options is not None and (self.callbacks or tables is None):
            options = apply_callbacks(self.callbacks, options)
            sharding_plan = to_sharding_plan(options, self.topology)
            try:
                self.plan_ = from_torchrec(sharding_plan, self.topology.world_size, sharder_load_factors(module, sharders))
            except ShardingError:
                if tables is not None:  # a callback made a sharding we cannot record: say so
                    raise
                self.plan_ = None  # a loaded plan of kinds a Plan does not record (grid_shard)
        else:
            topo = self.topology
            sharding_plan = to_torchrec(self.plan_, tables, topo.compute_device, topo.local_world_size, self.constraints)
        if self._stats:
            result = self.search_result_
            log_stats(
                self._stats, self, self._reserved_by, sharders, sharding_plan, options, enumerator,
                result.states_evaluated if result is not None else 0, time.perf_counter() - start,
            )  # fmt: skip
        check_modules_planned(sharding_plan, module, sharders)
        return sharding_plan

    def _report(self, tables: Sequence[ModuleTable], decided: Triage, cap: int) -> None:
        """The searched plan's warnings (once per plan, however many proposals were
        searched: tables outside the model's data, kernels larger than it saw, the planning
        budget overrun), then NeuroShard's per-rank plan table on TorchRec's planner-stats logger."""
        result, task, model = self.search_result_, self.task_, self._cost_model()
        # every table the compute net priced (not those triage replicated), a row-wise one as its blocks
        replicated = {p.table for p in decided.decided if p.kind is ShardingKind.DATA_PARALLEL}
        outside = feature_range_warning(model, priced_tables([t for t in task.tables if t.name not in replicated], self.plan_))
        crowded = kernel_size_warning(model, self.plan_.kernel_sizes(task.tables, task.modules))
        for warning in filter(None, (outside, crowded)):
            logger.warning("%s", warning)
        empty = empty_device_line(self._model, task, self.plan_)
        if empty is not None:
            logger.log(logging.WARNING if empty[1] else logging.INFO, "%s", empty[0])
        if self._overran is not None:
            logger.warning(
                "planning budget timeout_seconds=%g ran out (%.2f s): the stages past it refined no further (no more "
                "offload proposals, kinds, splits or moves), and the plan is the best it had found by then",
                self.timeout_seconds, self._overran,
            )  # fmt: skip
        table = format_plan_stats(
            self.plan_, [t.spec for t in tables], result.devices, cap, self._global_batch(), dict(decided.reasons),
            memory_kind="HBM" if self.topology.compute_device == "cuda" else "DDR",
        )  # fmt: skip
        searched = f"searched {result.states_evaluated} split states in {result.seconds:.2f} s"
        for line in (table + "\n" + replica_overhead_line(self._model, task, self.plan_) + searched).splitlines():
            STATS_LOGGER.log(logging.INFO if self.debug else logging.DEBUG, line)

    def _search(
        self,
        decided: Triage,
        tables: Sequence[TableSpec],
        modules: tuple[tuple[str, ...], ...],
        cap: int,
        start: float,
        host_cap: int | None = None,
        config: SearchConfig | None = None,
        memo: dict | None = None,
    ) -> SearchResult:
        """Place the searched tables around the decided ones (all priced in the whole
        step on the topology's links, each sharded module paid at its slowest device), by
        ``config`` (default ``search_config``), with what earlier searches of this plan
        computed (``memo``: ``search``); a table placed table-wise or column-wise whose
        constraints allow only table_column_wise of the two is labelled so."""
        links = Links.of(self.topology)
        task = self.task_ = Task(tuple(tables), self.topology.world_size, cap, self._global_batch(), modules, links, host_cap)
        choices = search_choices(decided.searched, hosts=links.local_world_size < task.num_devices)
        model = self._cost_model()
        offloaded = any(p.kernel.in_host_memory for p in decided.decided) or any(t.kernel.in_host_memory for t in task.tables)
        self._model = self._priced_model() if offloaded else model
        config = config or self.search_config
        if self.timeout_seconds is not None:
            config = replace(config, deadline=start + self.timeout_seconds)
        result = search(task, self._model, config, choices, decided.decided, memo)
        return replace(result, plan=labelled(result.plan, decided.searched))

    def _per_rank_batch(self) -> int:
        return BATCH_SIZE if self.batch_size is None else self.batch_size

    def _global_batch(self) -> int:
        return global_batch(self._per_rank_batch(), self.topology.world_size)

    def _cost_model(self) -> NeuralCostModel:
        """The cost model (``cost_model_for``), loaded once per plan."""
        if getattr(self, "_base_model", None) is None:
            self._base_model = self._load_cost_model()
        return self._base_model

    def _load_cost_model(self) -> NeuralCostModel:
        model = cost_model_for(self.topology, self.cost_model)
        world = self.topology.world_size
        check_world_size(model, world)
        batch = self._global_batch()
        if batch != model.batch_size:
            logger.info("global batch %d (per-rank %d x %d ranks): %s", batch, batch // world, world, model.batch_note(batch))
        return model

    def _memory_cap(self, module: nn.Module, sharders: Sequence[ModuleSharder[nn.Module]]) -> int:
        """The smallest rank's memory (hbm on cuda, ddr on cpu) after the storage reservation."""
        reserved = self._reserved_by.reserve(self.topology, self._per_rank_batch(), module, list(sharders), self.constraints)
        field = "hbm" if self.topology.compute_device == "cuda" else "ddr"
        return int(min(getattr(d.storage, field) for d in reserved.devices))
