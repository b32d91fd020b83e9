"""Is a device's time fixed when its work is built? Issue 43, item 2: the judge read two
separately built copies of one plan 0.913 (0.852-0.998) apart (research log, "The judge on
two copies of one plan"), and a work timed against itself within one call agrees to 3%
while timed again after a rebuild it moves by up to 16%.

    taskset -c 1 python -m studies.build_bias run --pool-seed 4 --devices 8 --device 4
    THP_MEM_ALLOC_ENABLE=1 taskset -c 1 python -m studies.build_bias run --pool-seed 4 --devices 8 --device 4
    python -m studies.build_bias report
    python -m studies.build_bias pairs --rows studies/results/measured_refinement_measured.jsonl.gz --plans-sha a20c94d03ed1

``pairs``: in a judge's rows, two names that time one plan (the refined plan that kept no
move and the unrefined one; a run's ``COPY`` and its first plan), per run: the log ratio of
their times over every (unit, device), its mean and median, the (unit, device)s in which the
first name was the faster, and the copy check of ``lab.judgement`` (steadied where the run
timed a reference), with the run's order (``JudgeConfig.order``).

``run``: one device of the scale benchmark's stored NeuroShard plan, built ``--builds``
times (``judge.DeviceWork``, each copy its own kernels and bags), the copies timed in
``--rounds`` interleaved rounds with their order rotated (each copy takes each position
equally), all on one draw of ids; then built again, ``--epochs`` times. Rows (one per
copy and round, with its position and the process's ``THP_MEM_ALLOC_ENABLE``: PyTorch's
switch for 2 MB pages under its CPU allocations) go to ``results/build_bias.jsonl.gz``.
``report`` splits the log time's spread into what changes round to round within a copy,
what a copy keeps from its build, and what an epoch shares; and the position's mean.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.scale import scale_task, stored_plans
from torchrec_neuroshard.lab.collect import append_rows, read_rows
from torchrec_neuroshard.lab.evaluate import task_lookups
from torchrec_neuroshard.lab.judge import COPY, DeviceWork, JudgeConfig, time_works
from torchrec_neuroshard.lab.judgement import judgements, ratio_interval

RESULTS = Path(__file__).parent / "results"
ROWS = RESULTS / "build_bias.jsonl.gz"
REPORT = RESULTS / "build_bias.md"


def huge_pages_kb() -> int:
    """This process's anonymous memory in 2 MB pages (kB), from /proc/self/smaps_rollup."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def run(pool_seed: int, devices: int, device: int, builds: int, rounds: int, epochs: int, repeats: int, reverse: bool) -> None:
    torch.set_num_threads(1)
    task = scale_task(devices, pool_seed)
    plan = stored_plans(devices, pool_seed, ("neuroshard",))["neuroshard"]
    lookups = task_lookups(task, draw=0)
    config = JudgeConfig(passes=1, draws=1, rounds=rounds, repeats=repeats)
    key = {"pool_seed": pool_seed, "devices": devices, "device": device, "process": f"{os.getpid()}@{time.time():.0f}",
           "thp": os.environ.get("THP_MEM_ALLOC_ENABLE", "0"), "repeats": repeats, "built_last_first": reverse}  # fmt: skip
    for epoch in tqdm(range(epochs), desc=f"epochs (THP_MEM_ALLOC_ENABLE={key['thp']})"):
        order = range(builds - 1, -1, -1) if reverse else range(builds)
        built = {k: DeviceWork(task, plan, device) for k in order}
        work = {f"copy{k}": built[k] for k in range(builds)}  # timed in copy order, whatever order built them
        rows = time_works(work, device, [lookups], config, rotation=epoch)
        out = []
        for k, row in enumerate(rows):
            for r, ms in enumerate(np.add(row["fused_ms"], row["replicas_ms"])):
                position = (k - (epoch + r)) % builds  # time_works' rotation: round r starts at copy (epoch + r) % builds
                out.append({**key, "epoch": epoch, "copy": k, "round": r, "position": position, "ms": round(float(ms), 3)})
        hp = huge_pages_kb()
        append_rows(ROWS, [{**o, "huge_pages_kb": hp} for o in out])
        del work


