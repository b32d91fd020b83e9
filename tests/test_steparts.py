"""The step parts beyond the sharded kernels: real samples of every kind on 2 gloo ranks,
resumed collection, the linear fits pre-training stores in the model."""

from pathlib import Path

import numpy as np
import pytest

from torchrec_neuroshard.costmodel import NeuralCostModel
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.collect_step import DP_KINDS, STEP_KINDS, collect_step
from torchrec_neuroshard.lab.pretrain import pretrain
from torchrec_neuroshard.lab.training_data import load_step_data
from torchrec_neuroshard.lab.workloads import WorkloadScale
from torchrec_neuroshard.steparts import PART_FEATURES, LinearPart
from torchrec_neuroshard.types import ShardingError

SMALL = WorkloadScale(row_divisor=1024, batch_size=512)
DATA = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data"
SAMPLES = 13
"""Per kind: 10 train after the 80/10/10 split, the fewest dp_bwd's 5 coefficients take."""


@pytest.fixture(scope="module")
def step_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("step") / "step.jsonl"
    counts = collect_step(out, SAMPLES, world_sizes=(2,), scale=SMALL, dp_warmup=1, dp_repeats=2, progress=False)
    assert counts == {k: SAMPLES for k in STEP_KINDS}
    return out


@pytest.mark.measure
@pytest.mark.dmp
def test_step_samples_record_raw_quantities_and_resume(step_file: Path) -> None:
    rows = read_rows(step_file)
    by_kind = {k: [r for r in rows if r["kind"] == k] for k in STEP_KINDS}
    assert all(len(v) == SAMPLES for v in by_kind.values())
    for r in rows:
        assert r["world_size"] == 2 and r["hardware"]["device"] == "cpu"
        times = [r["fwd_ms"], r["bwd_ms"]] if r["kind"] in DP_KINDS else r["ms"]
        assert all(t > 0 for t in times)
    first = by_kind["input_dist"][0]
    # what rank 0 sends rank 1: 2 int64 splits, int32 lengths, int64 indices
    assert first["send_bytes"][0] == 2 * 8 + 4 * first["lengths"][0][1] + 8 * first["values"][0][1]
    assert first["send_bytes"][0] == first["recv_bytes"][1]
    assert all(r["nbytes"] > 0 and r["max_ms"] == max(r["ms"]) for k in STEP_KINDS[1:4] for r in by_kind[k])
    assert all(r["local_batch"] == 256 and len(r["lookups"]) == len(r["tables"]) for k in DP_KINDS for r in by_kind[k])
    before = step_file.read_text()
    collect_step(step_file, SAMPLES, world_sizes=(2,), scale=SMALL, progress=False)  # resumes: nothing to add
    assert step_file.read_text() == before


def test_pretrain_fits_every_part_and_the_model_file_keeps_them(step_file: Path, tmp_path: Path) -> None:
    compute = [r for r in read_rows(DATA / "cpu_compute.jsonl.gz")[:40]]
    model = pretrain(compute + read_rows(step_file), epochs=1, progress=False)
    assert set(model.meta["step_parts"]) == set(PART_FEATURES)
    assert all(m["test"]["mape"] >= 0 for m in model.meta["test"]["step_parts"].values())
    model.save(tmp_path / "m.pt")
    parts = NeuralCostModel.load(tmp_path / "m.pt").step_parts
    assert parts is not None and parts.to_dict() == model.step_parts.to_dict()
    data = load_step_data(read_rows(step_file))
    assert np.all(parts.predict("input_dist", data["input_dist"].x) > 0)
    bare = NeuralCostModel(model.compute_net, model.compute_norm, None, {k: v for k, v in model.meta.items() if k != "step_parts"})
    assert bare.step_parts is None


def test_linear_part_refuses_too_few_or_non_positive_timings() -> None:
    x = np.ones((8, 3))
    with pytest.raises(ShardingError, match="need >= 6"):
        LinearPart.fit("all_reduce", x[:5], np.ones(5))
    with pytest.raises(ShardingError, match="finite positive"):
        LinearPart.fit("all_reduce", x, np.r_[np.ones(7), 0.0])
    with pytest.raises(ShardingError, match="does not match|do not match"):
        LinearPart.fit("input_dist", x, np.ones(8))
    assert LinearPart.fit("all_reduce", x, np.full(8, 2.0)).predict(x[:1])[0] == pytest.approx(2.0)


