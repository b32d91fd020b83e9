"""On a GPU (skipped without one; run where a GPU is lent): a NeuroShard plan with tables on
UVM kernels runs in DistributedModelParallel on one rank: one step, pooled outputs equal
to the unsharded model's, and the fused optimizer updates every shard, UVM ones included."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from tests.models import copy_into_sharded, random_kjt, two_tower
from torchrec_neuroshard.kernels import ComputeKernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="UVM kernels are a cuda feature: needs a GPU")
HBM_CAP = 12_000
"""Bytes of HBM for two_tower's four 40-row tables (19,200 bytes of weights, fp32): two
go to host memory behind a cache, each beside a table in HBM in its module's kernel."""


def uvm_plan(model: torch.nn.Module, sharders: list):
    from torchrec.distributed.planner import Topology

    from torchrec_neuroshard.planner import NeuroShardPlanner

    topology = Topology(world_size=1, compute_device="cuda", hbm_cap=HBM_CAP, ddr_cap=2**30, local_world_size=1)
    planner = NeuroShardPlanner(topology, batch_size=8, storage_reservation=0.0)
    return planner.plan(model, sharders), planner.plan_


def test_plan_with_uvm_kernels_runs_one_dmp_step_on_one_gpu() -> None:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        device = torch.device("cuda", 0)
        reference, model = two_tower(), two_tower()
        sharders = [EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})]
        plan, ours = uvm_plan(model, sharders)
        kernels = {p.table: p.kernel for p in ours.placements}
        assert any(k is not ComputeKernel.FUSED for k in kernels.values()), kernels
        dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
        copy_into_sharded(dmp, reference)
        kjt = random_kjt(reference, batch=8, seed=1)
        want = reference(kjt)
        got = dmp(kjt.to(device))
        got = got.wait() if hasattr(got, "wait") else got
        assert sorted(got) == sorted(want)
        for key in want:
            torch.testing.assert_close(got[key].cpu(), want[key], rtol=1e-5, atol=1e-5)
        before = {k: v.local_shards()[0].tensor.detach().cpu().clone() for k, v in dmp.state_dict().items() if hasattr(v, "local_shards")}
        sum(v.sum() for v in got.values()).backward()
        after = {k: v.local_shards()[0].tensor.detach().cpu() for k, v in dmp.state_dict().items() if hasattr(v, "local_shards")}
        assert before and all(not torch.equal(before[k], after[k]) for k in before), "every shard is updated by the step"
        print({name: kernel.value for name, kernel in kernels.items()})
    finally:
        dist.destroy_process_group()
