"""The batch as a compute-net feature: samples collected across batches, a net that reads
the batch, linear scaling beyond the batches it learned, and models that learned one batch
pricing as before."""

import math

import numpy as np
import pytest
import torch

from torchrec_neuroshard.costmodel import NeuralCostModel, load_pretrained
from torchrec_neuroshard.costmodel.features import shard_features
from torchrec_neuroshard.lab.fine_tune import fine_tune
from torchrec_neuroshard.lab.collect import collect_compute, draw_batch, draw_compute_sample, read_rows, shard_record
from torchrec_neuroshard.lab.pretrain import pretrain
from torchrec_neuroshard.lab.training_data import load_compute_data
from torchrec_neuroshard.lab.workloads import WorkloadScale, synthetic_pool, table_spec
from torchrec_neuroshard.types import Shard, ShardingError

LOW, HIGH = 256, 65_536


def test_draw_batch_is_log_uniform_in_its_range_and_refuses_a_bad_one() -> None:
    batches = [draw_batch(9, i, (LOW, HIGH)) for i in range(400)]
    assert all(LOW <= b <= HIGH and b % 8 == 0 for b in batches)
    assert batches == [draw_batch(9, i, (LOW, HIGH)) for i in range(400)]  # a pure function of (seed, index)
    octaves = np.histogram(np.log2(batches), bins=8, range=(8, 16))[0]
    assert octaves.min() > 25  # every octave drawn, none favoured much (400 / 8 = 50 each)
    with pytest.raises(ShardingError, match="LOW <= HIGH"):
        draw_batch(9, 0, (4096, 1024))


@pytest.mark.measure
def test_collect_measures_each_sample_at_its_own_batch(tmp_path) -> None:
    scale = WorkloadScale(row_divisor=1024, batch_size=512)
    out = tmp_path / "compute.jsonl"
    collect_compute(out, 4, torch.device("cpu"), scale=scale, seed=9, warmup=1, repeats=2, progress=False, batch_sizes=(64, 2048))
    rows, pool = read_rows(out), synthetic_pool()
    assert [r["batch_size"] for r in rows] == [draw_batch(9, i, (64, 2048)) for i in range(4)]
    for i, r in enumerate(rows):  # the tables of a fixed batch, their histograms those of the row's batch
        sample = draw_compute_sample(pool, scale, 9, i)
        at = WorkloadScale(1024, r["batch_size"])
        want = [shard_record(Shard(table_spec(pool[t], w, at, name=pool[t].name), w)) for t, w in zip(sample.table_ids, sample.widths)]
        assert r["shards"] == want


def _rows_across_batches(n: int, seed: int = 0, batches: tuple[int, int] = (LOW, HIGH)) -> list[dict]:
    """Measured-looking compute rows whose kernel time grows as batch^1.4 (not linearly)."""
    rng = np.random.default_rng(seed)
    pool, rows = synthetic_pool(), []
    for i in range(n):
        batch = draw_batch(seed, i, batches)
        ids, widths = rng.integers(0, 856, rng.integers(1, 5)), rng.choice([8, 32, 128], 4)
        shards = [Shard(table_spec(pool[j], int(w), WorkloadScale(64, batch)), int(w)) for j, w in zip(ids, widths)]
        ms = (sum(0.01 * s.width * s.table.pooling_factor for s in shards) + 0.1) * (batch / 4096) ** 1.4
        record = [shard_record(s) for s in shards]
        rows.append({"kind": "compute", "group": i, "batch_size": batch, "shards": record, "fwd_ms": ms, "bwd_ms": 2 * ms, "hardware": {"device": "cpu"}})
    return rows


@pytest.fixture(scope="module")
def across() -> NeuralCostModel:
    rows = _rows_across_batches(2000) + _rows_across_batches(200, seed=1, batches=(4096, 4096))
    return pretrain(rows, epochs=60, progress=False)


