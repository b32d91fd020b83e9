"""Fit a saved model's kernel correction (``costmodel.nets.KernelCorrection``) on
device-sized kernels timed in pairs; its nets stay bit for bit as they are.

    python -m torchrec_neuroshard.lab.kernel_correction --model cpu --form work \
        --pairs torchrec_neuroshard/lab/data/cpu_compute_devices.jsonl.gz \
                torchrec_neuroshard/lab/data/cpu_compute_devices_seed1.jsonl.gz --out cpu_work.pt

The compute net prices a kernel from the sum of its shards' embeddings, and on kernels of
16-128 tables its error grows with what their lookups read (studies/device_error.py: the
same on held-out pools at D = 8-128): with their mean width (``--form width``), with
their lookups per ms of its price (``--form work``), and with that and the bytes of rows a
batch reads in them (``--form work+footprint``). Within a pair (two kernels timed in turn)
the machine's drift cancels: each pair's difference of log(measured / the nets' price) is
regressed, through 0, on its difference of log x (the form's quantities,
``KernelCorrection``). The slopes are the correction's; the reference of the width or the
work is the geometric mean of its x over the pairs' kernels, so a kernel there keeps its
price; the footprint's is a knee below which a kernel keeps its price (``knee_terms``).
"""

from __future__ import annotations

import argparse
from typing import NamedTuple, Sequence

import numpy as np

from torchrec_neuroshard.costmodel import NeuralCostModel, model_named
from torchrec_neuroshard.costmodel.nets import CORRECTION_FORMS, FOOTPRINT_FORM, KernelCorrection, shard_footprint
from torchrec_neuroshard.lab.collect import read_rows, shard_from_record
from torchrec_neuroshard.lab.collect_devices import pairs_apart, whole_pairs
from torchrec_neuroshard.types import Shard, ShardingError


def lookups(shards: Sequence[Shard]) -> float:
    """A kernel's lookups a sample: sum(pooling factor x width) over its shards."""
    return float(sum(s.table.pooling_factor * s.width for s in shards))


def mean_width(shards: Sequence[Shard]) -> float:
    """The lookup-weighted mean width of a kernel's shards: sum(pooling factor x width) / sum(pooling factor)."""
    return lookups(shards) / float(sum(s.table.pooling_factor for s in shards))


def correction_input(model: NeuralCostModel, form: str, shards: Sequence[Shard], batch_size: int, price_ms: float) -> float:
    """The x of ``KernelCorrection`` of ``form`` for ``shards`` in a kernel of ``batch_size``
    that ``model``'s nets alone price at ``price_ms``: the mean width, or lookups per ms of
    that price at the nets' own batch (``KernelNet.batch_factor`` divided out)."""
    if form == "width":
        return mean_width(shards)
    return lookups(shards) / (price_ms / model.pooled_kernel.batch_factor(batch_size))


def footprint(shards: Sequence[Shard], batch_size: int) -> float:
    """A kernel's bytes of rows a batch reads (``nets.shard_footprint`` summed)."""
    return float(sum(shard_footprint(s, batch_size) for s in shards))


def without_correction(model: NeuralCostModel) -> NeuralCostModel:
    """``model`` pricing by its nets alone (its kernel correction, if any, dropped)."""
    meta = {k: v for k, v in model.meta.items() if k not in ("kernel_correction", "width_correction")}
    return model.with_meta(meta)


class PricedPair(NamedTuple):
    """A whole device pair, members in order: their shards, batches, ``model``'s prices
    (fwd + bwd ms) and log(measured / price)."""

    shards: list[list[Shard]]
    batches: list[int]
    prices: list[float]
    errors: list[float]


def priced_pairs(model: NeuralCostModel, rows: Sequence[dict]) -> list[PricedPair]:
    """Each whole pair of ``rows`` (``collect_devices.whole_pairs``) priced by ``model``."""
    whole = whole_pairs(rows)
    shards = [[shard_from_record(s) for s in r["shards"]] for r in whole]
    batches = [int(r["batch_size"]) for r in whole]
    prices = [model.kernel_ms(s, b) for s, b in zip(shards, batches)]
    errors = [float(np.log((r["fwd_ms"] + r["bwd_ms"]) / price)) for r, price in zip(whole, prices)]
    return [PricedPair(shards[i : i + 2], batches[i : i + 2], prices[i : i + 2], errors[i : i + 2]) for i in range(0, len(whole), 2)]


