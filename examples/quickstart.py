"""NeuroShardPlanner in place of TorchRec's planner. Run: torchrun --nproc_per_node 2 examples/quickstart.py"""

import gc
import os

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import get_default_sharders
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_neuroshard import NeuroShardPlanner

device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
world_size, per_rank_batch = dist.get_world_size(), 64

model = EmbeddingBagCollection(
    tables=[
        EmbeddingBagConfig(name="t_user", embedding_dim=64, num_embeddings=10_000, feature_names=["user"]),
        EmbeddingBagConfig(name="t_item", embedding_dim=32, num_embeddings=5_000, feature_names=["item"]),
    ],
    device=torch.device("meta"),  # DMP materialises only each rank's shards
)
sharders = get_default_sharders()
topology = Topology(world_size=world_size, compute_device=device.type, local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]))
planner = NeuroShardPlanner(topology, batch_size=per_rank_batch, constraints={  # per-rank batch, as TorchRec's
    "t_user": ParameterConstraints(pooling_factors=[12.0]),          # mean lookups per sample
    "t_item": ParameterConstraints(sharding_types=["table_wise"]),  # never split
})
plan = planner.collective_plan(model, sharders)  # plans on rank 0, broadcasts
model = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)

lengths = torch.randint(1, 4, (2 * per_rank_batch,))
batch = KeyedJaggedTensor.from_lengths_sync(
    keys=["user", "item"], values=torch.randint(0, 5_000, (int(lengths.sum()),)), lengths=lengths
).to(device)
pooled = model(batch).wait()
pooled.values().sum().backward()  # the fused optimizer updates the shards in backward
if dist.get_rank() == 0:
    print(plan)
del model, pooled  # free the sharded model on every rank before the group goes:
gc.collect()  # tearing gloo down under a live DMP module can abort at exit
dist.barrier()  # no rank tears the group down while another still uses it
dist.destroy_process_group()
