"""The training step is the judge: step time of a model sharded by each planner under DMP.

    python -m benchmarks.dmp_step --tables 24 40 --pool-seed 0       # generated tasks
    python -m benchmarks.dmp_step --task my_task.json                  # a task file
    python -m benchmarks.dmp_step --quick                              # 2 small tasks, few steps
    python -m benchmarks.dmp_step --calibrated runs/cpu_calibrated.pt  # also NeuroShard with that model
    neuroshard bench dmp_step ...                                      # the same

The model, the harness and the report live in the lab (``lab.dmp_model``,
``lab.dmp_measure``, ``lab.dmp_report``); this script picks the tasks, resumes a results
file (tasks already in it are skipped) and writes JSON lines and a markdown report under
benchmarks/results/.

``--calibrated PATH`` (a model file made by ``neuroshard calibrate``, on this machine)
adds the planner ``neuroshard_calibrated``: NeuroShard's search with that model, measured
interleaved with the others; its rows record the file and its sha256 prefix. Each
NeuroShard variant's "fastest of all planners" leaves the other variant out.

On a 2-core machine run 2 ranks: more ranks than cores measures contention, not the plan.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
from pathlib import Path

from torchrec_neuroshard.costmodel import pretrained_for
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.dmp_measure import PLANNERS, run
from torchrec_neuroshard.lab.dmp_model import StepConfig, generated_tasks
from torchrec_neuroshard.lab.dmp_report import report
from torchrec_neuroshard.lab.launch import default_device
from torchrec_neuroshard.lab.planners import CALIBRATED, CalibratedModel, check_machine
from torchrec_neuroshard.lab.workloads import WorkloadScale
from torchrec_neuroshard.types import Task

HERE = Path(__file__).parent

QUICK_SCALE = WorkloadScale(row_divisor=1024, batch_size=512)
QUICK_CONFIG = StepConfig(steps=3, warmup=1, batches=1)
QUICK_TABLES = (6, 10)


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", type=Path, nargs="*", default=[], help="task JSON files")
    p.add_argument("--tables", type=int, nargs="*", default=[24], help="generated tasks: table counts")
    p.add_argument("--pool-seed", type=int, nargs="*", default=[0], help="generated tasks: pool seeds")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--row-divisor", type=int, default=WorkloadScale().row_divisor)
    p.add_argument("--batch-size", type=int, default=WorkloadScale().batch_size, help="global batch")
    p.add_argument("--steps", type=int, default=StepConfig().steps)
    p.add_argument("--warmup", type=int, default=StepConfig().warmup)
    p.add_argument("--planners", default=",".join(PLANNERS))
    p.add_argument("--quick", action="store_true", help="2 small tasks, few steps (the smoke test)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="directory for NAME.jsonl.gz / NAME.md")
    p.add_argument("--name", default="dmp_step", help="results file stem (resumes: tasks already in it are skipped)")
    p.add_argument("--allow-mismatch", action="store_true", help="plan with a model of other hardware than this machine")
    p.add_argument("--calibrated", type=Path, help=f"a model file made by `neuroshard calibrate`: adds the planner {CALIBRATED}")
    args = p.parse_args(argv)
    args.planners = args.planners.split(",")
    if args.calibrated and CALIBRATED not in args.planners:
        args.planners.append(CALIBRATED)
    unknown = sorted(set(args.planners) - set(PLANNERS) - ({CALIBRATED} if args.calibrated else set()))
    if unknown:
        p.error(f"unknown planners {unknown}; choose from {list(PLANNERS)}, or {CALIBRATED} with --calibrated PATH")
    return args


def _tasks(args: argparse.Namespace) -> tuple[StepConfig, list[tuple[Task, str]]]:
    if args.quick:
        return QUICK_CONFIG, generated_tasks(QUICK_TABLES, [0], args.devices, QUICK_SCALE)
    if args.task:
        return StepConfig(steps=args.steps, warmup=args.warmup), [(Task.load(path), path.stem) for path in args.task]
    scale = WorkloadScale(args.row_divisor, args.batch_size)
    return StepConfig(steps=args.steps, warmup=args.warmup), generated_tasks(args.tables, args.pool_seed, args.devices, scale)


def main(argv: list[str] | None = None) -> None:
    args = _arguments(argv)
    check_machine(pretrained_for(default_device().type), args.allow_mismatch)
    calibrated = CalibratedModel.load(args.calibrated) if args.calibrated else None
    if calibrated is not None:
        check_machine(calibrated.model, args.allow_mismatch, f"{args.calibrated}: ")
    logging.getLogger("torchrec").setLevel(logging.ERROR)  # its topology notice, once per plan
    config, tasks = _tasks(args)
    name = "dmp_step_quick" if args.quick else args.name
    path = args.out / f"{name}.jsonl.gz"
    rows = [] if args.quick else read_rows(path)
    done = {r["task"] for r in rows}
    if calibrated is not None:
        calibrated.check_resumes(rows, path)
    rows += run([(t, label) for t, label in tasks if label not in done], config, args.planners, path, calibrated=calibrated)
    text = (
        f"# Training step time under DistributedModelParallel\n\n"
        f"Date: {datetime.date.today()}. {args.devices} ranks ({default_device().type}), one torch thread each; "
        f"{config.steps} timed steps after {config.warmup} warm-up, interleaved across plans; "
        f"`python -m benchmarks.dmp_step {' '.join(sys.argv[1:] if argv is None else argv)}`\n\n"
        f"{report(rows)}\n"
    )
    (args.out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
