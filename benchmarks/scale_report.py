"""The table of ``benchmarks/scale.py``: measured compute, modelled comm, planning time.

    python -m benchmarks.scale report

Reads ``results/scale_planned.jsonl.gz`` (the last row of each planner and D wins) and
``results/scale_measured.jsonl.gz`` (the rows of the plans measured last at each D) and
writes ``results/scale.md``.
"""

from __future__ import annotations

import datetime
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.fullsize import PLANNERS, TORCHREC_CONFIGS
from torchrec_neuroshard.heuristics import BASELINES
from torchrec_neuroshard.lab.collect import read_rows

RESULTS = Path(__file__).parent / "results"
PLANNED = RESULTS / "scale_planned.jsonl.gz"
"""Each planner's plan and planning time at each D (``scale.py plan`` appends; the last row wins)."""
MEASURED = RESULTS / "scale_measured.jsonl.gz"
"""Each device's measured compute of each plan (``scale.py measure`` appends)."""
RESULT = RESULTS / "scale.md"
TORCHREC_ROWS = tuple(TORCHREC_CONFIGS)


@dataclass(frozen=True)
class Measured:
    """One plan's measurement: each device's compute in every round (data-parallel work
    included) and the modelled communication, ms."""

    rounds: tuple[tuple[float, ...], ...]
    """rounds[d]: device d's compute in each round."""
    comm_ms: float

    @property
    def per_device(self) -> tuple[float, ...]:
        """each device's median round."""
        return tuple(statistics.median(r) for r in self.rounds)

    @property
    def compute_ms(self) -> float:
        return max(self.per_device)

    @property
    def imbalance(self) -> float:
        """slowest device / mean device."""
        return self.compute_ms / statistics.fmean(self.per_device)

    @property
    def spread(self) -> float:
        """the slowest device with every device at its upper quartile round less the same
        at the lower quartile, as a share of the compute (robust to a round spiking on one
        device, which a per-round maximum is not)."""
        quartiles = [statistics.quantiles(r, n=4) if len(r) > 1 else [r[0]] * 3 for r in self.rounds]
        return (max(q[2] for q in quartiles) - max(q[0] for q in quartiles)) / self.compute_ms


def measured(rows: list[dict], devices: int, planner: str) -> Measured | None:
    """The plan's measurement of its last-measured plans (``plans_sha``), None unless every device has one."""
    ours = [r for r in rows if r["devices"] == devices and r["planner"] == planner]
    if not ours:
        return None
    mine = {r["device"]: r for r in ours if r.get("plans_sha") == ours[-1].get("plans_sha")}
    if "all" not in mine or len(mine) != devices + 1:
        return None
    shared = mine.pop("all")
    dp = shared["data_parallel_ms"]
    rounds = tuple(tuple(f + b + dp for f, b in zip(r["fwd_ms"], r["bwd_ms"])) for _, r in sorted(mine.items()))
    return Measured(rounds, shared["comm_input_ms"] + shared["comm_forward_ms"] + shared["comm_backward_ms"])


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a and b else "-"


def _rows_of(devices: int, planned: dict, results: dict) -> list[str]:
    lines = []
    best_h = min((results[n].compute_ms for n in BASELINES if results.get(n)), default=None)
    ref = {t: results[t].compute_ms if results.get(t) else None for t in TORCHREC_ROWS}
    for name in PLANNERS:
        p = planned.get((devices, name))
        if p is None:
            continue
        m = results.get(name)
        if p["status"] != "ok" or m is None:
            lines.append(f"| {devices} | {name} | - | - | - | - | - | - | - | - | {p['planning_s']} | {p['status'][:160]} |")
            continue
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(p["kinds"].items()))
        note = f"{p['note']}; " if p.get("note") else ""
        lines.append(
            f"| {devices} | {name} | {m.compute_ms:.1f} ({100 * m.spread:.0f}%) | {m.imbalance:.2f} | {m.comm_ms:.2f} "
            f"| {m.compute_ms + m.comm_ms:.1f} | {_ratio(m.compute_ms, ref['torchrec_timeout'])} "
            f"| {_ratio(m.compute_ms, ref['torchrec_dp'])} | {_ratio(m.compute_ms, best_h)} "
            f"| {max(p['predicted_compute_ms']):.1f} | {p['planning_s']} | {note}{kinds} |"
        )
    return lines


def _model_error(planned: dict, results: dict[int, dict]) -> list[str]:
    """How far the shipped CPU model is from every plan's measured devices, per D."""
    lines = ["", "| D | devices priced | predicted / measured per device, median | within 10% | MAPE |", "|---|---|---|---|---|"]
    for devices, by_planner in sorted(results.items()):
        ratios = []
        for name, m in by_planner.items():
            p = planned.get((devices, name))
            if m is not None and p and p["status"] == "ok":
                ratios += [pr / me for pr, me in zip(p["predicted_compute_ms"], m.per_device)]
        if ratios:
            within = sum(abs(r - 1) <= 0.10 for r in ratios) / len(ratios)
            mape = statistics.fmean(abs(r - 1) for r in ratios)
            lines.append(f"| {devices} | {len(ratios)} | {statistics.median(ratios):.3f} | {100 * within:.0f}% | {100 * mape:.1f}% |")
    return lines


def write_report(machine: str) -> str:
    planned = {(r["devices"], r["planner"]): r for r in read_rows(PLANNED)}
    rows = read_rows(MEASURED)
    all_devices = sorted({d for d, _ in planned})
    results = {d: {n: measured(rows, d, n) for n in PLANNERS} for d in all_devices}
    lines = [
        "# 856 tables on 8 to 128 devices, measured",
        "",
        f"`python -m benchmarks.scale plan && python -m benchmarks.scale measure && python -m benchmarks.scale report`; "
        f"{machine}, one thread; {datetime.date.today().isoformat()}. Compute: every device's kernels timed here "
        "(rows / 64, global batch 4,096), slowest device, median of interleaved rounds (spread: the slowest device with every device at its upper quartile round less the same at its lower quartile). "
        "Comm: priced from published H100 NVLink / 400 Gb/s InfiniBand rates (`lab.published_comm`), not measured; "
        "sum = compute + comm. Ratios are of measured compute. Predicted: the slowest device as the shipped CPU model sees it.",
        "",
        "| D | planner | compute ms (spread) | slowest / mean device | comm ms (modelled) | sum ms | / TorchRec timeout "
        "| / TorchRec DP | / best heuristic | predicted compute ms | planning s | kinds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in all_devices:
        lines += _rows_of(d, planned, results[d])
    counts = {d: sorted({len(r) for m in results[d].values() if m for r in m.rounds}) for d in all_devices}
    lines += ["", "Timing rounds per device: " + ", ".join(f"D = {d}: {'/'.join(map(str, c))}" for d, c in counts.items() if c) + "."]
    lines += ["", "The shipped CPU model against the measured devices (every plan's devices):"] + _model_error(planned, results)
    text = "\n".join(lines) + "\n"
    RESULT.write_text(text)
    return text
