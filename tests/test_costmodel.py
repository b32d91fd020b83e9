"""The neural cost models: shapes, symmetries, persistence, training."""

import itertools

import numpy as np
import pytest
import torch

from torchrec_neuroshard.costmodel import (
    NeuralCostModel,
    device_features,
    load_pretrained,
)
from torchrec_neuroshard.lab.pretrain import load_compute_data, pretrain, split_by_group, train_compute
from torchrec_neuroshard.types import Shard, ShardingError
from torchrec_neuroshard.lab.workloads import WorkloadScale, synthetic_pool, table_spec


@pytest.fixture(scope="module")
def model() -> NeuralCostModel:
    return load_pretrained("cpu")


def shards(n: int, width: int = 32) -> list[Shard]:
    pool = synthetic_pool()
    return [Shard(table_spec(pool[i], width, WorkloadScale()), width) for i in range(n)]


def test_compute_shapes_empty_device_and_permutation_invariance(model) -> None:
    s = shards(5)
    out = model.compute_cost([s, [], s[:1], list(reversed(s))])
    assert len(out) == 4 and out[1] == (0.0, 0.0)
    assert all(f > 0 and b > 0 for f, b in (out[0], out[2]))
    assert np.allclose(out[0], out[3], rtol=1e-5)  # order of shards on a device is irrelevant
    assert sum(out[0]) > sum(out[2])  # five tables cost more than one of them


def test_comm_is_equivariant_over_devices(model) -> None:
    dims = np.array([[100, 300, 40, 8]], dtype=np.float32)
    skews = np.array([[0.0, 2.0, 5.0, 1.0]], dtype=np.float32)
    base = model.comm_cost_array(dims, skews)[0]
    assert base.shape == (4, 2) and (base >= 0).all()
    for perm in itertools.permutations(range(4)):
        p = list(perm)
        permuted = model.comm_cost_array(dims[:, p], skews[:, p])[0]
        assert np.allclose(permuted, base[p], rtol=1e-5)
    # a world size never seen in training still gets an answer of the right shape
    assert model.comm_cost_array(np.full((2, 6), 64.0), np.zeros((2, 6)))[0].shape == (6, 2)
    # the late device does not wait; the others wait for it
    assert base[2, 0] < base[0, 0]


def test_device_features_are_per_device_or_symmetric() -> None:
    f = device_features(np.array([[10, 20]]), np.array([[0.0, 3.0]]))
    assert f.shape == (1, 2, 11)
    assert np.allclose(f[0, 0, 5:], f[0, 1, 5:])  # pooled parts identical across devices
    # own: dim, skew, wait for the latest, columns sent to / received from the other rank
    assert np.allclose(f[0, 0, :5], [0.1, 0.0, 3.0, 0.05, 0.1])


def test_batched_inference_of_10000_device_shards(model) -> None:
    s = shards(20)
    devices = [s[i % 20 : i % 20 + 1] for i in range(10_000)]
    out = model.compute_cost(devices)
    assert len(out) == 10_000 and all(np.isfinite(out[i]).all() for i in (0, 9_999))


def test_save_load_round_trip_and_bad_files(model, tmp_path) -> None:
    path = tmp_path / "m.pt"
    model.save(path)
    again = NeuralCostModel.load(path)
    s = shards(3)
    assert again.compute_cost([s]) == model.compute_cost([s])
    assert again.meta == model.meta

    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ShardingError, match="corrupt.pt: not a readable torchrec-neuroshard cost model"):
        NeuralCostModel.load(corrupt)

    blob = torch.load(path, weights_only=True)
    blob["feature_version"] = 99
    old = tmp_path / "old.pt"
    torch.save(blob, old)
    with pytest.raises(ShardingError, match="old.pt: cost model has feature version 99.*re-train"):
        NeuralCostModel.load(old)
    with pytest.raises(ShardingError, match="no pretrained cost model 'tpu'"):
        load_pretrained("tpu")