def components(rows: list[dict]) -> dict[str, float]:
    """The log time's spread (%, standard deviations) in one process's rows: within a copy
    round to round, between copies of one epoch (what a build fixes, its rounds' noise
    taken out), between epochs; and the geometric mean ms."""
    epochs = sorted({r["epoch"] for r in rows})
    copies = sorted({r["copy"] for r in rows})
    rounds = max(r["round"] for r in rows) + 1
    logs = np.full((len(epochs), len(copies), rounds), np.nan)  # [epoch, copy, round]
    for r in rows:
        logs[epochs.index(r["epoch"]), copies.index(r["copy"]), r["round"]] = np.log(r["ms"])
    copy_means = logs.mean(axis=2)  # [epoch, copy]
    within = float(np.mean(np.var(logs, axis=2, ddof=1)))
    between_copies = float(np.mean(np.var(copy_means, axis=1, ddof=1))) - within / rounds
    between_epochs = float(np.var(copy_means.mean(axis=1), ddof=1)) - float(np.mean(np.var(copy_means, axis=1, ddof=1))) / len(copies)
    return {
        "ms": float(np.exp(logs.mean())),
        "within": 100 * within**0.5,
        "build": 100 * max(between_copies, 0.0) ** 0.5,
        "epoch": 100 * max(between_epochs, 0.0) ** 0.5,
        "copy_range": float(np.exp(np.max(copy_means - copy_means.mean(axis=1, keepdims=True)) - np.min(copy_means - copy_means.mean(axis=1, keepdims=True)))),
    }  # fmt: skip


def position_effect(rows: list[dict]) -> dict[int, float]:
    """Per position in a round, the mean of log(ms / its copy's mean over rounds), %."""
    by_copy: dict[tuple, list[float]] = {}
    for r in rows:
        by_copy.setdefault((r["process"], r["epoch"], r["copy"]), []).append(np.log(r["ms"]))
    out: dict[int, list[float]] = {}
    for r in rows:
        out.setdefault(r["position"], []).append(np.log(r["ms"]) - np.mean(by_copy[(r["process"], r["epoch"], r["copy"])]))
    return {p: 100 * float(np.mean(x)) for p, x in sorted(out.items())}


def copy_effect(rows: list[dict]) -> dict[int, tuple[float, int, int]]:
    """Per copy (the order its work is timed in a round's rotation), the mean over epochs of
    log(its mean ms / the epoch's mean), %, the epochs in which it was the slowest copy, and the epochs."""
    epochs: dict[tuple, dict[int, list[float]]] = {}
    for r in rows:
        epochs.setdefault((r["process"], r["epoch"]), {}).setdefault(r["copy"], []).append(np.log(r["ms"]))
    out: dict[int, list[float]] = {}
    slowest: dict[int, int] = {}
    for by_copy in epochs.values():
        means = {c: float(np.mean(x)) for c, x in by_copy.items()}
        level = float(np.mean(list(means.values())))
        for c, m in means.items():
            out.setdefault(c, []).append(100 * (m - level))
        slowest[max(means, key=means.get)] = slowest.get(max(means, key=means.get), 0) + 1
    return {c: (float(np.mean(x)), slowest.get(c, 0), len(x)) for c, x in sorted(out.items())}


