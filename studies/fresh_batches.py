"""Does the judge's repeated batch flatter small devices? Each device of the scale benchmark's
stored plans timed as the judge times it and as a training step runs it.

    taskset -c 1 python -m studies.fresh_batches measure --devices 16 --pool-seed 2
    python -m studies.fresh_batches report

The judge (``lab.judge``) times a device's kernel as one untimed step then the median of 3
on ONE batch of ids, back to back, and so do the training kernels (``lab.collect``): a kernel
whose rows fit the caches reads them warm from its step before. A training step under DMP
reads the next batch (the same tables and hot rows, other ids). Here every plan's work at
a device (``judge.DeviceWork``, built once) is timed both ways in the same rounds, plans'
order drawn per device and round, the two ways alternating which goes first:
- "repeat": the judge's way on one draw of ids (``FIRST_DRAW``);
- "fresh": one untimed step on the next draw, then one timed step on each of 3 more draws
  (the median): no step reads the batch of the step before it.
Ids come from draws the judge's runs never timed. Rows (resumable by device) go to
results/fresh_batches.jsonl.gz; ``report`` writes results/fresh_batches.md: per plan, its
compute (slowest device) each way and over the best heuristic's; per device, fresh / repeat
against the bytes of rows a batch reads there (``nets.shard_footprint``), the two ways'
ranking of a plan's devices, and the planning model's (the row's ``predicted_ms``) against each.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.scale import judged_on, scale_task, stored_plans, task_draws
from benchmarks.scale_report import PLANNED, latest_plans
from torchrec_neuroshard.costmodel.nets import shard_footprint
from torchrec_neuroshard.lab.collect import append_rows, read_rows
from torchrec_neuroshard.heuristics import BASELINES
from torchrec_neuroshard.lab.judge import CPU, DeviceWork, JudgeConfig, time_steps
from torchrec_neuroshard.lab.judgement import rank_correlation
from torchrec_neuroshard.lab.measure_compute import Step, time_forward_backward

HERE = Path(__file__).parent / "results"
ROWS, OUT = HERE / "fresh_batches.jsonl.gz", HERE / "fresh_batches.md"
PLANNERS = ("neuroshard_shift", "neuroshard_knee", "torchrec_timeout", "lookup", "size_lookup")
FIRST_DRAW = 40
"""Draws 40-44: the judge's runs timed draws 0-33."""
FRESH = 3
ROUNDS = 2


def fresh_ms(by_draw: list[list[Step]]) -> float:
    """Each of a device's steps once untimed on ``by_draw[0]``'s ids, then once timed on each
    later draw's: the median, summed over the steps."""
    total = 0.0
    for j, (forward, backward) in enumerate(by_draw[0]):
        backward(forward())
        total += statistics.median(time_forward_backward(*draw[j], CPU, 0, 1).total_ms for draw in by_draw[1:])
    return total


def time_device(task, plans: dict, device: int, draws: list) -> list[dict]:
    """Both ways, ``ROUNDS`` rounds, for every plan's work at ``device``."""
    work = {n: DeviceWork(task, p, device) for n, p in plans.items()}
    steps = {n: [sum(w.steps(d), []) for d in draws] for n, w in work.items()}  # [draw][step]
    times: dict[str, dict[str, list[float]]] = {n: {"repeat": [], "fresh": []} for n in plans}
    rng = np.random.default_rng([3, device])
    for r in range(ROUNDS):
        for n in [list(plans)[i] for i in rng.permutation(len(plans))]:
            for way in ("repeat", "fresh") if r % 2 == 0 else ("fresh", "repeat"):
                times[n][way].append(round(time_steps(steps[n][0], JudgeConfig().repeats, CPU) if way == "repeat" else fresh_ms(steps[n][1:]), 4))
    rows = []
    for n, plan in plans.items():
        shards = plan.device_shards(task.tables)[device]
        footprint = sum(shard_footprint(s, task.batch_size) for s in shards)
        rows.append({"device": device, "planner": n, **{f"{w}_ms": t for w, t in times[n].items()}, "footprint_mb": round(footprint / 2**20, 3), "shards": len(shards)})
    return rows


def measure(num_devices: int, pool_seed: int, planners: list[str]) -> None:
    task, plans = scale_task(num_devices, pool_seed), stored_plans(num_devices, pool_seed, planners)
    key = {"devices": num_devices, "pool_seed": pool_seed, "planners": sorted(plans), "cpu": judged_on(), "first_draw": FIRST_DRAW}
    done = {r["device"] for r in read_rows(ROWS) if {k: r.get(k) for k in key} == key} if ROWS.exists() else set()
    draws = task_draws(num_devices, pool_seed, 2 + FRESH, FIRST_DRAW)
    for device in tqdm([d for d in range(num_devices) if d not in done], desc=f"pool {pool_seed} D={num_devices} devices"):
        append_rows(ROWS, [{**key, **row} for row in time_device(task, plans, device, draws)])


# ---------------------------------------------------------------- report

WAYS = ("repeat", "fresh")


def compute(rows: list[dict], way: str) -> dict[str, float]:
    """Per planner, its slowest device's median over rounds, timed ``way``."""
    return {n: max(statistics.median(r[f"{way}_ms"]) for r in rows if r["planner"] == n) for n in dict.fromkeys(r["planner"] for r in rows)}


