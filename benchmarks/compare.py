"""NeuroShard against TorchRec's planner and the classic heuristics, on measured cost.

    python -m benchmarks.compare                 # the committed suite, results/ updated
    python -m benchmarks.compare --limit 2       # a quick look

Every planner plans every task of a fixed suite (benchmarks/tasks/suite.json, made by the
task generator and committed); every plan is measured by the plan evaluator (fused TBE
compute per device, all-to-all on a real gloo/NCCL group), all of a task's plans
interleaved over rounds. Results append to a JSONL file, so an interrupted run resumes.
Prints a markdown table and writes it, with PNG plots, under benchmarks/results/.

    python -m benchmarks.compare --calibrated runs/cpu_calibrated.pt

adds ``neuroshard_calibrated``: NeuroShard's search with a model file made on the day by
``neuroshard calibrate``, measured interleaved with the others. Its rows record the file
and its sha256 prefix; the report gives its headline figures beside NeuroShard's. Each
NeuroShard variant's "cheapest of all planners" leaves the other variant out (they are
one planner with two models, not rivals), so NeuroShard's figures are defined as without
the option.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from torchrec_neuroshard.costmodel import NeuralCostModel, load_pretrained, pretrained_for
from torchrec_neuroshard.heuristics import BASELINES
from torchrec_neuroshard.lab.collect import hardware, read_rows
from torchrec_neuroshard.lab.evaluate import evaluate_plans
from torchrec_neuroshard.lab.launch import default_device
from torchrec_neuroshard.lab.planners import CALIBRATED, RIVALS, CalibratedModel, check_machine, calibrated_files, geomean, plan_task
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.types import ShardingError, Task

HERE = Path(__file__).parent
SUITE_SIZES = ((20, 2), (40, 4), (60, 4), (80, 8))
PLANNERS = ("neuroshard", "neuroshard_nolocal", "neuroshard_prototype", "torchrec", "torchrec_neural", *BASELINES)
LABELS = {
    "neuroshard": "NeuroShard",
    CALIBRATED: "NeuroShard, calibrated model",
    "neuroshard_nolocal": "NeuroShard, no local pass",
    "neuroshard_prototype": "NeuroShard (prototype search)",
    "torchrec": "TorchRec",
    "torchrec_neural": "TorchRec+NeuralEst",
    "torchrec_default_memory": "TorchRec at its default memory",
    "random": "Random",
    "size": "Size",
    "dim": "Dim",
    "lookup": "Lookup",
    "size_lookup": "Size-lookup",
}


def make_suite(
    tasks_per_size: int,
    sizes: Sequence[tuple[int, int]] = SUITE_SIZES,
    scale: WorkloadScale = WorkloadScale(),
    pool_seed: int = 0,
) -> list[Task]:
    """``tasks_per_size`` generated tasks of every (tables, devices) size, drawn from the
    synthetic pool of ``pool_seed`` (the cost models' compute samples come from pool 0)."""
    pool = synthetic_pool(seed=pool_seed)
    return [
        generate_task(pool, t, d, scale, seed=1000 * t + 10 * d + k)
        for t, d in sizes
        for k in range(tasks_per_size)
    ]


def save_suite(tasks: Sequence[Task], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([json.loads(t.to_json()) for t in tasks]))


def load_suite(path: Path) -> list[Task]:
    return Task.load_all(path)


def run(
    tasks: Sequence[Task],
    results_path: Path,
    planners: Sequence[str] = PLANNERS,
    rounds: int = 3,
    model: NeuralCostModel | None = None,
    progress: bool = True,
    calibrated: CalibratedModel | None = None,
) -> list[dict]:
    """Plan and measure every task not yet in ``results_path``; returns all rows.
    ``calibrated`` plans ``neuroshard_calibrated``, each of its rows records the file."""
    model = model or load_pretrained()
    done = {r["task"] for r in read_rows(results_path)}
    if calibrated is not None:
        calibrated.check_resumes(read_rows(results_path), results_path)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    for i, task in enumerate(tqdm(tasks, desc="tasks", disable=not progress)):
        if i in done:
            continue

        plans, rows = {}, []
        for name in _with_fallbacks(planners, rows):
            t0 = time.perf_counter()
            row = {"task": i, "tables": len(task.tables), "devices": task.num_devices, "planner": name}
            if name == CALIBRATED and calibrated is not None:
                row["cost_model_file"] = calibrated.record()
            try:
                plan = plan_task(name, task, model, calibrated.model if calibrated else None)
                row["planning_s"] = time.perf_counter() - t0
                plan.validate(task)
                plans[name] = plan
                row["splits"] = sum(len(p.widths) > 1 for p in plan.placements)
                row["data_parallel"] = len(plan.data_parallel)
            except Exception as e:  # noqa: BLE001 - a planner failing is a result to report
                row["planning_s"] = time.perf_counter() - t0
                row["status"] = f"invalid: {type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
        measured = evaluate_plans(task, list(plans.values()), rounds=rounds)
        by_name = dict(zip(plans, measured))
        with open(results_path, "a") as f:
            for row in rows:
                if row["planner"] in by_name:
                    pm = by_name[row["planner"]]
                    row["status"] = "ok"
                    row["cost_ms"] = pm.cost_ms
                    row["iqr_ms"] = pm.spread_ms
                    row["per_device"] = [[d.fwd_compute, d.bwd_compute, d.fwd_comm, d.bwd_comm] for d in pm.devices]
                f.write(json.dumps(row) + "\n")
    return read_rows(results_path)


def _with_fallbacks(planners: Sequence[str], rows: list[dict]):
    """The planners, then TorchRec at its default topology memory when it found no plan
    at the task's cap (its result stays "invalid"; this row shows what it would plan)."""
    yield from planners
    torchrec = next((r for r in rows if r["planner"] == "torchrec"), None)
    if torchrec is not None and torchrec.get("status", "").startswith("invalid"):
        yield "torchrec_default_memory"


def summarize(rows: Sequence[dict], planners: Sequence[str] = PLANNERS) -> tuple[str, dict]:
    """The markdown table and headline figures."""
    by_task: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_task.setdefault(r["task"], {})[r["planner"]] = r
    sizes = sorted({(r["tables"], r["devices"]) for r in rows})
    lines = [
        "| T, D | planner | mean ms | median ms | ratio to TorchRec (geomean) | invalid | planning s |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in sizes:
        tasks = [t for t, p in by_task.items() if (next(iter(p.values()))["tables"], next(iter(p.values()))["devices"]) == size]
        for name in planners:
            ok = [by_task[t][name] for t in tasks if by_task[t].get(name, {}).get("status") == "ok"]
            costs = [r["cost_ms"] for r in ok]
            ratios = [
                by_task[t][name]["cost_ms"] / by_task[t]["torchrec"]["cost_ms"]
                for t in tasks
                if by_task[t].get(name, {}).get("status") == "ok" and by_task[t].get("torchrec", {}).get("status") == "ok"
            ]
            invalid = sum(1 for t in tasks if by_task[t].get(name, {}).get("status", "ok") != "ok")
            plan_s = [by_task[t][name]["planning_s"] for t in tasks if name in by_task[t]]
            lines.append(
                f"| {size[0]}, {size[1]} | {LABELS.get(name, name)} | "
                f"{statistics.mean(costs) if costs else float('nan'):.2f} | {statistics.median(costs) if costs else float('nan'):.2f} | "
                f"{geomean(ratios):.3f} | {invalid}/{len(tasks)} | {statistics.mean(plan_s) if plan_s else float('nan'):.2f} |"
            )
    headline = {"tasks": len(by_task), **_variant_headline(by_task, "neuroshard")}
    if any(CALIBRATED in p for p in by_task.values()):
        cal = _variant_headline(by_task, CALIBRATED)
        headline.update({f"{CALIBRATED}_{k}" if k.startswith("tasks") else k: v for k, v in cal.items()})
        pairs = [p[CALIBRATED]["cost_ms"] / p["neuroshard"]["cost_ms"] for p in by_task.values() if _ok(p, CALIBRATED) and _ok(p, "neuroshard")]
        headline[f"{CALIBRATED}_over_neuroshard_geomean"] = geomean(pairs)
    return "\n".join(lines), headline


def _ok(plans: dict[str, dict], name: str) -> bool:
    return plans.get(name, {}).get("status") == "ok"


def _share(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else float("nan")


def _variant_headline(by_task: dict[int, dict[str, dict]], name: str) -> dict:
    """A NeuroShard variant's figures: / TorchRec (geomean over the tasks both planned
    validly), the share of its valid tasks below every heuristic, and cheapest of all
    planners measured but its rival variant (``RIVALS``)."""
    mine = [p for p in by_task.values() if _ok(p, name)]
    ratios = [p[name]["cost_ms"] / p["torchrec"]["cost_ms"] for p in mine if _ok(p, "torchrec")]
    below = [all(p[name]["cost_ms"] < p[b]["cost_ms"] for b in BASELINES if _ok(p, b)) for p in mine]
    cheapest = [all(p[name]["cost_ms"] <= r["cost_ms"] for k, r in p.items() if k != RIVALS[name] and _ok(p, k)) for p in mine]
    return {
        "tasks_both_valid": len(ratios),
        f"{name}_over_torchrec_geomean": geomean(ratios),
        f"{name}_below_every_heuristic": _share(below),
        f"{name}_cheapest_of_all": _share(cheapest),
    }


def plot(rows: Sequence[dict], out_dir: Path, planners: Sequence[str] = PLANNERS, name: str = "compare") -> list[Path]:
    """Per-planner cost bars (geomean ratio to TorchRec per size) and one task's per-device
    breakdown, NeuroShard vs TorchRec."""
    import matplotlib

    matplotlib.use("Agg")
    prefix = "" if name == "compare" else f"{name}_"
    by_task: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_task.setdefault(r["task"], {})[r["planner"]] = r
    paths = [_cost_bars(by_task, planners, out_dir / f"{prefix}cost_by_planner.png")]
    both = [t for t, p in by_task.items() if p.get("neuroshard", {}).get("status") == "ok" and p.get("torchrec", {}).get("status") == "ok"]
    if both:
        t = max(both, key=lambda t: by_task[t]["torchrec"]["devices"])
        paths.append(_breakdown(t, by_task[t], out_dir / f"{prefix}per_device_breakdown.png"))
    return paths


def _cost_bars(by_task: dict[int, dict[str, dict]], planners: Sequence[str], path: Path) -> Path:
    import matplotlib.pyplot as plt
    import numpy as np

    sizes = sorted({(r["tables"], r["devices"]) for p in by_task.values() for r in p.values()})
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(planners)
    for k, name in enumerate(planners):
        vals = []
        for size in sizes:
            ratios = [
                p[name]["cost_ms"] / p["torchrec"]["cost_ms"]
                for p in by_task.values()
                if (p["torchrec"]["tables"], p["torchrec"]["devices"]) == size
                and p.get(name, {}).get("status") == "ok" and p["torchrec"].get("status") == "ok"
            ]
            vals.append(geomean(ratios))
        ax.bar(np.arange(len(sizes)) + k * width, vals, width, label=LABELS.get(name, name))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(sizes)) + 0.4 - width / 2, [f"T={t}, D={d}" for t, d in sizes])
    ax.set_ylabel("measured embedding cost / TorchRec's")
    ax.legend(ncol=4, fontsize=8)
    ax.set_title("Measured embedding cost relative to TorchRec's planner (geomean over tasks)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _breakdown(task: int, plans: dict[str, dict], path: Path) -> Path:
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    parts = ("fwd compute", "bwd compute", "fwd comm", "bwd comm")
    for ax, name in zip(axes, ("neuroshard", "torchrec")):
        per = np.asarray(plans[name]["per_device"])
        bottom = np.zeros(len(per))
        for j, label in enumerate(parts):
            ax.bar(np.arange(len(per)), per[:, j], bottom=bottom, label=label)
            bottom += per[:, j]
        ax.set_title(f"{LABELS[name]}: {plans[name]['cost_ms']:.1f} ms")
        ax.set_xticks(np.arange(len(per)))
        ax.set_xlabel("device")
    axes[0].set_ylabel("measured ms")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Per-device measured cost, task {task} (T={plans['torchrec']['tables']}, D={plans['torchrec']['devices']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(rows: Sequence[dict], out_dir: Path, note: str = "", name: str = "compare", planners: Sequence[str] = PLANNERS) -> str:
    extra = tuple(n for n in ("torchrec_default_memory", CALIBRATED) if n not in planners and any(r["planner"] == n for r in rows))
    table, headline = summarize(rows, (*planners, *extra))
    hw = hardware(default_device(), 1)
    text = (
        f"# Planner comparison on measured embedding cost\n\n"
        f"Date: {datetime.date.today()}. Hardware: {hw['device']} ({hw['device_name']}), torch "
        f"{hw['torch']}, fbgemm-gpu {hw['fbgemm_gpu']}, compute timed on 1 thread, comm on gloo.\n"
        f"{note}\n\n{table}\n\n"
        f"NeuroShard / TorchRec, geometric mean over the {headline['tasks_both_valid']} of {headline['tasks']} "
        f"tasks where TorchRec's plan fit the memory cap: "
        f"**{headline['neuroshard_over_torchrec_geomean']:.3f}**. NeuroShard below every heuristic on "
        f"**{100 * headline['neuroshard_below_every_heuristic']:.0f}%** of tasks, the cheapest of all planners "
        f"measured on **{100 * headline['neuroshard_cheapest_of_all']:.0f}%**"
        f"{' (the calibrated variant left out)' if f'{CALIBRATED}_over_torchrec_geomean' in headline else ''}.\n"
        f"{_calibrated_paragraph(rows, headline)}"
    )
    (out_dir / f"{name}.md").write_text(text)
    return text


def _calibrated_paragraph(rows: Sequence[dict], headline: dict) -> str:
    """NeuroShard calibrated's headline figures beside NeuroShard's, and the file that planned them."""
    if f"{CALIBRATED}_over_torchrec_geomean" not in headline:
        return ""
    return (
        f"\nNeuroShard with the calibrated model ({calibrated_files([r for r in rows if r['planner'] == CALIBRATED])}) "
        f"/ TorchRec, geometric mean over {headline[f'{CALIBRATED}_tasks_both_valid']} tasks: "
        f"**{headline[f'{CALIBRATED}_over_torchrec_geomean']:.3f}** (NeuroShard's: "
        f"{headline['neuroshard_over_torchrec_geomean']:.3f}); below every heuristic on "
        f"**{100 * headline[f'{CALIBRATED}_below_every_heuristic']:.0f}%** of tasks, the cheapest of all planners "
        f"(shipped-model NeuroShard left out) on **{100 * headline[f'{CALIBRATED}_cheapest_of_all']:.0f}%**; "
        f"calibrated / shipped model, geomean: **{headline[f'{CALIBRATED}_over_neuroshard_geomean']:.3f}**.\n"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", type=Path, default=HERE / "tasks" / "suite.json")
    p.add_argument("--tasks-per-size", type=int, default=5, help="when (re)making the suite")
    p.add_argument("--new-suite", action="store_true", help="regenerate the suite file")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--limit", type=int, help="only the first N tasks")
    p.add_argument("--model", type=Path, help="cost model file (default: the shipped one for this machine)")
    p.add_argument("--allow-mismatch", action="store_true", help="plan with a model of other hardware than this machine")
    p.add_argument("--report-only", action="store_true", help="report the tasks measured so far, measure nothing")
    p.add_argument("--sizes", nargs="*", default=[f"{t}:{d}" for t, d in SUITE_SIZES], help="T:D sizes of a new suite")
    p.add_argument("--pool-seed", type=int, default=0, help="synthetic pool of a new suite")
    p.add_argument("--planners", default=",".join(PLANNERS), help="comma-separated planners to measure")
    p.add_argument("--name", default="compare", help="results file stem")
    p.add_argument("--calibrated", type=Path, help=f"a model file made by `neuroshard calibrate`: adds the planner {CALIBRATED}")
    args = p.parse_args(argv)
    planners = tuple(args.planners.split(","))
    if args.calibrated and CALIBRATED not in planners:
        planners += (CALIBRATED,)
    unknown = sorted(set(planners) - set(PLANNERS) - ({CALIBRATED} if args.calibrated else set()))
    if unknown:
        raise ShardingError(f"unknown planners {unknown}; choose from {list(PLANNERS)}, or {CALIBRATED} with --calibrated PATH")
    if args.new_suite or not args.suite.exists():
        sizes = [tuple(int(x) for x in s.split(":")) for s in args.sizes]
        save_suite(make_suite(args.tasks_per_size, sizes, pool_seed=args.pool_seed), args.suite)
    model = NeuralCostModel.load(args.model) if args.model else pretrained_for(default_device().type)
    check_machine(model, args.allow_mismatch)
    calibrated = CalibratedModel.load(args.calibrated) if args.calibrated else None
    if calibrated is not None:
        check_machine(calibrated.model, args.allow_mismatch, f"{args.calibrated}: ")
    tasks = load_suite(args.suite)[: args.limit]
    results = args.out / (f"{args.name}.jsonl" if args.limit is None else f"{args.name}_first{args.limit}.jsonl")
    rows = read_rows(results) if args.report_only else run(tasks, results, planners, args.rounds, model, calibrated=calibrated)
    rows = [r for r in rows if r["task"] < len(tasks)]
    measured = len({r["task"] for r in rows})
    note = (
        f"Suite: {args.suite.name}, {measured} of its first {len(tasks)} tasks measured, {args.rounds} interleaved "
        f"rounds per task (`{' '.join(['python -m benchmarks.compare', *(argv if argv is not None else sys.argv[1:])])}`). TorchRec's "
        "planner gets the per-rank batch and the task's memory, never raised (lab/torchrec_baseline.py); the "
        "evaluator prices the KJT input all-to-all, one kernel and set of collectives per sharding type, and "
        "data-parallel tables as DMP runs them (lab/evaluate.py). This replaces the earlier NeuroShard / "
        "TorchRec = 0.715, withdrawn: TorchRec had been given the global batch as its per-rank batch (its "
        "estimates and I/O storage D times too large, its memory cap raised until it planned, 4 of 20 plans "
        "dropped) and the evaluator left out the input all-to-all."
    )
    print(write_report(rows, args.out, note=note, name=args.name, planners=planners))
    for path in plot(rows, args.out, planners, args.name):
        print(f"wrote {path}")


if __name__ == "__main__":
    try:
        main()
    except ShardingError as e:
        raise SystemExit(f"compare: {e}")
