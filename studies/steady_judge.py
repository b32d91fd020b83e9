"""Does a reference timed in every round take this machine's drift out of the judge?
Held-out pools, issue 43 (item 2: a judge that resolves plans on a noisy 2-core machine).

    taskset -c 1 python -m studies.steady_judge measure --devices 8 16 --pool-seeds 2 3 4
    python -m studies.steady_judge report

The judge times a plan device by device, each device's block of rounds at its own moment,
so a machine whose speed moves by the minute puts its drift on whole devices, and a plan's
compute (its slowest device) on whichever device drew the slow minutes. ``measure``: the
scale benchmark's stored plans of ``PLANNERS`` judged as ``benchmarks.scale`` judges them,
with ``JudgeConfig.reference`` on (one fixed device's work timed in every round), rows
appended to ``results/steady_judge_measured.jsonl.gz`` (resumable). ``report``: the same
rows judged plain and steadied by the reference (``Judged.steadied``), side by side, with
what says which is nearer the truth without knowing it: the two passes time the same
kernels on the same ids at different moments, so their disagreement is the judge's own
noise. ``results/steady_judge.md``.

The report also asks how much room the steadied judge leaves below the best heuristic
(``room_lines``, as ``studies.headroom`` asks of the evaluator): no plan of the same kernels
measures below its mean device, and a perfectly balanced plan still reads its slowest
device's noise. And whether this machine's own model (``intel_xeon.pt``, trained on pool 0
here) ranks the devices of each plan better than the shipped ``cpu.pt`` the plans were made
with (``ranking_lines``).
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np

from benchmarks.scale import judge_task, planning_model, stored_plans, task_draws
from benchmarks.scale_report import PLANNED as SCALE_PLANNED
from benchmarks.scale_ratios import best_heuristic
from benchmarks.scale_report import judged_task, last_judged, model_lines, ok_rows, task_lines
from studies.task_steps import over_tasks, task_parser
from torchrec_neuroshard.costmodel import PRETRAINED_DIR
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.judge import REFERENCE, JudgeConfig
from torchrec_neuroshard.lab.judgement import Judged, rank_correlation
from torchrec_neuroshard.lab.refine import device_compute
from torchrec_neuroshard.types import Plan

RESULTS = Path(__file__).parent / "results"
MEASURED = RESULTS / "steady_judge_measured.jsonl.gz"
REPORT = RESULTS / "steady_judge.md"
PLANNERS = ("neuroshard", "torchrec_timeout", "lookup", "size_lookup")
"""The scale benchmark's stored plans judged here; the first one's device 0 is the reference."""
MODELS = {"cpu.pt (planned the plans)": None, "intel_xeon.pt (this machine's)": str(PRETRAINED_DIR / "intel_xeon.pt")}
"""The models ``ranking_lines`` prices every plan's devices with, by label (None: the shipped cpu.pt)."""


def measure(devices: int, pool_seed: int, config: JudgeConfig) -> None:
    judge_task(devices, pool_seed, stored_plans(devices, pool_seed, PLANNERS), config, task_draws(devices, pool_seed, config.draws), MEASURED)


def pass_disagreement(judged: dict[str, Judged], passes: int) -> float:
    """The judge's own noise: over every device of every plan, the spread (standard
    deviation, %) of log(the device's median in the first pass / in the second)."""
    logs = []
    for j in judged.values():
        halves = j.times.reshape(passes, -1, j.times.shape[1])  # [passes, units a pass, devices]
        logs.append(np.log(np.median(halves[0], axis=0) / np.median(halves[1], axis=0)))
    return float(np.std(np.concatenate(logs)) * 100)


def block_spread(judged: dict[str, Judged], blocks: int) -> float:
    """The spread (%) of a device's (pass, draw) blocks about its own median, over every
    device of every plan: the drift and the draws' differences together."""
    logs = []
    for j in judged.values():
        block = np.log(np.median(j.times.reshape(blocks, -1, j.times.shape[1]), axis=1))  # [blocks, devices]
        logs.append((block - np.median(block, axis=0)).ravel())
    return float(np.std(np.concatenate(logs)) * 100)


def expected_max(devices: int, draws: int = 200_000, seed: int = 0) -> float:
    """E[max of ``devices`` independent standard normals], by simulation."""
    return float(np.random.default_rng(seed).standard_normal((draws, devices)).max(axis=1).mean())