def task_lines(rows: list[dict], predicted: dict[str, list[float]]) -> list[str]:
    """A task's table: per plan, its compute each way, over the best heuristic's, and its devices' ranks."""
    lines = []
    by_way = {w: compute(rows, w) for w in WAYS}
    best = {w: min((n for n in by_way[w] if n in BASELINES), key=by_way[w].get, default=None) for w in WAYS}
    for name in by_way["repeat"]:
        mine = sorted((r for r in rows if r["planner"] == name), key=lambda r: r["device"])
        medians = {w: [statistics.median(r[f"{w}_ms"]) for r in mine] for w in WAYS}
        cells = [f"{by_way[w][name]:.1f}" for w in WAYS] + [f"{by_way['fresh'][name] / by_way['repeat'][name]:.3f}"]
        cells += [f"{by_way[w][name] / by_way[w][best[w]]:.3f} ({best[w]})" if best[w] else "-" for w in WAYS]
        cells += [f"{rank_correlation(medians['repeat'], medians['fresh']):.2f}", f"{rank_correlation(*zip(*(r['repeat_ms'][:2] for r in mine))):.2f}"]
        cells += [f"{rank_correlation(predicted[name], medians[w]):.2f}" if name in predicted else "-" for w in WAYS]
        lines.append(f"| {rows[0]['pool_seed']} | {rows[0]['devices']} | {name} | " + " | ".join(cells) + " |")
    return lines


def device_lines(rows: list[dict]) -> list[str]:
    """Per task: each device's fresh / repeat, its spread, and its correlation with the footprint (logs)."""
    ratio = np.array([statistics.median(r["fresh_ms"]) / statistics.median(r["repeat_ms"]) for r in rows])
    itself = np.array([r["repeat_ms"][1] / r["repeat_ms"][0] for r in rows])  # the judge's way against itself
    footprint = np.log(np.array([max(r["footprint_mb"], 1e-6) for r in rows]))
    corr = float(np.corrcoef(np.log(ratio), footprint)[0, 1]) if len(rows) > 2 else float("nan")
    low, mid, high = np.percentile(ratio, [10, 50, 90])
    fp = np.exp(np.percentile(footprint, [10, 90]))
    spread = np.percentile(itself, [10, 90])
    return [
        f"| {rows[0]['pool_seed']} | {rows[0]['devices']} | {len(rows)} | {mid:.3f} ({low:.3f}-{high:.3f}) "
        f"| {np.median(itself):.3f} ({spread[0]:.3f}-{spread[1]:.3f}) | {fp[0]:.1f}-{fp[1]:.1f} | {corr:+.2f} |"
    ]


def report() -> str:
    rows = read_rows(ROWS)
    planned = read_rows(PLANNED)
    tasks = sorted({(r["pool_seed"], r["devices"]) for r in rows}, key=lambda t: (t[1], t[0]))
    plan_lines, dev_lines = [], []
    for pool_seed, devices in tasks:
        mine = [r for r in rows if (r["pool_seed"], r["devices"]) == (pool_seed, devices)]
        if len({r["device"] for r in mine}) < devices:
            continue  # in progress
        latest = latest_plans(planned, pool_seed, devices)
        predicted = {n: latest[n]["predicted_ms"] for n in dict.fromkeys(r["planner"] for r in mine) if n in latest}
        plan_lines += task_lines(mine, predicted)
        dev_lines += device_lines(mine)
    text = "\n".join([
        "# The judge's repeated batch against fresh batches", "",
        f"`python -m studies.fresh_batches measure --devices D --pool-seed P` then `report`; written "
        f"{datetime.date.today().isoformat()} on {', '.join(sorted({r['cpu'] for r in rows}))} (one thread on one core). "
        "Repeat: one untimed step then the median of 3 on one batch, the judge's way; fresh: each timed step on the "
        f"next draw of ids (draws {FIRST_DRAW}-{FIRST_DRAW + 1 + FRESH}), as training steps run. Each device's median of "
        f"{ROUNDS} rounds; a plan's compute is its slowest device's.", "",
        "| pool | D | plan | compute ms, repeat | fresh | fresh / repeat | / best heuristic, repeat | fresh "
        "| devices ranked alike (Spearman, repeat vs fresh) | repeat's round 1 vs round 2 | planning model's rank vs repeat | vs fresh |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *plan_lines, "",
        "Per device, every plan's: fresh / repeat (median, 10th-90th percentile), beside the judge's way against "
        "itself (its round 2 / round 1), the bytes of rows a batch reads there (MB, 10th-90th percentile) and the "
        "correlation of fresh / repeat with them (logs): a negative one is a judge that flatters the devices whose rows "
        "fit the caches.", "",
        "| pool | D | devices | fresh / repeat | repeat, round 2 / round 1 | footprint MB | corr. with footprint |",
        "|---|---|---|---|---|---|---|",
        *dev_lines,
    ]) + "\n"
    OUT.write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--devices", type=int, required=True)
    m.add_argument("--pool-seed", type=int, required=True)
    m.add_argument("--planners", nargs="+", default=list(PLANNERS))
    sub.add_parser("report")
    args = p.parse_args(argv)
    if args.command == "measure":
        measure(args.devices, args.pool_seed, args.planners)
    print(report())


if __name__ == "__main__":
    main()
