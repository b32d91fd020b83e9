"""Tables from TorchRec modules: ``TableSpec``s and what the search may do with each, read
from a model's modules, their sharders and constraints; and a module built from tables."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from torchrec_neuroshard.access import uniform_access_histograms
from torchrec_neuroshard.kernels import ComputeKernel, check_cache_load_factor, sharder_load_factor
from torchrec_neuroshard.types import WIDTH_ALIGNMENT, ShardingError, ShardingKind, TableChoices, TableSpec

if TYPE_CHECKING:
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ModuleSharder

logger = logging.getLogger(__name__)

DEFAULT_POOLING_FACTOR = 1.0
"""Pooling factor assumed when neither constraints nor data give one (TorchRec's default)."""


@dataclass(frozen=True)
class ModuleTable:
    """One table as the model holds it: the path of the module that owns it, its
    ``TableSpec``, the sharding kinds its constraints and its module's sharder allow, the
    narrowest column shard it may be cut into, the compute kernels it may run on (its
    sharder's on the device, narrowed by its constraints' ``compute_kernels``) and the
    cache load factor its constraints' ``cache_params`` fix, else its sharder's
    ``fused_params`` (as TorchRec's planner reads them; None: the planner chooses).
    ``name`` is the table's name in its module; ``spec.name`` the key the plan knows it by
    (``table_key``: the same, or ``path.name`` for a name that several modules use)."""

    path: str
    spec: TableSpec
    allowed: frozenset[ShardingKind]
    min_width: int
    kernels: frozenset[ComputeKernel] = frozenset({ComputeKernel.FUSED})
    load_factor: float | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.spec.name)
        if not self.allowed:
            raise ShardingError(f"table {self.spec.name!r} (module {self.path!r}): no sharding kind is allowed")

    @property
    def pooled(self) -> bool:
        """Bags of an EmbeddingBagCollection (True) or sequences of an EmbeddingCollection."""
        return self.spec.pooled

    @property
    def shape(self) -> "TableShape":
        return TableShape(self.path, self.name, self.spec.rows, self.spec.dim, self.spec.pooled, self.spec.name)


SUPPORTED_DTYPES = {"FP32": 4, "FP16": 2}
"""Weight dtypes a plan can hold, by TorchRec ``DataType`` name, and their bytes: the fused
training kernel's (fbgemm-gpu trains fp32 and fp16 weights; bf16 fails in the training TBE:
fbgemm-gpu 1.6 on CUDA, "cache_precision bf16 not supported!", fbgemm-gpu-cpu 1.8 on CPU,
"split_embedding_cpu_forward_2 not implemented for 'BFloat16'"; int8 and lower are
inference-only). Whether the cost model has seen a dtype is
checked when it prices it."""


def sequence_min_width(dim: int) -> int:
    """The narrowest column shard of a sequence (EmbeddingCollection) table: half its dim.

    TorchRec's sequence all-to-all needs a column-split EC table's shards to be equally wide
    (12 + 4 fails under DMP on gloo, 8 + 8 and 4 x 4 run), and the search splits a shard in
    halves, so one halving is the split that stays even; a dim whose half is not a multiple
    of ``WIDTH_ALIGNMENT`` stays whole."""
    half = dim // 2
    return half if dim % 2 == 0 and half % WIDTH_ALIGNMENT == 0 else dim


def shardable_modules(module: nn.Module, sharders: Sequence[ModuleSharder]) -> dict[str, tuple[nn.Module, ModuleSharder]]:
    """Every module of ``module`` that one of ``sharders`` shards (matched by exact type,
    as TorchRec matches them), by attribute path ('' for the root), in module order. A
    module inside a matched one (an FP-EBC's inner EBC) belongs to it and is not listed."""
    by_type = {s.module_type: s for s in sharders}
    found: dict = {}
    for path, m in module.named_modules():
        if any(p == "" or path.startswith(p + ".") for p in found):
            continue
        sharder = by_type.get(type(m))
        if sharder is not None:
            found[path] = (m, sharder)
    return found


