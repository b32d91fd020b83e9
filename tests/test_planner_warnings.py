"""The planner's and its estimators' warnings of tables outside the data the compute model
was trained on, and of kernels fusing more tables than it saw: one per plan or estimate,
naming the tables."""

import logging

import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints, Topology

from tests.models import TwoEBCs, meta_ebc, row_wise_cpu_sharder
from torchrec_neuroshard.planner import NeuroShardPlanner

SHARDERS = [EmbeddingBagCollectionSharder()]


def topology(world: int = 2, ddr: int = 64 * 2**20) -> Topology:
    return Topology(world_size=world, compute_device="cpu", ddr_cap=ddr, local_world_size=world)


def test_our_estimator_inside_torchrecs_planner_names_the_tables_outside_the_training_data(caplog) -> None:
    """One warning per estimate, naming the 16-row table read 40 times per sample (each of
    its rows in the 8,192-16,384 accesses bin) and not the table inside the training data."""
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

    from torchrec_neuroshard.estimators import NeuralPerfEstimator

    model = meta_ebc([("tiny", 128, 16), ("x", 32, 50_000)])
    cons = {"tiny": ParameterConstraints(pooling_factors=[40.0]), "x": ParameterConstraints(pooling_factors=[2.0])}
    topo = topology(2)
    enumerator = EmbeddingEnumerator(topology=topo, batch_size=2048, constraints=cons, estimator=[NeuralPerfEstimator(topo, cons)])
    with caplog.at_level(logging.WARNING, logger="torchrec_neuroshard.estimators"):
        enumerator.enumerate(model, SHARDERS)
    warned = [r.getMessage() for r in caplog.records if r.name == "torchrec_neuroshard.estimators"]
    assert len(warned) == 1, warned
    assert warned[0].startswith("1 table(s) lie outside the data the compute model was trained on ('tiny': log_rows 2.773")


def test_a_row_wise_table_whose_blocks_lie_outside_the_training_data_is_named_in_the_one_warning(caplog) -> None:
    """'rw' (1,000 rows) lies inside the CPU model's training data whole, but row-wise over
    2 ranks its 500-row blocks, what the compute net prices, lie 1.2 standard deviations
    below the smallest trained table: the plan's one warning names it by its blocks."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from torchrec_neuroshard.costmodel import load_pretrained
    from torchrec_neuroshard.stepcost import priced_tables

    module = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="rw", embedding_dim=32, num_embeddings=1000, feature_names=["f_rw"]),
            EmbeddingBagConfig(name="x", embedding_dim=32, num_embeddings=20_000, feature_names=["f_x"]),
        ],
        device=torch.device("meta"),
    )
    cons = {"rw": ParameterConstraints(sharding_types=["row_wise"], pooling_factors=[2.0]), "x": ParameterConstraints(pooling_factors=[4.0])}
    planner = NeuroShardPlanner(topology(), batch_size=512, constraints=cons)
    with caplog.at_level(logging.WARNING, logger="torchrec_neuroshard"):
        planner.plan(module, [row_wise_cpu_sharder()])
    assert planner.plan_.kinds()["rw"].value == "row_wise"
    model, tables = load_pretrained("cpu"), planner.task_.tables
    assert model.out_of_range(tables) == {}  # whole, both tables lie inside
    blocks = [t for t in priced_tables(tables, planner.plan_) if t.name == "rw"]
    assert [(b.rows, b.pooling_factor) for b in blocks] == [(500, 1.0), (500, 1.0)]
    warned = [r.getMessage() for r in caplog.records if "outside the data the compute model was trained on" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("1 table(s) lie outside") and "'rw': log_rows 6.215 (trained 7.206..12.63)" in warned[0]


def test_the_kernel_size_warning_counts_each_modules_kernels_apart(caplog) -> None:
    from torchrec_neuroshard.costmodel import load_pretrained

    trained = load_pretrained("cpu").meta["max_tables_per_kernel"]
    tables = [(f"t{i}", 8, 100) for i in range(2 * trained + 2)]  # one more than trained per rank

    def warned(model: torch.nn.Module) -> str:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torchrec_neuroshard.planner"):
            planner = NeuroShardPlanner(topology(2, 500_000), batch_size=64, storage_reservation=0.0)
            planner.plan(model, SHARDERS)
        sizes = planner.plan_.kernel_sizes(planner.task_.tables, planner.task_.modules)
        assert sum(sizes.values()) == len(tables)  # every table in one kernel
        return caplog.text

    # two EBCs: four kernels of about trained / 2 shards, each inside the trained size
    half = len(tables) // 2
    assert "fuses" not in warned(TwoEBCs(meta_ebc(tables[:half]), meta_ebc(tables[half:])))
    # one EBC: some rank's one kernel holds more than the model ever saw, and it is named
    text = warned(meta_ebc(tables))
    assert "module 0, table_wise fuses" in text and f"at most {trained} tables" in text
