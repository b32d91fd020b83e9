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

from typing import TYPE_CHECKING

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
    return task.batch_size // task.num_devices


def torchrec_plan(
    task: Task,
    device_type: str = "cpu",
    neural: object | None = None,
    module: nn.Module | None = None,
    default_memory: bool = False,
    local_world_size: int | None = None,
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

    Returns a TorchRec ShardingPlan keyed by ``module``'s EBC paths. Raises TorchRec's
    ``PlannerError`` when it finds no plan.
    """
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation

    from torchrec_neuroshard.tables import module_for_tables

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
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch,
        constraints=constraints,
        enumerator=enumerator,
        performance_model=performance_model,
        storage_reservation=FixedPercentageStorageReservation(0.0),
    )
    return planner.plan(module if module is not None else module_for_tables(task.tables), [EmbeddingBagCollectionSharder()])
