"""The ``neuroshard`` command: collect / pretrain / calibrate / plan / bench."""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path

from torchrec_neuroshard.types import ShardingError

logger = logging.getLogger(__name__)


def _collect(args: argparse.Namespace) -> None:
    from torchrec_neuroshard.lab import collect
    from torchrec_neuroshard.lab.launch import default_device

    device = default_device()
    t0 = time.perf_counter()
    if args.what == "compute":
        n = collect.collect_compute(
            args.out, args.samples, device, seed=args.seed, num_threads=args.threads,
            precision=args.precision, pooled=args.pooling == "sum",
            **({"tables": tuple(args.tables)} if args.tables else {}),
            batch_sizes=tuple(args.batch_sizes) if args.batch_sizes else None,
        )
        print(f"{args.out}: {n} compute samples ({time.perf_counter() - t0:.0f} s this run)")
    elif args.what == "devices":
        from torchrec_neuroshard.lab.collect_devices import collect_device_pairs

        n = collect_device_pairs(args.out, args.samples, device, seed=args.seed)
        print(f"{args.out}: {n} pairs of device-sized kernels ({time.perf_counter() - t0:.0f} s this run)")
    elif args.what == "comm":
        n = collect.collect_comm(args.out, args.world_size, args.samples, seed=args.seed)
        print(f"{args.out}: {n} comm samples, D={args.world_size} ({time.perf_counter() - t0:.0f} s this run)")
    elif args.what == "step":
        from torchrec_neuroshard.lab.collect_step import STEP_KINDS, collect_step

        counts = collect_step(args.out, args.samples, args.world_sizes, args.kinds or STEP_KINDS, seed=args.seed)
        print(f"{args.out}: {counts} step samples ({time.perf_counter() - t0:.0f} s this run)")
    else:
        cvs = collect.compute_noise(args.samples, args.trials, device, seed=args.seed, num_threads=args.threads)
        print(
            f"compute noise over {len(cvs)} samples x {args.trials} trials: "
            f"median CV {100 * statistics.median(cvs):.1f}%, mean {100 * statistics.mean(cvs):.1f}%, "
            f"max {100 * max(cvs):.1f}%"
        )
        cvs = collect.comm_noise(args.world_size, args.samples, args.trials, seed=args.seed)
        print(
            f"comm noise (D={args.world_size}) over {len(cvs)} sample-devices x {args.trials} trials: "
            f"median CV {100 * statistics.median(cvs):.1f}%, mean {100 * statistics.mean(cvs):.1f}%"
        )


def _pretrain(args: argparse.Namespace) -> None:
    import json

    from torchrec_neuroshard.lab.pretrain import pretrain_files

    named = {"device_name": args.device_name, "cores": args.cores}
    model = pretrain_files(
        args.data, epochs=args.epochs, seed=args.seed, exclude_world_sizes=args.exclude_world_size,
        hardware={k: v for k, v in named.items() if v is not None}, stretch_beyond=args.stretch_beyond,
        batch_shift_paths=args.batch_shift_data,
    )  # fmt: skip
    model.save(args.out)
    print(json.dumps(model.meta["test"], indent=2))
    print(f"saved {args.out} (trained in {model.meta['train_seconds']} s)")


def _calibrate(args: argparse.Namespace) -> None:
    import torch

    from torchrec_neuroshard.costmodel import model_named, pretrained_for
    from torchrec_neuroshard.lab.calibrate import Calibration, busy_machine_warning, calibrate, summary
    from torchrec_neuroshard.lab.launch import default_device

    t0 = time.perf_counter()
    device = torch.device(args.device) if args.device else default_device()
    try:  # before anything is measured or written
        run = Calibration(
            device, Path(args.data_dir), args.samples, args.device_pairs, tuple(args.world_size), args.comm_samples,
            args.step_samples, args.busy_neighbours, args.threads, args.epochs, args.seed,
        )  # fmt: skip
    except ShardingError as e:  # a bad flag, reported as argparse reports one
        raise SystemExit(str(e)) from None
    warning = busy_machine_warning()
    if warning:
        print(warning, file=sys.stderr)
    done = calibrate(pretrained_for(device.type) if args.base is None else model_named(args.base), run)
    done.model.save(args.out)
    for line in summary(done, run, args.out, time.perf_counter() - t0):
        print(line)


