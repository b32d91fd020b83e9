"""Does a device run slower than the model prices it when it holds more columns than the
others, and does capping each device's columns make NeuroShard's plans faster? Held-out
pools, issue 43.

    python -m studies.dim_cap evidence
    taskset -c 1 python -m studies.dim_cap plan --devices 8 --pool-seeds 2 4
    taskset -c 1 python -m studies.dim_cap measure --devices 8 --pool-seeds 2 4
    python -m studies.dim_cap report

``evidence``: every device of every plan judged so far (``benchmarks/results/scale_measured``,
timed on an AMD EPYC; ``studies/results/machine_model_measured``, on an Intel Xeon), its
measured / predicted ms (predicted by the shipped ``cpu.pt`` as ``benchmarks.scale`` plans
with it) over its plan's mean of that ratio, against its dim sum and its lookup columns
(width x pooling factor, summed) over their plan's means: per machine and D the pooled
correlation and the least-squares slope of each. A positive slope on dims: the wider
device runs slower than priced. ``plan``: NeuroShard as ``benchmarks.scale`` plans it
(the shipped cpu.pt, links-priced comm) by today's search (``neuroshard_now``) and with its
max-dimension scales cut to ``CAPPED`` and no local search (``neuroshard_dimcap``: the local
search moves shards whatever their columns), rows appended to
``results/dim_cap_planned.jsonl.gz``. ``measure``: both beside the stored plans of
``PLANNERS`` by the scale benchmark's judge (``results/dim_cap_measured.jsonl.gz``,
resumable). ``report``: all of it, ``results/dim_cap.md``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from benchmarks.scale import judge_task, planned_row, planning_model, task_draws
from benchmarks.scale_report import MEASURED as SCALE_MEASURED
from benchmarks.scale_report import PLANNED as SCALE_PLANNED
from benchmarks.scale_report import beside_stored, judged_task, latest_plans, task_lines
from studies.machine_model import MEASURED as MACHINE_MEASURED
from studies.machine_model import PLANNED as MACHINE_PLANNED
from studies.task_steps import over_tasks, task_parser
from torchrec_neuroshard.lab.collect import append_rows, read_rows
from torchrec_neuroshard.lab.judge import JudgeConfig
from torchrec_neuroshard.lab.refine import device_compute
from torchrec_neuroshard.search import SearchConfig, search
from torchrec_neuroshard.types import CostModel, Plan, Task

RESULTS = Path(__file__).parent / "results"
PLANNED = RESULTS / "dim_cap_planned.jsonl.gz"
MEASURED = RESULTS / "dim_cap_measured.jsonl.gz"
REPORT = RESULTS / "dim_cap.md"
CAPPED = (1.0, 1.025, 1.05)
"""The max-dimension scales of the capped search: a device's dim sum within 1.05 x the mean."""
VARIANTS = {"neuroshard_now": SearchConfig(), "neuroshard_dimcap": SearchConfig(scales=CAPPED, local_search=False)}
"""The searches ``plan`` runs, by planner name."""
PLANNERS = ("neuroshard", "lookup", "size_lookup")
"""The scale benchmark's stored plans, timed beside the capped one."""
JUDGED = (("AMD EPYC (scale.md)", SCALE_MEASURED, SCALE_PLANNED), ("Intel Xeon (machine_model.md)", MACHINE_MEASURED, MACHINE_PLANNED))
"""(machine, measured rows, planned rows) of the judged runs the evidence reads (the scale
benchmark's rows name no CPU: its report does)."""


