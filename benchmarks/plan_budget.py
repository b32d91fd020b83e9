"""How long ``NeuroShardPlanner.plan()`` takes end to end on many small tables, and
whether ``timeout_seconds`` bounds the whole call (issue 41).

    taskset -c 1 python -m benchmarks.plan_budget
    taskset -c 1 python -m benchmarks.plan_budget --profile 3000   # cProfile of one plan()
    taskset -c 1 python -m benchmarks.plan_budget --stages 3000    # wall seconds in each stage

What a user has: an ``EmbeddingBagCollection`` on the meta device of T small tables
(seeded random rows 1k-1M, dims from {16, 32, 64, 128}), a cuda ``Topology(world_size=8,
compute_device="cuda")``, TorchRec's default sharders. Each row is one ``plan()`` call,
timed end to end (table collection, kinds, offload attempts, search), after one warm-up
plan that loads the cost model. Targets: 1,000 / 3,000 / 10,000 tables without a budget
in 2 / 5 / 15 s; 3,000 tables with ``timeout_seconds=1`` within 2 s.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import inspect
import logging
import pstats
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from torch import nn

DIMS = (16, 32, 64, 128)
TARGETS = ((1000, None, 2.0), (3000, None, 5.0), (10000, None, 15.0), (3000, 1.0, 2.0))
"""(tables, timeout_seconds, seconds the plan() call may take)."""


@dataclass(frozen=True)
class Row:
    """One timed plan() call: its tables, budget, seconds, and the plan's placements."""

    tables: int
    timeout: float | None
    seconds: float
    placed: int

    def __post_init__(self) -> None:
        if self.tables <= 0 or self.seconds < 0:
            raise ValueError(f"Row(tables={self.tables}, seconds={self.seconds}): give a positive table count and time")