def test_small_and_many_dp_samples_hold_their_tables_and_count_toward_both_dp_parts(step_file: Path) -> None:
    from torchrec_neuroshard.lab.collect_step import DP_MANY_CAP_BYTES, DP_SMALL_ROWS, MAX_DP_MANY_TABLES, MAX_DP_SMALL_TABLES

    rows = read_rows(step_file)
    small = [r for r in rows if r["kind"] == "dp_small"]
    assert all(1 <= len(r["tables"]) <= MAX_DP_SMALL_TABLES for r in small)
    assert all(DP_SMALL_ROWS[0] <= t["rows"] <= DP_SMALL_ROWS[1] for r in small for t in r["tables"])
    many = [r for r in rows if r["kind"] == "dp_many"]
    assert all(9 <= len(r["tables"]) <= MAX_DP_MANY_TABLES for r in many)
    assert all(sum(t["rows"] * t["width"] * 4 for t in r["tables"]) <= DP_MANY_CAP_BYTES for r in many)
    data = load_step_data(rows)
    dp = sum(r["kind"] in DP_KINDS for r in rows)
    assert len(data["dp_fwd"]) == len(data["dp_bwd"]) == dp
    assert len(np.unique(data["dp_fwd"].group)) == dp  # every sample a group of its own, across kinds


def test_dp_forward_counts_lookups_into_uncached_tables_apart() -> None:
    from torchrec_neuroshard.steparts import DP_CACHED_TABLE_MB, DP_UPDATE_KNEE_MB, MB, dp_features

    big_rows = int(2 * DP_CACHED_TABLE_MB * MB / (4 * 16)) + 1  # a 16-column table over the knee
    one, lookup, output, over, k_lookups, k_pressured, mb_pressured = dp_features("dp_fwd", [1000.0, 3000.0], [16, 16], [100, big_rows], 64, 4)
    assert (one, lookup, over) == (1.0, pytest.approx(4000 * 16 * 4 / MB), pytest.approx(3000 * 16 * 4 / MB))
    assert output == pytest.approx(64 * 32 * 4 / MB)
    pressure = (100 + big_rows) * 16 * 4 / MB / DP_UPDATE_KNEE_MB  # the weights' share of the last-level cache
    assert (k_lookups, k_pressured, mb_pressured) == (4.0, pytest.approx(4.0 * pressure), pytest.approx(lookup * pressure))
    with pytest.raises(ValueError, match="one of each per table"):
        dp_features("dp_fwd", [1.0], [16, 16], [100, 100], 64, 4)


def test_tiny_replicated_tables_are_priced_as_well_as_large_ones_on_the_stored_samples() -> None:
    """The shipped parts on the data-parallel samples of cpu_step_dp.jsonl.gz (the ones they
    were fitted to): kernels of tables of at most 5,000 rows are priced, median, within 2x
    of how kernels of 8 MB or more are (1.02 against 0.86 as shipped). A live re-measure
    compared the two in the same minute, but on 2026-11-27 the tiny kernel ran 3.6x and the
    large one 1.5x faster than priced (a stable 2.35, 60 repeats each): machine speed does
    not cancel between sub-millisecond and 25 ms kernels, so that check measured the day."""
    import gzip
    import json
    import statistics

    from torchrec_neuroshard.costmodel import load_pretrained
    from torchrec_neuroshard.stepcost import data_parallel_ms
    from torchrec_neuroshard.types import TableSpec

    parts = load_pretrained("cpu").step_parts
    data = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data" / "cpu_step_dp.jsonl.gz"
    tiny, large = [], []
    for row in map(json.loads, gzip.open(data, "rt")):
        if row["kind"] not in DP_KINDS:
            continue
        tables = [TableSpec(t["name"], t["rows"], t["width"], t["pooling_factor"], tuple(t["access_hist"]), t["bytes_per_element"]) for t in row["tables"]]
        priced = data_parallel_ms(parts, tables, row["local_batch"] * row["world_size"], row["world_size"])
        ratio = (priced["dp_fwd"] + priced["dp_bwd"]) / (row["fwd_ms"] + row["bwd_ms"])
        if max(t.rows for t in tables) <= 5_000:
            tiny.append(ratio)
        elif sum(t.size_bytes() for t in tables) >= 8 * 2**20:
            large.append(ratio)
    assert len(tiny) > 100 and len(large) > 100
    assert 0.5 < statistics.median(tiny) / statistics.median(large) < 2.0


