"""Did pricing the all-to-all's wait in ms (not scaled with the batch) make NeuroShard's
plans faster or slower? Two ``benchmarks.dmp_step`` results files of the same tasks, one
planned before the fix and one after, give each task two NeuroShard plans; both run under
DMP in one run, their training steps interleaved, as ``benchmarks.dmp_step`` runs them.

    git show fb5946e:benchmarks/results/dmp_step_batch32768_heldout.jsonl.gz > runs/before.jsonl.gz
    python -m studies.wait_fix_step runs/before.jsonl.gz \
        benchmarks/results/dmp_step_batch32768_heldout.jsonl.gz --steps 30

Prints a table and writes it to ``studies/results/wait_fix_step.md``. Any other change of
the planner is compared the same way, under its own labels and file:

    git show a93cf38:benchmarks/results/dmp_step_batch512_heldout.jsonl.gz > runs/old/dmp_step_batch512_heldout.jsonl.gz
    python -m studies.wait_fix_step runs/old/dmp_step_batch512_heldout.jsonl.gz \
        benchmarks/results/dmp_step_batch512_heldout.jsonl.gz --tasks T60_D2_pool2 --steps 200 \
        --labels "uniform room (before)" "room per device (shipped)" --out studies/results/room_step.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

import torch

from studies.dmp_ranks import task_of
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.dmp_measure import PlannedTask, measure_task
from torchrec_neuroshard.lab.dmp_model import StepConfig, StepModel, with_ebcs
from torchrec_neuroshard.lab.launch import default_device
from torchrec_neuroshard.sharding import to_torchrec
from torchrec_neuroshard.types import Plan

OUT = Path(__file__).parent / "results" / "wait_fix_step.md"
BEFORE, AFTER = "wait scaled (before)", "wait in ms (shipped)"


def plans_by_task(path: Path) -> dict[str, dict]:
    """The NeuroShard rows of a ``dmp_step`` results file, by task label."""
    return {r["task"]: r for r in read_rows(path) if r["planner"] == "neuroshard" and r.get("plan")}


def planned(label: str, before: dict, after: dict, config: StepConfig, names: tuple[str, str] = (BEFORE, AFTER)) -> PlannedTask:
    """The task of ``label`` (regenerated as ``dmp_step`` generated it) with both plans,
    named ``names``."""
    task = with_ebcs(task_of(label, int(after["batch_size"])), config)
    model = StepModel(task, config, torch.device("cpu"))
    plans = {name: to_torchrec(Plan.from_dict(r["plan"]), model, default_device().type) for name, r in zip(names, (before, after))}
    return PlannedTask(task, label, plans, {}, {name: True for name in plans})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tasks", nargs="*", help="these task labels only (default every task of both files)")
    p.add_argument("--labels", nargs=2, default=[BEFORE, AFTER], metavar=("BEFORE", "AFTER"), help="the two plans' names")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    before, after = plans_by_task(args.before), plans_by_task(args.after)
    names = tuple(args.labels)
    chosen = [label for label in after if label in before and (args.tasks is None or label in args.tasks)]  # the run's order
    options = "".join(f" {flag}" for flag in _options(args))
    lines = [
        f"# NeuroShard's plans: {names[0]} and {names[1]}, on the DMP step", "",
        f"`python -m studies.wait_fix_step {args.before} {args.after} --steps {args.steps} --warmup {args.warmup}{options}`; "
        f"{datetime.date.today()}; 2 gloo ranks, one torch thread each; both plans' steps interleaved. "
        "Step: median of the timed steps (the slowest rank's), ms.", "",
        f"| task | batch | plans differ | {names[0]} | {names[1]} | after / before |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    ratios = []
    for label in chosen:
        config = StepConfig(**{**after[label]["config"], "steps": args.steps, "warmup": args.warmup})
        rows = {r["planner"]: r for r in measure_task(planned(label, before[label], after[label], config, names), config)}
        ms = [rows[name]["step_ms"] for name in names]
        ratios.append(ms[1] / ms[0])
        same = before[label]["plan"] == after[label]["plan"]
        lines.append(f"| {label} | {after[label]['batch_size']} | {'no' if same else 'yes'} | {ms[0]:.1f} | {ms[1]:.1f} | {ratios[-1]:.3f} |")
        print(lines[-1], flush=True)
    lines += ["", f"Geometric mean of after / before: {statistics.geometric_mean(ratios):.3f} over {len(ratios)} tasks."]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _options(args: argparse.Namespace) -> list[str]:
    """The command line's options beyond the defaults, as given."""
    options = [f"--tasks {' '.join(args.tasks)}"] if args.tasks else []
    if tuple(args.labels) != (BEFORE, AFTER):
        options.append("--labels " + " ".join(f'"{name}"' for name in args.labels))
    return options + ([f"--out {args.out}"] if args.out != OUT else [])


if __name__ == "__main__":
    main()
