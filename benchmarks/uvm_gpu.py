"""Models beyond HBM: the compute of NeuroShard's and TorchRec's plans, MEASURED on one GPU.

    python -m benchmarks.uvm_gpu prepare --label L   # here: plan benchmarks.uvm's tasks (needs torchrec)
    python -m benchmarks.uvm_gpu measure --out DIR   # on the GPU (torch + fbgemm-gpu only)
    python -m benchmarks.uvm_gpu report              # here: the table, from the measured rows

``prepare`` plans ``benchmarks.uvm``'s tasks (48 full-size tables on D = 8, 16, 64, HBM caps
sending 10-90% of the bytes to host memory, each task from its own held-out pool) with both
planners, as ``benchmarks.uvm`` runs them, and stores the plans with NeuroShard's under
``--label`` (which planner planned it). ``--training-pool`` works on the same tasks drawn
from pool 0, the training pool, whose plans and H200 rows (``POOL0``, sessions 1-2,
2026-11-27/28) are kept as such; ``measure`` and ``report`` default to the held-out ones.
``measure`` runs each plan's devices one after the other on the GPU, as
``lab.evaluate``'s compute half does: per device and lookup group one TBE holding its
shards where their kernels keep them (HBM, UVM, UVM behind an HBM cache of the tables'
rows-weighted load factor, as TorchRec groups them), ``DRAWS`` successive batches of the
global batch run in turn after a warm-up pass, forward+backward medians; a plan's compute is
the max over its devices. Planners are interleaved per round. Communication is not in these
figures (one GPU). Rows append to ``results/uvm_gpu.jsonl`` (pool 0's: ``uvm_gpu_pool0.jsonl``);
``report`` writes ``results/uvm_gpu.md``, both pool sets.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from pathlib import Path

import torch

from torchrec_neuroshard.lab.collect import append_rows, read_rows
from torchrec_neuroshard.lab.planners import geomean, ratio_cells
from torchrec_neuroshard.types import Plan, Task

HERE = Path(__file__).parent
PLANS = HERE / "results" / "uvm_gpu_plans.json.gz"
MEASURED = HERE / "results" / "uvm_gpu.jsonl"
POOL0 = (HERE / "results" / "uvm_gpu_plans_pool0.json.gz", HERE / "results" / "uvm_gpu_pool0.jsonl")
"""The training pool's stored plans and measured rows."""
DRAWS, WARMUP, REPEATS, ROUNDS = 3, 3, 6, 2


def paths(training_pool: bool) -> tuple[Path, Path]:
    """(stored plans, measured rows) of the held-out tasks, or of pool 0's."""
    return POOL0 if training_pool else (PLANS, MEASURED)


def prepare(label: str, tables: int = 48, training_pool: bool = False) -> None:
    """Plan every task of ``benchmarks.uvm`` with both planners and add NeuroShard's plan as
    ``neuroshard-<label>`` to the stored ones (TorchRec's, as ``torchrec``, is kept from the
    first prepare: the same plan; so is ``torchrec-scaleup``, TorchRec's given the tables'
    cache statistics and its ``EmbeddingOffloadScaleupProposer``, where it plans)."""
    import logging

    from benchmarks.uvm import TASKS, pool_seeds, run_one

    logging.disable(logging.WARNING)
    plans_path = paths(training_pool)[0]
    entries = json.loads(gzip.open(plans_path, "rt").read()) if plans_path.exists() else [None] * len(TASKS)
    for k, ((devices, seed, to_host), pool_seed) in enumerate(zip(TASKS, pool_seeds(training_pool))):
        row = run_one(devices, seed, to_host, tables, pool_seed)
        entry = entries[k] or {"pool_seed": pool_seed, "task": row["task"], "to_host": to_host, "plans": {"torchrec": row["plans"]["torchrec"]}}
        entry["plans"][f"neuroshard-{label}"] = row["plans"]["neuroshard"]
        if "torchrec-scaleup" in row["plans"]:  # TorchRec given cache statistics, where it plans
            entry["plans"].setdefault("torchrec-scaleup", row["plans"]["torchrec-scaleup"])
        entries[k] = entry
        print(f"D={devices} to host {to_host:.0%}: planned", flush=True)
    with gzip.open(plans_path, "wt") as f:
        json.dump(entries, f)
    print(f"wrote {plans_path}")


