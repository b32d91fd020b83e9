"""studies.recipe_ablation: a batch-varied file's level learned apart from the net, and the
batch correction, nothing at the model's own batch (the batch shift's: tests/test_batch_shift.py)."""

import torch

import torchrec_neuroshard.lab.training as training
from studies.recipe_ablation import DATA, SESSION, KernelCorrection, file_levels
from torchrec_neuroshard.costmodel import model_named
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.training_data import load_compute_data


def test_a_free_files_level_is_learned_apart_and_dropped_after_training() -> None:
    rows = read_rows(DATA / "cpu_compute.jsonl.gz")[:60]
    slower = [{**r, "group": r["group"] + SESSION, "fwd_ms": 2 * r["fwd_ms"], "bwd_ms": 2 * r["bwd_ms"]} for r in rows]
    data = load_compute_data(rows + slower)
    predict = training._compute_predict
    with file_levels({1}, files=2):
        net, norm, _ = training.train_compute(data, data, epochs=60, seed=0, lr=1e-2, progress=False)
    assert training._compute_predict is predict and "file_levels" not in dict(net.named_parameters())
    with torch.no_grad():
        priced = training._compute_predict(net, norm, data).exp()  # [N, 2]
    # the second file's kernels are priced at the first file's level (half theirs), not between the two (1 / sqrt 2)
    assert float((priced[60:] / data.y[60:]).median()) < 0.6
    assert 0.8 < float((priced[:60] / data.y[:60]).median()) < 1.25


def test_a_batch_correction_is_nothing_at_the_models_own_batch_only() -> None:
    model = model_named("intel_xeon")  # a net that does not read the batch
    rows = [r for r in read_rows(DATA / "cpu_compute.jsonl.gz")[:20] if r["batch_size"] == model.batch_size]
    at_reference = load_compute_data(rows, reads_batch=True)
    elsewhere = load_compute_data([{**r, "batch_size": 2 * r["batch_size"]} for r in rows], reads_batch=True)
    correction = KernelCorrection(at_reference, model)
    with torch.no_grad():
        assert correction(at_reference).abs().max() < 1e-6  # float32 rounding of x + d - d
        assert correction(elsewhere).abs().min() > 0
