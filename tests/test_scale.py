"""The scale benchmark: its held-out pools, the published-rate communication model, and
the report read from the judge's rows."""

import numpy as np
import pytest

from benchmarks.scale import POOL_SEEDS, scale_task
from benchmarks.scale_report import judge_lines, judged_task, latest_plans, variant_lines
from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.evaluate import task_lookups
from torchrec_neuroshard.lab.published_comm import INTER_HOST_GBPS, INTRA_HOST_GBPS, LATENCY_MS, PublishedLinks, modelled_comm
from torchrec_neuroshard.lab.workloads import HELD_OUT_POOL_SEEDS, TRAINING_POOL_SEEDS, WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.types import Plan, TablePlacement


def test_an_all_to_all_costs_its_slowest_ranks_bytes_at_the_published_rates() -> None:
    links = PublishedLinks(ranks_per_host=2, latency_ms=0.0, cross_host_latency_ms=0.0)
    one_host = np.array([[7e9, 450e6], [0.0, 0.0]])  # a rank's own slice moves nothing
    assert links.all_to_all_ms(one_host) == pytest.approx(450e6 / (INTRA_HOST_GBPS * 1e6))
    two_hosts = np.zeros((4, 4))
    two_hosts[0, 1] = two_hosts[0, 2] = 50e6  # rank 0 sends within its host and across
    assert links.all_to_all_ms(two_hosts) == pytest.approx(50e6 / (INTRA_HOST_GBPS * 1e6) + 50e6 / (INTER_HOST_GBPS * 1e6))
    assert PublishedLinks().all_to_all_ms(np.ones((1, 1))) == 0.0  # one rank: no collective


def test_a_ring_crossing_hosts_runs_at_the_inter_host_rate() -> None:
    links = PublishedLinks(ranks_per_host=8)
    assert links.ring_ms(1e9, 8, passes=1) == pytest.approx(LATENCY_MS + 1e9 * 7 / 8 / (INTRA_HOST_GBPS * 1e6))
    assert links.ring_ms(1e9, 16, passes=2) > 2 * 1e9 * 15 / 16 / (INTER_HOST_GBPS * 1e6)


