"""What does splitting one table by columns cost the step, measured and predicted?

    python -m studies.split_cost [--tasks 0 4 8] [--rounds 5]

For tasks of the evaluator suite (benchmarks/tasks/step_suite.json), the lookup
heuristic's plan of whole tables is measured beside the same plan with its widest table on
device 0 halved, the second half moved to device 1 (``lab/evaluate.py``, interleaved). The
split adds a column-wise lookup group: a second kernel, input distribution and pooled
all-to-all on every rank. The shipped model's whole-step prediction (``predict_step``) of
both plans is printed beside. Writes benchmarks/results/split_cost.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
from pathlib import Path

from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.evaluate import evaluate_plans
from torchrec_neuroshard.stepcost import predict_step
from torchrec_neuroshard.types import Plan, TablePlacement, Task

HERE = Path(__file__).parent


def split_widest(plan: Plan) -> Plan:
    """``plan`` with device 0's widest table halved, its second half on device 1."""
    widest = max((p for p in plan.placements if p.devices == (0,)), key=lambda p: p.widths[0])
    half = widest.widths[0] // 2
    placements = tuple(TablePlacement(p.table, (half, half), (0, 1)) if p is widest else p for p in plan.placements)
    return Plan(placements, plan.num_devices)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", type=int, nargs="+", default=[0, 4, 8])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    tasks = Task.load_all(HERE.parent / "benchmarks" / "tasks" / "step_suite.json")
    model = load_pretrained("cpu")
    lines = [
        "| task | D | plan | measured ms (IQR) | input comm ms | fwd comm ms | bwd comm ms | predicted ms | predicted input / fwd / bwd comm ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i in args.tasks:
        task = tasks[i]
        whole = baseline_plan("lookup", task)
        plans = {"whole tables": whole, "one table split": split_widest(whole)}
        measured = evaluate_plans(task, list(plans.values()), rounds=args.rounds)
        scaled = model.with_batch_size(task.batch_size)
        for (name, plan), m in zip(plans.items(), measured):
            pred = predict_step(scaled, task, plan)
            med = lambda xs: statistics.median(xs)  # noqa: E731 - per-device medians
            lines.append(
                f"| {i} | {task.num_devices} | {name} | {m.cost_ms:.1f} ({m.spread_ms:.1f}) | {med(m.input_comm_ms):.1f} | "
                f"{med([d.fwd_comm for d in m.devices]):.1f} | {med([d.bwd_comm for d in m.devices]):.1f} | {pred.cost_ms:.1f} | "
                f"{med(pred.parts['input_dist']):.1f} / {med([d.fwd_comm for d in pred.devices]):.1f} / "
                f"{med([d.bwd_comm for d in pred.devices]):.1f} |"
            )
            print(lines[-1], flush=True)
    command = "python -m studies.split_cost --tasks " + " ".join(map(str, args.tasks)) + f" --rounds {args.rounds}"
    text = (
        "# The cost of one column split\n\n"
        f"Date: {datetime.date.today()}, load average {os.getloadavg()[0]:.1f} at the end. `{command}` (lab/evaluate.py, plans interleaved; comm medians over devices; "
        "fwd comm includes the input comm and the wait for late devices).\n\n" + "\n".join(lines) + "\n"
    )
    (HERE / "results" / "split_cost.md").write_text(text)
    print(f"wrote {HERE / 'results' / 'split_cost.md'}")


if __name__ == "__main__":
    main()