def _configs(path: str, module: nn.Module) -> tuple[list, bool]:
    """(embedding configs, pooled) of a shardable module: its inner collection's for the
    feature-processed and managed-collision wrappers."""
    inner = getattr(module, "_embedding_bag_collection", None) or getattr(module, "_embedding_module", None) or module
    if hasattr(inner, "embedding_bag_configs"):
        return list(inner.embedding_bag_configs()), True
    if hasattr(inner, "embedding_configs"):
        return list(inner.embedding_configs()), False
    raise ShardingError(
        f"module {path!r} ({type(module).__name__}) has a sharder but NeuroShardPlanner cannot read its "
        "tables; plan it with TorchRec's planner, or leave its sharder out"
    )


@dataclass(frozen=True)
class TableShape:
    """Where a table lives and its shape: all a TorchRec sharding plan needs of it; ``key``
    is what the plan calls it (``table_key``)."""

    path: str
    name: str
    rows: int
    dim: int
    pooled: bool
    key: str = ""

    def __post_init__(self) -> None:
        if not self.key:
            object.__setattr__(self, "key", self.name)


def table_key(path: str, name: str, modules_with_name: int) -> str:
    """The name a plan knows a table by: its own, or ``path.name`` (TorchRec's fully
    qualified name) when several sharded modules hold a table of that name, as TorchRec's
    plans tell them apart by module path."""
    return f"{path}.{name}" if modules_with_name > 1 else name


def _walk(
    module: nn.Module, sharders: Sequence[ModuleSharder] | None, compute_device: str
) -> Iterator[tuple[str, frozenset[ShardingKind], tuple[frozenset[ComputeKernel], float | None], object, bool, str, nn.Parameter | None, str]]:
    """(module path, sharding kinds its sharder offers, the kernels it offers of those we
    plan with its cache load factor, embedding config, pooled, dtype name, weight parameter,
    ``table_key``) of every table of every module a sharder shards, in module order: one
    walk of the configs, with the checks that need no constraints (a module without tables,
    a sharder offering nothing here, unsupported dtypes)."""
    from torchrec.distributed.sharding_plan import get_default_sharders

    modules = shardable_modules(module, get_default_sharders() if sharders is None else sharders)
    if not modules and not any(hasattr(m, "embedding_bag_configs") or hasattr(m, "embedding_configs") for m in module.modules()):
        raise ShardingError(
            f"{type(module).__name__} contains no torchrec EmbeddingBagCollection or EmbeddingCollection: "
            "there is nothing to shard. Pass the model that owns the embedding tables."
        )
    walked = []
    for path, (owner, sharder) in modules.items():
        offered = _kinds(sharder.sharding_types(compute_device), f"the {type(sharder).__name__}")
        if not offered:
            raise ShardingError(
                f"module {path!r} ({type(owner).__name__}): {type(sharder).__name__} offers no sharding type "
                f"on {compute_device} (TorchRec's planner fails on it too); leave that sharder out of `sharders` "
                "to keep the module unsharded (replicated), or plan on a device it supports"
            )
        kernels = _sharder_kernels(sharder, offered, compute_device, path)
        configs, pooled = _configs(path, owner)
        weights = {name.rsplit(".", 2)[-2]: p for name, p in owner.named_parameters() if name.endswith(".weight")}
        walked.append((path, offered, kernels, configs, pooled, weights))
    modules_with = Counter(name for _, _, _, configs, _, _ in walked for name in {c.name for c in configs})
    for path, offered, kernels, configs, pooled, weights in walked:
        for config in configs:
            dtype = str(getattr(config.data_type, "name", config.data_type)).upper()
            if dtype not in SUPPORTED_DTYPES:
                raise ShardingError(
                    f"table {config.name!r} (module {path!r}) has {dtype} weights; NeuroShardPlanner plans "
                    f"{sorted(SUPPORTED_DTYPES)} (the fused training kernel's dtypes): use one of those, or "
                    "plan this model with TorchRec's planner"
                )
            key = table_key(path, config.name, modules_with[config.name])
            yield path, offered, kernels, config, pooled, dtype, weights.get(config.name), key


