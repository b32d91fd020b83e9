"""Pre-training the cost models on measured samples.

    neuroshard pretrain --data compute.jsonl comm.jsonl --out model.pt

Samples are split 80/10/10 into train/validation/test by sample group
(``training_data.split_by_group``), features are z-normalised with training statistics
that are saved in the model, and the checkpoint with the best validation loss is kept
(early stopping: ``training``). The model also records the range of every compute feature
its nets were trained on (``costmodel.features.FeatureRange``).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from torchrec_neuroshard.costmodel import NeuralComm, NeuralCostModel
from torchrec_neuroshard.costmodel.features import FeatureRange, Normalizer
from torchrec_neuroshard.costmodel.nets import ComputeNet
from torchrec_neuroshard.lab.batch_shift import with_batch_shift
from torchrec_neuroshard.lab.collect import iter_kind, read_rows
from torchrec_neuroshard.lab.collect_devices import pairs_apart
from torchrec_neuroshard.lab.training import comm_metrics, compute_metrics, mape, train_comm, train_compute
from torchrec_neuroshard.lab.training_data import (
    ComputeData,
    PartData,
    kernel_rows,
    load_comm_data,
    load_compute_data,
    load_step_data,
    split_by_group,
)
from torchrec_neuroshard.steparts import LinearPart, StepParts
from torchrec_neuroshard.types import ShardingError

MIN_SAMPLES = 30
"""Fewest sample groups (of compute, or of comm) pre-training takes: split 80/10/10, that
leaves 3 each to early-stop on and to test with; fewer give meaningless (or NaN) metrics."""

def pretrain(
    rows: Sequence[dict],
    epochs: int = 200,
    seed: int = 0,
    exclude_world_sizes: Sequence[int] = (),
    progress: bool = True,
    hardware: dict | None = None,
    stretch_beyond: int | None = None,
    batch_shift_rows: Sequence[dict] = (),
) -> NeuralCostModel:
    """Train the compute model, the sequence-kernel compute model if ``rows`` hold unpooled
    compute samples (``pooling_mode: none``), and the comm model if they hold comm samples,
    on measured rows, and fit the step parts ``rows`` hold samples of (``fit_step_parts``,
    stored in ``meta["step_parts"]``); the model's meta holds the hardware, the nets'
    constructor args, the range of each compute net's training features and the test metrics (``test.compute``, ``test.sequence_compute``,
    ``test.comm``, ``test.step_parts``).

    ``exclude_world_sizes`` drops those world sizes from training and validation (their
    test samples are still scored: the unseen-world-size check). ``hardware`` overrides
    fields of the rows' hardware record (e.g. a CPU name or core count an older collector
    did not record). ``stretch_beyond``: the pooled compute net prices kernels of more
    tables as the planner does, in training too (``ComputeNet.stretch_beyond``).
    ``batch_shift_rows``: pooled kernels at other batches than ``rows``' one, which a batch
    shift of the pooled kernel learns from, the net trained on ``rows`` frozen
    (``lab.batch_shift``; its test figures in ``meta["test"]["batch_shift"]``).
    """
    t0 = time.perf_counter()
    compute_rows = kernel_rows(rows, pooled=True)
    cnet, cnorm, kernel_meta, test = _train_kernel(rows, True, epochs, seed, progress, stretch_beyond=stretch_beyond)
    meta = {
        "hardware": {**compute_rows[0]["hardware"], **(hardware or {})},
        "batch_size": _reference_batch(rows),
        **kernel_meta,
        "world_sizes_trained": [],
        "seed": seed,
        "test": {"compute": test},
    }
    sequence = _train_sequence(rows, (cnet, cnorm), meta, epochs, seed, progress)
    comm = _train_comm(rows, meta, epochs, seed, exclude_world_sizes, progress, hardware)
    step = load_step_data(rows)
    if step:
        parts, step_test = fit_step_parts(step, seed, exclude_world_sizes)
        meta["step_parts"] = parts.to_dict()
        meta["step_parts_world_sizes"] = {n: sorted(set(d.world_size.tolist()) - set(exclude_world_sizes)) for n, d in step.items()}
        meta["test"]["step_parts"] = step_test
    model = NeuralCostModel(cnet, cnorm, comm, meta, sequence=sequence)
    if batch_shift_rows:
        model = with_batch_shift(model, batch_shift_rows, epochs, seed, progress)
    for name, value in _metrics(model.meta["test"]):
        if not math.isfinite(value):
            raise ShardingError(
                f"test metric {name} is {value}, so the trained model is not returned (nor saved): "
                "check the data for non-finite or zero times, and pre-train on more samples"
            )
    model.meta["train_seconds"] = round(time.perf_counter() - t0, 1)
    return model


def _reference_batch(rows: Sequence[dict]) -> int:
    """The batch a model predicts at by default and its comm net scales from: the one most
    of its comm samples were measured at, else most of its compute samples."""
    batches = [r["batch_size"] for r in iter_kind(rows, "comm")] or [r["batch_size"] for r in iter_kind(rows, "compute")]
    return max(set(batches), key=batches.count)


def _train_sequence(
    rows: Sequence[dict], pooled: tuple[ComputeNet, Normalizer], meta: dict, epochs: int, seed: int, progress: bool
) -> tuple[ComputeNet, Normalizer] | None:
    """The sequence kernel's (net, normaliser) if ``rows`` hold unpooled compute samples,
    its training and test recorded in ``meta``; else None."""
    if not kernel_rows(rows, pooled=False):
        return None
    # started from the pooled net's weights and normaliser (same features, related work):
    # sequence samples are few and slow to measure
    snet, snorm, meta["sequence"], meta["test"]["sequence_compute"] = _train_kernel(
        rows, False, epochs, seed, progress, start=pooled
    )
    return snet, snorm


def _train_comm(
    rows: Sequence[dict], meta: dict, epochs: int, seed: int, exclude_world_sizes: Sequence[int], progress: bool,
    hardware: dict | None,
) -> NeuralComm | None:
    """The comm model if ``rows`` hold comm samples, its training and test (per world size,
    an excluded one on all its rows) recorded in ``meta``; else None: a compute-only model
    (one GPU cannot measure all-to-alls) gets its comm at planning."""
    comm_rows = list(iter_kind(rows, "comm"))
    if not comm_rows:
        return None
    data = load_comm_data(comm_rows)
    train, val, test = _pretraining_split(data.group, seed, "comm")
    seen = ~np.isin(data.world_size, list(exclude_world_sizes))
    if not (train & seen).any():
        raise ShardingError(f"no comm samples left to train on after excluding world sizes {sorted(exclude_world_sizes)}")
    net, norm, log = train_comm(data.subset(train & seen), data.subset(val & seen), epochs, seed, progress=progress)
    scores = {}
    for d in sorted(set(data.world_size.tolist())):
        mask = test & (data.world_size == d) if d not in exclude_world_sizes else (data.world_size == d)
        scores[str(d)] = comm_metrics(net, norm, data.subset(mask))
    scores["all_seen"] = comm_metrics(net, norm, data.subset(test & seen))
    meta.update(
        comm_hardware={**comm_rows[0]["hardware"], **(hardware or {})},
        comm_config=net.config,
        world_sizes_trained=sorted(set(data.world_size[seen].tolist())),
        comm_train={k: v for k, v in log.items() if k != "history"},
    )
    meta["test"]["comm"] = scores
    return NeuralComm(net, norm, meta["batch_size"])


def _train_kernel(
    rows: Sequence[dict], pooled: bool, epochs: int, seed: int, progress: bool, start: tuple[ComputeNet, Normalizer] | None = None,
    stretch_beyond: int | None = None,
) -> tuple[ComputeNet, Normalizer, dict, dict]:
    """The compute net of one kernel kind trained on its rows (split 80/10/10 by group),
    from ``start``'s weights and normaliser when given (reading the batch if that net does),
    else a fresh net stretching beyond ``stretch_beyond`` tables: (net, normaliser, what the
    model's meta records of it, its test metrics)."""
    data, (tr, va, te) = _kernel_split(rows, pooled, seed, start[0].reads_batch if start else None)
    net, norm, log = train_compute(data.subset(tr), data.subset(va), epochs, seed, progress=progress, start=start, stretch_beyond=stretch_beyond)
    mine = kernel_rows(rows, pooled)
    meta = {
        # the planner stretches beyond this as the net was trained to (``ComputeNet.stretch_beyond``)
        "max_tables_per_kernel": net.stretch_beyond or max(len(r["shards"]) for r in mine),
        "bytes_per_element_trained": sorted({int(sh.get("bytes_per_element", 4)) for r in mine for sh in r["shards"]}),
        "feature_range": FeatureRange.fit(data.subset(tr).x).state(),
        "batch_sizes_trained": [int(data.subset(tr).batch_size.min()), int(data.subset(tr).batch_size.max())],
        "compute_config": net.config,
        "compute_train": {k: v for k, v in log.items() if k != "history"},
    }
    return net, norm, meta, compute_metrics(net, norm, data.subset(te))


def _kernel_split(
    rows: Sequence[dict], pooled: bool, seed: int, reads_batch: bool | None = None
) -> tuple[ComputeData, tuple[np.ndarray, ...]]:
    """The compute samples of one kernel kind (``load_compute_data``) and their (train,
    validation, test) masks."""
    data = load_compute_data(rows, pooled, reads_batch)
    return data, _pretraining_split(data.group, seed, "compute")



def fit_step_parts(
    data: dict[str, PartData], seed: int, exclude_world_sizes: Sequence[int] = ()
) -> tuple[StepParts, dict]:
    """Fit every part on its training split (80%, by sample group, as the nets; world sizes
    in ``exclude_world_sizes`` left out) and score it: MAPE % on its test split, and on
    every row of each excluded world size."""
    parts, metrics = {}, {}
    for name, d in data.items():
        train, _, test = split_by_group(d.group, seed)
        seen = ~np.isin(d.world_size, list(exclude_world_sizes))
        part = LinearPart.fit(name, d.x[train & seen], d.y[train & seen])
        parts[name] = part
        scores = {}
        for label, mask in [("test", test & seen)] + [(f"world_size_{w}", d.world_size == w) for w in exclude_world_sizes]:
            if mask.any():
                pred = torch.from_numpy(part.predict(d.x[mask]))
                scores[label] = {"rows": int(mask.sum()), "mape": mape(pred, torch.from_numpy(d.y[mask]))}
        metrics[name] = scores
    return StepParts(parts), metrics


def _pretraining_split(groups: np.ndarray, seed: int, kind: str) -> tuple[np.ndarray, ...]:
    """``split_by_group`` of ``kind`` ("compute" or "comm") samples, refusing too few."""
    count = len(np.unique(groups))
    if count < MIN_SAMPLES:
        raise ShardingError(
            f"{count} {kind} samples are too few to split 80/10/10 into train, validation and test; "
            f"pre-train on at least {MIN_SAMPLES} (`neuroshard collect {kind} --samples {MIN_SAMPLES}` or more)"
        )
    return split_by_group(groups, seed)


def add_feature_ranges(model: NeuralCostModel, rows: Sequence[dict]) -> NeuralCostModel:
    """``model`` with the range of each compute net's training features recorded, taken
    from the ``rows`` it was pre-trained on (split with its seed, as ``pretrain`` split
    them): for a model file written before ranges were recorded. The nets are untouched.

    Refuses rows whose pooled training split does not reproduce the model's normaliser
    bit for bit: they are not the samples it was trained on (nor is a calibrated model's
    normaliser, its base's: re-calibrate it from a base that records ranges)."""
    seed = int(model.meta["seed"])
    data, (train, _, _) = _kernel_split(rows, True, seed, model.compute_net.reads_batch)
    trained = data.subset(train).x
    fitted = Normalizer.fit(trained)
    if not (torch.equal(fitted.mean, model.compute_norm.mean) and torch.equal(fitted.std, model.compute_norm.std)):
        raise ShardingError(
            "these rows are not the samples the model was pre-trained on: their training split (seed "
            f"{seed}) does not reproduce its feature normaliser; give the data files its `neuroshard pretrain` read"
        )
    meta = {**model.meta, "feature_range": FeatureRange.fit(trained).state()}
    if model.sequence_kernel is not None:
        data, (train, _, _) = _kernel_split(rows, False, seed, model.sequence_kernel.net.reads_batch)
        meta["sequence"] = {**meta["sequence"], "feature_range": FeatureRange.fit(data.subset(train).x).state()}
    return model.with_meta(meta)


def _metrics(tree: dict, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(dotted name, value) of every number in a nested metrics dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _metrics(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def pretrain_files(paths: Sequence[str | Path], batch_shift_paths: Sequence[str | Path] = (), **kwargs) -> NeuralCostModel:
    """``pretrain`` on the rows of dataset files (``batch_shift_paths``': its
    ``batch_shift_rows``); a missing or unreadable file is an error."""
    rows = _read_files(paths)
    if not rows:
        raise ShardingError(f"no samples in {[str(p) for p in paths]}")
    return pretrain(rows, batch_shift_rows=_read_files(batch_shift_paths), **kwargs)


def _read_files(paths: Sequence[str | Path]) -> list[dict]:
    """The rows of the dataset files ``paths``, in order, each file's device pairs apart
    (``collect_devices.pairs_apart``); a missing or unreadable file is an error."""
    files = []
    for path in paths:
        if not Path(path).is_file():
            raise ShardingError(f"data file {str(path)!r} does not exist; give the JSONL(.gz) files `neuroshard collect` wrote")
        try:
            files.append(read_rows(path))
        except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ShardingError(f"data file {str(path)!r} is not a readable JSONL(.gz) dataset: {e}") from e
    return pairs_apart(files)
