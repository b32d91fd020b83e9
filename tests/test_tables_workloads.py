"""Tables, workloads, tasks and plan validation."""

import gzip
import math

import numpy as np
import pytest
import torch

from tests.models import configs, random_kjt, two_tower
from torchrec_neuroshard.heuristics import greedy_plan, HEURISTIC_KEYS
from torchrec_neuroshard.lab.dlrm_dataset import load_dlrm_dataset, save_dlrm_dataset
from torchrec_neuroshard.access import access_histogram, expected_access_histogram
from torchrec_neuroshard.access import profile_batches
from torchrec_neuroshard.tables import tables_from_module
from torchrec_neuroshard.types import InfeasibleError, Plan, ShardingError, TablePlacement, TableSpec, Task
from torchrec_neuroshard.lab.workloads import (
    DLRM_MEAN_POOLING,
    DLRM_REUSE_HISTOGRAM,
    WorkloadScale,
    generate_task,
    pool_reuse_histogram,
    sample_lookups,
    synthetic_pool,
    table_spec,
)

HIST = (1.0,) + (0.0,) * 16


def spec(name: str, rows: int = 100, dim: int = 8) -> TableSpec:
    return TableSpec(name, rows, dim, 2.0, HIST)


@pytest.mark.slow
def test_pool_matches_published_reuse_histogram_and_pooling() -> None:
    pool = synthetic_pool()
    assert len(pool) == 856
    target = np.asarray(DLRM_REUSE_HISTOGRAM)
    full = pool_reuse_histogram(pool)
    assert np.abs(full - target).max() <= 0.03, np.round(full, 3)
    # Shrinking rows and batch by the same factor keeps the histogram.
    shrunk = pool_reuse_histogram(pool, batch_size=65536 // 64, row_divisor=64)
    assert np.abs(shrunk - target).max() <= 0.03, np.round(shrunk, 3)
    mean_pf = np.mean([t.pooling_factor for t in pool])
    assert abs(mean_pf - DLRM_MEAN_POOLING) / DLRM_MEAN_POOLING <= 0.10


@pytest.mark.parametrize("table_id", [0, 1, 2, 5])
def test_sampler_reproduces_each_tables_expected_histogram(table_id: int) -> None:
    t = synthetic_pool()[table_id]
    scale = WorkloadScale()
    indices, offsets = t.lookups(scale, seed=3)
    assert offsets.numel() == scale.batch_size + 1 and int(offsets[-1]) == indices.numel()
    rows = t.rows // scale.row_divisor
    assert 0 <= int(indices.min()) and int(indices.max()) < rows
    want = table_spec(t, 8, scale).access_hist
    got = access_histogram(indices)
    assert np.abs(np.asarray(got) - np.asarray(want)).max() < 0.03
    # deterministic by seed
    again, _ = t.lookups(scale, seed=3)
    assert torch.equal(indices, again)


def test_access_histogram_bins() -> None:
    ids = np.array([0] + [1] * 2 + [2] * 3 + [3] * 40000)
    h = access_histogram(ids)
    assert h[0] == h[1] == h[2] == h[16] == 0.25 and math.isclose(sum(h), 1.0)


def test_expected_histogram_of_uniform_draws() -> None:
    # 1000 uniform draws over 10^6 rows: nearly every id is seen once.
    assert expected_access_histogram(10**6, 1000, alpha=0.0)[0] > 0.99


def test_uniform_histograms_at_once_match_the_bucket_sum() -> None:
    """The default histogram of a table known from its config, computed for many tables at
    once from one Poisson per table (issue 41), agrees with the power-law model's sum over
    its rank buckets at alpha 0 to rounding, reads and no reads alike."""
    from torchrec_neuroshard.access import uniform_access_histogram, uniform_access_histograms

    shapes = [(1, 4096.0), (64, 500.0 * 4096), (1000, 0.0), (1000, 3.5), (123_457, 4096.0), (10**6, 1e9), (2 * 10**6, 16.0)]
    at_once = uniform_access_histograms(shapes)
    for (rows, lookups), hist in zip(shapes, at_once):
        summed = expected_access_histogram(rows, lookups, alpha=0.0)
        assert np.abs(np.asarray(hist) - summed).max() < 1e-12, (rows, lookups)
        assert hist == uniform_access_histogram(rows, lookups) and math.isclose(sum(hist), 1.0)


def test_tables_from_module_finds_nested_ebcs_and_pooling() -> None:
    specs = tables_from_module(two_tower(), batch_size=16, pooling_factors={"a0": 3.5})
    assert [s.name for s in specs] == ["a0", "a1", "b0", "b1"]
    assert specs[0].pooling_factor == 3.5 and specs[1].pooling_factor == 1.0
    assert specs[0].rows == 40 and specs[0].dim == 64 and specs[0].feature_names == ("f_a0",)


def test_profile_batches_measures_pooling_and_histogram() -> None:
    model = two_tower()
    kjts = [random_kjt(model, batch=32, seed=s) for s in range(3)]
    f2t = {f"f_{n}": n for n in ("a0", "a1", "b0", "b1")}
    pooling, hists = profile_batches(kjts, f2t)
    for kjt in kjts[:1]:
        lengths = kjt.to_dict()["f_a0"].lengths()
    assert 0.5 < pooling["a0"] < 2.5  # lengths ~ U{0..3}: mean 1.5
    assert set(hists) == set(f2t.values()) and math.isclose(sum(hists["b1"]), 1.0)
    assert lengths.numel() == 32


def test_bad_tables_give_clear_errors() -> None:
    with pytest.raises(ShardingError, match=r"table 'x': dim 10 is not a positive multiple of 4.*Pad it to 12"):
        TableSpec("x", 10, 10, 1.0, HIST)
    with pytest.raises(ShardingError, match=r"duplicate table names: \['a'\]"):
        Task((spec("a"), spec("a")), 2, 10**6, 16)
    with pytest.raises(ShardingError, match="contains no torchrec EmbeddingBagCollection"):
        tables_from_module(torch.nn.Sequential(torch.nn.Linear(2, 2)), batch_size=8)



def test_table_larger_than_any_device_names_table_and_cap() -> None:
    task = Task((spec("small", 10), spec("huge", 10_000)), 2, memory_cap_bytes=100_000, batch_size=8)
    # 320,000 bytes of weights + the global batch's indices and pooled output (384 bytes)
    with pytest.raises(InfeasibleError, match=r"'huge' \(320,384 bytes\) fits no device.*220,384 short.*at least 320,384"):
        greedy_plan(task, HEURISTIC_KEYS["size"])


def test_plan_validation_names_table_and_numbers() -> None:
    task = Task((spec("a", dim=16), spec("b")), 2, 10**6, 8)
    ok = Plan((TablePlacement("a", (8, 4, 4), (0, 1, 1)), TablePlacement("b", (8,), (0,))), 2)
    ok.validate(task)
    assert ok.device_dims() == [16, 8]
    with pytest.raises(ShardingError, match=r"'a': shard widths \[8, 4\] sum to 12, not the table's dim 16"):
        Plan((TablePlacement("a", (8, 4), (0, 1)), TablePlacement("b", (8,), (0,))), 2).validate(task)
    with pytest.raises(ShardingError, match=r"'a': shard width 6 is not a positive multiple of 4"):
        Plan((TablePlacement("a", (6, 10), (0, 1)), TablePlacement("b", (8,), (0,))), 2).validate(task)
    with pytest.raises(ShardingError, match=r"'b': device 2 out of range"):
        Plan((TablePlacement("a", (16,), (0,)), TablePlacement("b", (8,), (2,))), 2).validate(task)
    tight = Task(task.tables, 2, 5000, 8)
    with pytest.raises(InfeasibleError, match=r"device 0 holds 7,040 bytes, over the cap of 5,000"):  # 6,400 + buffers
        Plan((TablePlacement("a", (16,), (0,)), TablePlacement("b", (8,), (1,))), 2).validate(tight)
    over = Plan((TablePlacement("a", (16,), (0,)), TablePlacement("b", (8,), (1,))), 2)
    assert ok.fits(task) and over.fits(task) and not over.fits(tight)  # fits: validate as a bool


def test_task_json_round_trip_and_generator_defaults(tmp_path) -> None:
    task = generate_task(synthetic_pool(), 30, 4, WorkloadScale(), seed=7)
    assert len(task.tables) == 30 and all(t.dim in (4, 8, 16, 32, 64, 128) for t in task.tables)
    total = sum(t.size_bytes() for t in task.tables)
    assert task.memory_cap_bytes * 4 >= total
    task.save(tmp_path / "task.json")
    assert Task.load(tmp_path / "task.json") == task
    assert generate_task(synthetic_pool(), 30, 4, WorkloadScale(), seed=7) == task


def test_dlrm_dataset_loader_reads_the_published_layout(tmp_path) -> None:
    bags = [sample_lookups(500, 3.0, 0.6, 0.5, 64, seed=s) for s in range(3)]
    path = tmp_path / "fbgemm_t3_bs64.pt.gz"
    save_dlrm_dataset(path, bags)
    indices, offsets, lengths = torch.load(gzip.open(path), weights_only=True)
    assert offsets.numel() == 3 * 64 + 1 and lengths.shape == (3, 64)
    tables = load_dlrm_dataset(path, dim=16)
    assert [t.spec.name for t in tables] == ["dlrm_t0", "dlrm_t1", "dlrm_t2"]
    for t, (idx, off) in zip(tables, bags):
        assert torch.equal(t.indices, idx) and torch.equal(t.offsets, off)
        assert t.spec.rows == int(idx.max()) + 1 and t.spec.dim == 16
        assert abs(t.spec.pooling_factor - idx.numel() / 64) < 1e-6
        assert t.spec.access_hist == access_histogram(idx)


def test_dlrm_dataset_loader_rejects_a_corrupt_file(tmp_path) -> None:
    path = tmp_path / "bad.pt.gz"
    path.write_bytes(b"not a gzip file")
    with pytest.raises(ShardingError, match="bad.pt.gz: not a readable DLRM dataset file"):
        load_dlrm_dataset(path)
