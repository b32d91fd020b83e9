"""The neuroshard command."""

import json

from torchrec_neuroshard.cli import main
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool


def test_plan_command_prints_the_per_rank_table_and_writes_json(tmp_path, capsys) -> None:
    task = generate_task(synthetic_pool(), 12, 2, WorkloadScale(), seed=2)
    task.save(tmp_path / "task.json")
    assert main(["plan", str(tmp_path / "task.json"), "--out", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "neuroshard plan: predicted embedding cost" in out and "searched in" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["num_devices"] == 2 and len(plan["placements"]) == 12
    assert main(["plan", str(tmp_path / "task.json"), "--planner", "size"]) == 0
    assert "size plan" in capsys.readouterr().out


def test_errors_exit_2_with_a_message(tmp_path, capsys) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["pretrain", "--data", str(empty), "--out", str(tmp_path / "m.pt")]) == 2
    assert "no samples in" in capsys.readouterr().err


def test_collect_compute_with_an_empty_table_range_is_a_clear_error(tmp_path, capsys) -> None:
    out = tmp_path / "c.jsonl"
    assert main(["collect", "compute", "--tables", "16", "8", "--samples", "1", "--out", str(out)]) == 2
    assert "tables per compute sample must be 1 <= LOW <= HIGH, got 16 8" in capsys.readouterr().err
    assert not out.exists() or out.read_text() == ""


def test_calibrate_refuses_counts_that_measure_nothing_before_writing_anything(tmp_path) -> None:
    import pytest

    data, out = tmp_path / "calib", tmp_path / "m.pt"
    base = ["calibrate", "--device", "cpu", "--data-dir", str(data), "--out", str(out)]
    with pytest.raises(SystemExit, match=r"--samples 0: calibrate fine-tunes on measured compute samples; give 1 or more"):
        main(base + ["--samples", "0"])
    with pytest.raises(SystemExit, match=r"--comm-samples 0 with --world-size: give 1 or more"):
        main(base + ["--world-size", "2", "--comm-samples", "0"])
    with pytest.raises(SystemExit, match=r"--step-samples -1: give 0"):
        main(base + ["--step-samples", "-1"])
    assert not data.exists() and not out.exists()  # no empty compute.jsonl left behind
