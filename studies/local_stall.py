"""The local search's stall rule (``SearchConfig.local_window``, ``local_min_gain``): what
it saves and what it gives up, in one interleaved run.

    taskset -c 1 python -m studies.local_stall [--rounds 2] [--large]

Each task is planned through ``plan()`` twice a round, in turn: with the local search
stopping only when no move pays (``local_min_gain=0``, the search before the rule) and with
the default rule. The local searches' rounds (``local._Devices.of``, once a round) are
counted and their seconds summed (``local.local_improve``, wrapped here): the rounds do not
depend on the machine, the seconds do. Tasks: ``benchmarks.plan_budget``'s 1,000 and 3,000 small tables on 8
GPUs (``--large``: and 10,000), and held-out pools 2-4's 856 full-size tables at D = 8, 32
and 128 (``studies.plan_speed_ab``'s). Per task: the local search's rounds and median
seconds, the median (range) wall seconds of ``plan()``, their ratio, whether the plans are the same, and each plan's predicted step (our
model: the objective both searches minimise, so it says what the rule gives up of the
search's own gain, not how the plans run). Writes ``studies/results/local_stall.md``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from benchmarks.plan_budget import wall_clocks
from benchmarks.uvm import median_range
from torchrec_neuroshard.search import SearchConfig
from torchrec_neuroshard.search import local

OUT = Path(__file__).parent / "results" / "local_stall.md"


LOCAL_SEARCH = ((local._Devices, "of", "rounds"), (local, "local_improve", "local search"))
"""What ``wall_clocks`` counts: the local search's rounds (``_Devices.of``, once a round) and its seconds."""


VARIANTS = {"no rule": SearchConfig(local_min_gain=0.0), "rule": SearchConfig()}
HELDOUT = ((2, 8), (3, 8), (4, 8), (2, 32), (3, 32), (4, 32), (2, 128), (3, 128), (4, 128))


def _plan_small(tables: int, config: SearchConfig):
    """(wall s, planner) of one ``plan()`` of ``plan_budget``'s small tables on 8 GPUs."""
    from torchrec.distributed.sharding_plan import get_default_sharders

    from benchmarks.plan_budget import planner_for, small_tables_model

    module, planner = small_tables_model(tables), planner_for(None, config)
    start = time.perf_counter()
    planner.plan(module, get_default_sharders())
    return time.perf_counter() - start, planner


def _tasks(large: bool) -> dict:
    from studies.plan_speed_ab import _timed_heldout

    small = (1000, 3000) + ((10000,) if large else ())
    out = {f"{n:,} small tables, D = 8": (lambda config, n=n: _plan_small(n, config)) for n in small}
    out.update({f"pool {p}, D = {d} (856 full-size)": (lambda config, p=p, d=d: _timed_heldout(p, d, config)) for p, d in HELDOUT})
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--large", action="store_true", help="also 10,000 small tables (about 3 minutes a round)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    tasks = _tasks(args.large)
    rows: dict[tuple[str, str], list[tuple[float, float, str, int, float]]] = {}  # wall s, step ms, plan, rounds, local s
    with threadpool_limits(limits=1):
        _plan_small(20, SearchConfig())  # warm-up: the cost model and TorchRec's imports
        for _ in tqdm(range(args.rounds), desc="rounds"):
            for name, plan in tasks.items():
                for variant, config in VARIANTS.items():
                    with wall_clocks(LOCAL_SEARCH) as spent:
                        wall, planner = plan(config)
                    rows.setdefault((name, variant), []).append(
                        (wall, planner.search_result_.predicted_cost_ms, repr(planner.plan_), spent["rounds"][1], spent["local search"][0])
                    )
    lines = [
        "| task | local search rounds, no rule -> rule | local search s (medians) | plan(): no rule, wall s | rule, wall s "
        "| rule / no rule (medians) | same plan | predicted step ms, no rule -> rule |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in tasks:
        before, after = rows[name, "no rule"], rows[name, "rule"]
        walls = [[run[0] for run in runs] for runs in (before, after)]
        local_s = [statistics.median(run[4] for run in runs) for runs in (before, after)]
        same = {run[2] for run in before} == {run[2] for run in after}
        lines.append(
            f"| {name} | {before[0][3]} -> {after[0][3]} | {local_s[0]:.2f} -> {local_s[1]:.2f} "
            f"| {median_range(walls[0])} | {median_range(walls[1])} | {statistics.median(walls[1]) / statistics.median(walls[0]):.3f} "
            f"| {'yes' if same else 'no'} | {before[0][1]:.4f} -> {after[0][1]:.4f} ({after[0][1] / before[0][1] - 1:+.4%}) |"
        )
    OUT.write_text(
        f"# The local search's stall rule ({SearchConfig().local_window} moves, {SearchConfig().local_min_gain:g} of the cost)\n\n"
        f"`python -m studies.local_stall --rounds {args.rounds}{' --large' if args.large else ''}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, one thread; the two searches in turn, task by task)\n\n"
        + "\n".join(lines) + "\n"
    )  # fmt: skip
    print(OUT.read_text())


if __name__ == "__main__":
    main()
