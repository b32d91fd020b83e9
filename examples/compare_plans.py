"""Why switch: NeuroShard's, TorchRec's and two heuristics' plans of one task, every
device's kernels timed here, side by side with what NeuroShard's model predicts.

    python examples/compare_plans.py                        # make demo: 96 tables, 16 devices, 1-2 min
    python examples/compare_plans.py --tables 200 --devices 32 --png runs/mine.png

The task: ``--tables`` tables drawn from a synthetic DLRM-like pool that no shipped model
trained on (``--pool``, a held-out seed), mixed sizes and heat, each at a random width;
rows / 64 and a global batch of 4,096 (the CPU's scale); each device's memory 1.3 x an
even share. Each planner plans it as its users run it, through its public API on the same
meta ``EmbeddingBagCollection``: ``NeuroShardPlanner(...).plan()`` and TorchRec's
``EmbeddingShardingPlanner(...).plan()`` (per-rank batch, pooling factors as constraints,
its default proposers), and the heuristics ``lookup`` and ``size_lookup`` (tables whole,
heaviest first, to the least loaded device).

One CPU cannot run 16 devices at once, so every device's work as DMP builds it (its fused
FBGEMM kernels; data-parallel tables as a dense kernel and full-table update) is timed
here one device at a time (``lab.judge``: two passes in opposite device order, planners
interleaved in an order drawn anew, a fixed reference timed in every round to divide the
machine's drift out, and NeuroShard's plan built and timed a second time: what separates
the two copies is the judge's own error). A plan's compute is its slowest device: the step waits
for it. Collectives are not timed: the emulated devices would run them over a cluster's
links, which NeuroShard prices from the ``Topology`` (as TorchRec's estimator does).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from collections import Counter
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints
from tqdm import tqdm

from torchrec_neuroshard import NeuroShardPlanner
from torchrec_neuroshard.costmodel import cost_model_for
from torchrec_neuroshard.costmodel.shipped import priced_by_links
from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.evaluate import task_lookups
from torchrec_neuroshard.lab.judge import JudgeConfig, judge_plans
from torchrec_neuroshard.lab.judgement import Judged, copy_check, judgements, rank_correlation, ratio_interval, wins
from torchrec_neuroshard.lab.measure_compute import cpu_threads
from torchrec_neuroshard.lab.torchrec_baseline import per_rank_batch, run_torchrec, topology_for
from torchrec_neuroshard.lab.workloads import HELD_OUT_POOL_SEEDS, WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.search import predicted_breakdown
from torchrec_neuroshard.sharding import from_torchrec
from torchrec_neuroshard.tables import module_for_tables
from torchrec_neuroshard.types import Links, Plan, Task

HEURISTICS = ("lookup", "size_lookup")
BAR_WIDTH = 40


def neuroshard_plan(task: Task, model) -> Plan:
    """``NeuroShardPlanner.plan()`` on the task's tables, as a user calls it."""
    constraints = {t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in task.tables}
    planner = NeuroShardPlanner(
        topology_for(task, "cpu"), per_rank_batch(task), constraints=constraints, storage_reservation=0.0, debug=False,
        cost_model=model, access_hists={t.name: t.access_hist for t in task.tables},
    )  # fmt: skip
    return from_torchrec(planner.plan(module_for_tables(task.tables), [EmbeddingBagCollectionSharder()]), task.num_devices)


def torchrec_plan(task: Task) -> Plan:
    """TorchRec's ``EmbeddingShardingPlanner`` as its users run it (``lab.torchrec_baseline``)."""
    run = run_torchrec(task, "cpu", timeout_seconds=None)
    if run.plan is None:
        raise RuntimeError(f"TorchRec's planner found no plan: {run.status}")
    return from_torchrec(run.plan, task.num_devices)


def plan_all(task: Task, model) -> tuple[dict[str, Plan], dict[str, float]]:
    """Every planner's plan of ``task`` and its planning seconds (end to end)."""
    makers = {"neuroshard": lambda: neuroshard_plan(task, model), "torchrec": lambda: torchrec_plan(task)}
    makers.update({name: (lambda name=name: baseline_plan(name, task)) for name in HEURISTICS})
    plans, seconds = {}, {}
    for name, make in makers.items():
        t0 = time.perf_counter()
        plans[name] = make()
        seconds[name] = time.perf_counter() - t0
        plans[name].validate(task)
        print(f"planned {name:<12} {seconds[name]:6.2f} s", flush=True)
    return plans, seconds


def measure(task: Task, plans: dict[str, Plan], config: JudgeConfig) -> tuple[dict[str, Judged], tuple | None]:
    """Every device of every plan timed here by ``lab.judge``'s protocol (steadied by its
    reference where ``config`` times one), and the run's check against itself where
    ``config`` times a copy of the first plan (``judgement.copy_check``)."""
    draws = [task_lookups(task, seed=0, draw=d) for d in range(config.draws)]
    with threadpool_limits(1), cpu_threads(1):
        rows = judge_plans(task, plans, draws, config, progress=lambda it: tqdm(it, desc="devices timed", leave=False))
    return judgements(rows, task.num_devices, config), copy_check(rows, task.num_devices, config)


def predicted(task: Task, plans: dict[str, Plan], model) -> dict[str, np.ndarray]:
    """Each plan's per-device compute (fwd + bwd ms) as NeuroShard's model prices it [devices]."""
    out = {}
    for name, plan in plans.items():
        _, devices = predicted_breakdown(model, task, plan)
        out[name] = np.array([d.compute for d in devices])
    return out