def device_features(task: Task, model: CostModel, plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per device [D]: ``model``'s predicted compute ms, the dim sum and the lookup columns
    (width x pooling factor, summed) of its shards."""
    pooling = {t.name: t.pooling_factor for t in task.tables}
    lookups = np.zeros(task.num_devices)
    for p in plan.placements:
        for width, device in zip(p.widths, p.devices):
            lookups[device] += width * pooling[p.table]
    return device_compute(model, task, plan), np.asarray(plan.device_dims(), dtype=float), lookups


def evidence_lines() -> list[str]:
    """The evidence table (see the module docstring)."""
    lines = [
        "| machine | D | plans | devices | dims: correlation | dims: slope | lookup columns: correlation | lookup columns: slope |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for machine, measured_path, planned_path in JUDGED:
        measured, planned = read_rows(measured_path), read_rows(SCALE_PLANNED) + read_rows(planned_path)
        pooled: dict[int, list[np.ndarray]] = {}
        for pool_seed, devices in sorted({(r["pool_seed"], r["devices"]) for r in measured}):
            stored, (task, model) = latest_plans(planned, pool_seed, devices), planning_model(devices, pool_seed)
            for name, judged in judged_task(measured, pool_seed, devices).items():
                predicted, dims, lookups = device_features(task, model, Plan.from_dict(stored[name]["plan"]))
                ratio = judged.per_device / predicted
                pooled.setdefault(devices, []).append(np.stack([ratio / ratio.mean(), dims / dims.mean(), lookups / lookups.mean()]))
        for devices, parts in sorted(pooled.items()):
            error, dims, lookups = np.concatenate(parts, axis=1) - 1.0  # [3, devices of every plan], 0 at a plan's mean
            cells = [f"{np.corrcoef(x, error)[0, 1]:+.2f} | {float(x @ error / (x @ x)):+.3f}" for x in (dims, lookups)]
            lines.append(f"| {machine} | {devices} | {len(parts)} | {error.size} | {cells[0]} | {cells[1]} |")
    return lines


def plan(devices: int, pool_seed: int) -> None:
    task, model = planning_model(devices, pool_seed)
    for name, config in VARIANTS.items():
        row = {
            "pool_seed": pool_seed, "devices": devices, "planner": name, "model": "shipped cpu.pt",
            "scales": [x if math.isfinite(x) else "inf" for x in config.scales],
            "local_search": config.local_search,
        }  # fmt: skip

        def searched(config: SearchConfig = config) -> tuple[Plan, dict]:
            result = search(task, model, config)
            return result.plan, {"note": f"{result.states_evaluated} split states"}

        append_rows(PLANNED, [planned_row(row, searched, lambda p: (task, model))])


def _planned(devices: int, pool_seed: int) -> dict[str, dict]:
    """The task's stored scale plans of ``PLANNERS`` and this study's, by planner."""
    return beside_stored(read_rows(PLANNED), pool_seed, devices, PLANNERS)


def measure(devices: int, pool_seed: int, config: JudgeConfig) -> None:
    plans = {n: Plan.from_dict(r["plan"]) for n, r in _planned(devices, pool_seed).items()}
    judge_task(devices, pool_seed, plans, config, task_draws(devices, pool_seed, config.draws), MEASURED)


def report() -> str:
    lines = [
        "# A device's columns: what the model misses, and a cap on them", "",
        "`python -m studies.dim_cap evidence`, `plan`, `measure`, `report` (see the study's docstring).", "",
        "## Every judged plan's devices: measured / predicted against dims and lookup columns (each over its plan's mean)", "",
    ] + evidence_lines()  # fmt: skip
    measured = read_rows(MEASURED)
    tasks = sorted({(r["pool_seed"], r["devices"]) for r in measured})
    if tasks:
        lines += [
            "", f"## NeuroShard by today's search (`neuroshard_now`) and with its scales cut to {list(CAPPED)}, no local search "
            f"(`neuroshard_dimcap`), judged on {measured[0]['cpu']}", "",
            "| D | planner | compute ms | slowest / mean device | / TorchRec | / best heuristic timed | units fastest "
            "| predicted ms | planning s (load) | kinds |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
    spreads = []
    for pool_seed, devices in tasks:
        rows = _planned(devices, pool_seed)
        lines += [f"| pool {pool_seed} | | | | | | | | | |"] + task_lines(pool_seed, devices, rows, judged_task(measured, pool_seed, devices))
        spread = {n: np.max(d := Plan.from_dict(r["plan"]).device_dims()) / np.mean(d) for n, r in rows.items()}
        spreads.append(f"- pool {pool_seed}, D = {devices}: " + ", ".join(f"{n} {x:.2f}" for n, x in spread.items()))
    if spreads:
        lines += ["", "A device's dim sum, widest / mean:", ""] + spreads
    REPORT.write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = task_parser(__doc__, ["evidence", "plan", "measure", "report"], devices=[8], pool_seeds=[2, 4]).parse_args(argv)
    if args.step in ("evidence", "report"):
        print("\n".join(evidence_lines()) if args.step == "evidence" else report())
        return
    config = JudgeConfig(rounds=args.rounds)
    over_tasks(args, plan if args.step == "plan" else lambda devices, pool_seed: measure(devices, pool_seed, config))


if __name__ == "__main__":
    main()
