"""The ensemble study's cost model prices as the search needs: additive embeddings, a
device at the geometric mean of its members (each brought to the first's level)."""

import numpy as np
import pytest

from benchmarks.scale import scale_task
from studies import ensemble
from studies.ensemble import EnsembleCostModel
from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.types import Shard


def _devices() -> list[list[Shard]]:
    pool = scale_task(8, 0).tables[:30]  # the training pool's
    return [[Shard(t, t.dim) for t in pool[i : i + 10]] for i in range(0, 30, 10)]


def test_an_ensemble_of_one_model_with_itself_prices_as_that_model_times_the_root_of_its_level() -> None:
    model = load_pretrained("cpu").with_batch_size(4096)
    alone = np.asarray(model.compute_cost(_devices()))  # [3, 2]
    assert np.allclose(EnsembleCostModel([model, model], [1.0, 1.0]).compute_cost(_devices()), alone, rtol=1e-5)
    assert np.allclose(EnsembleCostModel([model, model], [1.0, 4.0]).compute_cost(_devices()), 2 * alone, rtol=1e-5)


def test_an_ensemble_prices_the_geometric_mean_of_two_models() -> None:
    first, second = load_pretrained("cpu").with_batch_size(4096), load_pretrained("intel_xeon").with_batch_size(4096)
    a, b = np.asarray(first.compute_cost(_devices())), np.asarray(second.compute_cost(_devices()))
    both = EnsembleCostModel([first, second], [1.0, 0.5]).for_tables([s.table for d in _devices() for s in d])
    assert np.allclose(both.compute_cost(_devices()), np.sqrt(a * b * 0.5), rtol=1e-5)


def test_three_members_price_the_cube_root_of_their_product_and_a_missing_level_is_refused() -> None:
    first, second = load_pretrained("cpu").with_batch_size(4096), load_pretrained("intel_xeon").with_batch_size(4096)
    a, b = np.asarray(first.compute_cost(_devices())), np.asarray(second.compute_cost(_devices()))
    three = EnsembleCostModel([first, second, first], [1.0, 2.0, 0.5])
    assert np.allclose(three.compute_cost(_devices()), np.cbrt(a * b * 2.0 * a * 0.5), rtol=1e-5)
    with pytest.raises(ValueError, match="one level and weight a member"):
        EnsembleCostModel([first, second], [1.0])


def test_a_member_of_weight_zero_lends_its_parts_but_not_its_kernels() -> None:
    first, second = load_pretrained("cpu").with_batch_size(4096), load_pretrained("intel_xeon").with_batch_size(4096)
    b = np.asarray(second.compute_cost(_devices()))
    only_second = EnsembleCostModel([first, second], [1.0, 0.5], [0.0, 1.0])
    assert np.allclose(only_second.compute_cost(_devices()), b * 0.5, rtol=1e-5)
    assert only_second.step_parts is first.step_parts
    with pytest.raises(ValueError, match="weights >= 0"):
        EnsembleCostModel([first, second], [1.0, 1.0], [0.0, 0.0])


def test_the_deep_ensemble_without_its_trained_siblings_names_the_step_that_trains_them(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(ensemble, "SIBLINGS", tmp_path)
    with pytest.raises(FileNotFoundError, match="studies.ensemble train"):
        ensemble.member_paths(ensemble.DEEP)
    assert ensemble.member_paths(ensemble.NAME) == [None, str(ensemble.SECOND)]
