"""The width correction of a kernel's price (``costmodel.nets.WidthCorrection``), how the
search prices devices with it, and its fit on device pairs (``lab.width_correction``)."""

from pathlib import Path

import numpy as np
import pytest

from torchrec_neuroshard.costmodel import NeuralCostModel, load_pretrained
from torchrec_neuroshard.costmodel.nets import WidthCorrection
from torchrec_neuroshard.lab.collect import shard_record
from torchrec_neuroshard.lab.width_correction import fit, mean_width, without_correction
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool, table_spec
from torchrec_neuroshard.search import predicted_breakdown
from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.types import Shard

BATCH = 4096


@pytest.fixture(scope="module")
def plain() -> NeuralCostModel:
    return load_pretrained("cpu")


def corrected(model: NeuralCostModel, slope: float, reference: float) -> NeuralCostModel:
    meta = {**model.meta, "width_correction": {"slope": slope, "reference": reference}}
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
        WidthCorrection(0.1, 0.0)


def test_the_search_prices_each_device_of_a_plan_as_a_kernel_of_its_shards_with_the_correction(plain) -> None:
    """Devices' embeddings are summed before the head (the search's pooled rows): the
    correction's lookup columns sum with them, so a device is priced as its kernel."""
    task = generate_task(synthetic_pool(), 40, 4, WorkloadScale(), seed=3)
    model = corrected(plain, 0.25, 40.0).with_batch_size(task.batch_size)
    plan = baseline_plan("size", task)
    _, devices = predicted_breakdown(model, task, plan)
    _, before = predicted_breakdown(plain.with_batch_size(task.batch_size), task, plan)
    for d, shards in enumerate(plan.device_shards(task.tables)):
        assert devices[d].compute == pytest.approx(model.kernel_ms(shards, task.batch_size), rel=1e-4)
        assert devices[d].compute / before[d].compute == pytest.approx((mean_width(shards) / 40.0) ** 0.25, rel=1e-4)


def test_the_fit_recovers_a_width_law_under_a_drift_that_each_pair_shares(plain, tmp_path: Path) -> None:
    """Kernels timed at the nets' price x (mean width / 32) ** 0.2 x a level that drifts
    from pair to pair: the fit reads the slope within pairs, and the model file keeps it."""
    rng = np.random.default_rng(1)
    rows = []
    for pair, members in enumerate(zip(*[iter(kernels(24, 1))] * 2)):
        drift = float(rng.uniform(0.5, 2.0))
        for member, shards in enumerate(members):
            ms = plain.kernel_ms(shards, BATCH) * (mean_width(shards) / 32) ** 0.2 * drift
            rows.append({"pair": pair, "pair_member": member, "batch_size": BATCH, "shards": [shard_record(s) for s in shards], "fwd_ms": ms / 3, "bwd_ms": 2 * ms / 3})
    model, record = fit(corrected(plain, -1.0, 10.0), rows)  # a correction already there is refitted, not compounded
    assert record["slope"] == pytest.approx(0.2, abs=1e-3) and record["pairs"] == 12
    assert record["pair_error_sd"]["after"] < 1e-3 < record["pair_error_sd"]["before"]
    model.save(tmp_path / "width.pt")
    loaded = NeuralCostModel.load(tmp_path / "width.pt")
    shards = kernels(1, 5)[0]
    assert loaded.kernel_ms(shards, BATCH) == pytest.approx(model.kernel_ms(shards, BATCH), rel=1e-6)
    assert without_correction(loaded).kernel_ms(shards, BATCH) == pytest.approx(plain.kernel_ms(shards, BATCH), rel=1e-6)
