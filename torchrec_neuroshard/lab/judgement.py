"""The judgement of the judge's rows (``lab.judge``): a unit is one (pass, draw, round); a
plan's time in a unit is its slowest device, and its compute the slowest device's median
over units. Ratios come with a paired bootstrap interval over units, the units each plan is
fastest in are counted, and a run that timed a copy of its first plan checks itself by it.
A run's final round (``lab.final_round``) is read apart: its units are its own rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from torchrec_neuroshard.lab.judge import COPY, FINAL, REFERENCE, JudgeConfig
from torchrec_neuroshard.lab.training import spearman

@dataclass(frozen=True)
class Judged:
    """One plan's measurement: times [units, devices] ms, fused kernels plus replicas,
    units ordered by (pass, draw, round)."""

    times: np.ndarray

    @staticmethod
    def of(rows: Sequence[dict], num_devices: int, config: JudgeConfig) -> "Judged | None":
        """From one plan's rows (``judge_plans``'); None unless every (pass, device, draw) is there."""
        times = np.full((config.passes, config.draws, config.rounds, num_devices), np.nan)  # [pass, draw, round, device]
        for r in rows:
            times[r["pass"], r["draw"], :, r["device"]] = np.add(r["fused_ms"], r["replicas_ms"])
        if np.isnan(times).any():
            return None
        return Judged(times.reshape(config.units, num_devices))

    def steadied(self, reference: "Judged") -> "Judged":
        """These times with the machine's speed in each (unit, device) divided out: scaled by
        the reference work's median over its times there [units, devices]."""
        if reference.times.shape != self.times.shape:
            raise ValueError(f"reference timed over {reference.times.shape} (units, devices), the plan over {self.times.shape}: judge them in one run")
        return Judged(self.times * np.median(reference.times) / reference.times)

    @property
    def per_device(self) -> np.ndarray:
        """Each device's median over units [devices]."""
        return np.median(self.times, axis=0)

    @property
    def compute_ms(self) -> float:
        return float(self.per_device.max())

    @property
    def imbalance(self) -> float:
        """Slowest / mean device."""
        return self.compute_ms / float(self.per_device.mean())

    @property
    def unit_compute(self) -> np.ndarray:
        """The slowest device in each unit [units]."""
        return self.times.max(axis=1)

    @property
    def passes_agree(self) -> float:
        """The measurement against itself: the rank correlation of the devices' medians in
        the first half of the units against the second (the two passes of
        ``JudgeConfig``'s default: units run pass-major)."""
        first, second = np.array_split(self.times, 2)  # [units / 2, devices] each
        return rank_correlation(np.median(first, 0).tolist(), np.median(second, 0).tolist())


def judgements(rows: Sequence[dict], num_devices: int, config: JudgeConfig, steady: bool = True) -> dict[str, Judged]:
    """Per plan in ``rows`` (one run's), its measurement, where complete; with ``steady``
    and the reference among the rows (``JudgeConfig.reference``), steadied by it. The
    first plan's copy (``JudgeConfig.copy``) is not a plan: ``copy_check`` reads it."""
    out = _judged(rows, num_devices, config, steady)
    out.pop(COPY, None)
    return out


def copy_check(rows: Sequence[dict], num_devices: int, config: JudgeConfig, steady: bool = True) -> tuple[float, float, float] | None:
    """The run's A/A check: the first plan's copy (``JudgeConfig.copy``) over the first plan,
    with its interval (``ratio_interval``); None where the run timed no complete copy. An
    interval that leaves out 1 says the run's intervals do not hold its own error."""
    judged = _judged(rows, num_devices, config, steady)
    first = next((n for n in judged if n != COPY), None)
    return ratio_interval(judged[COPY], judged[first]) if COPY in judged and first is not None else None


def _judged(rows: Sequence[dict], num_devices: int, config: JudgeConfig, steady: bool) -> dict[str, Judged]:
    """Per name in ``rows`` but the reference's, its measurement where complete, steadied as ``judgements`` says."""
    out = {}
    rows = [r for r in rows if r.get("stage") != FINAL]
    for name in dict.fromkeys(r["planner"] for r in rows):
        judged = Judged.of([r for r in rows if r["planner"] == name], num_devices, config)
        if judged is not None:
            out[name] = judged
    reference = out.pop(REFERENCE, None)
    return {n: j.steadied(reference) for n, j in out.items()} if steady and reference is not None else out


