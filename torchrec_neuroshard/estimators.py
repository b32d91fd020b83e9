"""The neural cost model inside TorchRec's own planner.

``NeuralPerfEstimator`` (a ``ShardEstimator``) fills every shard's ``Perf`` from the
pre-trained model; ``NeuralPerfModel`` (a ``PerfModel``) rates whole plans with the
multi-table model, which sees fused-kernel effects that per-shard sums cannot;
``AccessCacheStatistics`` gives TorchRec's planner a table's UVM cache as our pricing sees
it (``CacheParams(stats=...)``)::

    enumerator = EmbeddingEnumerator(topology, batch_size, estimator=[
        NeuralPerfEstimator(topology), EmbeddingStorageEstimator(topology)])
    planner = EmbeddingShardingPlanner(topology, batch_size, enumerator=enumerator,
                                       performance_model=NeuralPerfModel(topology))
"""

from __future__ import annotations

import logging
import numbers
from typing import Mapping, Sequence

import numpy as np
from torchrec.distributed.planner.types import (
    ParameterConstraints,
    Perf,
    PerfModel,
    ShardEstimator,
    ShardingOption,
    Topology,
)
from torchrec.distributed.planner.constants import UVM_CACHING_RATIO
from torchrec.distributed.planner.utils import sharder_name
from torchrec.distributed.types import CacheStatistics, ShardingType

from torchrec_neuroshard.comm import AlphaBetaComm
from torchrec_neuroshard.costmodel import NeuralCostModel, feature_range_warning, load_pretrained
from torchrec_neuroshard.access import uniform_access_histogram
from torchrec_neuroshard.kernels import ComputeKernel, kernel_of, sharder_load_factor
from torchrec_neuroshard.types import WIDTH_ALIGNMENT, CostModel, Shard, ShardingError, ShardingKind, TableSpec
from torchrec_neuroshard.uvmcost import UvmPricedModel, UvmPricing, cached_share, unique_rows

logger = logging.getLogger(__name__)


def _sees_all_lookups(sharding_type: str) -> bool:
    """Column and table shards see every lookup; row blocks (grid shards too) and
    data-parallel replicas about 1/world of them."""
    try:
        kind = ShardingKind(sharding_type)
    except ValueError:  # grid_shard: row blocks of column shards
        return False
    return kind.splits_columns


Sharders = Mapping[str, object]
"""The sharders (or TorchRec's ``SharderData``) by ``sharder_name`` of their module type, as
TorchRec's enumerator hands them to its estimators: only their ``fused_params`` are read."""


def _option_kernel(option: ShardingOption, sharders: Sharders | None) -> tuple[ComputeKernel, float | None]:
    """The option's compute kernel and cache load factor as we price them: TorchRec's dense
    (a data-parallel replica, in HBM) as fused, a UVM cache without ``cache_params`` at its
    sharder's ``fused_params`` cache_load_factor, else TorchRec's default
    ``UVM_CACHING_RATIO`` (as TorchRec's storage estimator sizes it); a kernel we have no
    price for is an error."""
    if option.compute_kernel == "dense":
        return ComputeKernel.FUSED, None
    kernel = kernel_of(option.compute_kernel, option.name)
    if not kernel.cached:
        return kernel, None
    factor = option.cache_load_factor
    if factor is None:
        factor = sharder_load_factor((sharders or {}).get(sharder_name(type(option.module[1]))))
    return kernel, UVM_CACHING_RATIO if factor is None else factor


