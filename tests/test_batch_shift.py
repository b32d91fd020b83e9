"""The batch shift of a net trained at one batch (``costmodel.batchshift``): learned on
kernels at other batches with the net frozen, 0 at the net's batch, carried by every model
derived from it, through the model file and calibration; refused where it cannot apply."""

import numpy as np
import pytest
import torch

from benchmarks.costmodel import _batch_shift_table
from tests.test_batch_feature import _rows_across_batches
from torchrec_neuroshard.costmodel import NeuralCostModel
from torchrec_neuroshard.costmodel.batchshift import BatchShift
from torchrec_neuroshard.costmodel.modelfile import FORMAT_VERSION
from torchrec_neuroshard.costmodel.nets import KernelNet
from torchrec_neuroshard.lab.batch_shift import with_batch_shift
from torchrec_neuroshard.lab.collect import shard_from_record
from torchrec_neuroshard.lab.fine_tune import fine_tune
from torchrec_neuroshard.lab.pretrain import pretrain
from torchrec_neuroshard.lab.workloads import WorkloadScale, synthetic_pool, table_spec
from torchrec_neuroshard.types import Shard, ShardingError

REFERENCE = 4096


@pytest.fixture(scope="module")
def shifted() -> NeuralCostModel:
    """A net trained at batch 4,096 with a shift learned at 256-65,536 (times grow as batch^1.4)."""
    base = _rows_across_batches(300, seed=1, batches=(REFERENCE, REFERENCE))
    return pretrain(base, epochs=40, progress=False, batch_shift_rows=_rows_across_batches(800))


def _error_slope(model: NeuralCostModel, rows: list[dict]) -> float:
    """The slope of log priced / measured over log batch across ``rows``."""
    priced = [model.kernel_ms([shard_from_record(s) for s in r["shards"]], r["batch_size"]) for r in rows]
    error = np.log(np.asarray(priced) / [r["fwd_ms"] + r["bwd_ms"] for r in rows])
    return float(np.polyfit(np.log([r["batch_size"] for r in rows]), error, 1)[0])


def _shards() -> list[Shard]:
    pool = synthetic_pool()
    return [Shard(table_spec(pool[t], w, WorkloadScale(64, REFERENCE)), w) for t, w in ((5, 32), (40, 128), (300, 8))]


@pytest.mark.slow
def test_the_shift_learns_what_linear_scaling_misses_and_leaves_the_reference_batch_alone(shifted) -> None:
    assert set(shifted.meta["test"]["batch_shift"]) == {"samples", "mape_total_linear", "mape_total"}
    record = shifted.meta["batch_shift"]
    assert record["reference_batch"] == REFERENCE and 256 <= record["batch_sizes_trained"][0] < 300
    plain, shards = shifted.without_batch_shift(), _shards()
    # batch^1.4: priced linearly, the log error falls with the log batch; the shift flattens it
    slope = {id(m): _error_slope(m, _rows_across_batches(150, seed=5)) for m in (shifted, plain)}
    assert slope[id(plain)] < -0.2 and abs(slope[id(shifted)]) < 0.5 * abs(slope[id(plain)])
    assert shifted.kernel_ms(shards, REFERENCE) == plain.kernel_ms(shards, REFERENCE)  # bit for bit
    for batch in (512, 32_768):
        assert abs(shifted.kernel_ms(shards, batch) / plain.kernel_ms(shards, batch) - 1) > 0.05
    # beyond the batches it learned, the shift is held at the nearest and the linear factor carries on
    high = record["batch_sizes_trained"][1]
    ratio = shifted.kernel_ms(shards, 4 * high) / shifted.kernel_ms(shards, high)
    assert ratio == pytest.approx(4, rel=1e-5)
    assert "moved by its batch shift (learned at " in shifted.batch_note(512)


