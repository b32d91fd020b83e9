"""Calibration: a shipped cost model fine-tuned to this machine in minutes.

    neuroshard calibrate --samples 200 --out my_cpu.pt

A cost model predicts the machine its samples were measured on. Calibration measures a
small set of compute samples here (and, if asked, all-to-all samples at some world sizes),
chosen to cover the feature space, and fine-tunes the shipped model on them: every weight
from the shipped values (its feature normalisation kept), early-stopped on a held-out part
of the new samples, in seconds of training. The result is a
model file for this machine, loaded like any other.

Coverage: compute samples are drawn as ``neuroshard collect compute`` draws them, from a
fixed candidate list of ``CANDIDATES`` draws (seed ``CALIBRATION_SEED``), and taken round
robin over strata of (table count, total width, mean pooling factor), so the first n of the
order spread over the space for every n. Measuring appends to files under ``--data-dir``
and resumes where they stop, like ``collect``.

Neighbours: on a CPU host the ranks of a training step share the cores, caches and memory,
and a kernel timed alone does not see that. ``--busy-neighbours K`` times the compute
samples with K other processes running fused kernels beside them (``busy_neighbours``), as
K other ranks of the host do; those samples go to a file of their own (``compute_busyK``).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import defaultdict
from typing import Hashable, Iterator, Sequence

import numpy as np

from torchrec_neuroshard.costmodel import NeuralComm, NeuralCostModel
from torchrec_neuroshard.costmodel.features import FeatureRange
from torchrec_neuroshard.lab.collect import draw_compute_sample, iter_kind, shard_from_record
from torchrec_neuroshard.lab.pretrain import (
    comm_metrics,
    compute_metrics,
    load_comm_data,
    load_compute_data,
    split_by_group,
    train_comm,
    train_compute,
)
from torchrec_neuroshard.lab.workloads import PoolTable, WorkloadScale
from torchrec_neuroshard.types import ShardingError

CALIBRATION_SEED = 20_261_126
"""Seed of the calibration draws: apart from ``collect``'s default seeds 0 and 7."""
CANDIDATES = 6_000
"""Draws the covering order is taken from."""
HOLDOUT = 0.2
"""Share of the calibration samples (by group) kept out of fine-tuning for early stopping."""


def stratum(widths: Sequence[int], pooling_factors: Sequence[float]) -> tuple[int, int, int]:
    """The cell of a compute sample: log2 bins of its table count and total width, and
    its mean pooling factor in bins (< 8, < 24, >= 24)."""
    pooling = sum(pooling_factors) / len(pooling_factors)
    return (
        int(math.log2(len(widths))),
        int(math.log2(sum(widths))) // 2,
        0 if pooling < 8 else 1 if pooling < 24 else 2,
    )