def module_shapes(
    module: nn.Module, sharders: Sequence[ModuleSharder] | None = None, compute_device: str = "cpu"
) -> tuple[TableShape, ...]:
    """Path and shape of every table ``module_tables`` reads, without its constraints or
    access histograms (what ``sharding.to_torchrec`` needs, at a fraction of the cost)."""
    return tuple(
        TableShape(path, c.name, c.num_embeddings, c.embedding_dim, pooled, key)
        for path, _, _, c, pooled, _, _, key in _walk(module, sharders, compute_device)
    )


def module_tables(
    module: nn.Module,
    batch_size: int,
    constraints: Mapping[str, ParameterConstraints] | None = None,
    access_hists: Mapping[str, tuple[float, ...]] | None = None,
    sharders: Sequence[ModuleSharder] | None = None,
    compute_device: str = "cpu",
) -> tuple[ModuleTable, ...]:
    """One walk of ``module``: every table of every module a sharder shards (EBCs, ECs,
    feature-processed and managed-collision collections; nested, several, any path), with
    its constraints read and checked, in module order.

    Args:
        batch_size: the GLOBAL batch (per-rank batch x world size): a table-wise shard's
            kernel sees all of it; used for the default access histogram.
        constraints: TorchRec ``ParameterConstraints`` by table name. Read here:
            ``sharding_types``, ``min_partition``, ``pooling_factors`` (summed over the
            table's features; default ``DEFAULT_POOLING_FACTOR``), ``compute_kernels``.
        access_hists: measured histograms by table name (``access.profile_batches``); default the
            uniform-access histogram for the table's rows and lookups.
        sharders: decide which modules are planned and with which sharding kinds (each
            sharder's ``sharding_types(compute_device)``); default TorchRec's defaults.
    """
    constraints = constraints or {}
    access_hists = access_hists or {}
    walked = list(_walk(module, sharders, compute_device))
    limits = [constraints.get(config.name) for _, _, _, config, *_ in walked]  # by table name, as TorchRec's
    pfs = [float(sum(c.pooling_factors)) if c is not None and c.pooling_factors else DEFAULT_POOLING_FACTOR for c in limits]
    given = [access_hists.get(w[-1]) or access_hists.get(w[3].name) for w in walked]
    uniform = iter(uniform_access_histograms([(w[3].num_embeddings, pf * batch_size) for w, h, pf in zip(walked, given, pfs) if not h]))
    found: list[ModuleTable] = []
    for (path, offered, kernels, config, pooled, dtype, weight, key), c, pf, hist in zip(walked, limits, pfs, given):
        hist = hist or next(uniform)  # measured, else the uniform-access one
        spec = TableSpec(
            name=key, rows=config.num_embeddings, dim=config.embedding_dim, pooling_factor=pf, access_hist=tuple(hist),
            bytes_per_element=SUPPORTED_DTYPES[dtype], feature_names=tuple(config.feature_names), pooled=pooled,
            optimizer_multiplier=_optimizer_multiplier(weight),
        )  # fmt: skip
        found.append(replace(_constrained(path, spec, offered, kernels, c, compute_device), name=config.name))
    for name in sorted(set(constraints) - {t.name for t in found}):
        logger.warning("constraints name table %r, which the module does not have", name)
    return tuple(found)


