"""Planning time, this code against an earlier commit, in one interleaved run.

    python -m studies.plan_speed_ab --before 91b4e68 [--rounds 2] [--tables 856]   # beyond HBM
    python -m studies.plan_speed_ab --suite heldout --before 8ff930d                # held-out pools

``benchmarks.uvm --speed`` and ``benchmarks.search_speed --full-size`` time one tree; this
machine's speed drifts between runs by as much as a change saves, so a speed-up is
measured here. Suites: ``uvm``, ``benchmarks.uvm``'s five tasks (pool 0, 10-90% of the
bytes to host memory); ``heldout``, the 856 full-size tables of held-out pools 2, 3, 4 on
8-128 H200s of 141 GB in hosts of 8, in HBM (``benchmarks.scale.scale_task``'s draws). Each
task is planned by NeuroShard in this tree and in a temporary git worktree of ``--before``,
in turn, ``--rounds`` times, every plan in a fresh process on one thread (the module built
before the clock starts; the clock includes reading the model files, as a user's first
plan does). Per task: the median (range) wall seconds of each, their ratio,
and whether both made the same plan (a digest of ``Plan.to_dict``) and step. Writes
``studies/results/uvm_speed_ab_<tables>.md`` or ``heldout_speed_ab.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
RESULTS = HERE / "studies" / "results"


HELDOUT = tuple((pool, devices) for pool in (2, 3, 4) for devices in (8, 16, 32, 64, 128))
"""The ``heldout`` suite's (pool seed, D)."""


def plan_once(suite: str, task_index: int, tables: int) -> dict:
    """Plan one task of ``suite`` with the ``torchrec_neuroshard`` and ``benchmarks`` on the
    path (the ``uvm`` suite as ``benchmarks.uvm._timed_plan`` does, so ``--before`` needs
    that function: c9e4634 or later); wall s, plan digest, step."""
    import hashlib
    import logging

    import torch

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    if suite == "uvm":
        from benchmarks.uvm import TASKS, _timed_plan
        from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool

        devices, seed, to_host = TASKS[task_index]
        task = generate_task(synthetic_pool(), tables, devices, WorkloadScale(1, 65_536), seed=seed)
        wall, _, planner = _timed_plan(task, to_host)
        label = f"{devices}/{to_host:.0%}"
    else:
        pool, devices = HELDOUT[task_index]
        wall, planner = _timed_heldout(pool, devices)
        label = f"pool {pool}, D = {devices}"
    digest = hashlib.sha1(json.dumps(planner.plan_.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
    return {"wall_s": wall, "digest": digest, "step_ms": planner.search_result_.predicted_cost_ms, "label": label}


def _timed_heldout(pool: int, devices: int, config=None):
    """(wall s, planner) of one ``plan()`` of pool ``pool``'s 856 full-size tables on
    ``devices`` H200s, through the public API only (both trees have it); ``config``: the
    planner's ``search_config`` (None: its default)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import ParameterConstraints, Topology

    from benchmarks.fullsize import FULL_SIZE, GPUS_PER_HOST
    from benchmarks.scale import scale_task
    from torchrec_neuroshard import NeuroShardPlanner
    from torchrec_neuroshard.tables import module_for_tables

    task = scale_task(devices, pool, FULL_SIZE)
    topology = Topology(world_size=devices, compute_device="cuda", hbm_cap=int(141e9), local_world_size=min(GPUS_PER_HOST, devices))
    planner = NeuroShardPlanner(
        topology, task.per_rank_batch, constraints={t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in task.tables},
        debug=False, access_hists={t.name: t.access_hist for t in task.tables},
        **({} if config is None else {"search_config": config}),
    )  # fmt: skip
    module = module_for_tables(task.tables)
    start = time.perf_counter()
    planner.plan(module, [EmbeddingBagCollectionSharder()])
    return time.perf_counter() - start, planner


def timed_in(tree: Path, suite: str, task_index: int, tables: int) -> dict:
    """``plan_once`` in a fresh process whose package and benchmarks are ``tree``'s."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    child = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--suite", suite, "--one", str(task_index), "--tables", str(tables)],
        cwd=tree, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(child.stdout.strip().splitlines()[-1])


def compare(before: Path, suite: str, rounds: int, tables: int, tasks: range) -> str:
    from benchmarks.uvm import median_range  # here, not at the top: a child imports the other tree's benchmarks

    rows = {(k, name): [] for k in tasks for name in ("before", "after")}
    for r in range(rounds):
        for k in tasks:
            for name, tree in (("before", before), ("after", HERE)):
                rows[k, name].append(timed_in(tree, suite, k, tables))
                print(r, k, name, json.dumps(rows[k, name][-1]), flush=True)
    first = "D / bytes to host" if suite == "uvm" else "task"
    lines = [f"| {first} | before: wall s | after: wall s | after / before (medians) | same plan | step ms before -> after |", "|---|---|---|---|---|---|"]
    for k in tasks:
        old, new = ([x["wall_s"] for x in rows[k, n]] for n in ("before", "after"))
        same = {x["digest"] for x in rows[k, "before"]} == {x["digest"] for x in rows[k, "after"]}
        lines.append(
            f"| {rows[k, 'after'][0]['label']} | {median_range(old)} | {median_range(new)} "
            f"| {statistics.median(new) / statistics.median(old):.3f} | {'yes' if same else 'NO'} "
            f"| {rows[k, 'before'][0]['step_ms']:.3f} -> {rows[k, 'after'][0]['step_ms']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", help="the earlier commit (any git revision)")
    p.add_argument("--suite", choices=("uvm", "heldout"), default="uvm")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tables", type=int, default=856)
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(plan_once(args.suite, args.one, args.tables)))
        return
    if not args.before:
        p.error("--before REV is required")
    rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=HERE, capture_output=True, check=True)
        try:
            table = compare(tree, args.suite, args.rounds, args.tables, range(5 if args.suite == "uvm" else len(HELDOUT)))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=HERE, capture_output=True)
    out = RESULTS / (f"uvm_speed_ab_{args.tables}.md" if args.suite == "uvm" else "heldout_speed_ab.md")
    what = "Planning beyond HBM" if args.suite == "uvm" else "Planning held-out pools' 856 full-size tables"
    out.write_text(
        f"# {what}: {head} (after) against {rev} (before)\n\n"
        f"`python -m studies.plan_speed_ab --suite {args.suite} --before {rev} --rounds {args.rounds} --tables {args.tables}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, one thread of this 2-core machine; each plan in a fresh "
        "process, the two trees in turn, task by task)\n\n" + table + "\n"
    )
    print(out.read_text())


if __name__ == "__main__":
    main()
