"""The comparison benchmark end to end on two tiny tasks: plan, measure, report, plot; the
training-step benchmark's quick mode; both with a calibrated model's planner added."""

import gzip
import itertools
import json
import statistics
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from benchmarks.compare import PLANNERS, make_suite, plot, run, save_suite, summarize, write_report
from torchrec_neuroshard.costmodel import NeuralCostModel, load_pretrained
from torchrec_neuroshard.lab.fine_tune import fine_tune
from torchrec_neuroshard.lab.collect import iter_kind, read_rows
from torchrec_neuroshard.lab.workloads import WorkloadScale
from torchrec_neuroshard.types import ShardingError

CPU_COMPUTE = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data" / "cpu_compute.jsonl.gz"


@pytest.fixture(scope="module")
def calibrated_file(tmp_path_factory) -> Path:
    """A real (if barely) calibrated model file: the shipped CPU model fine-tuned for 2
    epochs on 12 of its own training samples, labelled with its own hardware."""
    base = load_pretrained("cpu")
    with gzip.open(CPU_COMPUTE, "rt") as f:
        rows = list(itertools.islice(iter_kind(map(json.loads, f), "compute"), 12))
    rows = [dict(r, hardware=base.meta["hardware"]) for r in rows]
    path = tmp_path_factory.mktemp("calibrated") / "cpu_calibrated.pt"
    fine_tune(base, rows, epochs=2, progress=False).save(path)
    return path


@pytest.mark.measure
def test_compare_runs_end_to_end_on_two_tiny_tasks(tmp_path) -> None:
    tasks = make_suite(1, sizes=((6, 2), (8, 2)), scale=WorkloadScale(row_divisor=1024, batch_size=512))
    # the second task's cap holds 0.9 x an even share of its memory (as TorchRec counts it):
    # no whole-table plan fits, TorchRec's planner finds none, and its plan at its default
    # topology memory is recorded beside that result
    memory = [t.memory_bytes(tasks[1].batch_size, 2) for t in tasks[1].tables]
    tasks[1] = replace(tasks[1], memory_cap_bytes=int(max(1.01 * max(memory), 0.9 * sum(memory) / 2)))
    rows = run(tasks, tmp_path / "r.jsonl", rounds=1, progress=False)
    assert len(rows) == 2 * len(PLANNERS) + 1
    by = {(r["task"], r["planner"]): r for r in rows}
    assert by[0, "torchrec"]["status"] == "ok"
    assert by[1, "torchrec"]["status"].startswith("invalid: PlannerError")
    assert (1, "torchrec_default_memory") in by and (0, "torchrec_default_memory") not in by
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["planner"] for r in ok} >= {"neuroshard", "torchrec", "size"}
    for r in ok:
        assert r["cost_ms"] > 0 and len(r["per_device"]) == 2
    # resuming finds both tasks done and measures nothing again
    assert run(tasks, tmp_path / "r.jsonl", rounds=1, progress=False) == rows
    table, headline = summarize(rows)
    assert "| 6, 2 | NeuroShard |" in table and headline["tasks"] == 2
    # the headline ratio is task 0's measured costs' (task 1's TorchRec plan is invalid)
    ratio = by[0, "neuroshard"]["cost_ms"] / by[0, "torchrec"]["cost_ms"]
    assert headline["tasks_both_valid"] == 1 and headline["neuroshard_over_torchrec_geomean"] == pytest.approx(ratio)
    text = write_report(rows, tmp_path)
    assert f"over the 1 of 2 tasks where TorchRec's plan fit the memory cap: **{ratio:.3f}**" in text
    assert all(p.stat().st_size > 1000 for p in plot(rows, tmp_path))


@pytest.mark.dmp
def test_dmp_step_quick_mode_runs_every_plan_under_dmp(tmp_path) -> None:
    from torchrec_neuroshard.lab.dmp_model import generated_tasks
    from torchrec_neuroshard.lab.dmp_measure import PLANNERS, run
    from torchrec_neuroshard.lab.dmp_report import report
    from benchmarks.dmp_step import QUICK_CONFIG, QUICK_SCALE, QUICK_TABLES

    tasks = generated_tasks(QUICK_TABLES, [0], 2, QUICK_SCALE)
    rows = run(tasks, QUICK_CONFIG, out=tmp_path / "steps.jsonl.gz", progress=False)
    written = read_rows(tmp_path / "steps.jsonl.gz")
    assert [(r["task"], r["planner"], r["config"]) for r in written] == [(r["task"], r["planner"], asdict(QUICK_CONFIG)) for r in rows]
    for label in ("T6_D2_pool0", "T10_D2_pool0"):
        by_planner = {r["planner"]: r for r in rows if r["task"] == label}
        assert set(PLANNERS) <= set(by_planner)
        ran = [r for r in by_planner.values() if r["status"] == "ok"]
        # every planner's plan ran; TorchRec's may be "no plan within the cap", then its
        # default-memory plan ran instead
        assert {r["planner"] for r in ran} >= set(PLANNERS) - {"torchrec"}
        assert "torchrec" in {r["planner"] for r in ran} or by_planner["torchrec_default_memory"]["status"] == "ok"
        for r in ran:
            assert r["sharded_modules"] == QUICK_CONFIG.num_ebcs  # both EBCs sharded by DMP
            assert r["steps"] == QUICK_CONFIG.steps
            assert r["step_ms"] > 0 and r["step_iqr_ms"] >= 0
            assert 0 < r["embedding_ms"] <= r["step_ms"] and 0 < r["embedding_share"] <= 1
    assert "| T10_D2_pool0 | neuroshard |" in report(rows)