def _plan(args: argparse.Namespace) -> None:
    import json

    from torchrec_neuroshard.types import Task

    tasks = list(enumerate(Task.load_all(args.task)))  # before the heavy imports: a bad file fails fast
    suite = len(tasks) > 1
    if args.index is not None:
        if not 0 <= args.index < len(tasks):
            raise ShardingError(
                f"--index {args.index} is out of range: {args.task} holds {len(tasks)} task(s), "
                f"give 0 to {len(tasks) - 1}"
            )
        tasks = [tasks[args.index]]

    from torchrec_neuroshard.costmodel import NeuralCostModel, check_world_size, feature_range_warning, load_pretrained
    from torchrec_neuroshard.heuristics import baseline_plan
    from torchrec_neuroshard.search import predicted_breakdown, search
    from torchrec_neuroshard.stats import format_plan_stats
    from torchrec_neuroshard.stepcost import priced_tables
    from torchrec_neuroshard.tables import sharder_choices

    model = NeuralCostModel.load(args.model) if args.model else load_pretrained()
    for world in sorted({task.num_devices for _, task in tasks}):
        check_world_size(model, world)
    plans = []
    for i, task in tasks:
        if args.planner == "neuroshard":
            result = search(task, model, choices=sharder_choices(task.tables, model.hardware.device))
            plan, devices, note = result.plan, result.devices, f"searched in {result.seconds:.2f} s"
        else:
            plan = baseline_plan(args.planner, task, seed=args.seed)
            _, devices = predicted_breakdown(model, task, plan)
            note = ""
        outside = feature_range_warning(model, priced_tables(task.tables, plan))
        if outside:
            logger.warning("%s%s", f"task {i}: " if suite else "", outside)
        title = f"{args.planner} plan" + (f" of task {i}" if suite else "")
        print(format_plan_stats(plan, task.tables, devices, task.memory_cap_bytes, task.batch_size, title=title))
        if note:
            print(note)
        plans.append(plan.to_dict())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(plans if len(plans) > 1 else plans[0], f, indent=1)
        print(f"{'plans' if len(plans) > 1 else 'plan'} written to {args.out}")


def _checkout() -> Path:
    """The repository checkout the package runs from (an editable install or a clone on
    PYTHONPATH): the folder holding ``torchrec_neuroshard/`` and ``benchmarks/``."""
    import torchrec_neuroshard

    root = Path(torchrec_neuroshard.__file__).resolve().parent.parent
    if not (root / "benchmarks" / "__init__.py").is_file():
        raise ShardingError(
            f"`neuroshard bench` runs the benchmarks of the repository checkout, and there is no "
            f"benchmarks/ beside this installed package ({root}); clone the repository and "
            f"`pip install -e` it"
        )
    return root


def _bench(args: argparse.Namespace) -> None:
    import runpy

    root = str(_checkout())
    if root not in sys.path:
        sys.path.insert(0, root)
    sys.argv = [args.which] + args.rest
    runpy.run_module(f"benchmarks.{args.which}", run_name="__main__")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="neuroshard", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    _add_collect(sub)
    _add_pretrain(sub)
    _add_calibrate(sub)
    _add_plan(sub)
    _add_bench(sub)
    return p


