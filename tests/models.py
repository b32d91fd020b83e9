"""Small real TorchRec models and distributed checks shared by the tests."""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def row_wise_cpu_sharder(**kwargs):
    """TorchRec's EBC sharder, offering on CPU the row splits it offers on CUDA (DMP runs
    them over gloo; the stock sharder offers them on CUDA only)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    class RowWiseCpuSharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type: str) -> list[str]:
            return super().sharding_types("cuda")

    return RowWiseCpuSharder(**kwargs)


class SparseArch(nn.Module):
    def __init__(self, tables: list[EmbeddingBagConfig]) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))


class TwoTowerLike(nn.Module):
    """Two EBCs at different attribute paths, one nested two levels deep."""

    def __init__(self, tables_a: list[EmbeddingBagConfig], tables_b: list[EmbeddingBagConfig]):
        super().__init__()
        self.user = SparseArch(tables_a)
        self.item_ebc = EmbeddingBagCollection(tables=tables_b, device=torch.device("cpu"))

    def forward(self, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        out = {}
        for kt in (self.user.ebc(kjt), self.item_ebc(kjt)):
            out.update(kt.to_dict())
        return out


def configs(dims: dict[str, int], rows: int = 40) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=rows, feature_names=[f"f_{n}"])
        for n, d in dims.items()
    ]


def two_tower(seed: int = 0) -> TwoTowerLike:
    torch.manual_seed(seed)
    return TwoTowerLike(configs({"a0": 64, "a1": 16}), configs({"b0": 32, "b1": 8}))


def same_names(seed: int = 0) -> TwoTowerLike:
    """``two_tower`` with a table named "t" in each tower (64 and 32 wide, each its own feature)."""
    torch.manual_seed(seed)
    user = [EmbeddingBagConfig(name="t", embedding_dim=64, num_embeddings=40, feature_names=["f_user_t"])] + configs({"a1": 16})
    item = [EmbeddingBagConfig(name="t", embedding_dim=32, num_embeddings=40, feature_names=["f_item_t"])] + configs({"b1": 8})
    return TwoTowerLike(user, item)


MODELS = {"two_tower": two_tower, "same_names": same_names}


def random_kjt(model: nn.Module, batch: int, seed: int, rows: int = 40) -> KeyedJaggedTensor:
    from torchrec_neuroshard.tables import module_tables

    g = torch.Generator().manual_seed(seed)
    keys = [f for t in module_tables(model, batch_size=1) for f in t.spec.feature_names]
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=g)
    values = torch.randint(0, rows, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


def copy_into_sharded(dmp: nn.Module, reference: nn.Module) -> None:
    """Copy the reference's full table weights into the DMP's local shards."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    ref = {k.removeprefix("module."): v for k, v in reference.state_dict().items()}
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            full = ref[key.removeprefix("module.").removeprefix("_dmp_wrapped_module.")]
            if isinstance(value, ShardedTensor):
                for shard in value.local_shards():
                    r0, c0 = shard.metadata.shard_offsets
                    nr, nc = shard.metadata.shard_sizes
                    shard.tensor.copy_(full[r0 : r0 + nr, c0 : c0 + nc])
            else:
                value.copy_(full)


def shard_and_compare(rank: int, world_size: int, plan_dict: dict, local_size: int | None = None) -> dict:
    """Worker: shard ``two_tower`` with the plan, compare pooled outputs to the reference
    by key, run backward (fused SGD updates the shards), return what a test checks.

    ``local_size`` (ranks per host; hosts are ``rank // local_size``), when given, is set as
    ``LOCAL_WORLD_SIZE`` (where TorchRec reads it) and passed to ``to_torchrec``; by
    default every rank is on one host."""
    import os

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from torchrec_neuroshard.sharding import to_torchrec
    from torchrec_neuroshard.types import Plan

    reference = two_tower()
    model = two_tower()
    if local_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(local_size)
    plan = to_torchrec(Plan.from_dict(plan_dict), model, device_type="cpu", local_size=local_size)
    dmp = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=plan,
        sharders=[EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})],
    )
    copy_into_sharded(dmp, reference)
    kjt = random_kjt(reference, batch=8 * world_size, seed=1)
    want = reference(kjt)
    # Each rank feeds its slice of the global batch; pooled outputs come back per rank.
    local = random_kjt_slice(kjt, rank, world_size)
    got = dmp(local)
    got = got.wait() if hasattr(got, "wait") else got
    lo, hi = rank * 8, (rank + 1) * 8
    max_err = max(float((got[k] - want[k][lo:hi]).abs().max()) for k in want)
    before = {k: v.clone() for k, v in _local_weights(dmp).items()}
    loss = sum(v.sum() for v in got.values())
    loss.backward()
    after = _local_weights(dmp)
    changed = sum(int(not torch.equal(before[k], after[k])) for k in before)
    return {"keys": sorted(got), "max_err": max_err, "changed": changed, "shards": len(before)}


