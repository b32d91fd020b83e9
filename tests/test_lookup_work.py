import numpy as np
import pytest

from studies.lookup_work import device_work, elasticity
from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool


def test_a_devices_lookup_work_is_its_tables_pooling_times_width() -> None:
    task = generate_task(synthetic_pool(), 12, 3, WorkloadScale(), seed=0)
    plan = baseline_plan("size", task)
    expected = np.zeros(3)
    for t in task.tables:
        (device,) = plan.placement(t.name).devices  # table-wise: one device
        expected[device] += t.pooling_factor * t.dim
    assert np.allclose(device_work(task, plan), expected)


def test_the_elasticity_is_the_slope_of_the_models_error_in_log_work() -> None:
    log_work = np.log([1.0, 2.0, 4.0, 8.0])
    log_work -= log_work.mean()
    slope, explained = elasticity(log_work, 0.3 * log_work)
    assert slope == pytest.approx(0.3) and explained == pytest.approx(1.0)
    noise = np.array([0.01, -0.02, 0.02, -0.01])
    slope, explained = elasticity(log_work, noise - noise.mean())
    assert abs(slope) < 0.02 and explained < 0.5
