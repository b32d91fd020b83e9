"""The correction of a kernel's price by what its lookups read (``costmodel.nets.KernelCorrection``),
how the search prices devices with it, and its fit on device pairs (``lab.kernel_correction``)."""

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from torchrec_neuroshard.costmodel import NeuralCostModel, load_pretrained
from torchrec_neuroshard.costmodel.nets import KernelCorrection, shard_footprint
from torchrec_neuroshard.lab.collect import append_rows, read_rows, shard_record
from torchrec_neuroshard.lab.collect_devices import DEVICE_GROUP_OFFSET
from torchrec_neuroshard.lab.kernel_correction import correction_input, fit, footprint, lookups, mean_width, read_pairs, without_correction
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool, table_spec
from torchrec_neuroshard.search import predicted_breakdown
from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.types import NUM_ACCESS_BINS, Shard, TableSpec

BATCH = 4096



@functools.cache
def plain_model() -> NeuralCostModel:
    return load_pretrained("cpu")


@pytest.fixture(scope="module")
def plain() -> NeuralCostModel:
    return plain_model()


def corrected(model: NeuralCostModel, slope: float, reference: float, form: str = "width", **footprint: float) -> NeuralCostModel:
    meta = {**model.meta, "kernel_correction": {"form": form, "slope": slope, "reference": reference, **footprint}}
    return NeuralCostModel(model.compute_net, model.compute_norm, model.comm, meta, model.batch_scale, model.sequence)


def kernels(count: int, seed: int) -> list[list[Shard]]:
    """``count`` kernels of 16-40 tables of the training pool, each of a width of 8-128."""
    pool, rng = synthetic_pool(), np.random.default_rng(seed)
    out = []
    for _ in range(count):
        picked = rng.choice(len(pool), size=int(rng.integers(16, 41)), replace=False)
        widths = rng.choice([8, 16, 32, 64, 128], size=len(picked))
        out.append([Shard(table_spec(pool[i], int(w), WorkloadScale()), int(w)) for i, w in zip(picked, widths)])
    return out


def test_a_correction_multiplies_a_kernels_price_by_its_mean_width_over_the_reference(plain) -> None:
    shards = kernels(1, 0)[0]
    width = mean_width(shards)
    base = plain.kernel_ms(shards, BATCH)
    assert corrected(plain, 0.3, width).kernel_ms(shards, BATCH) == pytest.approx(base, rel=1e-5)
    assert corrected(plain, 0.3, width / 2).kernel_ms(shards, BATCH) == pytest.approx(base * 2**0.3, rel=1e-5)
    assert corrected(plain, 0.0, 7.0).kernel_ms(shards, BATCH) == pytest.approx(base, rel=1e-5)
    with pytest.raises(ValueError, match="positive reference"):
        KernelCorrection("width", 0.1, 0.0)
    with pytest.raises(ValueError, match="form='depth'"):
        KernelCorrection("depth", 0.1, 1.0)


def test_a_work_correction_blends_the_nets_price_with_the_kernels_lookups(plain) -> None:
    """(lookups / price / reference) ** slope: slope 1 prices kernels by their lookups alone,
    so two kernels' prices are in the ratio of their lookups; at the reference the price stays."""
    first, second = kernels(2, 4)
    rate = lookups(first) / plain.kernel_ms(first, BATCH)
    assert correction_input(plain, "work", first, BATCH, plain.kernel_ms(first, BATCH)) == pytest.approx(rate, rel=1e-6)
    assert corrected(plain, 0.4, rate, "work").kernel_ms(first, BATCH) == pytest.approx(plain.kernel_ms(first, BATCH), rel=1e-5)
    by_lookups = corrected(plain, 1.0, 100.0, "work")
    assert by_lookups.kernel_ms(first, BATCH) / by_lookups.kernel_ms(second, BATCH) == pytest.approx(lookups(first) / lookups(second), rel=1e-5)
    assert by_lookups.kernel_ms(first, BATCH) == pytest.approx(lookups(first) / 100.0, rel=1e-5)


