"""TorchRec's own planner on a ``Task``: the baseline every benchmark compares against."""

from __future__ import annotations

from torchrec_neuroshard.types import Task


def torchrec_plan(task: Task, device_type: str = "cpu", neural: object | None = None, max_headroom: float = 4.0):
    """TorchRec's ``EmbeddingShardingPlanner`` on the task: its analytic perf estimator, or
    with ``neural`` (a NeuralCostModel) our ``NeuralPerfEstimator`` and ``NeuralPerfModel``
    plugged into it. Returns a TorchRec ShardingPlan.

    Both planners get the same memory: the task's cap per rank with no storage reservation.
    TorchRec's storage model also counts input/output buffers, which at small sizes can
    exceed the weights; when it finds no plan, its cap is raised stepwise (x1.25 up to
    ``max_headroom``) and the plan must still fit the task's cap on weights to be measured.
    """
    from torchrec.distributed.planner.types import PlannerError

    cap_scale = 1.0
    while True:
        try:
            return _torchrec_plan(task, device_type, neural, int(task.memory_cap_bytes * cap_scale))
        except PlannerError:
            cap_scale *= 1.25
            if cap_scale > max_headroom:
                raise


def _torchrec_plan(task: Task, device_type: str, neural: object | None, cap: int):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation

    from torchrec_neuroshard.tables import module_for_tables

    mem = {"hbm_cap": cap} if device_type == "cuda" else {"ddr_cap": cap}
    topology = Topology(
        world_size=task.num_devices, compute_device=device_type, local_world_size=task.num_devices, **mem
    )
    constraints = {t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in task.tables}
    enumerator = performance_model = None
    if neural is not None:
        from torchrec_neuroshard.estimators import NeuralPerfEstimator, NeuralPerfModel

        hists = {t.name: t.access_hist for t in task.tables}
        enumerator = EmbeddingEnumerator(
            topology=topology,
            batch_size=task.batch_size,
            constraints=constraints,
            estimator=[
                NeuralPerfEstimator(topology, constraints, neural, task.batch_size, hists),
                EmbeddingStorageEstimator(topology=topology, constraints=constraints),
            ],
        )
        performance_model = NeuralPerfModel(topology, neural, task.batch_size, hists)
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=task.batch_size,
        constraints=constraints,
        enumerator=enumerator,
        performance_model=performance_model,
        storage_reservation=FixedPercentageStorageReservation(0.0),
    )
    return planner.plan(module_for_tables(task.tables), [EmbeddingBagCollectionSharder()])