def _shard_spec(
    option: ShardingOption, rows: int, width: int, batch: int, pooling_scale: float, access_hists: Mapping[str, tuple[float, ...]], sharders: Sharders | None
) -> Shard:
    pf = float(sum(option.input_lengths)) * pooling_scale
    width = max(WIDTH_ALIGNMENT, -(-width // WIDTH_ALIGNMENT) * WIDTH_ALIGNMENT)
    hist = access_hists.get(option.name) or uniform_access_histogram(rows, pf * batch)
    kernel, load_factor = _option_kernel(option, sharders)
    # the option's weight dtype, kernel and kind (an EmbeddingCollection's options are unpooled)
    spec = TableSpec(
        option.name, rows, width, pf, tuple(hist), bytes_per_element=option.tensor.element_size(),
        pooled=option.is_pooled is not False, kernel=kernel, cache_load_factor=load_factor,
    )
    return Shard(spec, width)


def _priced(model: CostModel, batch: int) -> CostModel:
    """``model`` with the UVM kernels' penalties (the shipped UVM pricing) added: a fused
    shard's price is unchanged, a shard in host memory pays what its kernel adds."""
    return UvmPricedModel(model, UvmPricing.shipped(), batch)


def _option_shards(
    option: ShardingOption, world: int, batch: int, access_hists: Mapping[str, tuple[float, ...]], sharders: Sharders | None
) -> list[Shard]:
    """Our view of each TorchRec shard: a (rows x width) table seeing some of the lookups.

    Column and table shards see every lookup of the global batch; a row shard sees about
    1/world of them; a data-parallel replica sees its local batch (1/world of the bags).
    """
    scale = 1.0 if _sees_all_lookups(option.sharding_type) else 1.0 / world
    return [_shard_spec(option, int(s.size[0]), int(s.size[1]), batch, scale, access_hists, sharders) for s in option.shards]


class AccessCacheStatistics(CacheStatistics):
    """TorchRec's ``CacheStatistics`` of ``table``'s UVM cache at the GLOBAL ``batch_size``,
    from its access histogram as ``uvmcost`` reads it: the unique rows a batch looks up, the
    share a cache of the hottest rows misses, and cacheability, the mean miss rate over
    load factors 0.01-1 (the area under the miss-ratio curve, as TorchRec defines it)."""

    def __init__(self, table: TableSpec, batch_size: int) -> None:
        self.table = table
        self.batch_size = batch_size

    @property
    def expected_lookups(self) -> float:
        return float(unique_rows(self.table, self.batch_size))

    def expected_miss_rate(self, clf: float) -> float:
        return float(1.0 - cached_share(self.table, self.batch_size, clf))

    @property
    def cacheability(self) -> float:
        return float(np.mean([self.expected_miss_rate(clf) for clf in np.linspace(0.01, 1.0, 100)]))


def global_batch(per_rank: int, world: int) -> int:
    """The batch a table-wise shard's kernel sees: TorchRec's planners take the per-rank
    batch, the kernel sees all ranks'. A per-rank batch that is not a positive int is an
    error, never replaced by a default."""
    if isinstance(per_rank, bool) or not isinstance(per_rank, numbers.Integral) or per_rank < 1:
        raise ShardingError(
            f"batch_size must be a positive int (the per-rank batch, as TorchRec's planner "
            f"takes it), got {per_rank!r}"
        )
    return int(per_rank) * world


class NeuralPerfEstimator(ShardEstimator):
    """Fills ``shard.perf`` (ms, finite, >= 0) of every sharding option from the model.

    Compute is the model's cost of the shard alone on the option's compute kernel (a UVM
    kernel's penalty from the shipped UVM pricing; tables outside the data the model was
    trained on: one warning per ``estimate`` names them); comms is the shard's
    marginal all-to-all cost (the device's cost with the shard's width minus without it,
    the other devices idle). Per-shard numbers cannot see which shards end up together:
    pair with ``NeuralPerfModel`` to rate whole plans.

    ``batch_size`` (here and in ``NeuralPerfModel``) is the PER-RANK batch, as in
    TorchRec's estimators (default: the sharding options' own); shards are priced at the
    global batch a table-wise shard's kernel sees, per-rank x world size.
    """

    def __init__(
        self,
        topology: Topology,
        constraints: Mapping[str, ParameterConstraints] | None = None,
        cost_model: NeuralCostModel | None = None,
        batch_size: int | None = None,
        access_hists: Mapping[str, tuple[float, ...]] | None = None,
        is_inference: bool = False,
    ) -> None:
        if batch_size is not None:
            global_batch(batch_size, topology.world_size)  # a bad batch fails here, not at planning
        self.topology = topology
        self.constraints = constraints
        self.model = cost_model or load_pretrained("cpu")
        self.batch_size = batch_size
        self.access_hists = dict(access_hists or {})

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map: Sharders | None = None) -> None:
        if not sharding_options:
            return
        world = self.topology.world_size
        batch = global_batch(sharding_options[0].batch_size if self.batch_size is None else self.batch_size, world)
        base = self.model.with_batch_size(batch)
        model = _priced(base, batch)
        whole = {
            o.name: _shard_spec(o, o.tensor.shape[0], o.tensor.shape[1], batch, 1.0, self.access_hists, sharder_data_map).table
            for o in sharding_options
        }
        outside = feature_range_warning(base, list(whole.values()))
        if outside:
            logger.warning("%s", outside)
        for option in sharding_options:
            shards = _option_shards(option, world, batch, self.access_hists, sharder_data_map)
            compute = np.asarray(model.compute_cost([[s] for s in shards]), dtype=np.float64)
            dims = np.zeros((len(shards) + 1, max(world, 1)), dtype=np.float32)
            for i, s in enumerate(shards):
                dims[i, 0] = s.width
            comm = model.comm_cost_array(dims, np.zeros_like(dims))[:, 0, :]
            marginal = np.clip(comm[:-1] - comm[-1], 0.0, None)
            if option.sharding_type == ShardingType.DATA_PARALLEL.value:
                # no pooled all-to-all: the whole table's gradient is all-reduced instead, priced
                # from the topology's bandwidths as TorchRec's own estimator prices it
                grad_bytes = option.tensor.numel() * option.tensor.element_size()
                marginal[:, 0] = 0.0
                marginal[:, 1] = AlphaBetaComm.from_topology(self.topology, batch).all_reduce_ms(grad_bytes, world)
            for shard, (fwd, bwd), (cf, cb) in zip(option.shards, compute, marginal):
                shard.perf = Perf(
                    fwd_compute=float(max(fwd, 0.0)),
                    fwd_comms=float(cf),
                    bwd_compute=float(max(bwd, 0.0)),
                    bwd_comms=float(cb),
                )


class NeuralPerfModel(PerfModel):
    """Rates a whole plan (ms): per rank, the kernel cost of all its shards (each on its
    option's compute kernel) plus its all-to-all with every rank's dim sum and compute
    skew; the max over ranks. A ``PerfModel`` is not handed the sharders: give the planner's
    ``sharders`` for a UVM cache whose load factor only their ``fused_params`` set."""

    def __init__(
        self,
        topology: Topology,
        cost_model: NeuralCostModel | None = None,
        batch_size: int | None = None,
        access_hists: Mapping[str, tuple[float, ...]] | None = None,
        sharders: Sequence[object] | None = None,
    ) -> None:
        if batch_size is not None:
            global_batch(batch_size, topology.world_size)  # a bad batch fails here, not at planning
        self.topology = topology
        self.model = cost_model or load_pretrained("cpu")
        self.batch_size = batch_size
        self.access_hists = dict(access_hists or {})
        self.sharders = sharders

    def rate(self, plan: list[ShardingOption]) -> float:
        world = self.topology.world_size
        if not plan:
            return 0.0
        batch = global_batch(plan[0].batch_size if self.batch_size is None else self.batch_size, world)
        model = self._priced_at(batch)
        sharders = {sharder_name(s.module_type): s for s in self.sharders or ()}
        devices: list[list[Shard]] = [[] for _ in range(world)]
        dims = np.zeros((1, world), dtype=np.float32)
        for option in plan:
            for shard, ours in zip(option.shards, _option_shards(option, world, batch, self.access_hists, sharders)):
                rank = shard.rank if shard.rank is not None else 0
                devices[rank].append(ours)
                if option.sharding_type != ShardingType.DATA_PARALLEL.value:
                    dims[0, rank] += ours.width
        compute = np.asarray(model.compute_cost(devices), dtype=np.float32)
        _, total = model.embedding_cost(compute[None, :, 0], compute[None, :, 1], dims)
        return float(total[0])

    def _priced_at(self, batch: int) -> CostModel:
        """The model at the global ``batch``, UVM penalties added; kept as ``priced_`` (batch,
        model) for the next plan: TorchRec's planner rates thousands of them."""
        if getattr(self, "priced_", (None,))[0] != batch:
            self.priced_ = (batch, _priced(self.model.with_batch_size(batch), batch))
        return self.priced_[1]
