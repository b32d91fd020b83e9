"""The neural cost models: shapes, symmetries, persistence, training."""

import copy
import itertools
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from torchrec_neuroshard.costmodel import PRETRAINED_DIR, NeuralCostModel, feature_range_warning, load_pretrained, model_file
from torchrec_neuroshard.costmodel.features import POOLING_FEATURE, WIDTH_FEATURE, device_features
from torchrec_neuroshard.lab.collect import read_rows, shard_from_record
from torchrec_neuroshard.lab.pretrain import add_feature_ranges, pretrain
from torchrec_neuroshard.lab.training import train_compute
from torchrec_neuroshard.lab.training_data import kernel_rows, load_compute_data, split_by_group
from torchrec_neuroshard.types import Shard, ShardingError
from torchrec_neuroshard.lab.workloads import WorkloadScale, synthetic_pool, table_spec

DATA = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data"
TRAINING_SPLIT = 9_239
"""Pooled kernels in the shipped CPU model's net's training split (80% of its sample groups)."""


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


@pytest.mark.parametrize("scale", [1 / 8, 8.0])
def test_comm_at_another_batch_scales_every_time_alike(model, scale) -> None:
    """At ``scale`` x the batch the comm was measured at, with every device's forward
    ``scale`` x as late, the all-to-alls cost ``scale`` x as much: the wait for the latest
    device is the skews' own ms (it had been scaled again: at 8x the batch, a device 5 ms
    behind the latest paid 40 ms of wait)."""
    dims = np.array([[100, 300, 40, 8]], dtype=np.float32)
    skews = np.array([[0.0, 2.0, 5.0, 1.0]])
    scaled = model.with_batch_size(round(model.batch_size * scale))
    np.testing.assert_allclose(scaled.comm_cost_array(dims, skews * scale), scale * model.comm_cost_array(dims, skews), rtol=1e-5)


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
    elsewhere = tmp_path / "another_name.pt"
    model.save(elsewhere)
    assert elsewhere.read_bytes() == path.read_bytes()  # a file's digest is its content's (benchmarks record it)

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


def test_a_model_is_named_by_its_file_or_a_shipped_name(tmp_path) -> None:
    """A shipped name resolves to its file (a benchmark hashes the file it planned with), a
    path is itself, and a name neither shipped nor a file is refused with what is shipped."""
    assert model_file("intel_xeon") == PRETRAINED_DIR / "intel_xeon.pt"
    assert model_file(tmp_path / "mine.pt") == tmp_path / "mine.pt"
    with pytest.raises(ShardingError, match="no pretrained cost model 'xeon'; shipped: .*'intel_xeon'.*path of a .pt file"):
        model_file("xeon")


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


@pytest.mark.slow
def test_tiny_training_run_lowers_the_loss() -> None:
    data = load_compute_data(_synthetic_rows(300))
    tr, va, te = split_by_group(data.group, seed=0)
    assert not (tr & va).any() and not (tr & te).any() and (tr | va | te).all()
    _, _, log = train_compute(data.subset(tr), data.subset(va), epochs=15, seed=0, batch=64, progress=False)
    assert log["history"][-1] < log["history"][0] * 0.5


@pytest.mark.slow
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
    rows = read_rows(DATA / "h200_compute.jsonl.gz")[:60] + read_rows(DATA / "h200_compute_sequence.jsonl.gz")[:60]
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


def _without_ranges(model: NeuralCostModel) -> NeuralCostModel:
    """``model`` as a file written before feature ranges were recorded loads."""
    meta = copy.deepcopy(model.meta)
    for part in (meta, meta.get("sequence", {})):
        part.pop("feature_range", None)
    return NeuralCostModel(model.compute_net, model.compute_norm, model.comm, meta, sequence=model.sequence)


