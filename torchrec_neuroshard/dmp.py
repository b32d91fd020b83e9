"""Where a plan made on rank 0 travels: the device of a process group's collectives, and
``shard_model``, the one call from a model to ``DistributedModelParallel`` under a plan."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner.types import Topology
from torchrec.distributed.types import ModuleSharder, ShardingPlanner


def broadcast_device(pg: dist.ProcessGroup) -> torch.device:
    """The device a collective on ``pg`` runs on: this rank's GPU under NCCL, else the CPU."""
    if dist.get_backend(pg) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_model(
    model: nn.Module,
    planner: ShardingPlanner | None = None,
    sharders: list[ModuleSharder[nn.Module]] | None = None,
    device: torch.device | None = None,
    pg: dist.ProcessGroup | None = None,
    batch_size: int | None = None,
) -> nn.Module:
    """Plan with ``planner`` (default: a NeuroShardPlanner for the current group) and wrap
    ``model`` in ``DistributedModelParallel`` with that plan. Call on every rank."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import get_default_sharders

    device = device or broadcast_device(pg or dist.GroupMember.WORLD)
    sharders = sharders or get_default_sharders()
    if planner is None:
        from torchrec_neuroshard.planner import NeuroShardPlanner

        world = dist.get_world_size(pg)
        from torchrec.distributed.comm import get_local_size  # the launcher's ranks per host

        topology = Topology(world_size=world, compute_device=device.type, local_world_size=get_local_size(world))
        planner = NeuroShardPlanner(topology, batch_size=batch_size)
    plan = planner.collective_plan(model, sharders, pg)
    return DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
