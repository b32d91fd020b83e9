"""The search's knobs and its answer: ``SearchConfig`` goes in (its defaults are the
published ones), ``SearchResult`` comes out; ``SearchContext`` is what every stage of one
search shares."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from torchrec_neuroshard.stepcost import CachedEmbedder
from torchrec_neuroshard.types import CostModel, DeviceCost, Plan, TableChoices


def default_scales() -> tuple[float, ...]:
    """linspace(1.0, 1.5, 11) as published, plus no dimension limit as a last resort."""
    return tuple(float(x) for x in np.linspace(1.0, 1.5, 11)) + (math.inf,)


@dataclass(frozen=True)
class SearchConfig:
    """Knobs of the search; defaults are the published ones."""

    scales: tuple[float, ...] = field(default_factory=default_scales)
    beam_width: int = 3
    top_k: int = 10
    max_steps: int = 10
    scale_window: int | None = 2
    """The beam's children run at each beam state's best max-dimension scale and this many
    either side of it (and the last, no limit); the root at every scale. None: every scale."""
    min_gain: float = 0.0
    patience: int = 3
    """The beam search stops after ``patience`` depths in a row whose best state lowered the
    best greedy cost so far by less than ``min_gain`` of it (a negative ``min_gain``: it
    goes on for all ``max_steps`` depths). With ``scale_window`` and ``kinds_shortlist``
    (beyond the published search): the same plans on held-out pools 2-4 (856 full-size
    tables, D = 8-128) in 0.28-1.03x the time (studies/results/heldout_speed_ab.md)."""
    local_search: bool = True
    """A final move/swap pass off the bottleneck device (beyond the prototype). Measured over
    two runs of the 20-task suite: 0.998 and 0.985 geomean cost ratio to the search without
    it, lower on 26 of 40 paired tasks (benchmarks/compare.py)."""
    max_local_moves: int = 100
    local_window: int = 10
    local_min_gain: float = 1e-4
    """The local search stops when its last ``local_window`` moves together lowered the
    predicted embedding cost by less than ``local_min_gain`` of it (0: only when no move
    pays, or after ``max_local_moves``). Where devices hold hundreds of small shards each
    move gains a few parts in a million; on 856 full-size tables every ten moves gain far
    more (studies/results/local_stall.md)."""
    seed_with_baselines: bool = True
    """Also score the heuristic baselines' plans and start from the best plan overall, so
    the result is never predicted worse than any baseline."""
    data_parallel_grid: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    """How many of the best-scored replication candidates to try replicating."""
    row_wise_grid: tuple[int, ...] = (0, 1, 2, 4)
    """How many of the costliest row-wise candidates to try splitting by rows."""
    kinds_shortlist: int | None = 8
    """How many kind choices the whole step prices: those of least estimate (their quick
    greedy placement's cost plus what their row splits and replicas add); None: all."""
    kind_scales: tuple[float, ...] = (1.05, 1.25, math.inf)
    """The max-dimension scales of the quick greedy placement that prices each kind choice."""
    deadline: float | None = None
    """A ``time.perf_counter()`` reading past which the search refines no further: the kind
    choice keeps the given placements (or the cheapest kinds priced so far), the beam search
    splits no deeper, the by-module plan is not made and the local searches move no more
    shards; a greedy run that would end past it is dropped, but the root state's (whole
    tables, the fallback) and the heuristics' plans are always made, so the plan is the best
    found by then (the planner's ``timeout_seconds``); None: no limit."""

    def __post_init__(self) -> None:
        if self.local_window < 1 or not 0.0 <= self.local_min_gain < 1.0:
            raise ValueError(
                f"SearchConfig(local_window={self.local_window}, local_min_gain={self.local_min_gain}): give a window of "
                "at least 1 move and a gain in [0, 1) (0: the local search stops only when no move pays)"
            )


def past(deadline: float | None) -> bool:
    """Whether the planning budget's ``deadline`` (a ``time.perf_counter()`` reading; None:
    none) has passed: a stage that refines the plan starts no more work past it."""
    return deadline is not None and time.perf_counter() >= deadline


@dataclass(frozen=True)
class KindChoice:
    """One choice the kinds step (``kinds``) weighed: how many tables it splits by rows and
    how many it replicates, what its quick greedy placement of the other tables costs (inf:
    every run of it ran out of memory), whether that placement put the largest tables first
    (every run with the costliest first ran out of memory), and whether the shortlist kept
    it for the whole step to price (one out of memory is never priced)."""

    rows: int
    replicas: int
    greedy_ms: float
    largest_first: bool
    shortlisted: bool

    def __str__(self) -> str:
        ms = f"{self.greedy_ms:.1f} ms" if math.isfinite(self.greedy_ms) else "out of memory"
        return f"rows {self.rows}, replicas {self.replicas}: {ms}{' (largest first)' if self.largest_first else ''}{'*' if self.shortlisted else ''}"


@dataclass(frozen=True)
class SearchResult:
    """The best plan found, its predicted per-device costs (ms) and search statistics,
    among them the choices of row splits and replicas the kinds step weighed for the
    task's tables placed together (empty where it weighed none: one device, a model that
    prices neither, the planning budget spent)."""

    plan: Plan
    predicted_cost_ms: float
    devices: tuple[DeviceCost, ...]
    states_evaluated: int
    seconds: float
    kind_choices: tuple[KindChoice, ...] = ()


@dataclass(frozen=True)
class SearchContext:
    """What every stage of one search shares: the model (at the task's batch), the
    configuration, each table's choices, the embedding cache, and the answers of the
    stages earlier searches computed (``memo``: ``search``)."""

    model: CostModel
    config: SearchConfig
    choices: Mapping[str, TableChoices]
    embed: CachedEmbedder
    memo: dict = field(default_factory=dict)
