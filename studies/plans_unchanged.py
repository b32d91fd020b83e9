"""Does the shipped CPU model still make the plans a DMP-step run measured?

    python -m studies.plans_unchanged benchmarks/results/dmp_step_lowdrift_heldout.jsonl.gz [...]

A ``benchmarks.dmp_step`` run's figures are of the plans it measured. After the model
changes (a retrained ``cpu.pt``) they still describe the shipped planner on the tasks where
it makes the same plans. For each file, each task's stored NeuroShard plan is compared with
the plan the shipped model's search makes now (the task regenerated from its label, table
count and batch, as ``dmp_step`` generated it). Prints a table; writes it to
``studies/results/plans_unchanged.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from studies.dmp_ranks import task_of
from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.dmp_model import StepConfig, with_ebcs
from torchrec_neuroshard.lab.planners import plan_task

OUT = Path(__file__).parent / "results" / "plans_unchanged.md"


def changed_tasks(path: Path) -> tuple[int, list[str]]:
    """The NeuroShard tasks of a ``dmp_step`` results file, and those whose plan the
    shipped model now makes differently."""
    model = load_pretrained("cpu")
    rows = [r for r in read_rows(path) if r["planner"] == "neuroshard" and r.get("plan")]
    changed = []
    for r in rows:
        label = r["task"]
        task = with_ebcs(task_of(label, int(r["batch_size"])), StepConfig(**r["config"]))  # its modules, as dmp_step planned it
        if task.batch_size != int(r["batch_size"]):
            raise ValueError(f"{path.name} {label}: regenerated at batch {task.batch_size}, stored {r['batch_size']}")
        plan = plan_task("neuroshard", task, model)
        if _placements(plan.to_dict()) != _placements(r["plan"]):
            changed.append(label)
    return len(rows), changed


def _placements(plan: dict) -> list[dict]:
    """A plan's placements by table (the stored plan went through TorchRec and back)."""
    return sorted(plan["placements"], key=lambda p: p["table"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", type=Path, help="dmp_step results files (.jsonl.gz)")
    args = p.parse_args(argv)
    lines = ["| results file | NeuroShard tasks | plans the shipped model makes differently now |", "|---|---|---|"]
    for path in args.results:
        count, changed = changed_tasks(path)
        lines.append(f"| {path} | {count} | {', '.join(changed) if changed else 'none'} |")
    text = "\n".join(lines)
    OUT.write_text(
        "# Plans of the measured DMP runs, re-made by the shipped model\n\n"
        f"`python -m studies.plans_unchanged {' '.join(str(p) for p in args.results)}` ({time.strftime('%Y-%m-%d')})\n\n"
        + text + "\n"
    )
    print(text)


if __name__ == "__main__":
    main()
