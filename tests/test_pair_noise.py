"""studies.pair_noise: a pair drawn again is the file's pair, and the report's arithmetic."""

import pytest

from studies import pair_noise
from torchrec_neuroshard.lab.collect import append_rows


def test_a_pair_drawn_with_another_seed_than_its_files_is_refused_before_timing(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(pair_noise, "ROWS", tmp_path / "rows.jsonl.gz")
    shard = {"name": "not_a_table", "rows": 10, "width": 4, "pooling_factor": 1.0, "access_hist": [1.0] + [0.0] * 16}
    source = tmp_path / "pairs.jsonl"
    append_rows(source, [{"pair": 0, "pair_member": m, "batch_size": 1024, "shards": [shard], "fwd_ms": 1.0, "bwd_ms": 1.0} for m in (0, 1)])
    monkeypatch.setattr(pair_noise, "pair_rows", lambda k, seed, *a, **kw: [
        {"pair": k, "pair_member": m, "batch_size": 1024, "shards": [dict(shard, name="t1_2")], "fwd_ms": 1.0, "bwd_ms": 1.0} for m in (0, 1)
    ])  # fmt: skip
    with pytest.raises(ValueError, match="drawn with --seed 5 is not the pair in .*give the seed it was collected with"):
        pair_noise.run(source, 5, 1)
    assert not (tmp_path / "rows.jsonl.gz").exists()


def test_the_report_sets_the_ratio_timed_again_beside_the_first(tmp_path, monkeypatch) -> None:
    rows = tmp_path / "rows.jsonl.gz"
    monkeypatch.setattr(pair_noise, "ROWS", rows)
    timed = [(0, 0, 2.0, 2.0), (0, 1, 1.0, 1.1), (1, 0, 3.0, 3.0), (1, 1, 3.0, 2.7)]  # pair, member, now, then
    append_rows(rows, [
        {"source": "p.jsonl", "pair": p, "pair_member": m, "fwd_ms": now, "bwd_ms": 0.0, "ms_then": then, "timed": "t"}
        for p, m, now, then in timed
    ])  # fmt: skip
    text = pair_noise.report([])
    # ratios now 2.0 and 1.0, then 2.0 / 1.1 and 3.0 / 2.7: each 10% apart
    assert "MAPE 10.0%" in text and "the same in 50%" in text and "2 pairs" in text


def test_a_level_plans_slowest_device_grows_with_the_kernel_error_and_the_devices() -> None:
    assert pair_noise.level_plan_imbalance(0.0, 8) == pytest.approx(1.0)
    small, large = pair_noise.level_plan_imbalance(0.05, 8), pair_noise.level_plan_imbalance(0.10, 8)
    assert 1.0 < small < large < pair_noise.level_plan_imbalance(0.10, 32)
    assert large == pytest.approx(1.0 + 1.42 * 0.10, abs=0.02)  # the expected maximum of 8 normals: 1.42 sd