@pytest.mark.measure
def test_compare_calibrated_option_adds_its_planner_records_the_file_and_reports_it(calibrated_file, tmp_path, capsys) -> None:
    from benchmarks.compare import CALIBRATED, main

    suite = tmp_path / "suite.json"
    save_suite(make_suite(1, sizes=((6, 2),), scale=WorkloadScale(row_divisor=1024, batch_size=512)), suite)
    args = ["--suite", str(suite), "--out", str(tmp_path), "--rounds", "1", "--planners", "neuroshard,torchrec,size", "--allow-mismatch"]
    main([*args, "--calibrated", str(calibrated_file)])
    rows = [json.loads(line) for line in (tmp_path / "compare.jsonl").read_text().splitlines()]
    cal = next(r for r in rows if r["planner"] == CALIBRATED)
    assert cal["status"] == "ok" and cal["cost_model_file"]["path"] == str(calibrated_file)
    assert len(cal["cost_model_file"]["sha256"]) == 16
    assert all("cost_model_file" not in r for r in rows if r["planner"] != CALIBRATED)
    text = (tmp_path / "compare.md").read_text()
    assert "| 6, 2 | NeuroShard, calibrated model |" in text
    assert "the cheapest of all planners measured on" in text and "(the calibrated variant left out)" in text
    assert f"NeuroShard with the calibrated model (`{calibrated_file}` (sha256 {cal['cost_model_file']['sha256']}))" in text
    assert "calibrated / shipped model, geomean" in text

    other = tmp_path / "other.pt"
    model = NeuralCostModel.load(calibrated_file)
    model.meta["calibration"] = dict(model.meta["calibration"], note="another file")
    model.save(other)  # another calibrated file: resuming the results with it is refused
    with pytest.raises(ShardingError, match="pass that model file to --calibrated to resume"):
        main([*args, "--calibrated", str(other)])
    with pytest.raises(ShardingError, match="not a calibrated model"):
        main([*args, "--calibrated", str(Path(__file__).parents[1] / "torchrec_neuroshard" / "pretrained" / "cpu.pt")])


@pytest.mark.dmp
def test_dmp_step_calibrated_option_runs_its_plan_beside_the_others(calibrated_file, tmp_path, capsys) -> None:
    from torchrec_neuroshard.lab.planners import CALIBRATED
    from torchrec_neuroshard.lab.dmp_report import summary
    from benchmarks.dmp_step import main

    main(["--quick", "--planners", "neuroshard,torchrec,size", "--calibrated", str(calibrated_file), "--out", str(tmp_path), "--allow-mismatch"])
    rows = read_rows(tmp_path / "dmp_step_quick.jsonl.gz")
    cal = [r for r in rows if r["planner"] == CALIBRATED]
    assert len(cal) == 2 and all(r["status"] == "ok" and r["cost_model_file"]["path"] == str(calibrated_file) for r in cal)
    s = summary(rows)
    step = {}  # task -> planner -> step ms
    for r in rows:
        if r["status"] == "ok":
            step.setdefault(r["task"], {})[r["planner"]] = r["step_ms"]
    # the ratios are the geomeans of the measured steps, over the tasks both planners ran
    for rival in ("torchrec", "neuroshard"):
        pairs = [v[CALIBRATED] / v[rival] for v in step.values() if CALIBRATED in v and rival in v]
        assert pairs and s[f"{CALIBRATED}_over_{rival}"] == pytest.approx(statistics.geometric_mean(pairs))
    for name, rival in (("neuroshard", CALIBRATED), (CALIBRATED, "neuroshard")):  # each leaves the other out
        both = [v for v in step.values() if name in v and "torchrec" in v]
        assert s[f"{name}_fastest"] == sum(v[name] < min(ms for p, ms in v.items() if p not in (name, rival)) for v in both)
    text = (tmp_path / "dmp_step_quick.md").read_text()
    assert "| T10_D2_pool0 | neuroshard_calibrated |" in text
    assert "- NeuroShard fastest of all planners (the calibrated variant left out) on" in text
    assert f"- NeuroShard with the calibrated model (`{calibrated_file}` (sha256 {cal[0]['cost_model_file']['sha256']})) fastest" in text


