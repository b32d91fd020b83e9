"""TorchRec's own planner on a ``Task``: the baseline every benchmark compares against.

Configured as TorchRec documents it:

- ``batch_size`` is the PER-RANK batch (``EmbeddingShardingPlanner``'s estimators multiply
  it by the world size for table-wise shards and use it as is for data-parallel ones).
  Our ``Task.batch_size`` is the global batch, so TorchRec gets ``task.batch_size // D``.
- each table's pooling factor is a ``ParameterConstraints(pooling_factors=[...])``;
- the task's memory cap is the topology's per-rank memory (``hbm_cap`` on cuda,
  ``ddr_cap`` on cpu), with no storage reservation, so it gets the memory NeuroShard's
  search gets. The cap is never raised: when TorchRec finds no plan under it, that is its
  result (``PlannerError``); ``default_memory=True`` plans at TorchRec's default topology
  memory instead, to show what it would have done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from torchrec_neuroshard.types import ShardingError, Task

if TYPE_CHECKING:
    from torch import nn
    from torchrec.distributed.types import ShardingPlan


def topology_for(task: Task, device_type: str = "cpu", local_world_size: int | None = None, with_memory: bool = True):
    """The TorchRec ``Topology`` of a task: its devices, the task's memory cap as each rank's
    (hbm on cuda, ddr on cpu; TorchRec's defaults when ``with_memory`` is off), and
    ``local_world_size`` ranks per host (default all on one host)."""
    from torchrec.distributed.planner import Topology

    mem = {("hbm_cap" if device_type == "cuda" else "ddr_cap"): task.memory_cap_bytes} if with_memory else {}
    return Topology(
        world_size=task.num_devices, compute_device=device_type,
        local_world_size=local_world_size or task.num_devices, **mem,
    )


def per_rank_batch(task: Task) -> int:
    """The batch one rank feeds its model: what TorchRec's planner calls ``batch_size``."""
    if task.batch_size % task.num_devices:
        raise ShardingError(
            f"global batch {task.batch_size} does not split evenly over {task.num_devices} "
            f"ranks; use a multiple of {task.num_devices}"
        )
    return task.per_rank_batch


PROPOSERS = ("default", "dynamic_programming")
"""TorchRec's proposer configurations: its four default proposers (grid search, two
greedy, uniform), or ``DynamicProgrammingProposer`` alone (pytorch/torchrec PR 2286, the
fix its users adopted for 500+ tables; it bins HBM, so a CPU topology divides by zero)."""


def _check_proposer(proposer: str) -> None:
    if proposer not in PROPOSERS:
        raise ValueError(f"proposer {proposer!r}: choose one of {PROPOSERS}")


def torchrec_plan(
    task: Task,
    device_type: str = "cpu",
    neural: object | None = None,
    module: nn.Module | None = None,
    default_memory: bool = False,
    local_world_size: int | None = None,
    timeout_seconds: int | None = None,
    proposer: str = "default",
) -> ShardingPlan:
    """TorchRec's ``EmbeddingShardingPlanner`` on the task: its analytic perf estimator, or
    with ``neural`` (a NeuralCostModel) our ``NeuralPerfEstimator`` and ``NeuralPerfModel``
    plugged into it.

    Args:
        device_type: the topology's compute device, "cpu" or "cuda".
        module: the model to plan (its EBCs hold the task's tables); default one
            EmbeddingBagCollection of the task's tables on the meta device.
        default_memory: plan at the topology's default memory instead of the task's cap.
        local_world_size: ranks per host (default all on one host).
        timeout_seconds, proposer: TorchRec's own planning budget and proposers (see
            ``torchrec_planner``).

    Returns a TorchRec ShardingPlan keyed by ``module``'s EBC paths. Raises TorchRec's
    ``PlannerError`` when it finds no plan.
    """
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from torchrec_neuroshard.tables import module_for_tables

    planner = torchrec_planner(task, device_type, neural, default_memory, local_world_size, timeout_seconds, proposer)
    return planner.plan(module if module is not None else module_for_tables(task.tables), [EmbeddingBagCollectionSharder()])


def torchrec_planner(
    task: Task,
    device_type: str = "cpu",
    neural: object | None = None,
    default_memory: bool = False,
    local_world_size: int | None = None,
    timeout_seconds: int | None = None,
    proposer: str = "default",
):
    """The ``EmbeddingShardingPlanner`` that ``torchrec_plan`` runs (arguments as there).

    ``timeout_seconds`` is TorchRec's own budget: past it the proposal loop stops and the
    best plan found so far is returned. ``proposer`` is one of ``PROPOSERS``."""
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.proposers import DynamicProgrammingProposer
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation

    _check_proposer(proposer)
    batch = per_rank_batch(task)
    topology = topology_for(task, device_type, local_world_size, with_memory=not default_memory)
    constraints = {t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in task.tables}
    enumerator = performance_model = None
    if neural is not None:
        from torchrec_neuroshard.estimators import NeuralPerfEstimator, NeuralPerfModel

        hists = {t.name: t.access_hist for t in task.tables}
        enumerator = EmbeddingEnumerator(
            topology=topology,
            batch_size=batch,
            constraints=constraints,
            estimator=[
                NeuralPerfEstimator(topology, constraints, neural, batch, hists),
                EmbeddingStorageEstimator(topology=topology, constraints=constraints),
            ],
        )
        performance_model = NeuralPerfModel(topology, neural, batch, hists)
    return EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch,
        constraints=constraints,
        enumerator=enumerator,
        proposer=[DynamicProgrammingProposer()] if proposer == "dynamic_programming" else None,
        performance_model=performance_model,
        storage_reservation=FixedPercentageStorageReservation(0.0),
        timeout_seconds=timeout_seconds,
    )


