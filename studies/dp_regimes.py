"""Does one linear data-parallel part price the replicated sets a planner makes at scale?

    python -m studies.dp_regimes [--data torchrec_neuroshard/lab/data/cpu_step_dp.jsonl.gz]
    git show e76beb9:torchrec_neuroshard/pretrained/cpu.pt > /tmp/cpu_e76beb9.pt
    python -m studies.dp_regimes --before /tmp/cpu_e76beb9.pt   # adds the parts shipped before

The data: the three data-parallel kinds of ``collect step`` ("dp": 1-8 pool tables up to
256 MB; "dp_small": 1-4 tables of 10-5,000 rows; "dp_many": 9-64 small read-heavy tables,
what the planner replicates on 856-table plans at D = 8) at local batches of 4,096 / D for
D = 2-128, all timed in one session (DATASHEET.md). Fits ``dp_fwd`` and ``dp_bwd`` as
``pretrain`` fits them (``LinearPart.fit``: non-negative, relative error, train split by
sample group) on each kind alone and on all three, with ``steparts.DP_LOOKUP_FEATURES`` and
without them (their columns zeroed), and scores fwd + bwd on each kind's validation split;
the shipped CPU model's parts beside them (and ``--before``'s, a model file stored before
those features: its coefficients padded with zeros, the same prices). Last column: the replicated sets of the plans
``benchmarks.scale`` judged on the held-out pools (each set's predicted ms over the judge's
median, min-max, in the last judged set of each task).
Writes studies/results/dp_regimes.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks.scale import scale_task
from benchmarks.scale_report import MEASURED, PLANNED, last_judged, latest_plans
from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.collect_step import DP_KINDS
from torchrec_neuroshard.lab.training_data import load_step_data, split_by_group
from torchrec_neuroshard.stepcost import data_parallel_ms
from torchrec_neuroshard.steparts import DP_LOOKUP_FEATURES, LinearPart, StepParts
from torchrec_neuroshard.types import Plan, ShardingKind

HERE = Path(__file__).parent
DATA = HERE.parent / "torchrec_neuroshard" / "lab" / "data" / "cpu_step_dp.jsonl.gz"
PARTS = ("dp_fwd", "dp_bwd")


def judged_sets() -> list[tuple[list, tuple[int, int], float]]:
    """(replicated tables, (global batch, D), the judge's median ms) of each plan that
    replicates in the last judged set of each task (whose plans are the last planned)."""
    measured, planned, out = read_rows(MEASURED), read_rows(PLANNED), []
    for pool_seed, devices in sorted({(r["pool_seed"], r["devices"]) for r in measured}):
        rows = last_judged(measured, pool_seed, devices)
        task, plans = scale_task(devices, pool_seed), latest_plans(planned, pool_seed, devices)
        for name in dict.fromkeys(r["planner"] for r in rows):
            times = [np.mean(r["replicas_ms"]) for r in rows if r["planner"] == name and r["replicas_ms"]]
            plan = Plan.from_dict(plans[name]["plan"])
            tables = [task.table(p.table) for p in plan.placements if p.kind is ShardingKind.DATA_PARALLEL]
            if tables and times:
                out.append((tables, (task.batch_size, devices), float(np.median(times))))
    return out


def fitted(rows: list[dict], kinds: tuple[str, ...], seed: int, lookup_features: bool) -> StepParts:
    """The parts fitted on ``kinds``' training split; without ``lookup_features`` their
    columns are zeroed (a zero column keeps a zero coefficient: the part without them)."""
    data = load_step_data([r for r in rows if r["kind"] in kinds])
    parts = {}
    for part in PARTS:
        train = split_by_group(data[part].group, seed)[0]
        x = data[part].x[train].copy()  # [train rows, features]
        if not lookup_features:
            x[:, -len(DP_LOOKUP_FEATURES) :] = 0.0
        parts[part] = LinearPart.fit(part, x, data[part].y[train])
    return StepParts(parts)


def parts_before(path: Path) -> StepParts:
    """The data-parallel parts of a model file fitted before ``DP_LOOKUP_FEATURES``."""
    import torch

    stored = torch.load(path, map_location="cpu", weights_only=False)["meta"]["step_parts"]
    return StepParts({part: LinearPart(part, (*stored[part], *[0.0] * len(DP_LOOKUP_FEATURES))) for part in PARTS})


def validation_sets(rows: list[dict], seed: int) -> dict[str, tuple[dict, np.ndarray]]:
    """Per kind: its parts' validation features {part: [rows, features]} and fwd + bwd ms [rows]."""
    out = {}
    for kind in DP_KINDS:
        data = load_step_data([r for r in rows if r["kind"] == kind])
        val = split_by_group(data["dp_fwd"].group, seed)[1]
        out[kind] = ({part: data[part].x[val] for part in PARTS}, data["dp_fwd"].y[val] + data["dp_bwd"].y[val])
    return out


def line(label: str, parts: StepParts, validation: dict[str, tuple[dict, np.ndarray]], judged: list) -> str:
    cells = []
    for kind in DP_KINDS:
        x, measured = validation[kind]
        predicted = sum(parts.predict(part, x[part]) for part in PARTS)  # [validation rows]
        cells.append(f"{100 * np.mean(np.abs(predicted / measured - 1)):.0f}")
    ratios = [sum(data_parallel_ms(parts, t, *batch)[p] for p in PARTS) / ms for t, batch, ms in judged]
    return f"| {label} | {' | '.join(cells)} | {min(ratios):.2f}-{max(ratios):.2f} |"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--before", type=Path, help="a model file stored before DP_LOOKUP_FEATURES (git e76beb9's cpu.pt)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "dp_regimes.md")
    args = p.parse_args(argv)
    rows = [r for r in read_rows(args.data) if r.get("kind") in DP_KINDS]
    judged, validation = judged_sets(), validation_sets(rows, args.seed)
    lines = [
        "# One linear data-parallel part for three regimes", "",
        f"`python -m studies.dp_regimes{' --before ' + str(args.before) if args.before else ''}` (--before: git e76beb9's "
        f"cpu.pt); {len(rows)} rows, {len(judged)} judged sets. Validation MAPE % of fwd + bwd per kind.", "",
        "| parts fitted on | dp | dp_small | dp_many | judged held-out sets, predicted / measured |",
        "|---|---|---|---|---|",
        line("shipped cpu.pt", load_pretrained("cpu").step_parts, validation, judged),
    ]  # fmt: skip
    if args.before:
        lines.append(line(f"{args.before.name} (before)", parts_before(args.before), validation, judged))
    for lookup_features in (False, True):
        for kinds in [(k,) for k in DP_KINDS] + [DP_KINDS]:
            label = f"{' + '.join(kinds)}, {'with' if lookup_features else 'without'} the lookup features"
            lines.append(line(label, fitted(rows, kinds, args.seed, lookup_features), validation, judged))
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
