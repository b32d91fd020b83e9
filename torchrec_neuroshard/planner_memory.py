"""How ``NeuroShardPlanner`` fits a model into its ranks' memory: HBM and, on a GPU, host
memory through the UVM kernels. The offload stage (``offload``) proposes which tables go
to host memory; each proposal is triaged and searched in the HBM it leaves by a quick
search (``QUICK_SEARCH``), and of the first feasible ones (``KEPT_ATTEMPTS``) the one the
model predicts cheapest is searched in full and kept. Past the planning budget
(``timeout_seconds``, from the start of ``plan()``) no more proposals are screened once one
has a plan, and the cheapest screened is kept as its screen planned it. A model that fits HBM is planned
exactly as without this stage: its first proposal sends no table to host memory, and is
searched in full at once."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Sequence

from torchrec_neuroshard.offload import Offload, attempts
from torchrec_neuroshard.search.config import past
from torchrec_neuroshard.stepcost import predict_step
from torchrec_neuroshard.tables import ModuleTable
from torchrec_neuroshard.triage import Triage, labelled, search_choices, triage
from torchrec_neuroshard.types import CostModel, InfeasibleError, Links, Plan, Shard, ShardingError, ShardingKind, TableChoices, TableSpec, Task
from torchrec_neuroshard.uvmcost import UvmPricedModel, UvmPricing

logger = logging.getLogger("torchrec_neuroshard.planner")

KEPT_ATTEMPTS = 3
"""Feasible offload proposals planned (each by a quick search) before the cheapest is
searched in full and kept."""
QUICK_SEARCH = {"beam_width": 1, "max_steps": 1, "local_search": False}
"""How an offload proposal is screened: a narrow, shallow split search, no local moves."""


class MemoryPlanning:
    """The part of ``NeuroShardPlanner`` that splits the tables between HBM and host
    memory (see the module docstring); the planner provides the rest it calls."""

    def _plan_in_memory(self, tables: Sequence[ModuleTable], cap: int, start: float) -> None:
        """``plan_``, ``search_result_`` and ``task_`` of ``tables`` in ``cap`` bytes of
        HBM per rank (and the topology's host memory on a GPU), or the last error."""
        host_cap, topo, batch = self._host_memory_cap(), self.topology, self._global_batch()
        deadline = None if self.timeout_seconds is None else start + self.timeout_seconds
        error, most, best, planned = None, 0, None, 0
        memo: dict = {}  # what each search computed: the full search of the chosen proposal keeps its screen's
        for attempt in attempts(tables, topo.world_size, cap, host_cap, batch, UvmPricing.shipped(), self._price, topo.local_world_size):
            try:  # an offload proposal is screened by a quick search; no offload is searched in full at once
                cost = self._plan_tables(tables, attempt, cap, host_cap, start, memo, quick=bool(attempt.placements))
            except InfeasibleError as e:  # a larger share of the tables in host memory may fit
                error, most = e, max(most, len(attempt.placements))
                logger.info("no plan with %d tables in host memory: %s", len(attempt.placements), e)
                continue
            if best is None or cost < best[0]:
                best = (cost, attempt, self.plan_, self.search_result_, self.task_, self._decided)
            planned += 1
            if not attempt.placements or planned >= KEPT_ATTEMPTS or past(deadline):
                break
        if best is None:
            if most:
                raise InfeasibleError(f"no plan fits HBM and host memory with up to {most} of {len(tables)} tables in host memory: {error}")
            raise error or InfeasibleError("no plan: the offload stage found no split of the tables between HBM and host memory")
        _, attempt, self.plan_, self.search_result_, self.task_, decided = best
        if attempt.placements and not past(deadline):  # the chosen proposal, searched in full
            self._plan_tables(tables, attempt, cap, host_cap, start, memo)
            decided = self._decided
        if self.refiner is not None and self.search_result_ is not None and not past(deadline):
            self._refine(decided, deadline)
        self._overran = time.perf_counter() - start if past(deadline) else None
        if self.plan_.offloaded():
            logger.info("UVM kernels priced by the shipped UVM pricing, %s", UvmPricing.shipped().source)
        if self.search_result_ is not None:
            self._report(tables, decided, cap)

    def _refine(self, decided: Triage, deadline: float | None) -> None:
        """``plan_`` and ``search_result_`` from the ``refiner``'s plan (it may do to the
        searched tables what the search may: ``search_choices``), labelled, checked and priced."""
        model = self._model.with_batch_size(self.task_.batch_size)
        hosts = self.topology.local_world_size < self.task_.num_devices
        choices = {p.table: TableChoices.of(frozenset(), self.task_.table(p.table).dim) for p in decided.decided}  # never split
        choices.update(search_choices(decided.searched, hosts))
        refined = self.refiner.refine(self.task_, model, self.plan_, self.topology.compute_device, deadline, choices)
        if refined is not self.plan_:
            refined = labelled(refined, decided.searched)
            refined.validate(self.task_)
            step = predict_step(model, self.task_, refined)
            self.plan_ = refined
            self.search_result_ = replace(self.search_result_, plan=refined, predicted_cost_ms=step.cost_ms, devices=step.devices)

    def _plan_tables(
        self,
        tables: Sequence[ModuleTable],
        attempt: Offload,
        cap: int,
        host_cap: int | None,
        start: float,
        memo: dict,
        quick: bool = False,
    ) -> float:
        """``plan_`` (and ``search_result_``, ``task_``) of ``tables`` with ``attempt``'s in
        host memory, the rest triaged and searched in the HBM those leave (what earlier
        searches computed kept in ``memo``); its predicted ms.
        The offloaded tables the attempt placed whole are searched too, on their kernels (the
        search may split their columns and balances them with the rest); only those it
        split by rows stay as placed."""
        world, batch = self.topology.world_size, self._global_batch()
        whole = {p.table: p for p in attempt.placements if p.kind is ShardingKind.TABLE_WISE}
        fixed = tuple(p for p in attempt.placements if p.table not in whole)
        tables = [replace(t, spec=whole[t.spec.name].spec_of(t.spec)) if t.spec.name in whole else t for t in tables]
        sent = {p.table for p in fixed}
        used = Plan(fixed, world).device_memory([t.spec for t in tables if t.spec.name in sent], batch)
        kept = [t for t in tables if t.spec.name not in sent]
        decided = triage(kept, world, self.topology.local_world_size, cap - max(used, default=0), batch)
        decided = self._decided = Triage(decided.searched, decided.decided + fixed, decided.reasons + attempt.reasons)
        for name, why in decided.reasons:
            logger.info("table %s: %s (TorchRec's sharding, priced in the whole step)", name, why)
        specs = sorted((t.spec for t in tables), key=lambda s: s.name)
        self.search_result_ = self.task_ = None
        self.plan_ = Plan(decided.decided, world)
        if decided.searched:
            modules = tuple(tuple(t.spec.name for t in tables if t.path == path) for path in dict.fromkeys(t.path for t in tables))
            config = replace(self.search_config, **QUICK_SEARCH) if quick else self.search_config
            self.search_result_ = self._search(decided, specs, modules, cap, start, host_cap, config, memo)
            self.plan_ = self.search_result_.plan
            self.plan_.validate(self.task_)  # the search counts HBM; host memory is checked here
            return self.search_result_.predicted_cost_ms
        task = self.task_ = Task(tuple(specs), world, cap, batch, (), Links.of(self.topology), host_cap)
        self.plan_.validate(task)  # every table decided before the search: none checked the memory
        self._model = self._priced_model() if attempt.placements else self._cost_model()
        return predict_step(self._model.with_batch_size(batch), task, self.plan_).cost_ms if attempt.placements else 0.0

    def _priced_model(self) -> UvmPricedModel:
        """The cost model with the UVM kernels' penalties (``UvmPricing.shipped``), at the global batch."""
        return UvmPricedModel(self._cost_model(), UvmPricing.shipped(), self._global_batch())

    def _price(self, specs: Sequence[TableSpec]) -> list[float]:
        """Predicted ms of each table alone, table-wise on its kernel (``offload.Price``)."""
        model = self._priced_model().with_batch_size(self._global_batch())
        return [f + b for f, b in model.compute_cost([[Shard(s, s.dim)] for s in specs])]

    def _host_memory_cap(self) -> int | None:
        """The smallest rank's host memory (ddr) on a cuda topology, where the UVM kernels
        keep tables; None on a CPU one (its memory is the ddr ``_memory_cap`` counts)."""
        if self.topology.compute_device != "cuda":
            return None
        return int(min(d.storage.ddr for d in self.topology.devices))
