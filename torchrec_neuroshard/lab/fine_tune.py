"""Fine-tuning a cost model on one machine's measured samples (``neuroshard calibrate``).

A copy of each net trained from the base model's weights with the base's feature
normalisation, early-stopped on a held-out part of the new samples (by group: a device
pair is one group). The new samples are compute kernels of 1-15 tables at one batch,
optionally device pairs (16-128-table kernels timed two in turn, ``collect_devices``),
whose ratio the pair loss learns, and comm samples. ``meta["calibration"]`` records what
the fine-tuning saw and the held-out error before and after.
"""

from __future__ import annotations

import copy
import time
from typing import Sequence

import numpy as np
import torch

from torchrec_neuroshard.costmodel import NeuralComm, NeuralCostModel
from torchrec_neuroshard.costmodel.batchshift import BatchShift
from torchrec_neuroshard.costmodel.features import FeatureRange, feature_names
from torchrec_neuroshard.costmodel.nets import ComputeNet
from torchrec_neuroshard.lab.collect import iter_kind, shard_from_record
from torchrec_neuroshard.lab.collect_devices import whole_pairs
from torchrec_neuroshard.lab.training import comm_metrics, compute_metrics, mape, train_comm, train_compute
from torchrec_neuroshard.lab.training_data import ComputeData, load_comm_data, load_compute_data, split_by_group
from torchrec_neuroshard.types import ShardingError