@dataclass(frozen=True)
class TorchRecRun:
    """One run of TorchRec's planner, as its users run it: its plan (None when it failed),
    how long it took, and what it says of itself."""

    plan: ShardingPlan | None
    seconds: float
    status: str
    """"ok", "timed out: best of N proposals" (TorchRec's ``timeout_seconds`` stopped its
    proposal loop and it returned its best plan so far), or "failed: " and the error."""
    error: Exception | None = None
    """what TorchRec raised, when it failed."""
    proposals: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    """sharding type -> tables, of the plan."""
    kernels: dict[str, int] = field(default_factory=dict)
    """compute kernel -> tables, of the plan."""
    peak_hbm_bytes: int = 0
    peak_ddr_bytes: int = 0
    """the most any rank holds, as TorchRec's storage estimator counts it."""


def run_torchrec(task: Task, device_type: str, timeout_seconds: int | None, proposer: str = "default", **kwargs) -> TorchRecRun:
    """Run ``torchrec_planner`` once on the task's tables (``timed_run``). ``kwargs`` go to
    ``torchrec_planner``."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from torchrec_neuroshard.tables import module_for_tables

    _check_proposer(proposer)  # our argument: refused here, not reported as TorchRec's failure
    module = module_for_tables(task.tables)
    return timed_run(
        lambda: torchrec_planner(task, device_type, timeout_seconds=timeout_seconds, proposer=proposer, **kwargs),
        module, [EmbeddingBagCollectionSharder()],
    )  # fmt: skip


def timed_run(make_planner: Callable[[], object], module: nn.Module, sharders: list) -> TorchRecRun:
    """Make a TorchRec ``EmbeddingShardingPlanner`` and plan ``module`` with it once, timed
    (making it included), with no alarm of ours: a failure is a result (its error text),
    never dropped; a plan its own ``timeout_seconds`` cut short says so."""
    import logging
    import time
    from collections import Counter

    timed_out: list[str] = []

    class _TimeoutSeen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "Exceeded time limit" in record.getMessage():
                timed_out.append(record.getMessage())

    log = logging.getLogger("torchrec.distributed.planner.planners")
    handler, level = _TimeoutSeen(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    t0 = time.perf_counter()
    try:
        planner = make_planner()
        plan = planner.plan(module, sharders)
    except Exception as e:  # noqa: BLE001 - TorchRec failing is the row's result
        return TorchRecRun(None, time.perf_counter() - t0, f"failed: {type(e).__name__}: {str(e)[:300]}", error=e)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    seconds = time.perf_counter() - t0
    options = planner._best_plan or []  # its chosen ShardingOptions, with each shard's storage and rank
    hbm, ddr = Counter(), Counter()
    for option in options:
        for shard in option.shards:
            hbm[shard.rank] += shard.storage.hbm
            ddr[shard.rank] += shard.storage.ddr
    return TorchRecRun(
        plan=plan,
        seconds=seconds,
        status=f"timed out: best of {planner._num_proposals} proposals" if timed_out else "ok",
        proposals=planner._num_proposals,
        kinds=dict(Counter(o.sharding_type for o in options)),
        kernels=dict(Counter(o.compute_kernel for o in options)),
        peak_hbm_bytes=max(hbm.values(), default=0),
        peak_ddr_bytes=max(ddr.values(), default=0),
    )
