"""Plans saved and loaded as TorchRec's planner saves and loads them: its planner-context
hash, and a ``PlanLoader``'s ``ShardingOption``s merged into the enumerated search space by
their storage hash (``extract_plan``). NeuroShard's own plans reload too: the column splits
and cache load factors TorchRec's enumerator never makes join that space as variants of the
option of the same table, sharding type and kernel."""

from __future__ import annotations

import copy
import logging
from typing import Mapping, Sequence

from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints, PlanLoader, ShardingOption, StorageReservation, Topology
from torchrec.distributed.types import ModuleSharder

logger = logging.getLogger(__name__)


def planner_context(
    topology: Topology,
    batch_size: int,
    reservation: StorageReservation,
    constraints: Mapping[str, ParameterConstraints] | None,
    module: nn.Module,
    sharders: Sequence[ModuleSharder[nn.Module]],
) -> tuple[list[ShardingOption], str]:
    """TorchRec's default enumerator's search space for ``module``, and the planner-context
    hash ``EmbeddingShardingPlanner.hash_planner_context_inputs_str`` gives for these inputs
    (topology, per-rank ``batch_size``, that search space, the storage reservation, constraints)."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.types import hash_planner_context_inputs_str

    cons = dict(constraints) if constraints else None
    reservation.reserve(topology=topology, batch_size=batch_size, module=module, sharders=list(sharders), constraints=cons)
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=batch_size, constraints=cons)
    search_space = enumerator.enumerate(module=module, sharders=list(sharders))
    return search_space, hash_planner_context_inputs_str(topology, batch_size, enumerator, reservation, cons)


def load_plan(loader: PlanLoader, context: tuple[list[ShardingOption], str]) -> list[ShardingOption] | None:
    """The plan ``loader`` loads, as ``EmbeddingShardingPlanner.plan`` loads it, in the
    planner ``context`` (``planner_context``: the search space and the context hash): the
    hash checked against the loaded plan's (a ``PlannerError`` when they differ), then the
    loaded shards merged into the search space (with the variants ``with_loaded_variants``
    adds). None when the loader loads nothing."""
    from torchrec.distributed.planner.planners import extract_plan
    from torchrec.distributed.planner.types import PlannerError, PlannerErrorType

    search_space, current = context
    loaded_hash = loader.plan_context_hash()
    if loaded_hash is not None and loaded_hash != current:
        raise PlannerError(
            error_type=PlannerErrorType.PLANNER_INPUT_CONTEXT_MISMATCH,
            message=f"plan_loader's plan {plan_id(loader)!r} was made for another planner context "
            f"(hash {loaded_hash}, this planner's {current}): topology, batch size, tables, storage "
            "reservation or constraints differ; plan anew (plan_loader=None) or load a plan made for these",
        )
    loaded = loader.load()
    if loaded is None:
        return None
    options = extract_plan(search_space=with_loaded_variants(search_space, loaded), loaded_sharding_options=loaded)
    logger.info("plan loaded by plan_loader (plan id %r): no new plan searched", plan_id(loader))
    return copy.deepcopy(options) if options else None


def with_loaded_variants(search_space: list[ShardingOption], loaded: Mapping[int, ShardingOption]) -> list[ShardingOption]:
    """``search_space`` and, for each loaded option whose storage hash (table, sharding type,
    kernel, cache load factor, number of shards) no enumerated option has, the enumerated
    option of its table, sharding type and kernel with the loaded one's shards and cache
    parameters. A loaded option of a table, type or kernel not enumerated gets no variant:
    ``extract_plan`` then refuses the plan, as TorchRec's planner does."""
    known = {option.storage_hash() for option in search_space}
    enumerated = {(o.fqn, o.sharding_type, o.compute_kernel): o for o in search_space}
    variants: dict[int, list[ShardingOption]] = {}  # by id of the enumerated option, to follow it
    for storage_hash, option in sorted(loaded.items()):
        base = enumerated.get((option.fqn, option.sharding_type, option.compute_kernel))
        if storage_hash in known or base is None:
            continue
        variant = copy.deepcopy(base)  # keeps the module and tensor, copies the rest
        variant.shards, variant.cache_params = copy.deepcopy(option.shards), copy.deepcopy(option.cache_params)
        if variant.storage_hash() == storage_hash:
            variants.setdefault(id(base), []).append(variant)
            known.add(storage_hash)
    # each variant right after its enumerated option: the plan keeps the module's table order
    return [o for option in search_space for o in (option, *variants.get(id(option), ()))]


def plan_id(loader: PlanLoader) -> object:
    """The loader's plan id, which TorchRec's planner logs (its PlanLoader need not define one)."""
    get = getattr(loader, "get_plan_id", None)
    return get() if callable(get) else None
