"""The planner on TorchRec 1.6.1, the release beside fbgemm-gpu 1.6 that the lent GPUs run
(benchmarks/gpu/bundle.py): in a fresh interpreter with that torchrec first on the path
(``make venv`` unpacks it beside the venv), a plan with tables on UVM kernels is made and
read back by TorchRec 1.6.1's planner API, and a CPU plan runs one DMP step on one gloo
rank with outputs equal to the unsharded model's. The UVM kernels themselves run only on
a GPU (tests/test_uvm_dmp_gpu.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

OLDEST = Path(sys.prefix) / "torchrec-1.6.1"
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_planner_plans_and_shards_on_torchrec_1_6() -> None:
    assert (OLDEST / "torchrec").is_dir(), f"no torchrec 1.6.1 at {OLDEST}: run `make venv`"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(OLDEST), str(ROOT)]), PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-m", "tests.test_oldest_torchrec"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "planned and sharded on torchrec 1.6.1" in done.stdout, done.stdout[-2000:]


def check() -> None:
    """Run in the fresh interpreter: what the test above asserts, on the torchrec found first."""
    from importlib.metadata import version

    import torch
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import Topology

    from tests.models import copy_into_sharded, random_kjt, two_tower
    from torchrec_neuroshard.planner import NeuroShardPlanner
    from torchrec_neuroshard.sharding import from_torchrec

    assert Path(torchrec.__file__).is_relative_to(OLDEST), torchrec.__file__
    sharders = [EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})]
    cuda = Topology(world_size=1, compute_device="cuda", hbm_cap=12_000, ddr_cap=2**30, local_world_size=1)
    planner = NeuroShardPlanner(cuda, batch_size=8, storage_reservation=0.0)
    plan = planner.plan(two_tower(), sharders)
    assert planner.plan_.offloaded()
    assert {p.table: p for p in from_torchrec(plan, 1).placements} == {p.table: p for p in planner.plan_.placements}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        reference, model = two_tower(), two_tower()
        cpu = Topology(world_size=1, compute_device="cpu", local_world_size=1)
        dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=NeuroShardPlanner(cpu, batch_size=8).plan(model, sharders), sharders=sharders)
        copy_into_sharded(dmp, reference)
        kjt = random_kjt(reference, batch=8, seed=1)
        want, got = reference(kjt), dmp(kjt)
        got = got.wait() if hasattr(got, "wait") else got
        assert sorted(got) == sorted(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()
    print(f"planned and sharded on torchrec {version('torchrec')}")


if __name__ == "__main__":
    check()