def pair_terms(model: NeuralCostModel, form: str, rows: Sequence[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Over the whole pairs of ``rows`` (``priced_pairs``): each pair's difference (first
    member less second) of log(measured / ``model``'s price) [P] and of log x [P, k], and
    every member's x [2P, k] (k = 1, or 2 for "work+footprint": ``correction_input`` and
    the footprint)."""
    errors, terms, every = [], [], []
    for pair in priced_pairs(model, rows):
        x = [
            [correction_input(model, form, *member)] + ([footprint(member[0], member[1])] if form == FOOTPRINT_FORM else [])
            for member in zip(pair.shards, pair.batches, pair.prices)
        ]  # [2, k]
        errors.append(pair.errors[0] - pair.errors[1])
        terms.append(np.log(x[0]) - np.log(x[1]))
        every += x
    if not errors:
        raise ShardingError("no whole device pairs in the rows given: pass a file `neuroshard collect devices` or `calibrate --device-pairs` wrote")
    return np.array(errors), np.array(terms), np.array(every)


def knee_terms(errors: np.ndarray, terms: np.ndarray, every: np.ndarray) -> tuple[np.ndarray, float]:
    """"work+footprint": the pairs' terms [P, 2] with the footprint's column read above a
    knee, log(max(footprint, knee)), and that knee: of the pairs' footprints from the
    smallest to the median, the one whose fit leaves the least error (the caches' size
    shows as the footprint where kernels begin to slow)."""
    first, second = every[0::2, 1], every[1::2, 1]  # [P] each: the members' footprints
    best = None
    candidates = np.unique(every[:, 1])  # sorted
    for knee in candidates[candidates <= np.median(candidates)]:
        hinged = np.c_[terms[:, 0], np.log(np.maximum(first, knee)) - np.log(np.maximum(second, knee))]  # [P, 2]
        left = float((errors - hinged @ np.linalg.lstsq(hinged, errors, rcond=None)[0]).std())
        if best is None or left < best[0] - 1e-12:
            best = (left, hinged, float(knee))
    return best[1], best[2]


def fit(model: NeuralCostModel, rows: Sequence[dict], form: str = "width") -> tuple[NeuralCostModel, dict]:
    """``model`` with a correction of ``form`` fitted on the device pairs of ``rows`` (its own
    dropped first), and the record kept in its meta: form, slopes, references (the
    footprint's: its knee, ``knee_terms``), pairs, and the pairs' error sd before and after."""
    if form not in CORRECTION_FORMS:
        raise ValueError(f"form={form!r}: give one of {CORRECTION_FORMS}")
    plain = without_correction(model)
    errors, terms, every = pair_terms(plain, form, rows)  # [P], [P, k], [2P, k]
    if form == FOOTPRINT_FORM:
        terms, knee = knee_terms(errors, terms, every)
    slopes = np.linalg.lstsq(terms, errors, rcond=None)[0]  # [k]
    record = {"form": form, "slope": float(slopes[0]), "reference": float(np.exp(np.log(every[:, 0]).mean()))}
    if form == FOOTPRINT_FORM:
        record |= {"footprint_slope": float(slopes[1]), "footprint_reference": knee}
    KernelCorrection.from_meta({"kernel_correction": record})  # validates
    record |= {"pairs": len(errors), "pair_error_sd": {"before": float(errors.std()), "after": float((errors - terms @ slopes).std())}}
    return plain.with_meta({**plain.meta, "kernel_correction": record}), record


def read_pairs(paths: Sequence[str]) -> list[dict]:
    """The rows of the device-pair files ``paths``, each file's pairs apart (``pairs_apart``)."""
    return pairs_apart([read_rows(path) for path in paths])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model file, or a shipped model's name")
    p.add_argument("--form", choices=CORRECTION_FORMS, required=True, help="what the correction reads (KernelCorrection)")
    p.add_argument("--pairs", nargs="+", required=True, help="device-pair files (JSONL.gz)")
    p.add_argument("--out", required=True, help="model file to write")
    args = p.parse_args(argv)
    model, record = fit(model_named(args.model), read_pairs(args.pairs), args.form)
    model.save(args.out)
    sd = record["pair_error_sd"]
    footprint_part = f", footprint slope {record['footprint_slope']:.4f} beyond a knee of {record['footprint_reference']:.4g} bytes" if "footprint_slope" in record else ""
    print(
        f"{args.form} correction: slope {record['slope']:.4f}, reference {record['reference']:.4g}{footprint_part}, from {record['pairs']} pairs; "
        f"the pairs' log-error sd {sd['before']:.3f} -> {sd['after']:.3f} (in sample); saved {args.out}"
    )


if __name__ == "__main__":
    main()
