"""The compute part of every planner's plan, MEASURED device by device on one GPU.

    python -m benchmarks.gpu_compute prepare            # here: tasks + plans (needs torchrec)
    python -m benchmarks.gpu_compute measure --out DIR  # on the GPU (torch + fbgemm-gpu only)
    python -m benchmarks.gpu_compute report             # the table, from the measured rows

One GPU cannot run a D-GPU step, but it can run each device's kernels of a D-GPU plan one
after the other, as the prototype's evaluator did: that is the compute half of the
evaluator, on the hardware the H200 cost model was trained on. The tasks are the synthetic
pool's at FULL size (rows as in the pool, global batch 65,536), T tables on D GPUs of one
host; every planner plans every task here (NeuroShard with the shipped H200 compute model
and the alpha-beta comm stand-in, TorchRec's planner at its per-rank batch on a cuda
topology with the task's HBM, the five heuristics) and the plans travel to the GPU.

Per device, the evaluator's compute half (``lab.evaluate``): one fused TBE per lookup group
(sharding kind) over the global batch, a row block over the indices in its rows, and the
data-parallel tables' dense kernel at the local batch. A device's compute is the sum of
its kernels' forward+backward medians; a plan's is the max over devices. Communication is
NOT in these figures (one GPU).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from pathlib import Path

import torch

from torchrec_neuroshard.heuristics import BASELINES
from torchrec_neuroshard.lab.collect import append_rows, read_rows
from torchrec_neuroshard.lab.planners import geomean, ratio_cells
from torchrec_neuroshard.types import Plan, Task

HERE = Path(__file__).parent
PLANS = HERE / "results" / "gpu_plans.json.gz"
MEASURED = HERE / "results" / "gpu_compute.jsonl.gz"
SIZES = ((20, 4), (40, 4), (40, 8), (60, 8))
SEEDS = (0, 1)
PLANNERS = ("neuroshard", "torchrec", *BASELINES)


# ---------------------------------------------------------------- here: plan


def prepare(path: Path = PLANS, scale: object = None, sizes: tuple[tuple[int, int], ...] = SIZES) -> None:
    """Plan every task with every planner; ``scale`` (default full size) and ``sizes``
    only change for a quick check on a CPU."""
    from benchmarks.fullsize import FULL_SIZE, plan_with, topology_for
    from torchrec_neuroshard.costmodel import cost_model_for
    from torchrec_neuroshard.lab.workloads import generate_task, synthetic_pool
    from torchrec_neuroshard.search import predicted_breakdown

    pool = synthetic_pool()
    out = []
    for tables, devices in sizes:
        for seed in SEEDS:
            task = generate_task(pool, tables, devices, scale or FULL_SIZE, seed=100 + seed)
            model = cost_model_for(topology_for(task)).with_batch_size(task.batch_size)
            entry = {"task": json.loads(task.to_json()), "plans": {}, "predicted_compute_ms": {}, "errors": {}}
            for name in PLANNERS:
                try:  # TorchRec: default proposers under its own 120 s timeout
                    plan, _ = plan_with("torchrec_timeout" if name == "torchrec" else name, task, model, torchrec_timeout=120)
                except Exception as e:  # noqa: BLE001 - a baseline that fails is reported, not hidden
                    entry["errors"][name] = f"{type(e).__name__}: {e}"
                    continue
                _, per_device = predicted_breakdown(model, task, plan)
                entry["plans"][name] = plan.to_dict()
                entry["predicted_compute_ms"][name] = [d.compute for d in per_device]
            out.append(entry)
            print(f"T={tables} D={devices} seed {seed}: planned {sorted(entry['plans'])}, failed {sorted(entry['errors'])}")
    with gzip.open(path, "wt") as f:
        json.dump(out, f)
    print(f"wrote {path}")


# ---------------------------------------------------------------- on the GPU: measure


def measure(out_dir: Path, path: Path = PLANS, deadline_s: float = 300.0, repeats: int = 10) -> None:
    from torchrec_neuroshard.hardware import local_hardware
    from torchrec_neuroshard.lab.evaluate import _measure_compute_round, lookup_groups, task_lookups
    from torchrec_neuroshard.lab.launch import default_device

    device = default_device()
    name = local_hardware(device.type).name
    t0 = time.perf_counter()
    with gzip.open(path, "rt") as f:
        entries = json.load(f)
    out_dir.mkdir(parents=True, exist_ok=True)
    for i, entry in enumerate(entries):
        task = Task.from_json(json.dumps(entry["task"]))
        lookups = task_lookups(task)
        plans = {k: Plan.from_dict(v) for k, v in entry["plans"].items()}
        for k, plan in plans.items():  # the evaluator's compute half: every device's kernels
            groups, replicated = lookup_groups(task, plan, [[t.name for t in task.tables]])
            per_device = _measure_compute_round(task, groups, replicated, lookups, device, 3, repeats)
            row = {"task": i, "tables": len(task.tables), "devices": task.num_devices, "planner": k,
                   "measured_ms": [fwd + bwd for fwd, bwd in per_device],
                   "predicted_ms": entry["predicted_compute_ms"][k], "gpu": name, "torch": torch.__version__}
            append_rows(out_dir / MEASURED.name, [row])
            if time.perf_counter() - t0 > deadline_s:
                print(f"deadline reached in task {i} after {k}; stopping", flush=True)
                return
        print(f"task {i} (T={len(task.tables)}, D={task.num_devices}) measured, {time.perf_counter() - t0:.0f} s", flush=True)


# ---------------------------------------------------------------- here: report


def _model_accuracy(device_pred: list[float], device_meas: list[float]) -> list[str]:
    """The stored prediction of every measured device against its measurement."""
    from scipy.stats import spearmanr

    pairs = [(p, m) for p, m in zip(device_pred, device_meas) if m > 0]
    if not pairs:
        return []
    mape = statistics.fmean(abs(p - m) / m for p, m in pairs)
    rho = spearmanr([p for p, _ in pairs], [m for _, m in pairs]).statistic
    return [
        f"The H200 compute model's prediction of these devices, as stored by `prepare` (the fp32-only h200.pt "
        f"that planned them; it prices column shards only: a device holding row blocks or replicas is "
        f"under-predicted): MAPE {100 * mape:.1f}%, Spearman {rho:.3f} over "
        f"{len(pairs)} devices."
    ]


def report(path: Path = MEASURED) -> str:
    """The table: per device the median over measurement rounds, a plan's compute the max
    over its devices; the spread is the range of the plan's per-round compute."""
    rows = read_rows(path)
    gpu = rows[0]["gpu"]
    runs: dict[int, dict[str, list[dict]]] = {}
    for r in rows:
        runs.setdefault(r["task"], {}).setdefault(r["planner"], []).append(r)
    rounds = max(len(v) for t in runs.values() for v in t.values())
    names = [n for n in PLANNERS if any(n in t for t in runs.values())]
    lines = [
        f"Compute part of each plan, MEASURED on one {gpu} (max over devices of the device's kernels' "
        f"forward+backward, per-device median of {rounds} rounds, ms; communication not included), and its "
        "ratio to TorchRec's plan. Spread: range of the plan's compute over the rounds, % of its median.",
        "",
        "| task | T | D | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    ratios: dict[str, list[float]] = {n: [] for n in names}
    wins = 0
    spreads = []
    device_pred, device_meas = [], []
    for i, t in sorted(runs.items()):
        first = next(iter(t.values()))[0]
        compute = {}
        for n, rs in t.items():
            per_device = [statistics.median(col) for col in zip(*(r["measured_ms"] for r in rs))]
            compute[n] = max(per_device)
            per_round = [max(r["measured_ms"]) for r in rs]
            spreads.append((max(per_round) - min(per_round)) / compute[n])
            device_pred += rs[0]["predicted_ms"]
            device_meas += per_device
        cells = ratio_cells(compute, names, ratios, "failed", digits=3)
        if "neuroshard" in compute and all(compute["neuroshard"] <= compute[h] for h in BASELINES if h in compute):
            wins += 1
        lines.append(f"| {i} | {first['tables']} | {first['devices']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Geometric mean of measured compute / TorchRec's: "
        + ", ".join(f"{n} {geomean(v):.3f}" for n, v in ratios.items() if v)
        + f". Median spread over rounds {100 * statistics.median(spreads):.1f}% (max {100 * max(spreads):.1f}%).",
        f"NeuroShard's compute part at or below every heuristic's on {wins} of {len(runs)} tasks "
        "(heuristics that failed to plan a task are left out of that task).",
    ]
    lines += _model_accuracy(device_pred, device_meas)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["prepare", "measure", "report"])
    p.add_argument("--out", type=Path, default=HERE / "results", help="measure: folder for gpu_compute.jsonl.gz")
    p.add_argument("--deadline-s", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.step == "prepare":
        prepare()
    elif args.step == "measure":
        measure(args.out, deadline_s=args.deadline_s)
    else:
        text = report()
        print(text)
        (HERE / "results" / "gpu_compute.md").write_text(text + "\n\nReproduce: `python -m benchmarks.gpu_compute report` "
                                                          "(measured with `... measure` on the GPU after `... prepare`).\n")


if __name__ == "__main__":
    main()