@pytest.mark.slow
def test_the_modelled_comm_follows_the_bytes_a_plan_moves() -> None:
    task = generate_task(synthetic_pool(), 6, 4, WorkloadScale(), seed=2)
    lookups = task_lookups(task)
    whole = baseline_plan("size", task)
    widest = max(task.tables, key=lambda t: t.dim)
    halves = [widest.dim // 2] * 2
    split = Plan(
        tuple(p if p.table != widest.name else TablePlacement(widest.name, tuple(halves), (0, 1)) for p in whole.placements),
        task.num_devices,
    )
    a, b = modelled_comm(task, whole, lookups), modelled_comm(task, split, lookups)
    assert a.forward_ms == pytest.approx(a.backward_ms)  # the gradient all-to-all mirrors the output's
    assert b.input_ms > a.input_ms  # both column shards receive the table's indices
    assert min(a.input_ms, a.forward_ms) > 0


def test_the_benchmark_claims_on_held_out_pools_that_no_training_pool_shares() -> None:
    assert set(POOL_SEEDS) <= set(HELD_OUT_POOL_SEEDS) and len(POOL_SEEDS) >= 3
    assert not set(HELD_OUT_POOL_SEEDS) & set(TRAINING_POOL_SEEDS)


@pytest.mark.slow
def test_a_pool_holds_the_same_tables_and_batch_at_every_device_count_and_pools_differ() -> None:
    small, large = scale_task(8, POOL_SEEDS[0]), scale_task(128, POOL_SEEDS[0])
    assert small.tables == large.tables and small.batch_size == large.batch_size == 4096
    assert len(small.tables) == 856 and large.memory_cap_bytes < small.memory_cap_bytes
    assert [t.rows for t in scale_task(8, 0).tables] != [t.rows for t in small.tables]


def test_the_report_reads_the_last_plans_and_the_last_judged_set_of_complete_plans() -> None:
    planned = [
        {"pool_seed": 2, "devices": 2, "planner": "a", "status": "old"},
        {"pool_seed": 3, "devices": 2, "planner": "a", "status": "other pool"},
        {"pool_seed": 2, "devices": 2, "planner": "a", "status": "ok"},
    ]
    assert latest_plans(planned, 2, 2) == {"a": planned[2]}
    config = {"passes": 1, "draws": 1, "rounds": 2, "repeats": 1}

    def row(sha: str, planner: str, device: int, ms: float) -> dict:
        return {"pool_seed": 2, "devices": 2, "plans_sha": sha, **config, "pass": 0, "draw": 0, "device": device,
                "planner": planner, "fused_ms": [ms, ms], "replicas_ms": [0.0, 0.0]}  # fmt: skip

    rows = [row("old", "a", 0, 9.0), row("old", "a", 1, 9.0), row("new", "a", 0, 1.0), row("new", "a", 1, 2.0), row("new", "b", 0, 3.0)]
    judged = judged_task(rows, 2, 2)
    assert set(judged) == {"a"} and judged["a"].compute_ms == 2.0  # b's device 1 not yet timed; the old set left
    # the same plans timed again on another CPU: that CPU's rows alone, never a mix of machines
    other = {**rows[2], "cpu": "another cpu", "fused_ms": [5.0, 5.0]}  # its device 0 so far
    assert judged_task(rows + [other], 2, 2) == {}
    assert judged_task(rows + [other, {**rows[3], "cpu": "another cpu"}], 2, 2)["a"].compute_ms == 5.0
    # the same plans on the same CPU judged again by another protocol (the shuffled order): its rows alone
    shuffled = [{**r, "order": "shuffled", "fused_ms": [7.0, 7.0]} for r in rows[2:4]]
    assert judged_task(rows + shuffled[:1], 2, 2) == {}  # its device 1 not yet timed: no mix with the rotated run's
    assert judged_task(rows + shuffled, 2, 2)["a"].compute_ms == 7.0


def test_the_judges_section_reads_each_run_steadied_and_plain_and_skips_runs_without_a_copy() -> None:
    """NeuroShard's slowest device is its device 0, the heuristic's its device 1, timed when
    the reference read half what it read at device 0 (a fast minute): plain, NeuroShard is
    the slower (1.0 against 0.9 ms); steadied, the heuristic's device 1 is read at the
    reference's median speed (1.35) and NeuroShard's device 0 at 0.75, so NeuroShard is faster."""
    config = {"passes": 2, "draws": 1, "rounds": 1, "repeats": 1, "reference": True, "copy": True, "order": "shuffled"}

    def row(planner: str, p: int, device: int, ms: float) -> dict:
        return {"pool_seed": 2, "devices": 2, "plans_sha": "s", **config, "pass": p, "draw": 0, "device": device,
                "planner": planner, "fused_ms": [ms], "replicas_ms": [0.0]}  # fmt: skip

    rows = [row(name, p, d, 0.4 if d == 1 else 1.0) for name in ("neuroshard", "_copy") for p in (0, 1) for d in (0, 1)]
    rows += [row("lookup", p, d, 0.9 if d == 1 else 0.5) for p in (0, 1) for d in (0, 1)]
    rows += [row("_reference", p, d, 0.5 if d == 1 else 1.0) for p in (0, 1) for d in (0, 1)]
    (line,) = [x for x in judge_lines(rows, [(2, 2)]) if x.startswith("| 2 | 2 |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "not recorded"  # rows before 2026-11-29 did not name the CPU
    assert cells[3:6] == ["1.000 (1.000-1.000)", "1.000 (1.000-1.000)", "-"]  # the copy, steadied, plain, no final round
    assert cells[6].startswith("0.556 ") and cells[7].startswith("1.111 ") and cells[7].endswith(" lookup") and cells[8] == "-"
    final = [{**r, "stage": "final", "pass": -1, "fused_ms": [2.0 if r["planner"] == "lookup" else 1.0]} for r in rows if r["device"] == 0 and r["pass"] == 0 and r["planner"] != "_reference"]
    (line,) = [x for x in judge_lines(rows + final, [(2, 2)]) if x.startswith("| 2 | 2 |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[5] == "1.000 (1.000-1.000)" and cells[8] == "0.500 (0.500-0.500) lookup"  # side by side, no reference
    assert judge_lines([r for r in rows if r["planner"] != "_copy"], [(2, 2)]) == []


def test_a_variant_is_pooled_over_every_run_that_judged_it_beside_the_shipped_models_plan() -> None:
    """Two runs of one task (another draw of ids, so another run) and a run without the
    variant: the variant's ratio is the geometric mean of its two runs', the third left out."""
    config = {"passes": 1, "draws": 1, "rounds": 1, "repeats": 1}

    def row(sha: str, first_draw: int, planner: str, ms: float) -> dict:
        return {"pool_seed": 2, "devices": 1, "plans_sha": sha, **config, "first_draw": first_draw, "pass": 0, "draw": 0,
                "device": 0, "planner": planner, "fused_ms": [ms], "replicas_ms": [0.0]}  # fmt: skip

    times = {0: {"neuroshard": 1.0, "neuroshard_b": 0.5, "lookup": 2.0}, 2: {"neuroshard": 1.0, "neuroshard_b": 2.0, "lookup": 2.0}}
    rows = [row("s", first, name, ms) for first, by in times.items() for name, ms in by.items()]
    rows += [row("t", 0, "neuroshard", 1.0), row("t", 0, "lookup", 4.0)]
    (line,) = [x for x in variant_lines(rows, []) if x.startswith("| neuroshard_b |")]
    assert [c.strip() for c in line.strip("|").split("|")][1:] == ["1", "not recorded", "2", "1.000 (1.000-1.000)", "0.500 (0.500-0.500)", "0.500 (0.500-0.500)"]  # one unit a run: no spread within runs
    assert variant_lines([r for r in rows if r["planner"] != "neuroshard_b"], []) == []


def test_runs_on_two_cpu_kinds_are_pooled_apart() -> None:
    """The same plans judged on two CPU kinds: one row a kind, each its own run's ratio."""
    config = {"passes": 1, "draws": 1, "rounds": 1, "repeats": 1}

    def row(cpu: str, planner: str, ms: float) -> dict:
        return {"pool_seed": 2, "devices": 1, "plans_sha": "s", "cpu": cpu, **config, "pass": 0, "draw": 0,
                "device": 0, "planner": planner, "fused_ms": [ms], "replicas_ms": [0.0]}  # fmt: skip

    times = {"cpu AMD EPYC, 1 cores": 0.5, "cpu Intel(R) Xeon(R) Processor, 1 cores": 2.0}
    rows = [row(cpu, name, ms) for cpu, b in times.items() for name, ms in {"neuroshard": 1.0, "neuroshard_b": b, "lookup": 2.0}.items()]
    cells = [[c.strip() for c in x.strip("|").split("|")] for x in variant_lines(rows, []) if x.startswith("| neuroshard_b |")]
    assert [c[2:5] for c in cells] == [["AMD EPYC", "1", "0.500 (0.500-0.500)"], ["Intel(R) Xeon(R) Processor", "1", "2.000 (2.000-2.000)"]]


def test_a_run_of_a_plan_since_re_planned_is_pooled_under_the_label_it_was_kept_as() -> None:
    """neuroshard_b judged (0.5 of neuroshard), then kept as neuroshard_b_old and re-planned
    (``scale keep`` then ``plan``), both judged (old 0.5, new 2.0): the first run counts for
    neuroshard_b_old, not for the new plan of neuroshard_b; a plan neither latest nor kept
    reads as an earlier plan."""
    from benchmarks.scale_report import plans_digest

    config = {"passes": 1, "draws": 1, "rounds": 1, "repeats": 1}
    plans = {"neuroshard": {"p": "n"}, "lookup": {"p": "l"}}
    first, second = {**plans, "neuroshard_b": {"p": "b1"}}, {**plans, "neuroshard_b": {"p": "b2"}, "neuroshard_b_old": {"p": "b1"}}

    def planned(by: dict) -> list[dict]:
        return [{"pool_seed": 2, "devices": 1, "planner": n, "status": "ok", "plan": p} for n, p in by.items()]

    def rows(by: dict, times: dict) -> list[dict]:
        return [{"pool_seed": 2, "devices": 1, "plans_sha": plans_digest(by), **config, "pass": 0, "draw": 0, "device": 0,
                 "planner": n, "fused_ms": [ms], "replicas_ms": [0.0]} for n, ms in times.items()]  # fmt: skip

    measured = rows(first, {"neuroshard": 1.0, "neuroshard_b": 0.5, "lookup": 2.0})
    measured += rows(second, {"neuroshard": 1.0, "neuroshard_b": 2.0, "neuroshard_b_old": 0.5, "lookup": 2.0})
    lines = variant_lines(measured, planned(first) + planned(second))
    by_label = {x.split("|")[1].strip(): [c.strip() for c in x.strip("|").split("|")][3:5] for x in lines if x.startswith("| neuroshard_")}
    assert by_label == {"neuroshard_b": ["1", "2.000 (2.000-2.000)"], "neuroshard_b_old": ["2", "0.500 (0.500-0.500)"]}
    lines = variant_lines(measured, planned(first) + planned({**second, "neuroshard_b_old": {"p": "b3"}}))
    assert any(x.startswith("| neuroshard_b (an earlier plan) | 1 | not recorded | 1 | 0.500 ") for x in lines)


@pytest.mark.slow
def test_the_report_prices_every_plan_by_the_shipped_model_but_another_models_own() -> None:
    from benchmarks.scale import planning_model, price_with_shipped
    from benchmarks.scale_report import file_sha256 as _sha256
    from torchrec_neuroshard.costmodel import PRETRAINED_DIR
    from torchrec_neuroshard.search import predicted_breakdown

    task, model = planning_model(8, POOL_SEEDS[0])
    plan = baseline_plan("lookup", task).to_dict()
    shipped = _sha256(PRETRAINED_DIR / "cpu.pt")
    rows = {
        "lookup": {"status": "ok", "plan": plan, "predicted_ms": [0.0] * 8},  # a baseline: priced when it was planned
        "neuroshard_other": {"status": "ok", "plan": plan, "model": "runs/other.pt", "model_sha256": "x", "predicted_ms": [1.0] * 8},
        "neuroshard": {"status": "ok", "plan": plan, "model_sha256": shipped, "predicted_ms": [2.0] * 8},
        "torchrec_dp": {"status": "no plan: ZeroDivisionError"},
    }
    before = {n: dict(r) for n, r in rows.items()}
    price_with_shipped(POOL_SEEDS[0], 8, rows)
    _, devices = predicted_breakdown(model, task, Plan.from_dict(plan))
    assert rows["lookup"]["predicted_ms"] == [round(d.compute, 4) for d in devices]
    assert rows["lookup"]["model_sha256"] == shipped and min(rows["lookup"]["predicted_ms"]) > 0
    assert all(rows[n] == before[n] for n in ("neuroshard_other", "neuroshard", "torchrec_dp"))


def test_a_kept_plan_is_the_last_plan_under_a_new_name_with_its_model_named(tmp_path, monkeypatch) -> None:
    import benchmarks.scale as scale
    from torchrec_neuroshard.lab.collect import append_rows

    path = tmp_path / "planned.jsonl.gz"
    monkeypatch.setattr(scale, "PLANNED", path)
    old = {"pool_seed": 2, "devices": 8, "planner": "neuroshard", "status": "ok", "plan": {"p": 1}, "model": "shipped cpu.pt", "model_sha256": "abc", "note": "7 states"}
    append_rows(path, [{**old, "plan": {"p": 0}}, old])
    scale.keep(8, 2, "neuroshard", "neuroshard_before")
    kept = latest_plans(read_rows(path), 2, 8)["neuroshard_before"]
    assert kept["plan"] == {"p": 1} and kept["model"] == "shipped cpu.pt of sha256 abc"
    assert kept["note"] == "7 states; neuroshard's plan, kept"


def test_a_re_measure_of_judged_plans_runs_on_the_draws_of_ids_it_names(monkeypatch) -> None:
    import benchmarks.scale as scale
    from torchrec_neuroshard.lab.judge import JudgeConfig

    calls = []
    monkeypatch.setattr(scale, "task_draws", lambda devices, pool_seed, draws, first=0: list(range(first, first + draws)))
    monkeypatch.setattr(scale, "measure", lambda devices, pool_seed, planners, config, draws: calls.append((config, draws)))
    scale.main(["measure", "--devices", "8", "--pool-seeds", "2", "--planners", "lookup", "--rounds", "2", "--first-draw", "2"])
    assert calls == [(JudgeConfig(rounds=2, reference=True, first_draw=2, copy=True), [2, 3])]


def test_the_uvm_benchmarks_plan_each_task_on_its_own_held_out_pool_and_pool_0_only_when_asked() -> None:
    import gzip
    import json

    from benchmarks import uvm, uvm_gpu
    from torchrec_neuroshard.lab.collect import read_rows

    assert set(uvm.pool_seeds(False)) <= set(HELD_OUT_POOL_SEEDS) and len(set(uvm.pool_seeds(False))) == len(uvm.TASKS)
    assert uvm.pool_seeds(True) == (0,) * len(uvm.TASKS)
    rows = read_rows(uvm.HERE / "results" / "uvm.jsonl")
    assert [r["pool_seed"] for r in rows] == list(uvm.HELD_OUT_POOLS)
    (devices, seed, _), pool_seed = uvm.TASKS[0], uvm.HELD_OUT_POOLS[0]
    drawn = {(t.name, t.rows) for t in uvm.uvm_task(devices, seed, rows[0]["tables"], pool_seed).tables}
    assert {(t["name"], t["rows"]) for t in rows[0]["task"]["tables"]} == drawn  # the committed rows are that pool's tables
    assert drawn != {(t.name, t.rows) for t in uvm.uvm_task(devices, seed, rows[0]["tables"], 0).tables}
    entries = json.loads(gzip.open(uvm_gpu.PLANS, "rt").read())
    assert [e["pool_seed"] for e in entries] == list(uvm.HELD_OUT_POOLS)


def test_the_report_says_whose_plans_neuroshards_rows_are() -> None:
    from benchmarks.scale_report import file_sha256, shipped_planner, shipped_text
    from torchrec_neuroshard.costmodel import PRETRAINED_DIR

    shipped = file_sha256(PRETRAINED_DIR / "cpu.pt")
    now = {(2, 8): {"neuroshard": {"status": "ok", "model_sha256": shipped}}}
    assert shipped_text(now).startswith("NeuroShard's rows are the plans of the shipped `cpu.pt`")
    before = {(2, 8): {"neuroshard": {"status": "ok", "model_sha256": "old"}, "neuroshard_new": {"status": "ok", "model_sha256": shipped}}}
    assert "shipped when they were made (model sha256 old), not of the file shipped now" in shipped_text(before)
    assert shipped_text(before).endswith("whose plans are the rows neuroshard_new")
    assert shipped_planner(now) == "neuroshard" and shipped_planner(before) == "neuroshard_new"


def _judged(*device_ms: float, units: int = 4):
    from torchrec_neuroshard.lab.judgement import Judged

    return Judged(np.tile(np.asarray(device_ms), (units, 1)))  # [units, devices]


def test_the_shipped_models_section_reads_every_task_against_torchrec_and_the_best_heuristic_and_pools_per_d() -> None:
    from benchmarks.scale_ratios import TaskRun, versus_lines

    ours = {"neuroshard_new": _judged(1.0, 1.0), "torchrec_timeout": _judged(2.0, 1.0), "lookup": _judged(1.0, 4.0), "size_lookup": _judged(1.0, 1.25)}
    runs = {
        (2, 8): TaskRun(ours, {}, range(4, 6), "ok"),
        (3, 8): TaskRun({n: j for n, j in ours.items() if n != "torchrec_timeout"}, {}, range(6, 8), "no plan: PlannerError: storage"),
        (2, 16): TaskRun({"lookup": _judged(1.0)}, {}, range(0, 2), "ok"),  # the shipped model's plan not judged: no row
    }
    lines = versus_lines("neuroshard_new", runs)
    assert "| 8 | 2 | 4-5 | 0.500 (0.500-0.500) | - | 0.800 (0.800-0.800) | - | " in "\n".join(lines)
    assert "| 8 | 3 | 6-7 | no plan (PlannerError) | - | 0.800 (0.800-0.800) | - | " in "\n".join(lines)
    pooled = next(line for line in lines if "| pooled |" in line)
    assert pooled.startswith("| 8 | pooled | | - | - | 0.800 (0.800-0.800), 2 pools | - |")  # TorchRec planned one pool: not pooled
    assert not any(line.startswith("| 16 |") for line in lines)
    assert versus_lines("neuroshard_new", {(2, 16): runs[2, 16]}) == []


def test_a_judges_rows_name_the_cpu_and_its_vector_instructions_and_the_report_tells_them_apart() -> None:
    import torch

    from benchmarks.scale import judged_on
    from benchmarks.scale_report import cpu_label

    assert judged_on().endswith(f", {torch.backends.cpu.get_cpu_capability()}")
    assert cpu_label("cpu AMD EPYC, 1 cores, AVX512") == "AMD EPYC AVX512" != cpu_label("cpu AMD EPYC, 1 cores, AVX2")
    assert cpu_label("cpu AMD EPYC, 1 cores") == "AMD EPYC" and cpu_label(None) == "not recorded"


def test_a_plans_row_names_the_cpu_as_the_judges_rows_do(tmp_path, monkeypatch) -> None:
    """Near-tie plans differ between AVX2 and AVX-512 machines of one name: a planned row
    names the vector instructions as a judged row does (``judged_on``)."""
    import benchmarks.scale as scale

    monkeypatch.setattr(scale, "PLANNED", tmp_path / "planned.jsonl.gz")
    scale.plan_all(8, 2, 60, ["lookup"], None)
    (row,) = read_rows(tmp_path / "planned.jsonl.gz")
    assert row["planner"] == "lookup" and row["status"] == "ok" and row["cpu"] == scale.judged_on()