def _constrained(
    path: str,
    spec: TableSpec,
    offered: frozenset[ShardingKind],
    sharder_kernels: tuple[frozenset[ComputeKernel], float | None],
    c: ParameterConstraints | None,
    compute_device: str,
) -> ModuleTable:
    """The table ``spec`` of the module at ``path`` with what its sharder ``offered`` (kinds,
    kernels and their cache load factor) narrowed by its constraints ``c`` (``sharding_types``,
    ``min_partition``, ``compute_kernels``, ``cache_params``); a ``ShardingError`` naming the
    fix when they leave no kind."""
    allowed = offered
    min_width = WIDTH_ALIGNMENT if spec.pooled else sequence_min_width(spec.dim)
    kernels, load_factor = sharder_kernels[0], None
    if c is not None:
        kernels, load_factor = _constrained_kernels(spec.name, kernels, c, compute_device)
        if c.sharding_types:
            allowed = allowed & _kinds(c.sharding_types, f"table {spec.name!r}")
        if c.min_partition is not None:
            if c.min_partition <= 0 or c.min_partition % WIDTH_ALIGNMENT:
                raise ShardingError(
                    f"table {spec.name!r}: min_partition {c.min_partition} must be a "
                    f"positive multiple of {WIDTH_ALIGNMENT}"
                )
            min_width = max(min_width, int(c.min_partition))
    if load_factor is None and ComputeKernel.FUSED_UVM_CACHING in kernels:
        load_factor = sharder_kernels[1]  # TorchRec's order: the constraint's, then the sharder's
    if not allowed:
        unplanned = sorted(set(c.sharding_types) - {k.value for k in ShardingKind})
        why = (
            f"NeuroShard does not plan {unplanned} yet (plan such tables with TorchRec's "
            "EmbeddingShardingPlanner)" if unplanned else f"the sharder of module {path!r} offers none of them"
        )
        raise ShardingError(
            f"table {spec.name!r}: its constraints allow {list(c.sharding_types)}, and {why}; allow one of "
            f"{sorted(k.value for k in offered)}, the kinds NeuroShard plans that this sharder offers"
        )
    return ModuleTable(path, spec, allowed, min_width, kernels, load_factor)