def _add_collect(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("collect", help="measure pre-training samples on this machine")
    c.add_argument(
        "what", choices=["compute", "devices", "comm", "step", "noise"],
        help="devices: pairs of device-sized kernels (16-128 tables) from the training pools, timed in turn (--samples counts pairs)",
    )  # fmt: skip
    c.add_argument("--out", default="neuroshard_data.jsonl", help="JSONL file to append to")
    c.add_argument("--samples", type=int, default=1000, help="total samples wanted in --out (noise: samples re-measured)")
    c.add_argument("--world-size", type=int, default=2, help="comm: ranks to spawn")
    c.add_argument("--world-sizes", type=int, nargs="+", default=[2, 3, 4, 6, 8], help="step: world sizes to measure")
    c.add_argument(
        "--kinds", nargs="+", choices=["input_dist", "all_reduce", "reduce_scatter", "all_gather", "dp", "dp_small", "dp_many"],
        help="step: kinds of samples (default: all); --samples counts each kind at each world size",
    )  # fmt: skip
    c.add_argument("--trials", type=int, default=8, help="noise: re-measurements per sample")
    c.add_argument("--threads", type=int, default=1, help="CPU: torch threads for compute")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"], help="compute: weight dtype")
    c.add_argument("--pooling", default="sum", choices=["sum", "none"], help="compute: pooled bags (EBC) or sequences (EC)")
    c.add_argument(
        "--tables", type=int, nargs=2, metavar=("LOW", "HIGH"),
        help="compute: tables one kernel fuses, drawn uniformly (default 1 to lab.collect.MAX_TABLES_PER_SAMPLE; "
        "give another --seed for another range)",
    )  # fmt: skip
    c.add_argument(
        "--batch-sizes", type=int, nargs=2, metavar=("LOW", "HIGH"),
        help="compute: each sample at its own global batch, log-uniform in LOW..HIGH (default: the device's "
        "scale, 4,096 on a CPU); the model then learns the batch",
    )  # fmt: skip
    c.set_defaults(func=_collect)


def _add_pretrain(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("pretrain", help="train the cost models on collected samples")
    t.add_argument("--data", nargs="+", required=True, help="JSONL(.gz) dataset files")
    t.add_argument("--out", required=True, help="model file to write")
    t.add_argument("--epochs", type=int, default=200)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--exclude-world-size", type=int, nargs="*", default=[], help="hold these world sizes out of training")
    t.add_argument("--device-name", help="name the hardware when the samples do not (older collections)")
    t.add_argument("--cores", type=int, help="CPU cores of the machine when the samples do not record them")
    t.add_argument(
        "--stretch-beyond", type=int, metavar="K",
        help="train kernels of more than K tables as the planner prices them: n / K kernels of K average tables "
        "(default: the net reads any number, and the planner stretches beyond the largest trained)",
    )  # fmt: skip
    t.add_argument(
        "--batch-shift-data", nargs="+", default=[], metavar="FILE",
        help="pooled compute kernels at other batches than --data's one: a batch shift learns how each shard's "
        "cost moves with the batch, the net trained on --data frozen (costmodel.batchshift)",
    )  # fmt: skip
    t.set_defaults(func=_pretrain)


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("calibrate", help="fine-tune the shipped cost model to this machine (minutes)")
    k.add_argument("--out", required=True, help="model file to write")
    k.add_argument("--device", choices=["cpu", "cuda"], help="what to calibrate (default: cuda if a GPU is visible, else cpu)")
    k.add_argument("--base", help="model to start from: a file or a shipped name (default: the shipped one for the device)")
    k.add_argument("--samples", type=int, default=200, help="compute samples to measure (kernels of 1-15 tables)")
    k.add_argument(
        "--device-pairs", type=int, default=0,
        help="CPU: also measure this many pairs of device-sized kernels (16-128 tables, each pair timed in turn) and "
        "fine-tune on their level and ratio (about 8 s a pair on a CPU; default 0: none)",
    )  # fmt: skip
    k.add_argument("--world-size", type=int, nargs="*", default=[], help="also measure and calibrate comm at these world sizes")
    k.add_argument("--comm-samples", type=int, default=100, help="comm samples per world size")
    k.add_argument(
        "--step-samples", type=int, default=0,
        help="with --world-size: also measure the step's other parts (input distribution, collectives, "
        "data-parallel kernel), this many samples of each kind at each world size, and refit them (default 0: kept)",
    )  # fmt: skip
    k.add_argument("--data-dir", default="neuroshard_calibration", help="where the measured samples go (resumable)")
    k.add_argument("--epochs", type=int, default=100, help="most fine-tuning epochs (early-stopped)")
    k.add_argument("--threads", type=int, default=1, help="CPU: torch threads for compute")
    k.add_argument(
        "--busy-neighbours", type=int, default=0,
        help="CPU: time compute with this many other processes running kernels beside it, as the other ranks "
        "of a host do in a training step (e.g. 1 for 2 ranks per host); default 0, the kernel alone",
    )
    k.add_argument("--seed", type=int, default=0)
    k.set_defaults(func=_calibrate)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser("plan", help="plan a task (JSON from the task generator)")
    pl.add_argument("task", help="task JSON file: one task, or a list of tasks (as benchmarks/tasks/suite.json)")
    pl.add_argument("--index", type=int, help="plan only task N of a list (default: every task)")
    pl.add_argument("--planner", default="neuroshard", choices=["neuroshard", "random", "size", "dim", "lookup", "size_lookup"])
    pl.add_argument("--model", help="cost model file (default: the shipped one)")
    pl.add_argument("--out", help="write the plan as JSON (a list of plans when several tasks are planned)")
    pl.add_argument("--seed", type=int, default=0)
    pl.set_defaults(func=_plan)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="run a benchmark from benchmarks/ (costmodel, search_speed, compare, dmp_step, transfer, fullsize)")
    b.add_argument("which", choices=["costmodel", "search_speed", "compare", "dmp_step", "transfer", "fullsize"])
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)


def main(argv: list[str] | None = None) -> int:
    """Run one command. Bad input (a ``ShardingError``: the commands turn malformed files,
    missing fields and bad values into one) and files that cannot be opened are one line on
    stderr and exit code 2, as argparse reports bad arguments; anything else is a bug and
    keeps its traceback."""
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ShardingError, OSError) as e:
        print(f"neuroshard: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
