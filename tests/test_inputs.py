"""Bad input from a user: a one-line error naming the value and the fix (the CLI: exit 2,
no traceback), never silent garbage."""

import dataclasses
import gzip
import itertools
import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import torchrec_neuroshard
from torchrec_neuroshard.cli import main
from torchrec_neuroshard.costmodel import check_world_size, load_pretrained
from torchrec_neuroshard.costmodel.features import SHARD_FEATURES
from torchrec_neuroshard.lab.pretrain import MIN_SAMPLES, pretrain
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.types import ShardingError, TableSpec, Task

HIST = (1.0,) + (0.0,) * 16
REPO = Path(torchrec_neuroshard.__file__).resolve().parent.parent
SUITE = REPO / "benchmarks" / "tasks" / "suite.json"
CPU_COMPUTE = REPO / "torchrec_neuroshard" / "lab" / "data" / "cpu_compute.jsonl.gz"


def task_dict() -> dict:
    table = {"name": "t", "rows": 100, "dim": 8, "pooling_factor": 2.0, "access_hist": list(HIST)}
    return {"num_devices": 2, "memory_cap_bytes": 10**6, "batch_size": 64, "tables": [table]}


@pytest.mark.parametrize(
    "hist, message",
    [
        ((math.nan,) + (0.0,) * 16, r"table 't': access_hist bin 0 is nan; .*re-measure it with access.profile_batches"),
        ((0.5, math.inf) + (0.0,) * 15, r"table 't': access_hist bin 1 is inf"),
        ((1.5, -0.5) + (0.0,) * 15, r"table 't': access_hist bin 1 is -0.5"),
        ((3.0, 1.0) + (0.0,) * 15, r"table 't': access_hist sums to 4, not 1.*normalise it: divide every bin by 4"),
        ((0.0,) * 17, r"table 't': access_hist sums to 0, not 1.*re-measure it"),
    ],
)
def test_nan_or_unnormalised_access_histograms_are_refused(hist, message) -> None:
    with pytest.raises(ShardingError, match=message):
        TableSpec("t", 100, 8, 2.0, hist)


def test_rounded_histograms_are_accepted() -> None:
    rounded = tuple(round(x, 5) for x in (1 / 3, 1 / 3, 1 / 3)) + (0.0,) * 14  # sums to 0.99999
    assert TableSpec("t", 100, 8, 2.0, rounded).access_hist == rounded
    assert len(Task.load_all(SUITE)) == 20  # the shipped suite's histograms are rounded too


@pytest.mark.parametrize("value", [1.7, True, "100", None])
def test_a_non_integral_row_count_is_refused_not_truncated(value) -> None:
    with pytest.raises(ShardingError, match=rf"table 't': rows must be a whole number, got {value!r}"):
        TableSpec("t", value, 8, 2.0, HIST)
    d = task_dict()
    d["tables"][0]["rows"] = value
    with pytest.raises(ShardingError, match=r"table 't': rows must be a whole number"):
        Task.from_json(json.dumps(d))


@pytest.mark.parametrize("field", ["num_devices", "memory_cap_bytes", "batch_size"])
def test_task_numbers_must_be_whole(field) -> None:
    d = task_dict()
    d[field] = 2.5
    with pytest.raises(ShardingError, match=rf"the task's {field} must be a whole number, got 2.5"):
        Task.from_json(json.dumps(d))
    d[field] = 2.0  # a whole number written as a float (1e9 in JSON) is that number
    assert getattr(Task.from_json(json.dumps(d)), field) == 2 and isinstance(getattr(Task.from_json(json.dumps(d)), field), int)


def test_task_dim_and_bytes_per_element_must_be_whole() -> None:
    for field in ("dim", "bytes_per_element"):
        d = task_dict()
        d["tables"][0][field] = 4.5
        with pytest.raises(ShardingError, match=rf"table 't': {field} must be a whole number, got 4.5"):
            Task.from_json(json.dumps(d))


def test_a_missing_field_is_named(tmp_path) -> None:
    d = task_dict()
    del d["tables"][0]["dim"]
    with pytest.raises(ShardingError, match=r"the task, table 0 has no 'dim' field; add it"):
        Task.from_json(json.dumps(d))
    d["tables"][0]["dim"] = 8
    del d["batch_size"]
    (tmp_path / "task.json").write_text(json.dumps(d))
    with pytest.raises(ShardingError, match=r"task.json has no 'batch_size' field"):
        Task.load(tmp_path / "task.json")


