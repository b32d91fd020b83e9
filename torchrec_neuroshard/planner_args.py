"""``EmbeddingShardingPlanner``'s arguments, as ``NeuroShardPlanner`` takes them: each one
checked when the planner is made, honoured, or refused with why and what to do instead."""

from __future__ import annotations

import logging
import pickle
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

from torch import nn
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    PlanLoader,
    ShardingOption,
    StorageReservation,
    Topology,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from torchrec_neuroshard.tables import ModuleTable
from torchrec_neuroshard.types import CostModel, Plan, ShardingError, TableChoices, Task

logger = logging.getLogger(__name__)

DEFAULT_STORAGE_RESERVATION = 0.15
"""Share of each rank's memory kept free for activations and buffers (TorchRec's default share)."""

Callback = Callable[[list[ShardingOption]], list[ShardingOption]]

REPLACED = {
    "enumerator": "its search enumerates every sharding its sharders and constraints allow",
    "proposer": "its search proposes the plans",
    "partitioner": "its search places the shards",
    "performance_model": "its cost model prices the plans",
}
"""TorchRec planner components NeuroShard's own replace, and what replaces each."""


def refuse_replaced(**given: object) -> None:
    """A ``ShardingError`` naming the first of TorchRec's planner components given."""
    for name, value in given.items():
        if value is not None:
            hint = ""
            if name == "enumerator" and isinstance(value, Mapping):
                hint = " (a dict: constraints are TorchRec's 9th parameter, after performance_model; pass constraints=...)"
            raise ShardingError(
                f"{name}={type(value).__name__}{hint}: NeuroShardPlanner takes no {name}, {REPLACED[name]}; "
                "leave it None, or to use NeuroShard's cost model inside TorchRec's own planner "
                "see examples/estimator_in_torchrec.py"
            )


def default_topology() -> Topology:
    """TorchRec's default topology for this process, as ``EmbeddingPlannerBase`` builds it."""
    import torch.distributed as dist
    from torchrec.distributed.comm import get_local_size, get_topology_domain_multiple
    from torchrec.distributed.utils import get_device_type

    if not dist.is_initialized():
        raise ShardingError(
            "topology=None builds TorchRec's default topology from the process group, and none is "
            "initialised: call torch.distributed.init_process_group first, or pass a Topology"
        )
    return Topology(
        local_world_size=get_local_size(),
        world_size=dist.get_world_size(),
        compute_device=get_device_type(),
        pod_size=get_topology_domain_multiple(),
    )


def check_topology(topology: object) -> Topology:
    """``topology``: a TorchRec ``Topology`` of at least one rank."""
    if not isinstance(topology, Topology):
        raise ShardingError(f"topology={type(topology).__name__}: give a TorchRec Topology, or None for TorchRec's default")
    if topology.world_size < 1:
        raise ShardingError(f"Topology(world_size={topology.world_size}): a plan needs at least one rank; give world_size >= 1")
    return topology


def reservation_of(reservation: StorageReservation | float | None) -> StorageReservation:
    """``storage_reservation`` as a TorchRec ``StorageReservation``: None is a fixed 15%."""
    if reservation is None:
        reservation = DEFAULT_STORAGE_RESERVATION
    if isinstance(reservation, StorageReservation):
        return reservation
    if isinstance(reservation, bool) or not isinstance(reservation, (int, float)) or not 0 <= reservation < 1:
        raise ShardingError(f"storage_reservation={reservation!r}: give a fraction in [0, 1) or a TorchRec StorageReservation")
    return FixedPercentageStorageReservation(float(reservation))


def check_timeout(timeout_seconds: object) -> float | None:
    """``timeout_seconds``: None, or a positive number of seconds."""
    if timeout_seconds is None:
        return None
    if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, (int, float)) or not timeout_seconds > 0:
        raise ShardingError(f"timeout_seconds={timeout_seconds!r}: give a positive number of seconds, or None for no limit")
    return float(timeout_seconds)


@runtime_checkable
class PlanRefiner(Protocol):
    """What refines the searched plan of ``task`` (planned for ``compute_device`` devices)
    within ``deadline`` (a ``time.perf_counter()`` reading, None: its own budget), doing to
    each table no more than its ``choices`` allow (the search's: ``triage.search_choices``;
    a table split by columns is labelled as its constraints name it after): a valid plan of
    the same tables, or ``plan`` itself."""

    def refine(
        self, task: Task, model: CostModel, plan: Plan, compute_device: str, deadline: float | None = None,
        choices: Mapping[str, TableChoices] | None = None,
    ) -> Plan: ...


def check_refiner(refiner: object) -> PlanRefiner | None:
    return _none_or(
        PlanRefiner, refiner, "refiner", "a PlanRefiner (its refine(task, model, plan, compute_device, deadline)) such as "
        "torchrec_neuroshard.lab.refine.MeasuredRefiner()",
    )  # fmt: skip