def test_a_shards_footprint_is_its_distinct_rows_a_batch_reads_times_its_row_bytes() -> None:
    """Every id read once (all the histogram in bin 0): distinct rows = lookups, at most the
    table's rows; read 12 times each (bin 4, (8, 16]): a twelfth; a row shard its share."""
    once = (1.0,) + (0.0,) * (NUM_ACCESS_BINS - 1)
    table = TableSpec("t", rows=100_000, dim=64, pooling_factor=2.0, access_hist=once)
    assert shard_footprint(Shard(table, 32), 1000) == pytest.approx(2000 * 32 * 4)
    assert shard_footprint(Shard(table, 64), 10**6) == pytest.approx(100_000 * 64 * 4)  # capped at the table's rows
    twelve = tuple(1.0 if i == 4 else 0.0 for i in range(NUM_ACCESS_BINS))
    assert shard_footprint(Shard(TableSpec("u", 100_000, 64, 6.0, twelve), 64), 1000) == pytest.approx(500 * 64 * 4)
    half = Shard(table, 64, rows=50_000)
    assert shard_footprint(half, 10**6) == pytest.approx(50_000 * 64 * 4)


def test_a_footprint_correction_multiplies_the_work_correction_by_the_footprint_beyond_its_knee(plain) -> None:
    shards = kernels(1, 7)[0]
    base, rate, size = plain.kernel_ms(shards, BATCH), lookups(shards) / plain.kernel_ms(shards, BATCH), footprint(shards, BATCH)
    beyond = corrected(plain, 0.1, rate / 2, "work+footprint", footprint_slope=0.3, footprint_reference=size / 4)
    assert beyond.kernel_ms(shards, BATCH) == pytest.approx(base * 2**0.1 * 4**0.3, rel=1e-5)
    below = corrected(plain, 0.1, rate / 2, "work+footprint", footprint_slope=0.3, footprint_reference=size * 4)
    assert below.kernel_ms(shards, BATCH) == pytest.approx(base * 2**0.1, rel=1e-5)  # a kernel below the knee: the work correction alone
    assert corrected(plain, 0.1, rate / 2, "work").kernel_ms(shards, BATCH) == pytest.approx(base * 2**0.1, rel=1e-5)
    with pytest.raises(ValueError, match="only the form 'work\\+footprint' reads the footprint"):
        KernelCorrection("work", 0.1, 1.0, footprint_slope=0.2)
    with pytest.raises(ValueError, match="positive references"):
        KernelCorrection("work+footprint", 0.1, 1.0, 0.2, 0.0)


def test_a_file_of_format_5_reads_its_width_correction(plain) -> None:
    meta = {**plain.meta, "width_correction": {"slope": 0.3, "reference": 20.0}}
    old = NeuralCostModel(plain.compute_net, plain.compute_norm, plain.comm, meta, plain.batch_scale, plain.sequence)
    shards = kernels(1, 6)[0]
    assert old.kernel_ms(shards, BATCH) == pytest.approx(corrected(plain, 0.3, 20.0).kernel_ms(shards, BATCH), rel=1e-6)
    assert without_correction(old).kernel_ms(shards, BATCH) == pytest.approx(plain.kernel_ms(shards, BATCH), rel=1e-6)


@pytest.mark.parametrize("form,reference", [("width", 40.0), ("work", 300.0), ("work+footprint", 300.0)])
def test_the_search_prices_each_device_of_a_plan_as_a_kernel_of_its_shards_with_the_correction(plain, form, reference) -> None:
    """Devices' embeddings are summed before the head (the search's pooled rows): the
    correction's lookup and footprint columns sum with them, so a device is priced as its kernel."""
    task = generate_task(synthetic_pool(), 40, 4, WorkloadScale(), seed=3)
    extra = {"footprint_slope": 0.2, "footprint_reference": 1e7} if form == "work+footprint" else {}  # two devices below the knee, two beyond
    model = corrected(plain, 0.25, reference, form, **extra).with_batch_size(task.batch_size)
    plan = baseline_plan("size", task)
    _, devices = predicted_breakdown(model, task, plan)
    _, before = predicted_breakdown(plain.with_batch_size(task.batch_size), task, plan)
    for d, shards in enumerate(plan.device_shards(task.tables)):
        assert devices[d].compute == pytest.approx(model.kernel_ms(shards, task.batch_size), rel=1e-4)
        x = mean_width(shards) if form == "width" else lookups(shards) / before[d].compute
        by_footprint = (max(footprint(shards, task.batch_size), 1e7) / 1e7) ** 0.2 if extra else 1.0
        assert devices[d].compute / before[d].compute == pytest.approx((x / reference) ** 0.25 * by_footprint, rel=1e-4)


def knee(seed: int) -> float:
    return sorted(footprint(shards, BATCH) for shards in kernels(24, seed))[8]


