"""NeuroShard planned with the model of the machine that runs the plan, judged there, on
held-out tables (issue 43).

    taskset -c 1 python -m studies.machine_model plan --devices 8 16 --pool-seeds 2 3 4
    taskset -c 1 python -m studies.machine_model measure --devices 8 16 --pool-seeds 2 3 4
    python -m studies.machine_model report

``benchmarks.scale`` plans every task with the shipped ``cpu.pt``, measured on an AMD EPYC,
and was judged there. On another CPU kind a user's ``NeuroShardPlanner`` loads the model
shipped for that machine where there is one (``costmodel.shipped.pretrained_for``: on an
Intel Xeon, ``intel_xeon.pt``, its nets trained on pool 0 only). ``plan``: NeuroShard with
this machine's model (``--model``, default the one ``pretrained_for("cpu")`` picks here),
as ``neuroshard_<model>``, rows appended to ``results/machine_model_planned.jsonl.gz``.
``measure``: that plan beside the scale benchmark's stored plans of ``PLANNERS`` (the AMD
model's NeuroShard plan among them), by the scale benchmark's judge, rows appended to
``results/machine_model_measured.jsonl.gz`` (resumable). ``report``: the scale report's
tables for these tasks, every plan's per-device prediction by this machine's model,
``results/machine_model.md``.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.fullsize import plan_with
from benchmarks.scale import judge_task, planned_row, planning_model, task_draws
from benchmarks.scale_report import beside_stored, judged_task, model_lines, task_lines
from studies.task_steps import over_tasks, task_parser
from torchrec_neuroshard.costmodel.shipped import shipped_hardware
from torchrec_neuroshard.hardware import local_hardware
from torchrec_neuroshard.lab.collect import append_rows, read_rows
from torchrec_neuroshard.lab.judge import JudgeConfig
from torchrec_neuroshard.search import predicted_breakdown
from torchrec_neuroshard.types import Plan

RESULTS = Path(__file__).parent / "results"
PLANNED = RESULTS / "machine_model_planned.jsonl.gz"
MEASURED = RESULTS / "machine_model_measured.jsonl.gz"
REPORT = RESULTS / "machine_model.md"
PLANNERS = ("neuroshard", "torchrec_timeout", "lookup", "size_lookup")
"""The scale benchmark's stored plans, timed beside this machine's model's."""


def machine_model_name() -> str:
    """The shipped model a planner on this machine loads for a CPU topology."""
    here = local_hardware("cpu")
    return next((name for name, hw in shipped_hardware().items() if here is not None and hw.mismatch(here) is None), "cpu")


def plan(devices: int, pool_seed: int, name: str) -> None:
    task, model = planning_model(devices, pool_seed, name)
    row = {"pool_seed": pool_seed, "devices": devices, "planner": f"neuroshard_{name}", "model": f"{name}.pt"}
    append_rows(PLANNED, [planned_row(row, lambda: plan_with("neuroshard", task, model, 0), lambda p: (task, model))])


def _planned(devices: int, pool_seed: int) -> dict[str, dict]:
    """The task's stored scale plans of ``PLANNERS`` and this study's, by planner."""
    return beside_stored(read_rows(PLANNED), pool_seed, devices, PLANNERS)


def measure(devices: int, pool_seed: int, config: JudgeConfig) -> None:
    plans = {n: Plan.from_dict(r["plan"]) for n, r in _planned(devices, pool_seed).items()}
    judge_task(devices, pool_seed, plans, config, task_draws(devices, pool_seed, config.draws), MEASURED)


def report(name: str) -> str:
    measured = read_rows(MEASURED)
    tasks = sorted({(r["pool_seed"], r["devices"]) for r in measured})
    planned, judged = {}, {}
    for pool_seed, devices in tasks:
        task, model = planning_model(devices, pool_seed, name)
        rows = _planned(devices, pool_seed)
        for n, row in rows.items():  # every plan priced per device by this machine's model
            _, priced = predicted_breakdown(model, task, Plan.from_dict(row["plan"]))
            rows[n] = {**row, "model": f"{name}.pt", "predicted_ms": [d.compute for d in priced]}
        planned[pool_seed, devices], judged[pool_seed, devices] = rows, judged_task(measured, pool_seed, devices)
    cpu = measured[0]["cpu"] if measured else "-"
    lines = [
        f"# NeuroShard with this machine's model ({name}.pt), judged on {cpu}", "",
        "`python -m studies.machine_model plan`, `measure`, `report` (see the study's docstring): held-out pools, rows / 64, "
        "global batch 4,096, one thread. Columns as in benchmarks/results/scale.md; `neuroshard` is the scale benchmark's "
        f"plan by the shipped cpu.pt (AMD EPYC); predicted ms: every plan priced by {name}.pt; planning s and load as stored "
        "(the baselines' from the scale benchmark's run).", "",
        "| D | planner | compute ms | slowest / mean device | / TorchRec | / best heuristic timed | units fastest "
        "| predicted ms | planning s (load) | kinds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for pool_seed, devices in tasks:
        lines += [f"| pool {pool_seed} | | | | | | | | | |"] + task_lines(pool_seed, devices, planned[pool_seed, devices], judged[pool_seed, devices])
    lines += ["", f"## {name}.pt against the measured devices", ""] + model_lines(planned, judged)
    REPORT.write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = task_parser(__doc__, ["plan", "measure", "report"], devices=[8, 16], pool_seeds=[2, 3, 4])
    parser.add_argument("--model", help="the model file or shipped name (default: the one this machine's planner loads)")
    args = parser.parse_args(argv)
    name = args.model or machine_model_name()
    if args.step == "report":
        print(report(name))
        return
    config = JudgeConfig(rounds=args.rounds)
    over_tasks(args, lambda devices, pool_seed: plan(devices, pool_seed, name) if args.step == "plan" else measure(devices, pool_seed, config))


if __name__ == "__main__":
    main()