def kinds(plan: Plan) -> str:
    counts = Counter(p.kind.value for p in plan.placements)
    return ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))


def summary(judged: dict[str, Judged], predictions: dict[str, np.ndarray], seconds: dict[str, float], plans: dict[str, Plan]) -> str:
    """One row per planner: measured compute, the ratio to NeuroShard's with its interval, units won, prediction."""
    won = wins(judged)
    lines = [
        "| planner | plan() s | measured compute ms (slowest device) | slowest / mean device | NeuroShard / this (90% interval) "
        "| units fastest | predicted ms | device rank correlation | kinds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in judged.items():
        ratio, low, high = ratio_interval(judged["neuroshard"], result)
        corr = rank_correlation(predictions[name], result.per_device)
        lines.append(
            f"| {name} | {seconds[name]:.2f} | {result.compute_ms:.2f} | {result.imbalance:.2f} | {ratio:.3f} ({low:.3f}-{high:.3f}) "
            f"| {won[name]} of {len(result.times)} | {predictions[name].max():.2f} | {corr:.2f} | {kinds(plans[name])} |"
        )
    return "\n".join(lines)


def best_heuristic(judged: dict[str, Judged]) -> str:
    return min(HEURISTICS, key=lambda name: judged[name].compute_ms)


def bars(judged: dict[str, Judged], predictions: dict[str, np.ndarray], shown: list[str]) -> str:
    """A terminal bar per device and planner: measured ms (the bar), predicted ms beside it."""
    top = max(judged[name].compute_ms for name in shown)
    width = max(len(name) for name in shown)
    lines = []
    for device in range(len(judged[shown[0]].per_device)):
        for k, name in enumerate(shown):
            ms = float(judged[name].per_device[device])
            bar = "#" * max(1, round(BAR_WIDTH * ms / top))
            slowest = " <- slowest" if ms == judged[name].compute_ms else ""
            label = f"dev {device:>3}" if k == 0 else " " * 7
            lines.append(f"{label}  {name:<{width}}  {bar:<{BAR_WIDTH}}  {ms:7.2f} ms  (predicted {predictions[name][device]:6.2f}){slowest}")
    return "\n".join(lines)


def save_png(path: Path, judged: dict[str, Judged], predictions: dict[str, np.ndarray], shown: list[str], title: str) -> None:
    """Grouped bars per device (measured) with the model's prediction as a tick on each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = np.arange(len(judged[shown[0]].per_device))  # [devices]
    step = 0.8 / len(shown)
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(devices)), 4.5))
    for k, name in enumerate(shown):
        x = devices - 0.4 + step * (k + 0.5)  # [devices]
        ax.bar(x, judged[name].per_device, step, label=f"{name}: slowest {judged[name].compute_ms:.1f} ms")
        ax.plot(x, predictions[name], "k_", markersize=8)
    ax.plot([], [], "k_", label="NeuroShard's model: predicted")
    ax.set(xlabel="device", ylabel="measured compute, ms", title=title, xticks=devices)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=96)
    p.add_argument("--devices", type=int, default=16)
    p.add_argument("--pool", type=int, default=HELD_OUT_POOL_SEEDS[0], help="the pool's seed (default one no shipped model trained on)")
    p.add_argument("--seed", type=int, default=1, help="which tables are drawn from the pool, and their widths")
    p.add_argument("--draws", type=int, default=2, help="batches of ids each device is timed on")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per draw")
    p.add_argument("--png", type=Path, default=Path("runs/compare_plans.png"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(message)s")  # TorchRec's planner logs kept to errors
    logging.getLogger("torchrec_neuroshard").setLevel(logging.WARNING)  # ours: which model, tables it was not trained on
    task = generate_task(synthetic_pool(seed=args.pool), args.tables, args.devices, WorkloadScale(), seed=args.seed)
    topology = topology_for(task, "cpu")
    task = dataclasses.replace(task, links=Links.of(topology))  # predictions price collectives on the topology's links
    model = priced_by_links(cost_model_for(topology), topology).with_batch_size(task.batch_size)  # the shipped model for this machine
    title = f"{args.tables} tables of held-out pool {args.pool} on {args.devices} emulated devices, global batch {task.batch_size}"
    print(f"{title}\nNeuroShard's cost model: the shipped one measured on {model.hardware.name} ({model.hardware.cores} cores)", flush=True)
    plans, seconds = plan_all(task, model)
    judged, check = measure(task, plans, JudgeConfig(passes=2, draws=args.draws, rounds=args.rounds, repeats=3, reference=True, copy=True))
    predictions = predicted(task, plans, model)
    shown = ["neuroshard", "torchrec", best_heuristic(judged)]
    print(f"\n{summary(judged, predictions, seconds, plans)}")
    units = len(judged["neuroshard"].times)
    print(
        f"compute: the slowest device's median over {units} units (pass x draw x round), each time divided by a fixed "
        "reference's timed in the same round (the machine's drift); below 1.000, NeuroShard's plan is the faster"
    )
    ratio, low, high = check
    print(
        f"the judge against itself: NeuroShard's plan built and timed a second time read {ratio:.3f} ({low:.3f}-{high:.3f}) "
        f"of itself{'' if low <= 1.0 <= high else ': its interval leaves out 1, so this run cannot resolve plans that close'}\n"
    )
    print(f"Per device, measured compute (bars) and NeuroShard's model's prediction:\n{bars(judged, predictions, shown)}")
    save_png(args.png, judged, predictions, shown, title)
    print(f"\nchart: {args.png}")


if __name__ == "__main__":
    main()
