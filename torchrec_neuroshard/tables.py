"""Tables from TorchRec modules and from data: ``TableSpec`` construction and profiling."""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Iterable, Mapping

import numpy as np
import torch
from torch import nn

from torchrec_neuroshard.access import access_histogram, uniform_access_histogram
from torchrec_neuroshard.types import NUM_ACCESS_BINS, ShardingError, TableSpec

logger = logging.getLogger(__name__)

DEFAULT_POOLING_FACTOR = 1.0
"""Pooling factor assumed when neither constraints nor data give one (TorchRec's default)."""


def find_embedding_bag_collections(module: nn.Module) -> dict[str, nn.Module]:
    """Every ``EmbeddingBagCollection`` in ``module``, by its attribute path ('' for the root)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    found = {path: m for path, m in module.named_modules() if isinstance(m, EmbeddingBagCollection)}
    if not found:
        raise ShardingError(
            f"{type(module).__name__} contains no torchrec EmbeddingBagCollection: there is "
            "nothing to shard. Pass the model that owns the embedding tables."
        )
    return found


def tables_from_module(
    module: nn.Module,
    batch_size: int,
    pooling_factors: Mapping[str, float] | None = None,
    access_hists: Mapping[str, tuple[float, ...]] | None = None,
) -> list[TableSpec]:
    """``TableSpec`` for every table of every EBC in ``module`` (nested, several, any path).

    Args:
        batch_size: global batch size, used for the default access histogram.
        pooling_factors: mean lookups per bag by table name (e.g. summed from TorchRec's
            ``ParameterConstraints.pooling_factors``); default ``DEFAULT_POOLING_FACTOR``.
        access_hists: measured histograms by table name (see ``profile_batches``); default
            the uniform-access histogram for the table's rows and lookups.
    """
    pooling_factors = pooling_factors or {}
    access_hists = access_hists or {}
    specs: list[TableSpec] = []
    seen: dict[str, str] = {}
    for path, ebc in find_embedding_bag_collections(module).items():
        for config in ebc.embedding_bag_configs():
            if config.name in seen:
                raise ShardingError(
                    f"duplicate table name {config.name!r} (in EBCs at {seen[config.name]!r} "
                    f"and {path!r}); TorchRec plans key tables by name, rename one"
                )
            seen[config.name] = path
            pf = float(pooling_factors.get(config.name, DEFAULT_POOLING_FACTOR))
            hist = access_hists.get(config.name) or uniform_access_histogram(
                config.num_embeddings, pf * batch_size
            )
            specs.append(
                TableSpec(
                    name=config.name,
                    rows=config.num_embeddings,
                    dim=config.embedding_dim,
                    pooling_factor=pf,
                    access_hist=tuple(hist),
                    bytes_per_element=_dtype_bytes(config.data_type),
                    feature_names=tuple(config.feature_names),
                )
            )
    return specs


def _dtype_bytes(data_type: object) -> int:
    name = str(getattr(data_type, "name", data_type)).upper()
    return {"FP32": 4, "FP16": 2, "BF16": 2, "INT8": 1, "FP8": 1, "INT4": 1, "INT2": 1}.get(
        name, 4
    )


def profile_batches(
    batches: Iterable["KeyedJaggedTensor"],  # noqa: F821
    feature_to_table: Mapping[str, str],
) -> tuple[dict[str, float], dict[str, tuple[float, ...]]]:
    """Measure pooling factor and access histogram of each table from real KJT batches.

    Args:
        batches: KeyedJaggedTensors, one per global batch.
        feature_to_table: KJT key -> table name (several features may share a table).

    Returns:
        (pooling factor per table: mean lookups per sample summed over its features,
         access histogram per table: averaged over batches, each batch's ids pooled over
         the table's features).
    """
    lookups: dict[str, int] = defaultdict(int)
    samples: dict[str, int] = defaultdict(int)
    hist_sum: dict[str, np.ndarray] = {}
    hist_n: dict[str, int] = defaultdict(int)
    for kjt in batches:
        per_table: dict[str, list[torch.Tensor]] = defaultdict(list)
        batch = kjt.stride()
        for key, jt in kjt.to_dict().items():
            table = feature_to_table.get(key)
            if table is None:
                continue
            values = jt.values()
            per_table[table].append(values)
            lookups[table] += values.numel()
        for table, vals in per_table.items():
            samples[table] += batch
            h = np.asarray(access_histogram(torch.cat(vals).cpu()))
            hist_sum[table] = hist_sum.get(table, 0) + h
            hist_n[table] += 1
    if not samples:
        raise ShardingError(
            "profile_batches saw no feature of any known table; check feature_to_table "
            f"(knows {sorted(feature_to_table)[:8]}...)"
        )
    # A table looked up by several features sums their lookups per sample.
    pooling = {t: lookups[t] / (samples[t]) for t in samples}
    hists = {t: tuple(float(x) for x in hist_sum[t] / hist_n[t]) for t in hist_sum}
    if any(not math.isfinite(v) for v in pooling.values()):
        raise ShardingError("profiling produced a non-finite pooling factor")
    return pooling, hists


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