def random_kjt_slice(kjt: KeyedJaggedTensor, rank: int, world_size: int) -> KeyedJaggedTensor:
    """Rows [rank*b, (rank+1)*b) of every feature of ``kjt`` (b = batch / world size)."""
    b = kjt.stride() // world_size
    per_key = kjt.to_dict()
    keys = kjt.keys()
    values, lengths = [], []
    for k in keys:
        jt = per_key[k]
        off = jt.offsets()
        values.append(jt.values()[off[rank * b] : off[(rank + 1) * b]])
        lengths.append(jt.lengths()[rank * b : (rank + 1) * b])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
    )


def _local_weights(dmp: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out = {}
    for key, value in dmp.state_dict().items():
        if isinstance(value, ShardedTensor):
            for i, shard in enumerate(value.local_shards()):
                out[f"{key}/{i}"] = shard.tensor.detach().clone()
    return out


def plan_shard_and_compare(rank: int, world_size: int, constraints: dict, use_estimator: bool = False, model_name: str = "two_tower") -> dict:
    """Worker: plan the model ``MODELS[model_name]`` with collective_plan (NeuroShardPlanner, with
    TorchRec's EmbeddingStats, or TorchRec's planner with the neural estimator), shard with
    DMP, compare with the reference."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
    from torchrec.distributed.planner.stats import EmbeddingStats

    from torchrec_neuroshard.estimators import NeuralPerfEstimator, NeuralPerfModel
    from torchrec_neuroshard.planner import NeuroShardPlanner

    reference, model = MODELS[model_name](), MODELS[model_name]()
    topology = Topology(world_size=world_size, compute_device="cpu", ddr_cap=64 * 2**20, local_world_size=world_size)
    cons = {k: ParameterConstraints(**v) for k, v in constraints.items()}
    sharders = [row_wise_cpu_sharder(fused_params={"learning_rate": 0.1})]
    if use_estimator:
        enumerator = EmbeddingEnumerator(
            topology=topology,
            batch_size=8,
            constraints=cons,
            estimator=[NeuralPerfEstimator(topology, cons), EmbeddingStorageEstimator(topology, cons)],
        )
        planner = EmbeddingShardingPlanner(
            topology=topology, batch_size=8, constraints=cons, enumerator=enumerator,
            performance_model=NeuralPerfModel(topology),
        )
    else:
        planner = NeuroShardPlanner(topology, batch_size=8, constraints=cons, stats=EmbeddingStats())
    plan = planner.collective_plan(model, sharders)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    copy_into_sharded(dmp, reference)
    kjt = random_kjt(reference, batch=8 * world_size, seed=2)
    want = reference(kjt)
    got = dmp(random_kjt_slice(kjt, rank, world_size))
    got = got.wait() if hasattr(got, "wait") else got
    lo, hi = rank * 8, (rank + 1) * 8
    max_err = max(float((got[k] - want[k][lo:hi]).abs().max()) for k in want)
    sum(v.sum() for v in got.values()).backward()
    types = {
        (name if model_name == "two_tower" else f"{path}.{name}"): (ps.sharding_type, [int(s.shard_sizes[1]) for s in ps.sharding_spec.shards] if ps.sharding_spec else None)
        for path, module_plan in plan.plan.items()
        for name, ps in module_plan.items()
    }
    return {"plan": str(plan), "types": types, "max_err": max_err}


def shard_with_helper(rank: int, world_size: int) -> list[str]:
    """Worker: ``shard_model`` with its default NeuroShardPlanner; one forward/backward."""
    from torchrec_neuroshard.dmp import shard_model

    dmp = shard_model(two_tower(), batch_size=8)
    kjt = random_kjt_slice(random_kjt(two_tower(), batch=8 * world_size, seed=3), rank, world_size)
    out = dmp(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    sum(v.sum() for v in out.values()).backward()
    return sorted(out)


class MixedModules(nn.Module):
    """Every embedding module kind a TorchRec user brings: an EBC, an EC (sequence), a
    feature-processed EBC (position weights; left out when not ``weighted``) and a
    managed-collision EBC."""

    def __init__(self, device: torch.device = torch.device("cpu"), weighted: bool = True) -> None:
        from torchrec.modules.embedding_configs import EmbeddingConfig
        from torchrec.modules.embedding_modules import EmbeddingCollection
        from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
        from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
        from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
        from torchrec.modules.mc_modules import LFU_EvictionPolicy, ManagedCollisionCollection, MCHManagedCollisionModule

        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=configs({"bag": 32}), device=device)
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name="seq", embedding_dim=16, num_embeddings=40, feature_names=["f_seq"])], device=device
        )
        bags = [EmbeddingBagConfig(name="pos", embedding_dim=16, num_embeddings=40, feature_names=["f_pos"])]
        self.fp = None if not weighted else FeatureProcessedEmbeddingBagCollection(
            EmbeddingBagCollection(tables=bags, is_weighted=True, device=device),
            PositionWeightedModuleCollection({"f_pos": 8}, device=device),
        )
        mc_tables = configs({"mc": 8})
        self.mc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=mc_tables, device=device),
            ManagedCollisionCollection(
                {"mc": MCHManagedCollisionModule(zch_size=40, device=device, eviction_policy=LFU_EvictionPolicy(), eviction_interval=1, input_hash_size=1000, buckets=2)},
                mc_tables,
            ),
        )

    def forward(self, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        out = {}
        for kt in (self.ebc(kjt), *([self.fp(kjt)] if self.fp is not None else []), self.mc(kjt)[0]):
            out.update(kt.to_dict())
        out.update({k: jt.values() for k, jt in self.ec(kjt).items()})
        return out


def mixed_kjt(batch: int, seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys = ["f_bag", "f_seq", "f_pos", "f_mc"]
    lengths = torch.randint(1, 4, (len(keys) * batch,), generator=g)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


def plan_mixed_and_compare(rank: int, world_size: int, planner_name: str, plan_dict: dict | None = None) -> dict:
    """Worker: plan ``MixedModules`` with NeuroShard's or TorchRec's planner (or take
    ``plan_dict``, our ``Plan``, through ``to_torchrec``), shard it with DMP, compare every
    output with the unsharded model's on this rank's samples."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.sharding_plan import get_default_sharders

    from torchrec_neuroshard.planner import NeuroShardPlanner

    weighted = planner_name != "neuroshard" or plan_dict is not None  # NeuroShard refuses weighted bags
    torch.manual_seed(0)
    reference = MixedModules(weighted=weighted)
    torch.manual_seed(0)
    model = MixedModules(weighted=weighted)
    topology = Topology(world_size=world_size, compute_device="cpu", ddr_cap=64 * 2**20, local_world_size=world_size)
    # the CPU model that learned sequence kernels, whatever this machine's (intel_xeon.pt did not)
    planner = NeuroShardPlanner(topology, 8, cost_model="cpu") if planner_name == "neuroshard" else EmbeddingShardingPlanner(topology, 8)
    # TorchRec shards managed-collision collections on CUDA only: on CPU it stays whole
    sharders = [s for s in get_default_sharders() if "ManagedCollision" not in type(s).__name__]
    if plan_dict is None:
        plan = planner.collective_plan(model, sharders)
    else:
        from torchrec_neuroshard.sharding import to_torchrec
        from torchrec_neuroshard.tables import module_tables
        from torchrec_neuroshard.types import Plan

        plan = to_torchrec(Plan.from_dict(plan_dict), module_tables(model, 8 * world_size, sharders=sharders))
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    copy_into_sharded(dmp, reference)
    kjt = mixed_kjt(8 * world_size, seed=5)
    want = reference(kjt)
    local = random_kjt_slice(kjt, rank, world_size)
    # managed collision remaps ids by what it has seen: its unsharded twin sees this rank's samples
    torch.manual_seed(0)
    want["f_mc"] = torch.cat([torch.zeros(rank * 8, 8), MixedModules(weighted=weighted)(local)["f_mc"]])
    got = dmp(local)
    got = got.wait() if hasattr(got, "wait") else got
    lo, hi = rank * 8, (rank + 1) * 8
    errors = {}
    for k, w in want.items():
        if k == "f_seq":  # sequence values: this rank's samples' lookups
            off = kjt["f_seq"].offsets()
            w = w[int(off[lo]) : int(off[hi])]
        else:
            w = w[lo:hi]
        errors[k] = float((got[k] - w).abs().max())
    types = {name: ps.sharding_type for mp in plan.plan.values() for name, ps in mp.items()}
    return {"paths": sorted(plan.plan), "errors": errors, "types": types}


def meta_ebc(names_dims: list[tuple[str, int, int]]) -> nn.Module:
    """An EBC on the meta device of (name, dim, rows) tables, each its own feature ``f_<name>``."""
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"]) for n, d, r in names_dims],
        device=torch.device("meta"),
    )


class TwoEBCs(nn.Module):
    """Two modules side by side, at attributes ``first`` and ``second``."""

    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.first, self.second = first, second