def room_lines(by_task: dict[tuple[int, int], dict[str, Judged]], passes: dict[tuple[int, int], int]) -> list[str]:
    """Per task (steadied): the least mean device of any plan judged (the balanced bound)
    and how far the other plans' means lie above it,
    what a perfectly balanced plan's slowest device would read through this judge's noise
    (the bound x exp(E[max of D normals] x sigma), sigma the noise of a device's median over
    both passes, half the pass disagreement), and that over the best heuristic's compute:
    the lowest NeuroShard / best heuristic reachable with these kernels, beside NeuroShard's."""
    lines = [
        "| task | least mean device, ms (plan) | most / least mean of the plans | a balanced plan read through the noise, ms "
        "| best heuristic, ms | reachable / best heuristic | NeuroShard / best heuristic | NeuroShard's slowest / mean |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for (pool_seed, devices), judged in sorted(by_task.items()):
        means = {name: float(j.per_device.mean()) for name, j in judged.items()}
        least = min(means, key=means.get)
        sigma = pass_disagreement(judged, passes[pool_seed, devices]) / 100 / 2
        balanced = means[least] * float(np.exp(expected_max(devices) * sigma))
        best = best_heuristic(judged)
        ours = judged["neuroshard"]
        lines.append(
            f"| pool {pool_seed}, D = {devices} | {means[least]:.1f} ({least}) | {max(means.values()) / means[least]:.3f} | {balanced:.1f} "
            f"| {judged[best].compute_ms:.1f} ({best}) "
            f"| {balanced / judged[best].compute_ms:.3f} | {ours.compute_ms / judged[best].compute_ms:.3f} | {ours.imbalance:.2f} |"
        )
    return lines


def ranking_lines(by_task: dict[tuple[int, int], dict[str, Judged]], planned_all: dict) -> list[str]:
    """Per D and model (``MODELS``): the median over tasks of the rank correlation of its
    predicted compute with the steadied measured compute of a plan's devices, NeuroShard's
    plans and every plan."""
    ranks: dict[tuple[int, str, bool], list[float]] = {}
    for (pool_seed, devices), judged in sorted(by_task.items()):
        for label, path in MODELS.items():
            task, model = planning_model(devices, pool_seed, path)
            for name, measured in judged.items():
                predicted = device_compute(model, task, Plan.from_dict(planned_all[pool_seed, devices][name]["plan"]))  # [D]
                rho = rank_correlation(predicted, measured.per_device)
                for ours in {name == "neuroshard", False}:
                    ranks.setdefault((devices, label, ours), []).append(rho)
    lines = ["| D | model | NeuroShard's plans | every plan |", "|---|---|---|---|"]
    for devices, label in sorted({(d, m) for d, m, _ in ranks}):
        mine, every = ranks[devices, label, True], ranks[devices, label, False]
        lines.append(f"| {devices} | {label} | {statistics.median(mine):+.2f} ({', '.join(f'{r:+.2f}' for r in mine)}) | {statistics.median(every):+.2f} |")
    return lines


def report() -> str:
    measured = read_rows(MEASURED)
    tasks = sorted({(r["pool_seed"], r["devices"]) for r in measured})
    cpu = measured[-1]["cpu"] if measured else "-"
    lines = [
        f"# The judge steadied by a reference, on {cpu}", "",
        "`python -m studies.steady_judge measure`, `report` (see the study's docstring): the scale benchmark's stored "
        "plans, held-out pools, rows / 64, global batch 4,096, one thread. Each task is shown twice from the same rows: "
        "plain (as `benchmarks.scale` reports) and steadied (every time divided by the reference's in the same round "
        "and device, times the reference's median). Columns as in benchmarks/results/scale.md.", "",
        "| task | judged | pass 1 against pass 2 (sd of the log, %) | blocks about their device (sd, %) |",
        "|---|---|---|---|",
    ]  # fmt: skip
    tables, planned_all, by_kind, passes = [], {}, {False: {}, True: {}}, {}
    for pool_seed, devices in tasks:
        last = last_judged(measured, pool_seed, devices)
        first = last[0]
        passes[pool_seed, devices] = first["passes"]
        if not any(r["planner"] == REFERENCE for r in last):
            raise ValueError(f"pool {pool_seed}, D = {devices}: its last run timed no reference; measure it again with this study")
        planned = planned_all[pool_seed, devices] = ok_rows(read_rows(SCALE_PLANNED), pool_seed, devices, PLANNERS)
        for steady in (False, True):
            judged = judged_task(measured, pool_seed, devices, steady=steady)
            if not judged:
                continue
            by_kind[steady][pool_seed, devices] = judged
            label = "steadied" if steady else "plain"
            noise = f"{pass_disagreement(judged, first['passes']):.1f} | {block_spread(judged, first['passes'] * first['draws']):.1f}"
            lines.append(f"| pool {pool_seed}, D = {devices} | {label} | {noise} |")
            tables += [f"| pool {pool_seed}, {label} | | | | | | | | | |"] + task_lines(pool_seed, devices, planned, judged)
    lines += [
        "", "## The plans, plain and steadied", "",
        "| D | planner | compute ms | slowest / mean device | / TorchRec | / best heuristic timed | units fastest "
        "| predicted ms | planning s (load) | kinds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ] + tables  # fmt: skip
    for steady, judged in by_kind.items():
        lines += ["", f"## The shipped cpu.pt against the devices, {'steadied' if steady else 'plain'}", ""] + model_lines(planned_all, judged)
    lines += [
        "", "## The room below the best heuristic, steadied", "",
        "No plan of these kernels measures below its mean device; the least mean of the plans judged is the balanced "
        "bound (an estimate from the plans measured, as in `studies.headroom`: a plan doing less work could go below "
        "it). A perfectly balanced plan's slowest device still reads the judge's noise: the bound x exp(E[max of D "
        "standard normals] x sigma), sigma half the task's pass 1 against pass 2 disagreement (a device's median over "
        "both passes). Over the best heuristic's compute, that is the lowest NeuroShard / best heuristic these plans' "
        "kernels can reach on this machine.", "",
    ] + room_lines(by_kind[True], passes)  # fmt: skip
    lines += [
        "", "## Which model ranks a plan's devices, steadied", "",
        "The rank correlation of each model's predicted compute with the measured compute of a plan's devices: the "
        "median over the tasks (NeuroShard's plans: each task's in pool, D order). Both models price every plan; "
        "neither was trained on pools 2-4.", "",
    ] + ranking_lines(by_kind[True], planned_all)  # fmt: skip
    REPORT.write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = task_parser(__doc__, ["measure", "report"], devices=[8, 16], pool_seeds=[2, 3, 4]).parse_args(argv)
    if args.step == "report":
        print(report())
        return
    config = JudgeConfig(rounds=args.rounds, reference=True)
    over_tasks(args, lambda devices, pool_seed: measure(devices, pool_seed, config))


if __name__ == "__main__":
    main()