def test_refit_fits_parts_into_a_model_without_them_and_refuses_other_hardware() -> None:
    """The H200 model's nets without step parts: its data-parallel kernel rows (one H200)
    fit into it with its nets unchanged (as `make model` does, the shipped parts again),
    and CPU rows are refused for it."""
    import torch

    from torchrec_neuroshard.costmodel import PRETRAINED_DIR
    from torchrec_neuroshard.lab.refit_steps import NETS, refit

    data = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data"
    shipped = torch.load(PRETRAINED_DIR / "h200.pt", map_location="cpu", weights_only=False)
    bare = {k: v for k, v in shipped["meta"].items() if k not in ("step_parts", "step_parts_world_sizes")}
    checkpoint = {**shipped, "meta": {**bare, "test": {k: v for k, v in bare["test"].items() if k != "step_parts"}}}
    new, lines = refit(checkpoint, read_rows(data / "h200_step.jsonl.gz"))
    assert sorted(new["meta"]["step_parts"]) == ["dp_bwd", "dp_fwd"] and len(lines) == 2
    for name, coef in shipped["meta"]["step_parts"].items():  # to the last bits another CPU kind's least squares may flip
        np.testing.assert_allclose(new["meta"]["step_parts"][name], coef, rtol=1e-9, atol=1e-15)
    assert all(new[k] is checkpoint[k] for k in NETS if k in checkpoint)
    with pytest.raises(ShardingError, match="AMD EPYC"):
        refit(checkpoint, read_rows(data / "cpu_step.jsonl.gz")[:50])


def test_refit_keeps_the_parts_its_rows_hold_no_samples_of_and_refuses_rows_of_none() -> None:
    """Refitting the CPU model on its data-parallel rows (cpu_step_dp.jsonl.gz) refits the
    data-parallel parts to the shipped ones (`make model` reproduces them) and keeps the
    others as stored; rows with no step samples are refused."""
    import torch

    from torchrec_neuroshard.costmodel import PRETRAINED_DIR
    from torchrec_neuroshard.lab.refit_steps import refit

    data = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data"
    checkpoint = torch.load(PRETRAINED_DIR / "cpu.pt", map_location="cpu", weights_only=False)
    stored = checkpoint["meta"]["step_parts"]
    new, lines = refit(checkpoint, read_rows(data / "cpu_step_dp.jsonl.gz"))
    parts = new["meta"]["step_parts"]
    assert sorted(parts) == sorted(stored)
    assert all(parts[k] == stored[k] for k in stored)
    assert sorted(new["meta"]["test"]["step_parts"]) == sorted(checkpoint["meta"]["test"]["step_parts"])
    assert lines[-1].startswith("kept as stored") and "input_dist" in lines[-1]
    with pytest.raises(ShardingError, match="no `collect step` samples"):
        refit(checkpoint, [r for r in read_rows(data / "cpu_step.jsonl.gz") if r["kind"] == "nothing"])


def test_a_model_without_replica_parts_refuses_to_price_a_data_parallel_table() -> None:
    """Never a free replica: a model without the data-parallel parts (as intel_xeon.pt was
    before its dp rows) prices a plan with a replicated table by an error naming the table
    and the commands that measure the parts; the CPU model prices the same plan."""
    from dataclasses import replace

    from torchrec_neuroshard.costmodel import load_pretrained
    from torchrec_neuroshard.heuristics import baseline_plan
    from torchrec_neuroshard.lab.workloads import generate_task, synthetic_pool
    from torchrec_neuroshard.stepcost import predict_step
    from torchrec_neuroshard.types import TablePlacement

    task = generate_task(synthetic_pool(), 6, 2, WorkloadScale(), seed=0)
    plan = baseline_plan("size", task)
    replicated = task.tables[0].name
    plan = replace(plan, placements=tuple(TablePlacement.data_parallel(p.table) if p.table == replicated else p for p in plan.placements))
    model = load_pretrained("cpu").with_batch_size(task.batch_size)
    bare = NeuralCostModel(model.compute_net, model.compute_norm, model.comm, {**model.meta, "step_parts": None}, model.batch_scale, model.sequence)
    with pytest.raises(ShardingError, match=rf"\({replicated}\).*collect step --kinds dp"):
        predict_step(bare, task, plan)
    assert predict_step(model, task, plan).parts["dp_fwd"][0] > 0