def test_task_files_missing_malformed_or_a_suite(tmp_path) -> None:
    with pytest.raises(ShardingError, match=r"task file '.*nope.json' does not exist"):
        Task.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{\"num_devices\": 2,")
    with pytest.raises(ShardingError, match=r"task file '.*bad.json' is not valid JSON: "):
        Task.load(tmp_path / "bad.json")
    with pytest.raises(ShardingError, match=r"suite.json holds 20 tasks, not one; read it with Task.load_all"):
        Task.load(SUITE)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("pooling_factor", "2", r"pooling factor must be finite and >= 0, got '2'"),
        ("access_hist", 1.0, r"access_hist needs 17 bins, got 1.0"),
        ("access_hist", [0.5, 0.5], r"access_hist needs 17 bins, got 2"),
        ("access_hist", ["1"] + [0] * 16, r"access_hist bin 0 is '1'"),
    ],
)
def test_a_table_field_of_the_wrong_type_is_named(field, value, message) -> None:
    d = task_dict()
    d["tables"][0][field] = value
    with pytest.raises(ShardingError, match=rf"table 't': {message}"):
        Task.from_json(json.dumps(d))


# ---------------------------------------------------------------- the neuroshard command


def neuroshard(*argv: str, cwd: Path = REPO, pythonpath: Path = REPO) -> subprocess.CompletedProcess:
    """The command as a user runs it: its own process, exit code and stderr."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [sys.executable, "-m", "torchrec_neuroshard.cli", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("neuroshard: error: "), err
    return err


def compute_rows(n: int) -> list[dict]:
    """The first ``n`` measured compute samples of the shipped CPU dataset."""
    with gzip.open(CPU_COMPUTE, "rt") as f:
        return [r for r in map(json.loads, itertools.islice(f, 3 * n)) if r["kind"] == "compute"][:n]


def test_a_bad_task_file_is_one_line_and_exit_2_without_a_traceback(tmp_path) -> None:
    run = neuroshard("plan", str(tmp_path / "missing.json"))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr == f"neuroshard: error: task file '{tmp_path / 'missing.json'}' does not exist (or is not a file)\n"


def test_plan_names_malformed_json_and_missing_fields(tmp_path, capsys) -> None:
    (tmp_path / "bad.json").write_text("{\"num_devices\": 2,")
    assert main(["plan", str(tmp_path / "bad.json")]) == 2
    assert "bad.json' is not valid JSON: Expecting property name" in error_line(capsys)
    d = task_dict()
    del d["tables"][0]["pooling_factor"]
    (tmp_path / "task.json").write_text(json.dumps(d))
    assert main(["plan", str(tmp_path / "task.json")]) == 2
    assert "task.json, table 0 has no 'pooling_factor' field; add it" in error_line(capsys)
    d = task_dict()
    d["tables"][0]["rows"] = 1.7
    (tmp_path / "task.json").write_text(json.dumps(d))
    assert main(["plan", str(tmp_path / "task.json")]) == 2
    assert "table 't': rows must be a whole number, got 1.7" in error_line(capsys)


def test_plan_plans_every_task_of_a_suite_or_the_one_indexed(tmp_path, capsys) -> None:
    pool = synthetic_pool()
    tasks = [json.loads(generate_task(pool, 6, 2, WorkloadScale(), seed=s).to_json()) for s in (1, 2)]
    (tmp_path / "suite.json").write_text(json.dumps(tasks))
    assert main(["plan", str(tmp_path / "suite.json"), "--planner", "size", "--out", str(tmp_path / "plans.json")]) == 0
    out = capsys.readouterr().out
    assert "size plan of task 0" in out and "size plan of task 1" in out and "plans written to" in out
    assert [len(p["placements"]) for p in json.loads((tmp_path / "plans.json").read_text())] == [6, 6]
    assert main(["plan", str(SUITE), "--index", "3", "--planner", "size"]) == 0  # the shipped suite
    assert "size plan of task 3" in capsys.readouterr().out
    assert main(["plan", str(SUITE), "--index", "20"]) == 2
    assert "--index 20 is out of range: " in error_line(capsys)


def test_plan_refuses_a_world_size_far_beyond_the_comm_models(tmp_path, capsys) -> None:
    model = load_pretrained()
    trained = model.meta["world_sizes_trained"]
    far = 4 * max(trained) + 1
    with pytest.raises(ShardingError, match=rf"world size {far} is far beyond .*{trained}.*--world-size {far}"):
        check_world_size(model, far)
    check_world_size(model, 4 * max(trained))  # extrapolating up to 4x is allowed (a warning)
    task = generate_task(synthetic_pool(), 6, 2, WorkloadScale(), seed=1)
    dataclasses.replace(task, num_devices=far).save(tmp_path / "task.json")
    assert main(["plan", str(tmp_path / "task.json"), "--planner", "size"]) == 2
    assert f"world size {far} is far beyond" in error_line(capsys)


@pytest.mark.slow
def test_bench_runs_from_any_directory_of_a_checkout_and_says_when_there_is_none(tmp_path) -> None:
    run = neuroshard("bench", "search_speed", "--help", cwd=tmp_path)
    assert run.returncode == 0 and run.stdout.startswith("usage: search_speed"), run.stderr
    installed = tmp_path / "site-packages"  # the package alone, as a wheel installs it
    shutil.copytree(REPO / "torchrec_neuroshard", installed / "torchrec_neuroshard", ignore=shutil.ignore_patterns("data", "*.pt", "__pycache__"))
    run = neuroshard("bench", "compare", cwd=tmp_path, pythonpath=installed)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.startswith("neuroshard: error: `neuroshard bench` runs the benchmarks of the repository checkout")


# ---------------------------------------------------------------- pretrain


def test_pretrain_refuses_a_missing_or_unreadable_data_file(tmp_path, capsys) -> None:
    out = tmp_path / "m.pt"
    assert main(["pretrain", "--data", str(CPU_COMPUTE), str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "data file '" + str(tmp_path / "missing.jsonl") + "' does not exist" in error_line(capsys)
    (tmp_path / "junk.jsonl.gz").write_text("not gzip\n")
    assert main(["pretrain", "--data", str(tmp_path / "junk.jsonl.gz"), "--out", str(out)]) == 2
    assert "junk.jsonl.gz' is not a readable JSONL(.gz) dataset" in error_line(capsys)
    assert not out.exists()


def test_pretrain_refuses_too_few_samples_to_split(tmp_path, capsys) -> None:
    data, out = tmp_path / "nine.jsonl", tmp_path / "m.pt"
    data.write_text("".join(json.dumps(r) + "\n" for r in compute_rows(9)))
    assert main(["pretrain", "--data", str(data), "--out", str(out), "--epochs", "1"]) == 2
    err = error_line(capsys)
    assert "9 compute samples are too few to split 80/10/10" in err and f"--samples {MIN_SAMPLES}" in err
    assert not out.exists()


def test_pretrain_never_returns_a_model_with_nan_metrics() -> None:
    rows = [{**r, "fwd_ms": math.nan} for r in compute_rows(MIN_SAMPLES)]
    with pytest.raises(ShardingError, match=r"test metric compute.mape_total is nan, so the trained model is not returned"):
        pretrain(rows, epochs=1, progress=False)


# ---------------------------------------------------------------- our estimator in TorchRec's planner


@pytest.mark.parametrize("batch", [0, -8, 1.5, True])
def test_the_estimators_refuse_a_bad_batch_instead_of_a_default(batch) -> None:
    from torchrec.distributed.planner.types import Topology

    from torchrec_neuroshard.estimators import NeuralPerfEstimator, NeuralPerfModel

    topology = Topology(world_size=2, compute_device="cpu")
    for cls in (NeuralPerfEstimator, NeuralPerfModel):
        with pytest.raises(ShardingError, match=rf"batch_size must be a positive int \(the per-rank batch.*got {batch!r}"):
            cls(topology, batch_size=batch)


def test_a_table_whose_predicted_cost_overflows_is_named_not_planned_with_nan(tmp_path, capsys) -> None:
    """4 rows read 100,000 times per sample: far outside the kernels the model learned. The
    bare nets (a model file without feature ranges) overflow on it: the search, and the CLI
    on such a task, refuse it by name instead of returning a plan whose predicted cost is
    NaN. The shipped model, clamped into its ranges, prices it linearly in its lookups:
    567 times the most-read table it learned, seconds."""
    import torch

    from torchrec_neuroshard.access import uniform_access_histogram
    from torchrec_neuroshard.costmodel import PRETRAINED_DIR, NeuralCostModel
    from torchrec_neuroshard.search import search
    from torchrec_neuroshard.types import Shard

    base = generate_task(synthetic_pool(), 6, 2, WorkloadScale(), seed=3)
    bad = TableSpec("bad", 4, 128, 100_000.0, tuple(uniform_access_histogram(4, 100_000.0 * base.batch_size)))
    task = Task(base.tables + (bad,), 2, 10**11, base.batch_size)
    blob = torch.load(PRETRAINED_DIR / "cpu.pt", weights_only=True)
    for part in (blob["meta"], blob["meta"]["sequence"]):
        del part["feature_range"]
    bare = tmp_path / "bare.pt"
    torch.save(blob, bare)
    with pytest.raises(ShardingError, match=r"tables \['bad'\]: not finite.*'bad': 100000 lookups per sample on 4 rows"):
        search(task, NeuralCostModel.load(bare))
    path = tmp_path / "task.json"
    task.save(path)
    assert main(["plan", str(path), "--model", str(bare)]) == 2
    assert "neuroshard: error: the cost model predicts" in capsys.readouterr().err
    assert 1_000 < sum(load_pretrained("cpu").compute_cost([[Shard(bad, 128)]])[0]) < 100_000


def test_a_table_far_outside_the_training_data_is_priced_as_the_nearest_learned_and_named_once(tmp_path, caplog) -> None:
    """16 rows read 40 times per sample: every row falls in the 8,192-16,384 accesses bin,
    where the CPU model's training tables had at most about 1% of theirs. A bare net once
    priced it at 778,000 ms (measured: about 2 ms at the training data's machine speed);
    clamped into the trained range it costs a few ms, and planning a task holding it logs
    one warning naming it, its features and the commands that fix the model."""
    from torchrec_neuroshard.access import uniform_access_histogram
    from torchrec_neuroshard.types import Shard

    tiny = TableSpec("tiny", 16, 128, 40.0, uniform_access_histogram(16, 40 * 4096))
    fwd, bwd = load_pretrained("cpu").compute_cost([[Shard(tiny, 128)]])[0]
    assert 0 < fwd + bwd < 100

    base = generate_task(synthetic_pool(), 6, 2, WorkloadScale(), seed=3)
    path = tmp_path / "task.json"
    Task(base.tables + (tiny,), 2, 10**11, base.batch_size).save(path)
    with caplog.at_level(logging.WARNING):
        assert main(["plan", str(path)]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert warned[0].startswith("1 table(s) lie outside the data the compute model was trained on ('tiny': log_rows 2.773")
    trained = load_pretrained("cpu").pooled_kernel.trained_range.high[SHARD_FEATURES.index("access_bin_14")]
    assert f"access_bin_14 1 (trained 0..{float(trained):.4g})" in warned[0]
    assert "`neuroshard collect compute`" in warned[0] and "`neuroshard pretrain`" in warned[0]


def test_a_tasks_modules_must_name_every_table_once() -> None:
    d = task_dict()
    d["tables"].append({**d["tables"][0], "name": "u"})
    d["modules"] = [["t"], ["u"]]
    task = Task.from_json(json.dumps(d))
    assert task.modules == (("t",), ("u",)) and Task.from_json(task.to_json()) == task
    for modules, named in [([["t", "u"], ["u"]], r"named twice or unknown \['u'\]"), ([["t"]], r"in no module \['u'\]"),
                           ([["t"], ["u", "x"]], r"unknown \['x'\]"), ([["t", "u"], []], "non-empty")]:
        d["modules"] = modules
        with pytest.raises(ShardingError, match=named):
            Task.from_json(json.dumps(d))
    for not_lists in ("tu", 5, [5]):
        d["modules"] = not_lists
        with pytest.raises(ShardingError, match="modules must be lists of table names"):
            Task.from_json(json.dumps(d))


def test_a_topology_far_beyond_the_comm_models_world_sizes_is_planned_with_the_links_stand_in(caplog) -> None:
    from torchrec.distributed.planner import Topology

    from torchrec_neuroshard.comm import AlphaBetaComm
    from torchrec_neuroshard.costmodel import NeuralComm, cost_model_for

    trained = load_pretrained().meta["world_sizes_trained"]
    near, far = 4 * max(trained), 4 * max(trained) + 8
    assert isinstance(cost_model_for(Topology(world_size=near, compute_device="cpu"), "cpu").comm, NeuralComm)
    with caplog.at_level(logging.WARNING, logger="torchrec_neuroshard.costmodel"):
        model = cost_model_for(Topology(world_size=far, compute_device="cpu", local_world_size=8), "cpu")
    assert isinstance(model.comm, AlphaBetaComm) and model.comm.local_world_size == 8
    # the step's measured collectives go too: stepcost.Collectives prices them by the links
    assert model.step_parts.has("dp_fwd", "dp_bwd") and not model.step_parts.has("input_dist")
    assert not any(model.step_parts.has(op) for op in ("all_reduce", "reduce_scatter", "all_gather"))
    assert f"world size {far} is beyond 4x" in caplog.text and f"--world-size {far}" in caplog.text
    check_world_size(model, far)  # priced by the links now: no refusal