def _synthetic_rows(n: int) -> list[dict]:
    """Measured-looking rows from a known formula, to test the training loop itself."""
    from torchrec_neuroshard.lab.collect import shard_record

    rng = np.random.default_rng(0)
    pool = synthetic_pool()
    rows = []
    for i in range(n):
        ss = [Shard(table_spec(pool[j], int(w), WorkloadScale()), int(w)) for j, w in zip(rng.integers(0, 856, rng.integers(1, 6)), rng.choice([8, 32, 128], 5))]
        ms = sum(0.01 * s.width * s.table.pooling_factor for s in ss) + 0.1
        rows.append({"kind": "compute", "group": i, "batch_size": 4096, "shards": [shard_record(s) for s in ss], "fwd_ms": ms, "bwd_ms": 2 * ms, "hardware": {"device": "cpu"}})
    for i in range(n):
        world = 2 + 2 * (i % 2)
        dims = rng.integers(0, 400, world).tolist()
        skews = [0.0] * (world - 1) + [1.0]
        rows.append({"kind": "comm", "group": i, "world_size": world, "batch_size": 4096, "dims": dims, "skews_ms": skews, "fwd_ms": [1 + d / 100 for d in dims], "bwd_ms": [1 + d / 200 for d in dims], "hardware": {"device": "cpu"}})
    return rows


def test_tiny_training_run_lowers_the_loss() -> None:
    data = load_compute_data(_synthetic_rows(300))
    tr, va, te = split_by_group(data.group, seed=0)
    assert not (tr & va).any() and not (tr & te).any() and (tr | va | te).all()
    _, _, log = train_compute(data.subset(tr), data.subset(va), epochs=15, seed=0, batch=64, progress=False)
    assert log["history"][-1] < log["history"][0] * 0.5


def test_pretrain_writes_test_metrics_and_holds_out_world_sizes() -> None:
    m = pretrain(_synthetic_rows(200), epochs=3, progress=False, exclude_world_sizes=[4])
    assert m.meta["world_sizes_trained"] == [2]
    assert set(m.meta["test"]["compute"]) >= {"mape_total", "spearman_total"}
    assert m.meta["test"]["comm"]["4"]["devices"] == 100 * 4  # every D=4 sample is unseen
    with pytest.raises(ShardingError, match=r"no comm samples left to train on after excluding world sizes \[2, 4\]"):
        pretrain(_synthetic_rows(40), epochs=1, progress=False, exclude_world_sizes=[2, 4])


def test_split_by_group_keeps_remeasured_samples_together() -> None:
    groups = np.repeat(np.arange(50), 3)  # each table set measured three times
    tr, va, te = split_by_group(groups, seed=1)
    for g in range(50):
        member = [tr[groups == g].all(), va[groups == g].all(), te[groups == g].all()]
        assert sum(member) == 1


def test_a_sequence_kernel_net_prices_ec_tables_as_their_own_kernel(tmp_path) -> None:
    """Trained on measured H200 rows of both kernels, a model carries a second net for the
    unpooled kernel: a device holding bags and sequences costs the sum of its two kernels,
    each 0 without shards; the net survives save/load; a model without it refuses sequence
    tables by name."""
    from dataclasses import replace
    from pathlib import Path

    from torchrec_neuroshard.lab.collect import read_rows

    data = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data"
    rows = read_rows(data / "h200_compute.jsonl.gz")[:60] + read_rows(data / "h200_compute_sequence.jsonl.gz")[:60]
    m = pretrain(rows, epochs=2, progress=False)
    assert m.meta["test"]["sequence_compute"]["samples"] == 6 and m.meta["sequence"]["bytes_per_element_trained"] == [4]
    m.save(tmp_path / "m.pt")
    m = NeuralCostModel.load(tmp_path / "m.pt")
    # each net's own training range: the sequence net's from the sequence samples alone
    assert not torch.equal(m.pooled_kernel.trained_range.low, m.sequence_kernel.trained_range.low)
    bag = shards(1)[0]
    seq = Shard(replace(bag.table, name="s", pooled=False), bag.width)
    solo_bag, solo_seq, both, empty = m.compute_cost([[bag], [seq], [bag, seq], []])
    assert solo_bag != solo_seq and empty == (0.0, 0.0)
    assert both == pytest.approx(tuple(a + b for a, b in zip(solo_bag, solo_seq)), rel=1e-5)
    pooled_only = NeuralCostModel(m.compute_net, m.compute_norm, None, m.meta)
    assert pooled_only.compute_cost([[bag]]) == m.compute_cost([[bag]])
    with pytest.raises(ShardingError, match=r"table 's' is a sequence \(EmbeddingCollection\) table, but this cost model learned the pooled kernel only"):
        pooled_only.compute_cost([[bag, seq]])