@pytest.mark.slow
def test_the_trained_range_leaves_every_training_kernel_priced_bit_for_bit(model) -> None:
    """Clamping into the recorded range is the identity on the samples the range came from:
    every kernel of the shipped CPU model's net's training split (pooled: fp32 and fp16, at
    its one batch) costs exactly what the bare nets predict, and none is reported outside
    its data. (Its batch shift reads the clamped features: batch-varied kernels outside the
    net's range are priced as the nearest inside, as the net is.)"""
    files = ("cpu_compute", "cpu_compute_fp16")  # Makefile's order (--data)
    rows = kernel_rows([r for f in files for r in read_rows(DATA / f"{f}.jsonl.gz")])
    train, _, _ = split_by_group(np.asarray([r["group"] for r in rows]), seed=model.meta["seed"])
    kept = [r for r, keep in zip(rows, train) if keep]
    assert len(kept) == TRAINING_SPLIT
    bare = _without_ranges(model)
    for batch in sorted({r["batch_size"] for r in kept}):  # each kernel at its own batch
        kernels = [[shard_from_record(s) for s in r["shards"]] for r in kept if r["batch_size"] == batch]
        guarded = np.asarray(model.with_batch_size(batch).compute_cost(kernels))
        assert np.abs(guarded - np.asarray(bare.with_batch_size(batch).compute_cost(kernels))).max() == 0.0
    assert model.out_of_range([shard_from_record(s).table for r in kept[:500] for s in r["shards"]]) == {}


def test_a_wider_or_more_read_shard_than_any_trained_costs_its_work_linearly(model) -> None:
    """A shard twice as wide as the widest trained (128 columns), or read three times as
    often as the most-read trained table, costs two (three) of the trained-extreme shard.
    Measured here, 256 and 512 columns cost 1.4x and 2.9x 128 (linear: 2x, 4x; the bare net
    1.4x, 1.6x; clamping alone 1.05x, 1.05x). The warning names the feature."""
    trained = model.pooled_kernel.trained_range
    widest, busiest = int(trained.high[WIDTH_FEATURE]), float(trained.high[POOLING_FEATURE])
    table = table_spec(synthetic_pool()[0], widest, WorkloadScale())
    base = sum(model.compute_cost([[Shard(table, widest)]])[0])
    wide = replace(table, name="wide", dim=2 * widest)
    assert sum(model.compute_cost([[Shard(wide, 2 * widest)]])[0]) == pytest.approx(2 * base, rel=1e-5)
    read = replace(table, pooling_factor=busiest)
    hot = replace(read, name="hot", pooling_factor=3 * busiest)
    assert sum(model.compute_cost([[Shard(hot, widest)]])[0]) == pytest.approx(3 * sum(model.compute_cost([[Shard(read, widest)]])[0]), rel=1e-5)
    with_other = sum(model.compute_cost([[Shard(wide, 2 * widest), Shard(read, widest)]])[0])
    assert with_other > sum(model.compute_cost([[Shard(wide, 2 * widest)]])[0])  # the extra work adds to the kernel's
    far = model.out_of_range([table, wide, hot])
    assert list(far) == ["wide", "hot"] and far["wide"] == [f"width 256 (trained 4..{widest})"]
    assert far["hot"][0] == f"pooling_factor {3 * busiest:.4g} (trained 1..{busiest:.4g})"
    assert "'wide': width 256" in feature_range_warning(model, [table, wide])


def test_a_model_file_without_feature_ranges_loads_with_a_warning_and_gets_them_from_its_data(tmp_path, caplog) -> None:
    """Older files still load, unguarded (the 16-row table read 40 times per sample: the
    bare net's 10^5 ms), with a warning naming the fix; ``add_feature_ranges`` records them
    from the model's own training rows, nets untouched, and refuses other rows."""
    shipped = load_pretrained("intel_xeon")
    path = tmp_path / "old.pt"
    _without_ranges(shipped).save(path)
    with caplog.at_level(logging.WARNING, logger="torchrec_neuroshard.costmodel"):
        old = NeuralCostModel.load(path)
    assert "old.pt: this cost model file records no range of its training features" in caplog.text
    assert "add_feature_ranges(model, rows)" in caplog.text
    from torchrec_neuroshard.access import uniform_access_histogram
    from torchrec_neuroshard.types import TableSpec

    tiny = TableSpec("tiny", 16, 128, 40.0, uniform_access_histogram(16, 40 * 4096))
    assert sum(old.compute_cost([[Shard(tiny, 128)]])[0]) > 1e4
    assert old.out_of_range([tiny]) == {} and feature_range_warning(old, [tiny]) is None  # nothing to tell by

    again = add_feature_ranges(old, read_rows(DATA / "intel_xeon_compute.jsonl.gz"))
    assert again.meta == shipped.meta  # the shipped range is its training split's
    assert again.compute_net is old.compute_net
    with pytest.raises(ShardingError, match=r"these rows are not the samples the model was pre-trained on.*give the data files"):
        add_feature_ranges(old, read_rows(DATA / "cpu_compute.jsonl.gz")[:300])
