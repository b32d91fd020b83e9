import numpy as np

from studies.replication_worth import fit


def test_fit_recovers_the_weights_of_rest_and_replication_behind_task_intercepts() -> None:
    rng = np.random.default_rng(0)
    rows = []
    for task, intercept in enumerate((50.0, 120.0, 300.0)):
        for _ in range(12):
            rest, replication = rng.uniform(20, 100), rng.choice([0.0, rng.uniform(5, 30)])
            step = intercept + 2.0 * rest + 1.0 * replication + rng.normal(0, 0.5)
            rows.append(([float(task == k) for k in range(3)] + [rest, replication], step))
    design, step = np.asarray([r[0] for r in rows]), np.asarray([r[1] for r in rows])
    weights = fit(design, step, draws=100)
    assert abs(weights["rest"][0] - 2.0) < 0.05
    assert abs(weights["replication"][0] - 1.0) < 0.1
    assert abs(weights["ratio"][0] - 0.5) < 0.05
    assert weights["ratio"][1] <= weights["ratio"][0] <= weights["ratio"][2]


def test_a_dmp_run_is_priced_per_plan_with_one_intercept_per_task() -> None:
    from pathlib import Path

    from studies.replication_worth import priced_rows
    from torchrec_neuroshard.costmodel import load_pretrained
    from torchrec_neuroshard.lab.collect import read_rows

    path = Path(__file__).parents[1] / "benchmarks/results/dmp_step_lowdrift_heldout.jsonl.gz"
    rows = read_rows(path)[:14]  # two tasks of 7 plans
    design, step, hidden = priced_rows(rows, load_pretrained("cpu"))
    assert design.shape == (14, 2 + 2) and step.shape == hidden.shape == (14,)
    assert (hidden <= design[:, -2:].sum(1) + 1e-9).all()  # hiding the all-reduce never adds
    assert (design[:, :2].sum(1) == 1).all()
    assert (design[:, -2] > 0).all() and (design[:, -1] >= 0).all()
    # TorchRec replicates on T16 pool 2; a table-wise plan prices no replication
    planners = [r["planner"] for r in rows]
    assert design[planners.index("torchrec"), -1] > 0 and design[planners.index("size"), -1] == 0


def test_the_scaled_model_prices_replication_times_the_weight_and_nothing_else(tmp_path) -> None:
    from studies.replication_worth import REPLICATION_PARTS, write_scaled
    from torchrec_neuroshard.costmodel import NeuralCostModel, load_pretrained

    shipped = load_pretrained("cpu")
    write_scaled(load_pretrained("cpu"), 0.5, tmp_path / "scaled.pt", ["run.jsonl"])
    scaled = NeuralCostModel.load(tmp_path / "scaled.pt")
    assert scaled.meta["calibration"] == {"replication_weight": 0.5, "fitted_on": ["run.jsonl"]}
    for name, part in shipped.step_parts.parts.items():
        factor = 0.5 if name in REPLICATION_PARTS else 1.0
        assert np.allclose(scaled.step_parts.parts[name].coef, [factor * c for c in part.coef])


def test_a_run_of_task_files_is_refused_naming_the_label() -> None:
    import pytest

    from studies.dmp_ranks import task_of
    from torchrec_neuroshard.types import ShardingError

    assert task_of("T16_D2_pool4").num_devices == 2
    with pytest.raises(ShardingError, match="'my_task'.*T<tables>_D<devices>_pool<seed>"):
        task_of("my_task")
