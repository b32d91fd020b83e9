"""NeuroShard's cost model inside TorchRec's own planner. Run: python examples/estimator_in_torchrec.py"""

import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import EmbeddingStorageEstimator
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_neuroshard import NeuralPerfEstimator, NeuralPerfModel

model = EmbeddingBagCollection(
    tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
        for i, (dim, rows) in enumerate([(64, 200_000), (32, 50_000), (128, 100_000), (16, 1_000)])
    ],
    device=torch.device("meta"),
)
topology = Topology(world_size=2, compute_device="cpu", local_world_size=2)
batch_size = 2048  # per rank, as TorchRec's planner takes it
constraints = {f"t{i}": ParameterConstraints(pooling_factors=[pf]) for i, pf in enumerate([20.0, 4.0, 10.0, 1.0])}
enumerator = EmbeddingEnumerator(topology, batch_size, constraints, estimator=[
    NeuralPerfEstimator(topology, constraints), EmbeddingStorageEstimator(topology, constraints)])
planner = EmbeddingShardingPlanner(topology, batch_size, enumerator=enumerator, constraints=constraints,
                                   performance_model=NeuralPerfModel(topology))
plan = planner.plan(model, [EmbeddingBagCollectionSharder()])
print(plan)