def sharder_choices(tables: Iterable[TableSpec], compute_device: str) -> dict[str, TableChoices]:
    """What TorchRec's default EmbeddingBagCollectionSharder lets the search do with each
    of ``tables`` on ``compute_device`` (no row splits on a CPU), as a model walk with that
    sharder and no constraints would: the benchmarks' and the CLI's choices for a ``Task``."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    kinds = _kinds(EmbeddingBagCollectionSharder().sharding_types(compute_device), "EmbeddingBagCollectionSharder")
    return {t.name: TableChoices.of(kinds, t.dim) for t in tables}


def _optimizer_multiplier(weight: nn.Parameter | None) -> float:
    """Optimizer state per weight byte as TorchRec's storage estimator counts it: from the
    optimizer ``apply_optimizer_in_backward`` attached to the weight (none: 0)."""
    from torchrec.distributed.planner.shard_estimators import _get_optimizer_multipler

    optimizer = getattr(weight, "_optimizer_classes", [None])[0] if weight is not None else None
    return float(_get_optimizer_multipler(optimizer, weight.shape)) if optimizer is not None else 0.0


def tables_from_module(
    module: nn.Module,
    batch_size: int,
    pooling_factors: Mapping[str, float] | None = None,
    access_hists: Mapping[str, tuple[float, ...]] | None = None,
) -> list[TableSpec]:
    """``TableSpec`` of every table in ``module``; ``pooling_factors`` by table name."""
    from torchrec.distributed.planner.types import ParameterConstraints

    constraints = {name: ParameterConstraints(pooling_factors=[pf]) for name, pf in (pooling_factors or {}).items()}
    return [t.spec for t in module_tables(module, batch_size, constraints, access_hists)]


def _kinds(sharding_types: Iterable[str], where: str) -> frozenset[ShardingKind]:
    from torchrec.distributed.types import ShardingType

    known = {t.value for t in ShardingType}
    kinds = set()
    for st in sharding_types:
        if st not in known:
            raise ShardingError(f"{where}: unknown sharding type {st!r}; known types: {sorted(known)}")
        if st in {k.value for k in ShardingKind}:
            kinds.add(ShardingKind(st))
    return frozenset(kinds)


def _sharder_kernels(
    sharder: ModuleSharder, kinds: frozenset[ShardingKind], compute_device: str, path: str
) -> tuple[frozenset[ComputeKernel], float | None]:
    """The kernels of ours ``sharder`` offers for a sharded (not replicated) table on
    ``compute_device``, and the cache load factor its ``fused_params`` set where it offers
    fused_uvm_caching (TorchRec's planner and kernels take it for a table whose constraints
    set none); a ``ShardingError`` naming the module for one outside (0, 1]."""
    offered = {k for kind in kinds - {ShardingKind.DATA_PARALLEL} for k in sharder.compute_kernels(kind.value, compute_device)}
    kernels = frozenset(k for k in ComputeKernel if k.value in offered) or frozenset({ComputeKernel.FUSED})
    factor = sharder_load_factor(sharder)
    if factor is None or ComputeKernel.FUSED_UVM_CACHING not in kernels:
        return kernels, None
    try:
        return kernels, check_cache_load_factor(ComputeKernel.FUSED_UVM_CACHING, factor, path)
    except ShardingError:
        raise ShardingError(
            f"module {path!r}: its {type(sharder).__name__}'s fused_params cache_load_factor={factor!r} is not in "
            "(0, 1] (the share of a table's rows its HBM cache holds): fix it, or drop it to let the planner "
            "choose each table's"
        ) from None


def _constrained_kernels(
    table: str, offered: frozenset[ComputeKernel], c: ParameterConstraints, compute_device: str
) -> tuple[frozenset[ComputeKernel], float | None]:
    """The kernels a table may run on (``offered``: its sharder's of those we plan) as its
    constraints' ``compute_kernels`` narrow them, and the load factor their
    ``cache_params`` fix; a ``ShardingError`` naming the table for a kernel its sharder
    does not offer, for constraints leaving none we plan, and for a load factor outside (0, 1]."""
    kernels = offered
    if c.compute_kernels:
        ours = {k.value for k in ComputeKernel}
        not_offered = sorted(set(c.compute_kernels) & ours - {k.value for k in offered})
        if not_offered:
            raise ShardingError(
                f"table {table!r}: constraints allow compute kernels {not_offered}, which its sharder does not offer "
                f"on {compute_device} (it offers {sorted(k.value for k in offered)} of those NeuroShard plans); "
                "drop them, or plan on a device that has them (UVM kernels need cuda)"
            )
        kernels = frozenset(k for k in offered if k.value in c.compute_kernels)
        if not kernels:
            raise ShardingError(
                f"table {table!r}: constraints allow compute kernels {list(c.compute_kernels)}; NeuroShardPlanner "
                f"plans {sorted(ours)}: allow one of them, or plan this model with TorchRec's planner"
            )
    load_factor = c.cache_params.load_factor if c.cache_params is not None else None
    if load_factor is not None:
        load_factor = check_cache_load_factor(ComputeKernel.FUSED_UVM_CACHING, load_factor, table)
        if ComputeKernel.FUSED_UVM_CACHING not in kernels:
            raise ShardingError(
                f"table {table!r}: constraint cache_params.load_factor={load_factor:g}, but the table may run only "
                f"{sorted(k.value for k in kernels)} on {compute_device}, which cache nothing; drop load_factor, "
                "or allow fused_uvm_caching (on cuda)"
            )
    return kernels, load_factor


def module_for_tables(tables: Iterable[TableSpec], device: str = "meta") -> nn.Module:
    """An ``EmbeddingBagCollection`` with one table (and one feature) per ``TableSpec``.

    On "meta" it costs no memory: enough for planners, which only read configs.
    """
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    dtypes = {4: DataType.FP32, 2: DataType.FP16, 1: DataType.INT8}
    configs = [
        EmbeddingBagConfig(
            name=t.name,
            embedding_dim=t.dim,
            num_embeddings=t.rows,
            feature_names=list(t.feature_names) or [t.name],
            data_type=dtypes.get(t.bytes_per_element, DataType.FP32),
        )
        for t in tables
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device(device))