def measure(
    out_dir: Path, deadline_s: float, planners: list[str] | None = None, rounds: int = ROUNDS, tasks: list[int] | None = None, session: int = 1,
    training_pool: bool = False,
) -> None:
    """Measure the stored plans (``planners``, ``tasks``: a subset) on this GPU, each row
    labelled with ``session`` (ratios are only taken within one)."""
    from torchrec_neuroshard.lab.collect import hardware
    from torchrec_neuroshard.lab.evaluate import _measure_compute_round, lookup_groups, on_kernels, task_lookups

    device = torch.device("cuda")
    hw = hardware(device, None)
    t0 = time.perf_counter()
    plans_path, measured_path = paths(training_pool)
    with gzip.open(plans_path, "rt") as f:
        entries = json.load(f)
    for i, entry in enumerate(entries):
        if tasks is not None and i not in tasks:
            continue
        task = Task.from_json(json.dumps(entry["task"]))
        draws = [task_lookups(task, draw=j) for j in range(DRAWS)]
        plans = {k: Plan.from_dict(v) for k, v in entry["plans"].items() if planners is None or k in planners}
        for round_ in range(rounds):
            for name, plan in plans.items():
                if time.perf_counter() - t0 > deadline_s:
                    print(f"deadline: stopped in task {i} round {round_} before {name}", flush=True)
                    return
                plan.validate(task)
                groups, replicated = lookup_groups(task, plan, [[t.name for t in task.tables]])
                per_device = _measure_compute_round(on_kernels(task, plan), groups, replicated, draws, device, WARMUP, REPEATS)
                torch.cuda.empty_cache()
                append_rows(out_dir / measured_path.name, [{
                    "pool_seed": entry.get("pool_seed", 0), "task": i, "devices": task.num_devices, "tables": len(task.tables), "to_host": entry["to_host"],
                    "planner": name, "round": round_, "session": session, "measured_ms": [f + b for f, b in per_device], "hardware": hw,
                }])  # fmt: skip
        print(f"task {i} (D={task.num_devices}) measured, {time.perf_counter() - t0:.0f} s", flush=True)


def predicted_ms(task: Task, plan: Plan) -> list[float]:
    """Each device's compute (forward + backward ms) of ``plan`` as NeuroShard prices it: the
    shipped H200 model with the shipped UVM pricing, each table on its placement's kernel."""
    from benchmarks.fullsize import topology_for
    from torchrec_neuroshard.costmodel import cost_model_for
    from torchrec_neuroshard.search import predicted_breakdown
    from torchrec_neuroshard.uvmcost import UvmPricedModel, UvmPricing

    model = UvmPricedModel(cost_model_for(topology_for(task)), UvmPricing.shipped(), task.batch_size)
    _, per_device = predicted_breakdown(model, task, plan)
    return [d.compute for d in per_device]


def stored_predictions(plans_path: Path = PLANS) -> tuple[list[dict], dict[tuple[int, str], list[float]]]:
    """The stored tasks and plans, and every plan's per-device ``predicted_ms`` by (task, planner)."""
    with gzip.open(plans_path, "rt") as f:
        entries = json.load(f)
    predicted = {}
    for i, e in enumerate(entries):
        task = Task.from_json(json.dumps(e["task"]))
        predicted.update({(i, n): predicted_ms(task, Plan.from_dict(d)) for n, d in e["plans"].items()})
    return entries, predicted


def prediction_error(rows: list[dict], predictions: dict[tuple[int, str], list[float]]) -> str:
    """How well the shipped pricing predicts the measured devices of every measured plan
    (plans it never saw: it was fitted to single kernels, ``lab.fit_uvm``)."""
    errors, plan_errors = [], []
    for (session, i, planner), rs in _by_plan(rows).items():
        predicted = predictions[(i, planner)]
        measured = [statistics.median(c) for c in zip(*(r["measured_ms"] for r in rs))]
        errors += [abs(p - m) / m for p, m in zip(predicted, measured)]
        plan_errors.append(abs(max(predicted) - max(measured)) / max(measured))
    return (
        f"NeuroShard's pricing (shipped H200 model + shipped UVM pricing) against these measurements: MAPE "
        f"{100 * statistics.fmean(errors):.1f}% over {len(errors)} devices, {100 * statistics.fmean(plan_errors):.1f}% "
        f"on a plan's compute (max over devices) over {len(plan_errors)} measured plans."
    )