def final_judgements(rows: Sequence[dict], config: JudgeConfig) -> dict[str, Judged]:
    """Per plan (the copy too) in a run's final round (``lab.final_round``), its contenders'
    times [draws x rounds, contenders] (the final round's own rounds), where complete; no
    reference divides them."""
    final = [r for r in rows if r.get("stage") == FINAL]
    rounds = len(final[0]["fused_ms"]) if final else 0
    out = {}
    for name in dict.fromkeys(r["planner"] for r in final):
        mine = [r for r in final if r["planner"] == name]
        devices = sorted({r["device"] for r in mine})
        times = np.full((config.draws, rounds, len(devices)), np.nan)  # [draw, round, contender]
        for r in mine:
            times[r["draw"], :, devices.index(r["device"])] = np.add(r["fused_ms"], r["replicas_ms"])
        if not np.isnan(times).any():
            out[name] = Judged(times.reshape(config.draws * rounds, len(devices)))
    return out


def ratio_interval(a: Judged, b: Judged, samples: int = 2000, level: float = 0.9, seed: int = 0) -> tuple[float, float, float]:
    """``a``'s compute / ``b``'s, and its paired bootstrap interval over units (the same
    resampled units for both: they were timed side by side)."""
    ratios = _resampled_ratios(a, b, np.random.default_rng(seed), samples)  # [samples]
    tail = (1 - level) / 2
    return a.compute_ms / b.compute_ms, float(np.quantile(ratios, tail)), float(np.quantile(ratios, 1 - tail))


def runs_ratio_interval(pairs: Sequence[tuple[Judged, Judged]], samples: int = 2000, level: float = 0.9, seed: int = 0) -> tuple[float, float, float]:
    """The geometric mean over runs of a's compute / b's (each pair timed side by side in
    one run), and its bootstrap interval: every run's units resampled on their own."""
    rng = np.random.default_rng(seed)
    logs = np.mean([np.log(_resampled_ratios(a, b, rng, samples)) for a, b in pairs], axis=0)  # [samples]
    tail = (1 - level) / 2
    point = float(np.exp(np.mean([np.log(a.compute_ms / b.compute_ms) for a, b in pairs])))
    return point, float(np.exp(np.quantile(logs, tail))), float(np.exp(np.quantile(logs, 1 - tail)))


def _resampled_ratios(a: Judged, b: Judged, rng: np.random.Generator, samples: int) -> np.ndarray:
    """[samples] a's compute / b's over the same resampled units (they were timed side by side)."""
    units = a.times.shape[0]
    if b.times.shape[0] != units:
        raise ValueError(f"plans measured over {units} and {b.times.shape[0]} units: judge them in one run")
    pick = rng.integers(0, units, (samples, units))  # [samples, units]
    return _resampled_compute(a.times, pick) / _resampled_compute(b.times, pick)


def _resampled_compute(times: np.ndarray, pick: np.ndarray) -> np.ndarray:
    """[samples] the slowest device's median over each resample of units: ``times`` [units,
    devices], ``pick`` [samples, units]. ``np.median`` to the bit, sorted along the last axis
    (a median along the middle one is several times slower)."""
    units = pick.shape[1]
    ordered = np.sort(times.T[:, pick], axis=2)  # [devices, samples, units]
    medians = (ordered[..., (units - 1) // 2] + ordered[..., units // 2]) / 2  # [devices, samples]
    return medians.max(axis=0)


def wins(judged: Mapping[str, Judged]) -> dict[str, int]:
    """Per plan, the units in which it is the fastest (its slowest device the least)."""
    names = list(judged)
    fastest = np.argmin(np.stack([judged[n].unit_compute for n in names]), axis=0)  # [units]
    return {n: int((fastest == i).sum()) for i, n in enumerate(names)}


def rank_correlation(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Spearman's rank correlation of a plan's devices, predicted against measured."""
    return spearman(torch.as_tensor(predicted, dtype=torch.float64), torch.as_tensor(measured, dtype=torch.float64))
