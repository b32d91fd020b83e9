"""Planning time beyond HBM, this code against an earlier commit, in one interleaved run.

    python -m studies.uvm_speed_ab --before 91b4e68 [--rounds 2] [--tables 856]

``benchmarks.uvm --speed`` times one tree; this machine's speed drifts between runs by as
much as a change saves, so a speed-up is measured here: ``benchmarks.uvm``'s five tasks,
each planned by NeuroShard in this tree and in a temporary git worktree of ``--before``,
in turn, ``--rounds`` times, every plan in a fresh process on one thread (the module built
before the clock starts; the clock includes reading the model files, as a user's first
plan does). Per task: the median (range) wall seconds of each, their ratio,
and whether both made the same plan (a digest of ``Plan.to_dict``). Writes
``studies/results/uvm_speed_ab_<tables>.md``.
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


def plan_once(task_index: int, tables: int) -> dict:
    """Plan one task as ``benchmarks.uvm._timed_plan`` does, with the ``torchrec_neuroshard``
    and ``benchmarks`` on the path (so ``--before`` needs that function: c9e4634 or later);
    wall s, plan digest, step."""
    import hashlib
    import logging

    import torch

    from benchmarks.uvm import TASKS, _timed_plan
    from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    devices, seed, to_host = TASKS[task_index]
    task = generate_task(synthetic_pool(), tables, devices, WorkloadScale(1, 65_536), seed=seed)
    wall, _, planner = _timed_plan(task, to_host)
    digest = hashlib.sha1(json.dumps(planner.plan_.to_dict(), sort_keys=True).encode()).hexdigest()[:12]
    return {"wall_s": wall, "digest": digest, "step_ms": planner.search_result_.predicted_cost_ms, "label": f"{devices}/{to_host:.0%}"}


def timed_in(tree: Path, task_index: int, tables: int) -> dict:
    """``plan_once`` in a fresh process whose package and benchmarks are ``tree``'s."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    child = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--one", str(task_index), "--tables", str(tables)],
        cwd=tree, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(child.stdout.strip().splitlines()[-1])


def compare(before: Path, rounds: int, tables: int, tasks: range) -> str:
    from benchmarks.uvm import median_range  # here, not at the top: a child imports the other tree's benchmarks

    rows = {(k, name): [] for k in tasks for name in ("before", "after")}
    for r in range(rounds):
        for k in tasks:
            for name, tree in (("before", before), ("after", HERE)):
                rows[k, name].append(timed_in(tree, k, tables))
                print(r, k, name, json.dumps(rows[k, name][-1]), flush=True)
    lines = ["| D / bytes to host | before: wall s | after: wall s | after / before (medians) | same plan |", "|---|---|---|---|---|"]
    for k in tasks:
        old, new = ([x["wall_s"] for x in rows[k, n]] for n in ("before", "after"))
        same = {x["digest"] for x in rows[k, "before"]} == {x["digest"] for x in rows[k, "after"]}
        lines.append(
            f"| {rows[k, 'after'][0]['label']} | {median_range(old)} | {median_range(new)} "
            f"| {statistics.median(new) / statistics.median(old):.3f} | {'yes' if same else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", help="the earlier commit (any git revision)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tables", type=int, default=856)
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(plan_once(args.one, args.tables)))
        return
    if not args.before:
        p.error("--before REV is required")
    rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=HERE, capture_output=True, check=True)
        try:
            table = compare(tree, args.rounds, args.tables, range(5))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=HERE, capture_output=True)
    out = RESULTS / f"uvm_speed_ab_{args.tables}.md"
    out.write_text(
        f"# Planning beyond HBM: {head} (after) against {rev} (before)\n\n"
        f"`python -m studies.uvm_speed_ab --before {rev} --rounds {args.rounds} --tables {args.tables}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, one thread of this 2-core machine; each plan in a fresh "
        "process, the two trees in turn, task by task)\n\n" + table + "\n"
    )
    print(out.read_text())


if __name__ == "__main__":
    main()