def _started(process: str) -> str:
    """A row's ``process`` (pid@epoch seconds) as the date and time it started."""
    return datetime.datetime.fromtimestamp(int(process.split("@")[1]), datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")


def report() -> str:
    rows = read_rows(ROWS)
    lines = [
        "# Is a device's time fixed when its work is built?",
        "",
        "`python -m studies.build_bias report` over `build_bias.jsonl.gz` (commands: the study's docstring).",
        "Spreads are standard deviations of log ms (%): *within* a copy round to round, what a *build* fixes",
        "(between copies of one epoch, less what their rounds' noise explains), what an *epoch* shares.",
        "",
        "| process started (UTC) | THP_MEM_ALLOC_ENABLE | copies built | task | epochs x copies x rounds | huge pages MB | geomean ms | within % | build % | epoch % | widest copy / narrowest in an epoch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for process in dict.fromkeys(r["process"] for r in rows):
        mine = [r for r in rows if r["process"] == process]
        c, first = components(mine), mine[0]
        shape = f"{len({r['epoch'] for r in mine})} x {len({r['copy'] for r in mine})} x {max(r['round'] for r in mine) + 1}"
        task = f"pool {first['pool_seed']}, D = {first['devices']}, device {first['device']}"
        lines.append(
            f"| {_started(process)} | {first['thp']} | {'last first' if first.get('built_last_first') else 'first first'} | {task} | {shape} | {max(r['huge_pages_kb'] for r in mine) / 1024:.0f} | {c['ms']:.1f} | "
            f"{c['within']:.1f} | {c['build']:.1f} | {c['epoch']:.1f} | {c['copy_range']:.3f} |"
        )  # fmt: skip
    lines += ["", "Per arm: each copy's mean log ms over its epoch's mean (%), and the epochs it was the slowest copy in; the "
              "position in the round, mean log ms over the copy's mean (%).", "",
              "| THP_MEM_ALLOC_ENABLE | copies built | epochs | per copy, in the order timed: % (slowest in) | per position in the round, % |",
              "|---|---|---|---|---|"]  # fmt: skip
    for thp, reverse in sorted({(r["thp"], r.get("built_last_first", False)) for r in rows}):
        arm = [r for r in rows if r["thp"] == thp and r.get("built_last_first", False) == reverse]
        copies, positions = copy_effect(arm), position_effect(arm)
        lines.append(
            f"| {thp} | {'last first' if reverse else 'first first'} | {next(iter(copies.values()))[2]} | "
            + ", ".join(f"{c}: {e:+.1f} ({n})" for c, (e, n, _) in copies.items()) + " | "
            + ", ".join(f"{p}: {e:+.1f}" for p, e in positions.items()) + " |"
        )  # fmt: skip
    REPORT.write_text("\n".join(lines) + "\n")
    return REPORT.read_text()


def pairs(path: str, plans_sha: str, named: list[tuple[str, str]]) -> None:
    """``pairs``'s lines, one per run of ``plans_sha`` in ``path`` and pair present in it."""
    rows = [r for r in read_rows(path) if r.get("plans_sha") == plans_sha]
    for config in dict.fromkeys(JudgeConfig.of(r) for r in rows):
        run = [r for r in rows if JudgeConfig.of(r) == config]
        raw = judgements(run, run[0]["devices"], config, steady=False) | _copy_of(run, config, False)
        steadied = judgements(run, run[0]["devices"], config) | _copy_of(run, config, True)
        for a, b in ((a, b) for a, b in named if a in raw and b in raw):
            logs = 100 * np.log(raw[a].times / raw[b].times).ravel()  # [units x devices]
            ratio, low, high = ratio_interval(steadied[a], steadied[b])
            print(
                f"draws {config.first_draw}-{config.first_draw + config.draws - 1}, order {config.order}: {a} / {b} per (unit, device) "
                f"mean {logs.mean():+.2f}%, median {np.median(logs):+.2f}%, {a} faster in {(logs < 0).sum()} of {logs.size}; "
                f"compute {ratio:.3f} ({low:.3f}-{high:.3f})"
            )  # fmt: skip


def _copy_of(rows: list[dict], config: JudgeConfig, steady: bool) -> dict:
    """The run's copy (``JudgeConfig.copy``) as a plan named ``COPY``, where it timed one."""
    renamed = [{**r, "planner": "copied"} if r["planner"] == COPY else r for r in rows]
    judged = judgements(renamed, rows[0]["devices"], config, steady)
    return {COPY: judged["copied"]} if "copied" in judged else {}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("run", "report", "pairs"))
    parser.add_argument("--rows", help="pairs: a judge's rows (.jsonl.gz)")
    parser.add_argument("--plans-sha", help="pairs: the runs of these plans")
    parser.add_argument("--pair", nargs=2, action="append", help="pairs: two names timing one plan (default: the refined and unrefined, the copy and neuroshard)")
    parser.add_argument("--pool-seed", type=int, default=4)
    parser.add_argument("--devices", type=int, default=8, help="the stored task's D (benchmarks/results/scale_planned)")
    parser.add_argument("--device", type=int, default=4, help="the plan's device built and timed")
    parser.add_argument("--builds", type=int, default=3, help="copies built in an epoch")
    parser.add_argument("--rounds", type=int, default=6, help="rounds an epoch (a multiple of --builds puts each copy in each position equally)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps a round (median), after one untimed")
    parser.add_argument("--reverse", action="store_true", help="build the copies last first (they are still timed in copy order)")
    args = parser.parse_args()
    if args.what == "pairs":
        pairs(args.rows, args.plans_sha, args.pair or [["neuroshard_refined", "neuroshard"], [COPY, "neuroshard"], [COPY, "neuroshard_refined"]])
    elif args.what == "run":
        run(args.pool_seed, args.devices, args.device, args.builds, args.rounds, args.epochs, args.repeats, args.reverse)
    else:
        print(report())
