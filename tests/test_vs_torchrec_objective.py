"""benchmarks/vs_torchrec_objective.py on one task: its row, printed line and report agree."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

TASK = "16 x 50M, pooling 2"
"""The benchmark's quickest task (about 2 s: TorchRec's planner and ours on 8 GPUs)."""


@pytest.mark.slow
def test_one_task_row_line_and_report_agree(tmp_path, capsys, monkeypatch) -> None:
    """The ratio is ours / TorchRec's price, ours is what our search predicted, the line
    says FAILURE iff the ratio exceeds 1, the report renders the rows, and ``--strict``
    exits 1 on a FAILURE only."""
    from benchmarks import vs_torchrec_objective as bench

    out = tmp_path / "rows.jsonl"
    code = bench.main(["--cases", TASK, "--out", str(out), "--strict"])
    (row,) = [json.loads(text) for text in out.read_text().splitlines()]
    assert code == int(row["ratio"] > 1)
    ours, theirs = row["neuroshard"], row["torchrec"]
    assert row["ratio"] == pytest.approx(ours["ms"] / theirs["ms"], rel=1e-12)
    # priced by the model it searched with (no search when the offload stage split every table by rows)
    assert ours["ms"] == pytest.approx(ours["searched_ms"], rel=1e-9) if "searched_ms" in ours else all(k.startswith("row_wise/") for k in ours["kernels"])
    assert sum(ours["kernels"].values()) == sum(theirs["kernels"].values()) == row["tables"] == 16
    assert 0 <= ours["empty_devices"] < row["devices"] and 0 <= theirs["empty_devices"] < row["devices"]
    printed = capsys.readouterr().out
    first = printed.splitlines()[0]
    assert f"ratio {row['ratio']:.3f}" in first and f"ours {ours['ms']:.3f} ms" in first
    assert first.startswith("FAILURE") == (row["ratio"] > 1)
    assert bench.report([row]) in out.with_suffix(".md").read_text()

    worse = {**row, "ratio": 1.5, "neuroshard": {**ours, "ms": 1.5 * theirs["ms"]}}  # the other side of the check
    better = {**row, "ratio": 0.5, "neuroshard": {**ours, "ms": 0.5 * theirs["ms"]}}
    assert bench.line(worse).startswith("FAILURE") and not bench.line(better).startswith("FAILURE")
    for doctored, code in ((worse, 1), (better, 0)):
        monkeypatch.setattr(bench, "run_case", lambda case, doctored=doctored: doctored)
        assert bench.main(["--cases", TASK, "--out", str(out), "--strict"]) == code
        assert bench.main(["--cases", TASK, "--out", str(out)]) == 0


def test_cases_refuse_a_host_memory_on_cpu() -> None:
    from benchmarks.vs_torchrec_objective import CASES

    with pytest.raises(ValueError, match="'cpu' \\(no host_gib\\)"):
        replace(CASES[-1], host_gib=64)