def predicted_table(entries: list[dict], predictions: dict[tuple[int, str], list[float]]) -> list[str]:
    """Every stored plan's compute as NeuroShard prices it, measured or not."""
    names = sorted({n for e in entries for n in e["plans"]}, key=lambda n: (n != "torchrec", n))
    lines = [
        "Compute of every stored plan PREDICTED by NeuroShard's pricing (max over devices, ms; ratio to TorchRec's plan):",
        "",
        "| task | pool | D | bytes to host | " + " | ".join(names) + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for i, e in enumerate(entries):
        ms = {n: max(predictions[(i, n)]) for n in e["plans"]}
        cells = [f"{ms[n]:.2f} ({ms[n] / ms['torchrec']:.2f})" if n in ms else "-" for n in names]
        lines.append(f"| {i} | {e.get('pool_seed', 0)} | {e['task']['num_devices']} | {e['to_host']:.0%} | " + " | ".join(cells) + " |")
    return lines


def _by_plan(rows: list[dict]) -> dict[tuple[int, int, str], list[dict]]:
    out: dict[tuple[int, int, str], list[dict]] = {}
    for r in rows:
        out.setdefault((r["session"], r["task"], r["planner"]), []).append(r)
    return out


def report() -> str:
    """``pool_report`` of the held-out tasks, then of the training pool's."""
    return "\n\n".join(
        f"## {title}\n\n" + pool_report(training_pool)
        for title, training_pool in (("Held-out pools (one a task: benchmarks.uvm.HELD_OUT_POOLS)", False), ("Pool 0, the TRAINING pool", True))
    )


def pool_report(training_pool: bool) -> str:
    """Per session, task and planner: the per-device median over rounds, a plan's compute
    the max over its devices; ratios only to TorchRec's plan measured in the same session.
    Then every stored plan's prediction."""
    plans_path, measured_path = paths(training_pool)
    rows = read_rows(measured_path) if measured_path.exists() else []
    entries, predictions = stored_predictions(plans_path)
    if not rows:
        return "\n".join([f"Not measured yet: no GPU has timed these plans ({measured_path.name} holds no rows).", "", *predicted_table(entries, predictions)])
    runs: dict[tuple[int, int, int, float], dict[str, list[dict]]] = {}
    for r in rows:
        runs.setdefault((r["session"], r["task"], r["devices"], r["to_host"]), {}).setdefault(r["planner"], []).append(r)
    names = sorted({r["planner"] for r in rows}, key=lambda n: (n != "torchrec", n))
    gpu = rows[0]["hardware"]["device_name"]
    lines = [
        f"Compute of each plan MEASURED on one {gpu} (max over devices of the device's kernels' forward+backward, "
        "per-device median over rounds, ms; communication not included); in parentheses the ratio to TorchRec's plan "
        "measured in the same session, interleaved; '-': not measured in that session.",
        "",
        "| session | task | D | bytes to host | rounds | " + " | ".join(names) + " |",
        "|---|---|---|---|---|" + "---|" * len(names),
    ]
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for (session, i, devices, to_host), by_planner in sorted(runs.items()):
        compute = {n: max(statistics.median(c) for c in zip(*(r["measured_ms"] for r in rs))) for n, rs in by_planner.items()}
        cells = ratio_cells(compute, names, ratios, "-")
        rounds = max(len(rs) for rs in by_planner.values())
        lines.append(f"| {session} | {i} | {devices} | {to_host:.0%} | {rounds} | " + " | ".join(cells) + " |")
    lines += ["", "Geometric mean of the ratio to TorchRec's plan, over the tasks measured beside it: "
              + ", ".join(f"{n} {geomean(v):.3f} ({len(v)} tasks)" for n, v in ratios.items() if v and n != "torchrec") + "."]  # fmt: skip
    return "\n".join(lines + ["", prediction_error(rows, predictions), "", *predicted_table(entries, predictions)])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["prepare", "measure", "report"])
    p.add_argument("--label", default="shipped", help="prepare: which planner planned NeuroShard's plans")
    p.add_argument("--training-pool", action="store_true", help="prepare, measure: pool 0's tasks (the training pool) instead of the held-out ones")
    p.add_argument("--out", type=Path, default=HERE / "results", help="measure: folder for uvm_gpu.jsonl (uvm_gpu_pool0.jsonl)")
    p.add_argument("--deadline-s", type=float, default=240.0)
    p.add_argument("--planners", nargs="*", help="measure: these stored plans only (default all)")
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--tasks", type=int, nargs="*", help="measure: these tasks only (default all)")
    p.add_argument("--session", type=int, default=1, help="measure: the label of this GPU session")
    args = p.parse_args(argv)
    if args.step == "prepare":
        prepare(args.label, training_pool=args.training_pool)
    elif args.step == "measure":
        measure(args.out, args.deadline_s, args.planners, args.rounds, args.tasks, args.session, args.training_pool)
    else:
        text = report()
        print(text)
        (HERE / "results" / "uvm_gpu.md").write_text(
            "# Models beyond HBM: plans' compute MEASURED on a GPU\n\n" + text
            + "\n\nReproduce: here `python -m benchmarks.gpu.bundle` (once) and `python -m benchmarks.uvm_gpu prepare --label L`; "
            "on the GPU `bash benchmarks/gpu/run.sh python3 -m benchmarks.uvm_gpu measure --out $OUT --session N` "
            "(`--planners`, `--tasks`, `--rounds` for a subset; `--training-pool` for pool 0's tasks, whose rows go to "
            "uvm_gpu_pool0.jsonl); here `... report`.\n"
        )


if __name__ == "__main__":
    main()