def covering_order(keys: Sequence[Hashable]) -> list[int]:
    """Indices of ``keys`` in round-robin order over their strata (each stratum in its own
    order): every prefix is as evenly spread over the strata as it can be."""
    by_key: dict[Hashable, list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        by_key[k].append(i)
    queues = [by_key[k] for k in sorted(by_key)]
    order: list[int] = []
    for depth in range(max(len(q) for q in queues)):
        order += [q[depth] for q in queues if depth < len(q)]
    return order


def calibration_indices(pool: Sequence[PoolTable], scale: WorkloadScale, count: int, seed: int = CALIBRATION_SEED) -> list[int]:
    """The first ``count`` sample indices (for ``draw_compute_sample(pool, scale, seed, i)``)
    of the covering order over ``CANDIDATES`` draws."""
    if count > CANDIDATES:
        raise ShardingError(f"calibration takes at most {CANDIDATES} compute samples, asked for {count}")
    keys = []
    for i in range(CANDIDATES):
        s = draw_compute_sample(pool, scale, seed, i)
        keys.append(stratum(s.widths, [pool[t].pooling_factor for t in s.table_ids]))
    return covering_order(keys)[:count]


def covering_rows(rows: Sequence[dict], count: int) -> list[dict]:
    """The first ``count`` compute rows of the covering order (for rows measured before,
    e.g. another machine's dataset)."""
    keys = []
    for r in rows:
        shards = [shard_from_record(s) for s in r["shards"]]
        keys.append(stratum([s.width for s in shards], [s.table.pooling_factor for s in shards]))
    return [rows[i] for i in covering_order(keys)[:count]]


BUSY_SEED = CALIBRATION_SEED + 1
"""Seed of the kernels the busy neighbours run (other draws than the measured ones)."""


def _busy_loop(scale: WorkloadScale, index: int, stop: object) -> None:
    """A neighbour: fused kernels of compute samples (forward and backward), one thread,
    one after another until ``stop`` (a multiprocessing Event) is set."""
    import torch

    from torchrec_neuroshard.lab.collect import PoolLookups
    from torchrec_neuroshard.lab.measure_compute import measure_compute
    from torchrec_neuroshard.lab.workloads import synthetic_pool

    pool = synthetic_pool()
    bank = PoolLookups(pool, scale)
    i = 0
    while not stop.is_set():  # type: ignore[attr-defined]
        shards, lookups = bank.shards(draw_compute_sample(pool, scale, BUSY_SEED + index, i))
        measure_compute(shards, lookups, torch.device("cpu"), warmup=0, repeats=3)
        i += 1


@contextlib.contextmanager
def busy_neighbours(count: int, scale: WorkloadScale) -> Iterator[None]:
    """Run ``count`` processes of fused kernels beside the block: samples measured inside
    it are timed as one rank of ``count + 1`` on a host whose ranks share the CPU's cores,
    caches and memory (the data-parallel training step does that to every kernel)."""
    if count <= 0:
        yield
        return
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_busy_loop, args=(scale, k, stop), daemon=True) for k in range(count)]
    for proc in procs:
        proc.start()
    try:
        time.sleep(2.0)  # the neighbours import torch and build their first kernel
        yield
    finally:
        stop.set()
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()


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
    of the same kernel the net learned; a base without a range gets theirs).
    ``meta["calibration"]`` records the base, the sample counts, the time, and the held-out
    error before and after."""
    t0 = time.perf_counter()
    compute_rows = list(iter_kind(rows, "compute"))
    if not compute_rows:
        raise ShardingError("no compute samples to calibrate on; measure some with `neuroshard calibrate`")
    kinds = {(r["hardware"]["device"], r["hardware"].get("device_name")) for r in rows}
    if len(kinds) > 1:
        raise ShardingError(f"calibration rows come from several machines {sorted(kinds)}; calibrate on one machine's samples")
    batch_sizes = {r["batch_size"] for r in compute_rows}
    if len(batch_sizes) > 1:
        raise ShardingError(f"calibration rows mix batch sizes {sorted(batch_sizes)}; use one")

    data = load_compute_data(compute_rows)
    train, val = _split(data.group, seed)
    before = compute_metrics(base.compute_net, base.compute_norm, data.subset(val))
    net, norm, log = train_compute(
        data.subset(train), data.subset(val), epochs, seed, min(32, max(1, int(train.sum()) // 4)), lr, patience,
        progress, start=(base.compute_net, base.compute_norm),
    )  # fmt: skip
    after = compute_metrics(net, norm, data.subset(val))
    record = {
        "base": {"hardware": base.meta["hardware"], "batch_size": base.batch_size},
        "compute_samples": len(data),
        "compute_holdout": {"before": before, "after": after},
        "compute_epochs": log["epochs"],
    }
    meta = dict(base.meta)
    meta.update(
        hardware=compute_rows[0]["hardware"],
        batch_size=compute_rows[0]["batch_size"],
        max_tables_per_kernel=max(meta.get("max_tables_per_kernel", 0), max(len(r["shards"]) for r in compute_rows)),
        seed=seed,
    )
    tuned = FeatureRange.fit(data.subset(train).x)
    base_range = base.pooled_kernel.trained_range
    meta["feature_range"] = (tuned if base_range is None else base_range.union(tuned)).state()
    meta.pop("test", None)  # the base's test split is another machine's
    meta.pop("hardware_note", None)

    comm = base.comm if isinstance(base.comm, NeuralComm) else None
    comm_rows = list(iter_kind(rows, "comm"))
    if comm_rows:
        cdata = load_comm_data(comm_rows)
        ctrain, cval = _split(cdata.group, seed)
        start = (comm.net, comm.norm) if comm is not None else None
        comm_before = comm_metrics(comm.net, comm.norm, cdata.subset(cval)) if comm is not None else None
        cnet, cnorm, _ = train_comm(
            cdata.subset(ctrain), cdata.subset(cval), epochs if start else 200, seed, 64, lr, patience, progress, start=start
        )
        record["comm_samples"] = int(len(np.unique(cdata.group)))
        record["comm_holdout"] = {"before": comm_before, "after": comm_metrics(cnet, cnorm, cdata.subset(cval))}
        comm = NeuralComm(cnet, cnorm, meta["batch_size"])
        trained = sorted(set(cdata.world_size.tolist()) | set(meta.get("world_sizes_trained", []) if start else ()))
        meta.update(comm_hardware=comm_rows[0]["hardware"], comm_config=cnet.config, world_sizes_trained=trained)
    elif comm is not None:
        record["comm"] = "kept the base model's comm net (no comm samples measured here)"
    else:
        meta["world_sizes_trained"] = []
    record["seconds"] = round(time.perf_counter() - t0, 1)
    meta["train_seconds"] = record["seconds"]
    meta["calibration"] = record
    return NeuralCostModel(net, norm, comm, meta, sequence=base.sequence)