@pytest.mark.slow
def test_a_net_trained_across_batches_reads_the_batch_and_records_them(across) -> None:
    assert across.compute_net.reads_batch and across.meta["batch_size"] == 4096  # the most measured batch
    low, high = across.pooled_kernel.batch_sizes_trained
    assert LOW <= low < 300 and 60_000 < high <= HIGH
    shards = [Shard(table_spec(synthetic_pool()[5], 64, WorkloadScale(64, 16_384)), 64)]
    # the planner's path prices a kernel as the net does on the training features
    x = shard_features(shards, 16_384)
    with torch.no_grad():
        net = across.compute_net(across.compute_norm(x), torch.zeros(1, dtype=torch.long), 1).exp().numpy()
    np.testing.assert_allclose(across.with_batch_size(16_384).compute_cost([shards]), net, rtol=1e-4)
    # it learned the superlinear batch: 16x the batch is nearer 16^1.4 = 48.5x the time than
    # 16x (their geometric mean is 27.9; linear scaling would say 16)
    at = {b: sum(across.with_batch_size(b).compute_cost([shards])[0]) for b in (2048, 32_768)}
    assert at[32_768] / at[2048] > 27.9
    assert across.batch_note(16_384).startswith("compute priced by its net (learned at ")


@pytest.mark.slow
def test_beyond_its_batches_a_net_scales_linearly_from_the_nearest(across, tmp_path) -> None:
    low, high = across.pooled_kernel.batch_sizes_trained
    shards = [Shard(table_spec(synthetic_pool()[5], 64, WorkloadScale()), 64)]
    cost = {b: np.asarray(across.with_batch_size(b).compute_cost([shards])[0]) for b in (low // 4, low, high, 3 * high)}
    np.testing.assert_allclose(cost[low // 4], cost[low] * (low // 4) / low, rtol=1e-5)
    np.testing.assert_allclose(cost[3 * high], cost[high] * 3, rtol=1e-5)
    assert f"compute scaled linearly by 3 (learned at {low:,}-{high:,})" in across.batch_note(3 * high)
    across.save(tmp_path / "m.pt")
    again = NeuralCostModel.load(tmp_path / "m.pt")
    assert again.compute_net.reads_batch and again.pooled_kernel.batch_sizes_trained == (low, high)
    np.testing.assert_array_equal(again.with_batch_size(999).compute_cost([shards]), across.with_batch_size(999).compute_cost([shards]))


@pytest.mark.slow
def test_calibrating_a_net_that_reads_the_batch_keeps_it_reading(across) -> None:
    rows = [{**r, "hardware": {"device": "cpu", "device_name": "x"}} for r in _rows_across_batches(80, seed=2, batches=(4096, 4096))]
    tuned = fine_tune(across, rows, epochs=3, progress=False)
    assert tuned.compute_net.reads_batch
    assert tuned.pooled_kernel.batch_sizes_trained == across.pooled_kernel.batch_sizes_trained


def test_a_model_trained_at_one_batch_scales_linearly_as_before() -> None:
    h200 = load_pretrained("h200")  # a model file from before nets read the batch
    assert not h200.compute_net.reads_batch and h200.pooled_kernel.batch_sizes_trained == (65_536, 65_536)
    shards = [Shard(table_spec(synthetic_pool()[5], 64, WorkloadScale(1, 65_536)), 64)]
    base = np.asarray(h200.compute_cost([shards])[0])
    for batch in (1024, 65_536, 262_144):
        np.testing.assert_allclose(h200.with_batch_size(batch).compute_cost([shards])[0], base * batch / 65_536, rtol=1e-6)
    assert h200.batch_note(1024).startswith("compute scaled linearly by 0.0156 (learned at 65,536)")
    data = load_compute_data(_rows_across_batches(40, batches=(4096, 4096)))
    assert not data.reads_batch and data.x.shape[1] == len(shard_features(shards)[0])
    assert math.isclose(float(load_compute_data(_rows_across_batches(40)).x[0, -1]), math.log(draw_batch(0, 0, (LOW, HIGH))), rel_tol=1e-6)