@pytest.mark.slow
def test_every_derived_model_and_the_model_file_keep_the_shift(shifted, tmp_path) -> None:
    shards, batch = _shards(), 1000
    want = shifted.kernel_ms(shards, batch)
    derived = [
        shifted.with_batch_size(batch), shifted.with_meta(dict(shifted.meta)), shifted.for_tables([s.table for s in shards]),
        shifted.with_comm(shifted.comm) if shifted.comm is not None else shifted,
    ]  # fmt: skip
    shifted.save(tmp_path / "m.pt")
    derived.append(NeuralCostModel.load(tmp_path / "m.pt"))
    for model in derived:
        assert model.batch_shift is not None and model.kernel_ms(shards, batch) == want
    assert torch.load(tmp_path / "m.pt", weights_only=True)["format_version"] == FORMAT_VERSION >= 6  # the shift came in 6


@pytest.mark.slow
def test_calibration_keeps_the_shift_around_the_batch_it_tunes_at(shifted) -> None:
    here = 8192
    rows = [{**r, "hardware": {"device": "cpu", "device_name": "x"}} for r in _rows_across_batches(60, seed=2, batches=(here, here))]
    tuned = fine_tune(shifted, rows, epochs=3, progress=False)
    assert tuned.pooled_kernel.batch_shift.reference_batch == here == tuned.pooled_kernel.batch_sizes_trained[0]
    shards = _shards()
    assert tuned.kernel_ms(shards, here) == tuned.without_batch_shift().kernel_ms(shards, here)  # 0 at the tuned batch
    assert tuned.kernel_ms(shards, 512) != tuned.without_batch_shift().kernel_ms(shards, 512)
    # device pairs at other batches are learned through the frozen shift (a base pricing them linearly is refused)
    pairs = [
        {**r, "batch_size": b, "group": 700_000 + i // 2, "pair": i // 2, "pair_member": i % 2, "hardware": rows[0]["hardware"]}
        for i, (r, b) in enumerate(zip(_rows_across_batches(40, seed=6), [512, 512, 32_768, 32_768] * 10))
    ]  # fmt: skip
    paired = fine_tune(shifted, rows + pairs, epochs=3, progress=False)
    assert paired.meta["calibration"]["device_pairs"] == 20 and paired.pooled_kernel.batch_sizes_trained == (here, here)
    with pytest.raises(ShardingError, match="prices other batches linearly"):
        fine_tune(shifted.without_batch_shift(), rows + pairs, epochs=1, progress=False)


def test_a_shift_needs_a_net_of_one_batch_and_data_at_other_batches() -> None:
    across = pretrain(_rows_across_batches(60), epochs=2, progress=False)  # a net reading the batch
    with pytest.raises(ShardingError, match="--batch-shift-data"):
        with_batch_shift(across, _rows_across_batches(60), epochs=1, progress=False)
    one = pretrain(_rows_across_batches(60, batches=(REFERENCE, REFERENCE)), epochs=2, progress=False)
    with pytest.raises(ShardingError, match="no pooled compute kernels at a batch other than the net's 4,096"):
        with_batch_shift(one, _rows_across_batches(60, seed=3, batches=(REFERENCE, REFERENCE)), epochs=1, progress=False)
    shift = with_batch_shift(one, _rows_across_batches(60), epochs=1, progress=False).pooled_kernel.batch_shift
    kernel = across.pooled_kernel
    with pytest.raises(ValueError, match="shifts a net trained at that one batch alone"):
        KernelNet(kernel.net, kernel.norm, 15, (4,), None, kernel.batch_sizes_trained, None, shift)
    with pytest.raises(ShardingError, match="positive reference batch"):
        BatchShift(shift.net, shift.norm, 0, (256, 512))
    assert np.isfinite(one.kernel_ms(_shards(), 512))


@pytest.mark.slow
def test_the_accuracy_benchmark_scores_the_shift_on_its_own_files_only(shifted, capsys) -> None:
    _batch_shift_table(shifted, _rows_across_batches(100, seed=4), seed=0)
    printed = capsys.readouterr().out
    assert "other batches through its batch shift (" in printed and "other batches linear from 4,096 (" in printed
    with pytest.raises(SystemExit, match="this model has a batch shift"):
        _batch_shift_table(shifted, [], seed=0)
    with pytest.raises(SystemExit, match="this model has no batch shift"):
        _batch_shift_table(shifted.without_batch_shift(), _rows_across_batches(10), seed=0)