def pair_rows(form: str, seed: int, slope: float = 0.2) -> list[dict]:
    """12 pairs of kernels timed at the nets' price x (x / 32) ** ``slope`` (x: ``form``'s
    quantity; "work+footprint": times (max(footprint, knee) / knee) ** 0.15, the knee the
    9th smallest of the kernels' footprints, ``knee``) x a level that drifts from pair to
    pair, as device-pair rows."""
    rng, reference = np.random.default_rng(seed), {"width": 32.0, "work": 300.0, "work+footprint": 300.0}[form]
    rows = []
    for pair, members in enumerate(zip(*[iter(kernels(24, seed))] * 2)):
        drift = float(rng.uniform(0.5, 2.0))
        for member, shards in enumerate(members):
            price = plain_model().kernel_ms(shards, BATCH)
            ms = price * (correction_input(plain_model(), form, shards, BATCH, price) / reference) ** slope * drift
            ms *= (max(footprint(shards, BATCH), knee(seed)) / knee(seed)) ** 0.15 if form == "work+footprint" else 1.0
            rows.append({"group": DEVICE_GROUP_OFFSET + pair, "pair": pair, "pair_member": member, "batch_size": BATCH, "shards": [shard_record(s) for s in shards], "fwd_ms": ms / 3, "bwd_ms": 2 * ms / 3})
    return rows


@pytest.mark.parametrize("form", ["width", "work", "work+footprint"])
def test_the_fit_recovers_the_law_under_a_drift_that_each_pair_shares(plain, form, tmp_path: Path) -> None:
    """The fit reads the slopes within pairs, and the model file keeps the correction."""
    model, record = fit(corrected(plain, -1.0, 10.0, form), pair_rows(form, 1), form)  # a correction already there is refitted, not compounded
    assert record["form"] == form and record["slope"] == pytest.approx(0.2, abs=1e-3) and record["pairs"] == 12
    if form == "work+footprint":
        assert record["footprint_slope"] == pytest.approx(0.15, abs=1e-3) and record["footprint_reference"] == pytest.approx(knee(1), rel=1e-3)  # the rows round the pooling factors
    assert record["pair_error_sd"]["after"] < 1e-3 < record["pair_error_sd"]["before"]
    model.save(tmp_path / "corrected.pt")
    loaded = NeuralCostModel.load(tmp_path / "corrected.pt")
    shards = kernels(1, 5)[0]
    assert loaded.kernel_ms(shards, BATCH) == pytest.approx(model.kernel_ms(shards, BATCH), rel=1e-6)
    assert without_correction(loaded).kernel_ms(shards, BATCH) == pytest.approx(plain.kernel_ms(shards, BATCH), rel=1e-6)


def test_pairs_of_two_files_stay_apart(plain, tmp_path: Path) -> None:
    """Each file numbers its pairs from 0: read together, pair 3 of one is not pair 3 of the other."""
    paths = [tmp_path / f"pairs{i}.jsonl.gz" for i in range(2)]
    for i, path in enumerate(paths):
        append_rows(path, pair_rows("work", 2 + i))
    rows = read_pairs([str(p) for p in paths])
    assert [r["pair"] for r in rows[::2]] == list(range(24)) and read_pairs([str(paths[0])]) == pair_rows("work", 2)
    assert len({r["group"] for r in rows}) == 24  # a pair's split group moves with it
    _, record = fit(plain, rows, "work")
    assert record["pairs"] == 24 and record["slope"] == pytest.approx(0.2, abs=1e-3)


@pytest.mark.slow
def test_the_accuracy_benchmark_scores_a_corrected_model_as_the_planner_prices(plain, capsys) -> None:
    """``benchmarks.costmodel``'s compute rows price by the net alone; a model with a
    correction gets a row more, its kernels priced through it (``kernel_ms``)."""
    from benchmarks.costmodel import DATA_DIR, _compute_table, kernel_prices
    from torchrec_neuroshard.lab.training import mape

    rows = read_rows(DATA_DIR / "cpu_compute.jsonl.gz")[:300]
    _compute_table(plain, rows, 0, "cpu")
    assert "through its kernel correction" not in capsys.readouterr().out
    model = corrected(plain, 0.5, 300.0, "work")
    tested = _compute_table(model, rows, 0, "cpu")
    line = next(x for x in capsys.readouterr().out.splitlines() if "through its kernel correction" in x)
    truth = torch.tensor([r["fwd_ms"] + r["bwd_ms"] for r in tested], dtype=torch.float64)
    assert line.split(" | ")[1] == f"{mape(kernel_prices(model, tested), truth):.1f}"
    assert kernel_prices(model, tested).tolist() != kernel_prices(plain, tested).tolist()