def small_tables_model(tables: int, seed: int = 0) -> nn.Module:
    """An EBC on the meta device of ``tables`` tables: rows log-uniform in 1k-1M, dims from ``DIMS``."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    rng = np.random.default_rng(seed)
    rows = np.exp(rng.uniform(np.log(1_000), np.log(1_000_000), tables)).astype(np.int64)  # [T]
    dims = rng.choice(DIMS, tables)  # [T]
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=int(d), num_embeddings=int(r), feature_names=[f"f{i}"])
        for i, (r, d) in enumerate(zip(rows, dims))
    ]
    return EmbeddingBagCollection(tables=configs, device=torch.device("meta"))


def planner_for(timeout: float | None, config=None):
    """The planner a user makes: 8 cuda ranks, TorchRec's default topology otherwise
    (``config``: its ``search_config``, None: the default)."""
    from torchrec.distributed.planner.types import Topology

    from torchrec_neuroshard.planner import NeuroShardPlanner
    from torchrec_neuroshard.search import SearchConfig

    topology = Topology(world_size=8, compute_device="cuda")
    return NeuroShardPlanner(topology, timeout_seconds=timeout, debug=False, search_config=config or SearchConfig())


def time_plan(tables: int, timeout: float | None, seed: int = 0) -> Row:
    """One plan() of ``small_tables_model(tables)``, timed end to end."""
    from torchrec.distributed.sharding_plan import get_default_sharders

    model, sharders, planner = small_tables_model(tables, seed), get_default_sharders(), planner_for(timeout)
    start = time.perf_counter()
    planner.plan(model, sharders)
    seconds = time.perf_counter() - start
    return Row(tables, timeout, seconds, len(planner.plan_.placements))


def profile(tables: int, timeout: float | None, top: int) -> None:
    """cProfile of one plan() call, the ``top`` functions by cumulative time."""
    time_plan(20, None)  # loads the cost model and TorchRec's imports
    profiler = cProfile.Profile()
    profiler.enable()
    row = time_plan(tables, timeout)
    profiler.disable()
    print(f"plan() of {tables} tables, timeout_seconds={timeout}: {row.seconds:.2f} s")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(top)


STAGES = (
    ("torchrec_neuroshard.search.splits", "greedy_runs", "beam: greedy runs"),
    ("torchrec_neuroshard.search.joint", "choose_kinds", "kinds stage"),
    ("torchrec_neuroshard.search.joint", "improve_plan", "local search"),
    ("torchrec_neuroshard.search.joint", "baseline_plan", "heuristics' plans"),
    ("torchrec_neuroshard.offload", "tables_kernel_options", "offload: kernel options"),
    ("torchrec_neuroshard.planner", "module_tables", "table collection"),
)
"""(module, function, label) of the stages ``--stages`` times: each function as the module
that calls it holds it, wrapped in a wall clock (cProfile's overhead lands on small calls)."""


@contextmanager
def wall_clocks(targets: Sequence[tuple[object, str, str]]) -> Iterator[dict[str, list]]:
    """While inside: each ``(owner, name, label)`` of ``targets`` (a module or class and the
    function it holds) wrapped in a wall clock; yields ``{label: [seconds, calls]}``."""
    spent = {label: [0.0, 0] for *_, label in targets}

    def timed(function, label):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                spent[label][0] += time.perf_counter() - start
                spent[label][1] += 1

        return wrapper

    kept = [inspect.getattr_static(owner, name) for owner, name, _ in targets]  # a staticmethod stays one
    for (owner, name, label), held in zip(targets, kept):
        wrapped = timed(getattr(owner, name), label)
        setattr(owner, name, staticmethod(wrapped) if isinstance(held, staticmethod) else wrapped)
    try:
        yield spent
    finally:
        for (owner, name, _), held in zip(targets, kept):
            setattr(owner, name, held)


def stages(tables: int) -> None:
    """Wall seconds and calls of each of ``STAGES`` in one plan() of ``tables`` tables."""
    time_plan(20, None)  # loads the cost model and TorchRec's imports
    with wall_clocks([(importlib.import_module(m), name, label) for m, name, label in STAGES]) as spent:
        row = time_plan(tables, None)
    print(f"plan() of {tables:,} tables: {row.seconds:.2f} s")
    for label, (seconds, calls) in spent.items():
        print(f"  {label}: {seconds:.2f} s in {calls} calls")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=1, help="plan() calls per row (the median is reported)")
    p.add_argument("--profile", type=int, default=0, help="profile one plan() of this many tables instead")
    p.add_argument("--stages", type=int, default=0, help="time the stages of one plan() of this many tables instead")
    p.add_argument("--timeout", type=float, default=None, help="timeout_seconds of the profiled plan()")
    p.add_argument("--top", type=int, default=40, help="functions the profile prints")
    p.add_argument("--quick", action="store_true", help="skip the 10,000-table row")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.getLogger("torchrec_neuroshard").setLevel(logging.ERROR)
    with threadpool_limits(limits=1):
        if args.profile:
            return profile(args.profile, args.timeout, args.top)
        if args.stages:
            return stages(args.stages)
        time_plan(20, None)  # warm-up: the cost model and TorchRec's imports
        targets = [t for t in TARGETS if not (args.quick and t[0] > 3000)]
        rows = []
        for tables, timeout, limit in tqdm(targets, desc="plan() calls"):
            runs = [time_plan(tables, timeout) for _ in range(args.repeats)]
            rows.append((sorted(runs, key=lambda r: r.seconds)[len(runs) // 2], limit))
    print("\n| tables | timeout_seconds | plan() s | target s | met | tables placed |")
    print("|---|---|---|---|---|---|")
    for row, limit in rows:
        budget = "none" if row.timeout is None else f"{row.timeout:g}"
        met = "yes" if row.seconds <= limit else "NO"
        print(f"| {row.tables:,} | {budget} | {row.seconds:.2f} | {limit:g} | {met} | {row.placed:,} |")


if __name__ == "__main__":
    main()