HOLDOUT = 0.2
"""Share of the calibration samples (by group) kept out of fine-tuning for early stopping."""
def _split(groups: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(fine-tune, hold-out) masks by group; at least one group held out."""
    train, val, _ = split_by_group(groups, seed, (1.0 - HOLDOUT, 1.0))
    if not val.any():
        raise ShardingError(f"calibration needs at least 2 samples (one is held out), got {len(np.unique(groups))}")
    return train, val


def fine_tune(
    base: NeuralCostModel,
    rows: Sequence[dict],
    epochs: int = 100,
    lr: float = 1e-3,
    seed: int = 0,
    patience: int = 15,
    progress: bool = True,
) -> NeuralCostModel:
    """``base`` fine-tuned on the measured ``rows`` of one machine (compute, and comm if
    present): a copy of each net trained from the base's weights with the base's feature
    normalisation, early-stopped on ``HOLDOUT`` of the rows. A comm part the base lacks
    (a GPU model's alpha-beta stand-in) is trained from scratch on the comm rows; the
    base's sequence-kernel net is kept as it is (calibration measures pooled kernels).
    The compute net's feature range grows by the fine-tuning samples' (both are samples
    of the same kernel the net learned; a base without a range gets theirs), its batches
    too where it reads the batch (else it prices at the calibration's batch, linear beyond,
    moved by the base's batch shift around that batch where the base has one).
    ``meta["calibration"]`` records the base, the sample counts, the time, and the held-out
    error before and after."""
    t0 = time.perf_counter()
    reads_batch = base.compute_net.reads_batch or base.batch_shift is not None  # the data carry the batch
    compute_rows = _compute_rows_of_one_machine(rows, reads_batch)
    data = load_compute_data(compute_rows, reads_batch=reads_batch)
    shift = _shift_around(base, compute_rows[0]["batch_size"])
    train, val = _split(data.group, seed)
    start = _stretching_net(base)
    before = compute_metrics(start, base.compute_norm, data.subset(val), shift)
    net, norm, log = train_compute(
        data.subset(train), data.subset(val), epochs, seed, min(32, max(1, int(train.sum()) // 4)), lr, patience,
        progress, start=(start, base.compute_norm), shift=shift,
    )  # fmt: skip
    record = {
        "base": {"hardware": base.meta["hardware"], "batch_size": base.batch_size},
        "compute_samples": len(data),
        "compute_holdout": {"before": before, "after": compute_metrics(net, norm, data.subset(val), shift)},
        "compute_epochs": log["epochs"],
    }
    meta = _tuned_meta(base, net, compute_rows, data, train, seed)
    comm = _tune_comm(base, list(iter_kind(rows, "comm")), meta, record, epochs, lr, seed, patience, progress)
    record["seconds"] = round(time.perf_counter() - t0, 1)
    meta["train_seconds"] = record["seconds"]
    meta["calibration"] = record
    model = NeuralCostModel(net, norm, comm, meta, sequence=base.sequence, batch_shift=base.batch_shift)
    held_out_pairs = [r for r, held in zip(compute_rows, val) if held and "pair" in r]  # ``data``'s order
    if len(data.pairs()):
        record["device_pairs"] = len(data.pairs())
        record["pairs_holdout"] = {"before": pair_errors(base, held_out_pairs), "after": pair_errors(model, held_out_pairs)}
    return model


def _shift_around(base: NeuralCostModel, batch_size: int) -> BatchShift | None:
    """The base's batch shift around the calibration kernels' ``batch_size``, where the
    tuned net will price without it (None without one): device pairs at other batches are
    learned through it, frozen (a copy: no gradients computed for it, the base's net untouched)."""
    if base.batch_shift is None:
        return None
    net, norm = base.batch_shift
    return BatchShift.of(copy.deepcopy(net).requires_grad_(False), norm, {**base.meta["batch_shift"], "reference_batch": batch_size})


def _stretching_net(base: NeuralCostModel) -> ComputeNet:
    """A copy of the base's compute net that stretches beyond the kernel size the base was
    trained on (``ComputeNet.stretch_beyond``), as the planner prices the base's larger
    kernels: device-sized kernels are then learned as they will be priced, from inputs in
    the range the net knows. Within that size it computes what the base does."""
    net = copy.deepcopy(base.compute_net)
    if net.stretch_beyond is None and base.meta.get("max_tables_per_kernel"):
        net.config["stretch_beyond"] = int(base.meta["max_tables_per_kernel"])
    return net


def _tuned_meta(
    base: NeuralCostModel, net: ComputeNet, compute_rows: list[dict], data: ComputeData, train: np.ndarray, seed: int
) -> dict:
    """The base's meta for ``net`` fine-tuned on ``data`` (``compute_rows``, ``train`` of
    them): this machine's hardware and batch, the batches and feature range grown by the
    new samples', the kernel size the net stretches beyond, the base's test figures dropped."""
    meta = dict(base.meta)
    meta.update(
        hardware=compute_rows[0]["hardware"],
        batch_size=compute_rows[0]["batch_size"],  # the calibration kernels' one batch (device pairs follow them)
        compute_config=dict(net.config),  # the stretch it learned with
        max_tables_per_kernel=net.stretch_beyond or max(meta.get("max_tables_per_kernel", 0), max(len(r["shards"]) for r in compute_rows)),
        seed=seed,
    )
    here = int(data.batch_size[0])
    if net.reads_batch:
        low, high = base.pooled_kernel.batch_sizes_trained
        meta["batch_sizes_trained"] = [min(low, int(data.batch_size.min())), max(high, int(data.batch_size.max()))]
    else:  # it prices at the calibration's batch, linear (and moved by the base's batch shift) beyond
        meta["batch_sizes_trained"] = [here, here]
    tuned = FeatureRange.fit(data.subset(train).x[:, : len(feature_names(net.reads_batch))])
    base_range = base.pooled_kernel.trained_range
    meta["feature_range"] = (tuned if base_range is None else base_range.union(tuned)).state()
    meta.pop("test", None)  # the base's test split is another machine's
    meta.pop("kernel_correction", None)  # fitted to the base's nets, not these
    meta.pop("width_correction", None)
    meta.pop("hardware_note", None)
    if "batch_shift" in meta:  # the base's shift moves shards off the batch the net is now tuned at
        meta["batch_shift"] = {**meta["batch_shift"], "reference_batch": meta["batch_sizes_trained"][0]}
    return meta


def pair_errors(model: NeuralCostModel, rows: Sequence[dict]) -> dict:
    """``model`` on device pairs ``rows`` as the planner prices a device (``kernel_ms``):
    the whole pairs, the MAPE of each pair's predicted ratio (the two were timed in turn,
    so the machine's drift cancels), how often it names the pair's slower member, and the
    median predicted / measured (the level, which drifts)."""
    whole = whole_pairs(rows)
    if not whole:
        return {"pairs": 0}
    pred = torch.tensor([model.kernel_ms([shard_from_record(s) for s in r["shards"]], r["batch_size"]) for r in whole])  # [2P]
    truth = torch.tensor([r["fwd_ms"] + r["bwd_ms"] for r in whole], dtype=pred.dtype)  # [2P], partners side by side
    ratio_pred, ratio = pred[0::2] / pred[1::2], truth[0::2] / truth[1::2]  # [P]
    return {
        "pairs": len(ratio),
        "ratio_mape": mape(ratio_pred, ratio),
        "order_agreement": float(((ratio_pred > 1) == (ratio > 1)).double().mean()),
        "level": float((pred / truth).median()),
    }


def _compute_rows_of_one_machine(rows: Sequence[dict], reads_batch: bool) -> list[dict]:
    """The compute rows of ``rows``, calibration kernels first and device pairs after them;
    refusing none, several machines, calibration kernels at several batches, and device
    pairs (drawn at many batches) for a base that prices other batches linearly (its net
    does not read the batch and it has no batch shift)."""
    compute_rows = list(iter_kind(rows, "compute"))
    kernels = [r for r in compute_rows if "pair" not in r]
    if not kernels:
        raise ShardingError("no compute samples to calibrate on; measure some with `neuroshard calibrate`")
    kinds = {(r["hardware"]["device"], r["hardware"].get("device_name")) for r in rows}
    if len(kinds) > 1:
        raise ShardingError(f"calibration rows come from several machines {sorted(kinds)}; calibrate on one machine's samples")
    batch_sizes = {r["batch_size"] for r in kernels}
    if len(batch_sizes) > 1:
        raise ShardingError(f"calibration rows mix batch sizes {sorted(batch_sizes)}; use one")
    pairs = [r for r in compute_rows if "pair" in r]
    if pairs and not reads_batch:
        raise ShardingError(
            f"{len(pairs) // 2} device pairs at global batches {min(r['batch_size'] for r in pairs)}-"
            f"{max(r['batch_size'] for r in pairs)}, and the base model prices other batches linearly (its net does not "
            "read the batch, nor has it a batch shift); calibrate without --device-pairs, or from a base that learned "
            "the batch (the shipped cpu.pt)"
        )
    return kernels + pairs


def _tune_comm(
    base: NeuralCostModel, comm_rows: list[dict], meta: dict, record: dict, epochs: int, lr: float, seed: int,
    patience: int, progress: bool,
) -> NeuralComm | None:
    """The comm model fine-tuned on ``comm_rows`` (trained from scratch when ``base`` has no
    neural comm), its training recorded in ``meta`` and ``record``; the base's neural comm
    when there are no comm rows; else None."""
    comm = base.comm if isinstance(base.comm, NeuralComm) else None
    if not comm_rows:
        if comm is not None:
            record["comm"] = "kept the base model's comm net (no comm samples measured here)"
        else:
            meta["world_sizes_trained"] = []
        return comm
    data = load_comm_data(comm_rows)
    train, val = _split(data.group, seed)
    start = (comm.net, comm.norm) if comm is not None else None
    before = comm_metrics(comm.net, comm.norm, data.subset(val)) if comm is not None else None
    net, norm, _ = train_comm(
        data.subset(train), data.subset(val), epochs if start else 200, seed, 64, lr, patience, progress, start=start
    )
    record["comm_samples"] = int(len(np.unique(data.group)))
    record["comm_holdout"] = {"before": before, "after": comm_metrics(net, norm, data.subset(val))}
    trained = sorted(set(data.world_size.tolist()) | set(meta.get("world_sizes_trained", []) if start else ()))
    meta.update(comm_hardware=comm_rows[0]["hardware"], comm_config=net.config, world_sizes_trained=trained)
    return NeuralComm(net, norm, meta["batch_size"])
