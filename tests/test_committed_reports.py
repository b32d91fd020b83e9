"""Each committed report under benchmarks/results/ is what its script renders today from the
committed rows beside it. A report's header (date, command, machine) is its run's, not its
rows': each test renders the part the rows make and finds it, unchanged, in the file.

Not re-rendered here, and why:
- costmodel.md, costmodel_h200.md, costmodel_one_session.md, transfer.md: their scripts train
  or fine-tune models on the datasets under lab/data (minutes) and time noise floors; no rows.
- device_kernels.md, device_kernels_calibrated.md: they score model files (runs/cand_raw.pt,
  runs/cpu_devices.pt; the models `neuroshard calibrate` made on 2026-12-04) that were not kept.
- search_speed.md, search_speed_hosts.md, search_speed_modules8.md, uvm_speed_856_pool0.md: timings
  written as measured; no rows are kept.
- batch_curve.md's runs/cpu_before.pt column: that model is in git history only (c2c8594);
  the shipped model's columns are checked.
scale.md (every plan re-priced by the shipped model, about 25 s on 2 cores) and batch_curve.md
(about 12 s) are marked slow.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path

import pytest

from torchrec_neuroshard.lab.collect import read_rows

RESULTS = Path(__file__).parents[1] / "benchmarks" / "results"
DMP_STEP = sorted(p.name.removesuffix(".jsonl.gz") for p in RESULTS.glob("dmp_step*.jsonl.gz"))
STEP_SUITES = ("step_suite_batchnet", "step_suite_calibrated")
RENDERED = {
    *(f"{n}.md" for n in (*DMP_STEP, *STEP_SUITES)),
    *("batch_curve.md", "fullsize.md", "gpu_compute.md", "scale.md", "scale_full.md", "search_speed_full.md"),
    *("uvm.md", "uvm_pool0.md", "uvm_gpu.md", "validate_evaluator.md", "vs_torchrec_objective.md"),
}
NOT_RENDERED = {
    *("costmodel.md", "costmodel_h200.md", "costmodel_one_session.md", "transfer.md", "device_kernels.md", "device_kernels_calibrated.md"),
    *("search_speed.md", "search_speed_hosts.md", "search_speed_modules8.md", "uvm_speed_856_pool0.md"),
}


def assert_in_report(name: str, rendered: str) -> None:
    """``rendered`` appears, unchanged, in the committed ``name``."""
    committed = (RESULTS / name).read_text()
    if rendered not in committed:
        diff = difflib.unified_diff(committed.splitlines(), rendered.splitlines(), "committed", "rendered now", lineterm="", n=0)
        pytest.fail(f"{name} is not what its rows render now:\n" + "\n".join(list(diff)[:40]))


def test_every_committed_report_is_rendered_here_or_said_why_not() -> None:
    assert {p.name for p in RESULTS.glob("*.md")} == RENDERED | NOT_RENDERED


@pytest.mark.parametrize("name", DMP_STEP)
def test_dmp_step_reports(name: str) -> None:
    from torchrec_neuroshard.lab.dmp_report import report

    assert_in_report(f"{name}.md", report(read_rows(RESULTS / f"{name}.jsonl.gz")))


@pytest.mark.parametrize("name", STEP_SUITES)
def test_step_suite_reports(name: str, tmp_path: Path) -> None:
    """Rendered with the planners its command line named (its header)."""
    from benchmarks.compare import write_report

    planners = re.search(r"--planners (\S+)", (RESULTS / f"{name}.md").read_text()).group(1).split(",")
    text = write_report(read_rows(RESULTS / f"{name}.jsonl"), tmp_path, name=name, planners=planners)
    assert_in_report(f"{name}.md", text[text.index("| T, D |") :])


def test_validate_evaluator_report_and_summary() -> None:
    from benchmarks.validate_evaluator import report, summarize
    from torchrec_neuroshard.lab.dmp_measure import StepConfig

    rows = read_rows(RESULTS / "validate_evaluator.jsonl.gz")
    summary = summarize(rows)
    assert json.loads(json.dumps(summary)) == json.loads((RESULTS / "validate_evaluator_summary.json").read_text())
    text = report(rows, summary, "", StepConfig(), 2)
    assert_in_report("validate_evaluator.md", text[text.index("- Spearman") :])


def test_planning_reports() -> None:
    from benchmarks import fullsize, search_speed_report, uvm, vs_torchrec_objective

    assert_in_report("fullsize.md", fullsize.report(read_rows(RESULTS / "fullsize.jsonl")))
    assert_in_report("search_speed_full.md", search_speed_report.report(read_rows(RESULTS / "search_speed_full.jsonl")))
    assert_in_report("uvm.md", uvm.body(read_rows(RESULTS / "uvm.jsonl")))
    assert_in_report("uvm_pool0.md", uvm.body(read_rows(RESULTS / "uvm_pool0.jsonl")))
    assert_in_report("vs_torchrec_objective.md", vs_torchrec_objective.report(read_rows(RESULTS / "vs_torchrec_objective.jsonl")))


def test_gpu_measured_reports() -> None:
    from benchmarks import gpu_compute, scale_full, uvm_gpu

    assert_in_report("gpu_compute.md", gpu_compute.report())
    assert_in_report("scale_full.md", scale_full.report([scale_full.MEASURED]))
    assert_in_report("uvm_gpu.md", uvm_gpu.report())


@pytest.mark.slow
def test_scale_report(monkeypatch, tmp_path: Path) -> None:
    from benchmarks import scale, scale_report

    monkeypatch.setattr(scale_report, "RESULT", tmp_path / "scale.md")
    text = scale_report.write_report("any machine", scale.price_with_shipped)
    assert_in_report("scale.md", text[text.index("\n## Pool seed") :])


@pytest.mark.slow
def test_batch_curve_reports_shipped_models_columns() -> None:
    """Each line of the table rendered with the shipped model alone begins the committed
    line (whose last columns are runs/cpu_batchnet.pt's, the model shipped before)."""
    from benchmarks.batch_curve import report
    from torchrec_neuroshard.costmodel import load_pretrained

    rendered = report(read_rows(RESULTS / "batch_curve.jsonl"), {"shipped cpu.pt": load_pretrained("cpu")}).splitlines()
    committed = (RESULTS / "batch_curve.md").read_text().splitlines()
    start = next(i for i, line in enumerate(committed) if line.startswith("| batch"))
    table = committed[start : start + len(rendered)]
    assert all(c.startswith(r) for c, r in zip(table, rendered, strict=True)), "\n".join(rendered)
