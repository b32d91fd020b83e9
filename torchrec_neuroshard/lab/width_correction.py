"""Fit a saved model's width correction (``costmodel.nets.WidthCorrection``) on
device-sized kernels timed in pairs; its nets stay bit for bit as they are.

    python -m torchrec_neuroshard.lab.width_correction --model cpu \
        --pairs torchrec_neuroshard/lab/data/cpu_compute_devices_seed1.jsonl.gz --out cpu_width.pt

The compute net prices a kernel from the sum of its shards' embeddings, and on kernels of
16-128 tables it underprices those whose lookups read wide rows (studies/device_error.py:
the same on held-out pools at D = 8-128). Within a pair (two kernels timed in turn) the
machine's drift cancels: each pair's difference of log(measured / the nets' price) is
regressed, through 0, on its difference of log mean width (sum of pooling factor x width /
sum of pooling factors). The slope is the correction's; its reference width is the
geometric mean of the pairs' mean widths, so a kernel of that width keeps its price.
"""

from __future__ import annotations

import argparse
from typing import Sequence

import numpy as np

from torchrec_neuroshard.costmodel import NeuralCostModel, model_named
from torchrec_neuroshard.costmodel.nets import WidthCorrection
from torchrec_neuroshard.lab.collect import read_rows, shard_from_record
from torchrec_neuroshard.lab.collect_devices import whole_pairs
from torchrec_neuroshard.types import Shard, ShardingError


def mean_width(shards: Sequence[Shard]) -> float:
    """The lookup-weighted mean width of a kernel's shards: sum(pooling factor x width) / sum(pooling factor)."""
    pooling = np.array([s.table.pooling_factor for s in shards])  # [S]
    return float((pooling * np.array([s.width for s in shards])).sum() / pooling.sum())


def without_correction(model: NeuralCostModel) -> NeuralCostModel:
    """``model`` pricing by its nets alone (its width correction, if any, dropped)."""
    meta = {k: v for k, v in model.meta.items() if k != "width_correction"}
    return model.with_meta(meta)


def priced_pairs(model: NeuralCostModel, rows: Sequence[dict]) -> list[tuple[list[list[Shard]], list[float]]]:
    """Each whole pair of ``rows`` (``collect_devices.whole_pairs``), members in order: their
    shards and their log(measured / ``model``'s price)."""
    whole = whole_pairs(rows)
    shards = [[shard_from_record(s) for s in r["shards"]] for r in whole]
    errors = [float(np.log((r["fwd_ms"] + r["bwd_ms"]) / model.kernel_ms(s, r["batch_size"]))) for r, s in zip(whole, shards)]
    return [(shards[i : i + 2], errors[i : i + 2]) for i in range(0, len(whole), 2)]


def pair_terms(model: NeuralCostModel, rows: Sequence[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Over the whole pairs of ``rows`` (``priced_pairs``): each pair's difference (first
    member less second) of log(measured / ``model``'s price) [P] and of log mean width [P],
    and every member's mean width [2P]."""
    errors, widths, every = [], [], []
    for shards, error in priced_pairs(model, rows):
        width = [mean_width(s) for s in shards]
        errors.append(error[0] - error[1])
        widths.append(np.log(width[0]) - np.log(width[1]))
        every += width
    if not errors:
        raise ShardingError("no whole device pairs in the rows given: pass a file `neuroshard collect devices` or `calibrate --device-pairs` wrote")
    return np.array(errors), np.array(widths), np.array(every)


def fit(model: NeuralCostModel, rows: Sequence[dict]) -> tuple[NeuralCostModel, dict]:
    """``model`` with a width correction fitted on the device pairs of ``rows`` (its own
    dropped first), and the record kept in its meta: slope, reference, pairs, and the
    pairs' error sd before and after."""
    plain = without_correction(model)
    errors, widths, every = pair_terms(plain, rows)  # [P], [P], [2P]
    slope = float(widths @ errors / (widths @ widths))
    correction = WidthCorrection(slope, float(np.exp(np.log(every).mean())))
    record = {
        "slope": correction.slope,
        "reference": correction.reference,
        "pairs": len(errors),
        "pair_error_sd": {"before": float(errors.std()), "after": float((errors - slope * widths).std())},
    }
    return plain.with_meta({**plain.meta, "width_correction": record}), record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model file, or a shipped model's name")
    p.add_argument("--pairs", nargs="+", required=True, help="device-pair files (JSONL.gz)")
    p.add_argument("--out", required=True, help="model file to write")
    args = p.parse_args(argv)
    rows = [r for path in args.pairs for r in read_rows(path)]
    model, record = fit(model_named(args.model), rows)
    model.save(args.out)
    sd = record["pair_error_sd"]
    print(
        f"width correction: slope {record['slope']:.4f}, reference width {record['reference']:.1f}, from {record['pairs']} pairs; "
        f"the pairs' log-error sd {sd['before']:.3f} -> {sd['after']:.3f} (in sample); saved {args.out}"
    )


if __name__ == "__main__":
    main()