def check_callbacks(callbacks: object) -> list[Callback]:
    """``callbacks`` as TorchRec takes them: None or a list of callables."""
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)) or not all(callable(c) for c in callbacks):
        raise ShardingError(
            f"callbacks={callbacks!r}: give a list of callables, each taking and returning the plan's "
            "list of TorchRec ShardingOptions"
        )
    return list(callbacks)


def check_plan_loader(plan_loader: object) -> PlanLoader | None:
    return _none_or(PlanLoader, plan_loader, "plan_loader", "a TorchRec PlanLoader (torchrec.distributed.planner.types.PlanLoader)")


def _none_or(kind: type, value: object, argument: str, give: str):
    """``value`` where it is None or a ``kind``, else ``ShardingError`` naming ``argument``
    and what to ``give``."""
    if value is not None and not isinstance(value, kind):
        raise ShardingError(f"{argument}={type(value).__name__}: give {give}, or None")
    return value


def apply_callbacks(callbacks: Sequence[Callback], options: list[ShardingOption]) -> list[ShardingOption]:
    """``options = callback(options)`` for each callback in turn, as TorchRec's planner calls them."""
    for callback in callbacks:
        options = callback(options)
        if not isinstance(options, list) or not all(isinstance(o, ShardingOption) for o in options):
            raise ShardingError(
                f"callback {getattr(callback, '__name__', callback)!r} returned {type(options).__name__}; "
                "a callback returns the list of ShardingOptions it was given, changed or not"
            )
    return options


def refuse_weighted(module: nn.Module, sharders: Sequence[ModuleSharder[nn.Module]]) -> None:
    """A ``ShardingError`` naming every table a sharded module reads with per-id weights (an
    EmbeddingBagCollection made with ``is_weighted=True``, a feature-processed one's position
    weights): the shipped cost models were trained on unweighted kernels only, and weights
    change a kernel's cost by more than the gaps a plan is chosen on (``studies/weighted_bags.py``
    measures them on the CPU), so they are refused rather than priced as unweighted."""
    from torchrec_neuroshard.tables import shardable_modules

    weighted = []
    for path, (owner, _) in shardable_modules(module, sharders).items():
        inner = getattr(owner, "_embedding_bag_collection", None) or getattr(owner, "_embedding_module", None) or owner
        is_weighted = getattr(inner, "is_weighted", None)
        if callable(is_weighted) and is_weighted():
            weighted += [f"{c.name!r} (module {path!r})" for c in inner.embedding_bag_configs()]
    if weighted:
        raise ShardingError(
            f"tables {', '.join(weighted)} take per-id weights (is_weighted=True, or a feature processor's): "
            "NeuroShard's cost models were trained on unweighted kernels only and weights change a kernel's "
            "cost (studies/weighted_bags.py), so it cannot price them: plan this model with TorchRec's planner"
        )


def check_modules_planned(plan: ShardingPlan, module: nn.Module, sharders: Sequence[ModuleSharder[nn.Module]]) -> None:
    """TorchRec's own check that no module a sharder shards is missing from ``plan``
    (TorchRec 1.7 on; TorchRec 1.6, the release beside fbgemm-gpu 1.6, has none, nor does
    its planner)."""
    try:
        from torchrec.distributed.planner.planners import validate_modules_inclusion_in_sharding_plan
    except ImportError:
        return
    validate_modules_inclusion_in_sharding_plan(plan, module, list(sharders))


def portable(error: Exception) -> Exception:
    """``error`` if it survives pickling as the same type and message (what the broadcast
    sends), else a ``RuntimeError`` naming its type and message."""
    try:
        copy = pickle.loads(pickle.dumps(error))
        if type(copy) is type(error) and str(copy) == str(error):
            return error
    except Exception:  # noqa: BLE001 - an exception that does not pickle
        pass
    return RuntimeError(f"{type(error).__module__}.{type(error).__qualname__} on rank 0 while planning: {error}")


CONSTRAINT_FIELDS = {
    "sharding_types": "honoured: the kinds the table may take (tables.module_tables)",
    "compute_kernels": "honoured: the kernels the table may run on, of fused, fused_uvm_caching and fused_uvm "
    "(each must be one its sharder offers on the device; at least one of those three)",
    "min_partition": "honoured: the narrowest column shard",
    "pooling_factors": "honoured: lookups per sample, summed over the table's features",
    "num_poolings": "honoured: multiplies each feature's pooling factor, as TorchRec's estimators do",
    "batch_sizes": "honoured: each feature's lookups scaled by its batch over the planner's batch_size",
    "is_weighted": "refused when True: the cost model prices unweighted kernels",
    "cache_params": "honoured: load_factor (in (0, 1]) fixes the table's cache size when it runs fused_uvm_caching; "
    "the rest passed to its ParameterSharding, as TorchRec's planner does; stats refused (the cache is priced "
    "from the table's access histogram)",
    "enforce_hbm": "honoured: passed to the table's ParameterSharding, as TorchRec's planner does",
    "stochastic_rounding": "honoured: passed to the table's ParameterSharding",
    "bounds_check_mode": "honoured: passed to the table's ParameterSharding",
    "feature_names": "honoured: checked against the table's features; refused when they differ",
    "output_dtype": "honoured when the weights' dtype (passed to the ParameterSharding); refused otherwise",
    "device_group": "honoured when the topology's compute device; refused otherwise",
    "key_value_params": "refused when set: SSD / key-value kernels are not planned",
    "use_virtual_table": "refused when True: virtual tables need key-value kernels",
}
"""What ``NeuroShardPlanner`` does with each field of TorchRec's ``ParameterConstraints``."""