def test_a_variants_fastest_count_leaves_the_other_variant_out() -> None:
    from torchrec_neuroshard.lab.planners import CALIBRATED
    from torchrec_neuroshard.lab.dmp_report import summary

    def row(planner: str, ms: float) -> dict:
        return {"task": "t", "planner": planner, "status": "ok", "step_ms": ms, "predicted_ms": ms}

    rows = [row("neuroshard", 2.0), row(CALIBRATED, 1.0), row("torchrec", 3.0), row("size", 4.0)]
    s = summary(rows)
    assert s["neuroshard_fastest"] == 1 and s[f"{CALIBRATED}_fastest"] == 1
    assert s[f"{CALIBRATED}_over_neuroshard"] == 0.5 and s["neuroshard_over_best_heuristic"] == 0.5
    assert "neuroshard_calibrated_tasks" not in summary(rows[:1] + rows[2:])


def test_paired_bootstrap_resamples_a_tasks_plans_by_the_same_steps() -> None:
    from torchrec_neuroshard.lab.dmp_report import _spread_lines, paired_bootstrap

    drift = [50.0 + 100.0 * ((7 * k) % 11) / 10 for k in range(20)]  # step times that drift a lot, alike for every plan

    def row(task: str, planner: str, scale: float) -> dict:
        samples = [scale * d for d in drift]
        return {"task": task, "planner": planner, "status": "ok", "step_ms": scale * statistics.median(drift),
                "step_samples_ms": samples, "predicted_ms": scale}  # fmt: skip

    rows = [row("a", "neuroshard", 0.97), row("a", "torchrec", 1.0), row("a", "size", 1.1)]
    rows += [row("b", "neuroshard", 1.05), row("b", "torchrec", 1.2), row("b", "lookup", 1.0)]
    b = paired_bootstrap(rows, draws=200)
    # the drift is shared by a task's plans, so every draw keeps their ratios exactly
    assert b["over_torchrec_interval"] == pytest.approx(((0.97 * 1.05 / 1.2) ** 0.5,) * 2)
    assert b["fastest_interval"] == (1.0, 1.0)
    assert b["per_task"]["a"] == {"fastest_other": "torchrec", "ratio": pytest.approx(0.97), "ratio_interval": pytest.approx((0.97, 0.97)), "fastest_share": 1.0}
    assert b["per_task"]["b"]["fastest_other"] == "lookup" and b["per_task"]["b"]["fastest_share"] == 0.0
    assert "| b | lookup | 1.050 | 1.050-1.050 | 0% |" in _spread_lines(rows)

    noisy = [dict(r, step_samples_ms=[s * (1 + 0.3 * ((k * (i + 3)) % 5 - 2) / 2) for k, s in enumerate(r["step_samples_ms"])]) for i, r in enumerate(rows)]
    low, high = paired_bootstrap(noisy, draws=200)["per_task"]["a"]["ratio_interval"]
    assert low < high  # plans' own noise, not shared, widens the interval


def test_step_session_drift_matches_each_sample_to_its_stored_draw() -> None:
    from studies.step_session_drift import drift

    stored = [
        {"kind": "all_reduce", "world_size": 2, "group": 0, "max_ms": 4.0},
        {"kind": "all_reduce", "world_size": 2, "group": 1, "max_ms": 10.0},
        {"kind": "dp", "world_size": 2, "group": 0, "fwd_ms": 1.0, "bwd_ms": 3.0},
    ]
    now = [
        {"kind": "all_reduce", "world_size": 2, "group": 1, "max_ms": 15.0},
        {"kind": "dp", "world_size": 2, "group": 0, "fwd_ms": 2.0, "bwd_ms": 6.0},
        {"kind": "dp", "world_size": 2, "group": 7, "fwd_ms": 2.0, "bwd_ms": 6.0},  # never stored: left out
    ]
    assert drift(now, stored) == {("all_reduce", 2): [1.5], ("dp", 2): [2.0]}


def test_step_session_drift_refuses_a_file_with_no_stored_draw(tmp_path, capsys) -> None:
    from studies.step_session_drift import main

    missing = tmp_path / "never_collected.jsonl"
    with pytest.raises(SystemExit):
        main([str(missing)])
    assert f"no sample of {missing} is one of" in capsys.readouterr().err