_REFUSED_WHEN_SET = {
    "is_weighted": "the cost model was trained on unweighted kernels and cannot price per-id weights; "
    "drop it (a table its module weights is refused by name: planner_args.refuse_weighted)",
    "key_value_params": "NeuroShardPlanner plans the fused kernel, not SSD or key-value ones; drop it",
    "use_virtual_table": "a virtual table needs a key-value kernel, which NeuroShardPlanner does not plan; drop it",
}


def check_constraints(constraints: Mapping[str, ParameterConstraints] | None, compute_device: str) -> None:
    """Refuse, naming the table and the field, every constraint field set to something
    NeuroShardPlanner cannot honour that needs no table to tell (``CONSTRAINT_FIELDS``)."""
    for name, c in (constraints or {}).items():
        for field, why in _REFUSED_WHEN_SET.items():
            if getattr(c, field):
                raise ShardingError(
                    f"table {name!r}: constraint {field}={getattr(c, field)!r}: {why}, "
                    "or plan this table with TorchRec's planner"
                )
        if c.cache_params is not None and c.cache_params.stats is not None:
            raise ShardingError(
                f"table {name!r}: constraint cache_params.stats: NeuroShardPlanner prices a UVM cache from the "
                "table's access histogram (access_hists=, access.profile_batches), not from CacheStatistics; "
                "drop stats (keep the other cache_params), or plan this table with TorchRec's planner"
            )
        if c.device_group is not None and c.device_group != compute_device:
            raise ShardingError(
                f"table {name!r}: constraint device_group={c.device_group!r}, but the topology's compute device is "
                f"{compute_device!r}; NeuroShardPlanner plans one device group: drop it, or plan that group apart"
            )
        for field in ("num_poolings", "batch_sizes"):
            values = getattr(c, field)
            if values is not None and len(values) != len(c.pooling_factors):
                raise ShardingError(
                    f"table {name!r}: constraint {field} has {len(values)} values and pooling_factors "
                    f"{len(c.pooling_factors)}; give one per feature in each, as TorchRec needs"
                )


def lookups_per_sample(
    constraints: Mapping[str, ParameterConstraints] | None, batch_size: int
) -> dict[str, ParameterConstraints] | None:
    """``constraints`` with each table's ``num_poolings`` and ``batch_sizes`` folded into its
    ``pooling_factors`` (feature i: pf_i x num_poolings_i x batch_sizes_i / ``batch_size``,
    the per-rank batch): the lookups per sample the cost model prices."""
    from dataclasses import replace

    if not constraints:
        return None
    folded = {}
    for name, c in constraints.items():
        n = len(c.pooling_factors)
        poolings, batches = c.num_poolings or [1.0] * n, c.batch_sizes or [batch_size] * n
        pfs = [pf * p * b / batch_size for pf, p, b in zip(c.pooling_factors, poolings, batches)]
        folded[name] = replace(c, pooling_factors=pfs, num_poolings=None, batch_sizes=None)
    return folded


def check_table_constraints(tables: Sequence[ModuleTable], constraints: Mapping[str, ParameterConstraints] | None) -> None:
    """Refuse ``feature_names`` and ``output_dtype`` constraints that contradict their table."""
    from torchrec_neuroshard.tables import SUPPORTED_DTYPES

    for t in tables:
        c = (constraints or {}).get(t.name)  # by table name, as TorchRec keys constraints
        if c is None:
            continue
        if c.feature_names is not None and sorted(c.feature_names) != sorted(t.spec.feature_names):
            raise ShardingError(
                f"table {t.spec.name!r}: constraint feature_names={list(c.feature_names)}, but the table's "
                f"features are {list(t.spec.feature_names)}; give its own, or drop it"
            )
        dtype = getattr(c.output_dtype, "name", c.output_dtype)
        if c.output_dtype is not None and SUPPORTED_DTYPES.get(str(dtype)) != t.spec.bytes_per_element:
            raise ShardingError(
                f"table {t.spec.name!r}: constraint output_dtype={dtype}, but its weights take "
                f"{t.spec.bytes_per_element} bytes: the cost model prices the pooled output at the weights' "
                "dtype; drop it, or set the weights' dtype"
            )
