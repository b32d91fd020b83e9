"""Calibration: a shipped cost model fine-tuned to this machine in minutes.

    neuroshard calibrate --samples 200 --out my_cpu.pt

A cost model predicts the machine its samples were measured on. Calibration measures a
small set of compute samples here (and, if asked, all-to-all samples at some world sizes,
and the step's other parts), chosen to cover the feature space (``coverage``), and
fine-tunes the shipped model on them: every weight from the shipped values (its feature
normalisation kept), early-stopped on a held-out part of the new samples, in seconds of
training. The result is a model file for this machine, loaded like any other. Measuring
appends to files under ``--data-dir`` and resumes where they stop, like ``collect``.

Neighbours: on a CPU host the ranks of a training step share the cores, caches and memory,
and a kernel timed alone does not see that. ``--busy-neighbours K`` times the compute
samples with K other processes running fused kernels beside them (``busy_neighbours``), as
K other ranks of the host do; those samples go to a file of their own (``compute_busyK``).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from torchrec_neuroshard.costmodel import NeuralComm, NeuralCostModel
from torchrec_neuroshard.costmodel.features import FeatureRange
from torchrec_neuroshard.hardware import cpu_cores
from torchrec_neuroshard.lab.collect import (
    PoolLookups,
    collect_comm,
    collect_compute,
    draw_compute_sample,
    iter_kind,
    read_rows,
)
from torchrec_neuroshard.lab.coverage import CALIBRATION_SEED, calibration_indices
from torchrec_neuroshard.lab.measure_compute import measure_compute
from torchrec_neuroshard.lab.training import comm_metrics, compute_metrics, train_comm, train_compute
from torchrec_neuroshard.lab.training_data import load_comm_data, load_compute_data, split_by_group
from torchrec_neuroshard.lab.workloads import WorkloadScale, synthetic_pool
from torchrec_neuroshard.types import ShardingError

HOLDOUT = 0.2
"""Share of the calibration samples (by group) kept out of fine-tuning for early stopping."""
BUSY_SEED = CALIBRATION_SEED + 1
"""Seed of the kernels the busy neighbours run (other draws than the measured ones)."""


def _busy_loop(scale: WorkloadScale, index: int, stop: object) -> None:
    """A neighbour: fused kernels of compute samples (forward and backward), one thread,
    one after another until ``stop`` (a multiprocessing Event) is set."""
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
    of the same kernel the net learned; a base without a range gets theirs), its batches
    too where it reads the batch (else it prices at the calibration's batch, linear beyond).
    ``meta["calibration"]`` records the base, the sample counts, the time, and the held-out
    error before and after."""
    t0 = time.perf_counter()
    compute_rows = _compute_rows_of_one_machine(rows)
    data = load_compute_data(compute_rows, reads_batch=base.compute_net.reads_batch)
    train, val = _split(data.group, seed)
    before = compute_metrics(base.compute_net, base.compute_norm, data.subset(val))
    net, norm, log = train_compute(
        data.subset(train), data.subset(val), epochs, seed, min(32, max(1, int(train.sum()) // 4)), lr, patience,
        progress, start=(base.compute_net, base.compute_norm),
    )  # fmt: skip
    record = {
        "base": {"hardware": base.meta["hardware"], "batch_size": base.batch_size},
        "compute_samples": len(data),
        "compute_holdout": {"before": before, "after": compute_metrics(net, norm, data.subset(val))},
        "compute_epochs": log["epochs"],
    }
    meta = dict(base.meta)
    meta.update(
        hardware=compute_rows[0]["hardware"],
        batch_size=compute_rows[0]["batch_size"],
        max_tables_per_kernel=max(meta.get("max_tables_per_kernel", 0), max(len(r["shards"]) for r in compute_rows)),
        seed=seed,
    )
    here = int(data.batch_size[0])  # one batch (``_compute_rows_of_one_machine``)
    low, high = base.pooled_kernel.batch_sizes_trained if base.compute_net.reads_batch else (here, here)
    meta["batch_sizes_trained"] = [min(low, here), max(high, here)]
    tuned = FeatureRange.fit(data.subset(train).x)
    base_range = base.pooled_kernel.trained_range
    meta["feature_range"] = (tuned if base_range is None else base_range.union(tuned)).state()
    meta.pop("test", None)  # the base's test split is another machine's
    meta.pop("hardware_note", None)
    comm = _tune_comm(base, list(iter_kind(rows, "comm")), meta, record, epochs, lr, seed, patience, progress)
    record["seconds"] = round(time.perf_counter() - t0, 1)
    meta["train_seconds"] = record["seconds"]
    meta["calibration"] = record
    return NeuralCostModel(net, norm, comm, meta, sequence=base.sequence)


def _compute_rows_of_one_machine(rows: Sequence[dict]) -> list[dict]:
    """The compute rows of ``rows``, refusing none, several machines or several batch sizes."""
    compute_rows = list(iter_kind(rows, "compute"))
    if not compute_rows:
        raise ShardingError("no compute samples to calibrate on; measure some with `neuroshard calibrate`")
    kinds = {(r["hardware"]["device"], r["hardware"].get("device_name")) for r in rows}
    if len(kinds) > 1:
        raise ShardingError(f"calibration rows come from several machines {sorted(kinds)}; calibrate on one machine's samples")
    batch_sizes = {r["batch_size"] for r in compute_rows}
    if len(batch_sizes) > 1:
        raise ShardingError(f"calibration rows mix batch sizes {sorted(batch_sizes)}; use one")
    return compute_rows


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


# ---------------------------------------------------------------- the workflow


@dataclass(frozen=True)
class Calibration:
    """What ``neuroshard calibrate`` measures on this machine and how it fine-tunes; its
    errors name the command's flags.

    Attributes:
        device: what to calibrate (a CPU or a GPU of this machine).
        data_dir: where the measured samples go; measuring resumes where its files stop.
        samples: compute samples to measure and fine-tune on.
        world_sizes: also measure and fine-tune comm at these world sizes,
        comm_samples: this many samples at each.
        step_samples: with ``world_sizes``, also measure the step's other parts, this many
            samples of each kind at each world size, and refit them (0: kept).
        busy_neighbours: CPU: time compute beside this many processes running kernels.
        threads: CPU: torch threads for compute.
        epochs: most fine-tuning epochs (early-stopped).
    """

    device: torch.device
    data_dir: Path
    samples: int = 200
    world_sizes: tuple[int, ...] = ()
    comm_samples: int = 100
    step_samples: int = 0
    busy_neighbours: int = 0
    threads: int = 1
    epochs: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "world_sizes", tuple(self.world_sizes))
        if self.samples < 1:
            raise ShardingError(f"--samples {self.samples}: calibrate fine-tunes on measured compute samples; give 1 or more (default 200)")
        if self.world_sizes and self.comm_samples < 1:
            raise ShardingError(f"--comm-samples {self.comm_samples} with --world-size: give 1 or more comm samples per world size")
        if self.step_samples < 0:
            raise ShardingError(f"--step-samples {self.step_samples}: give 0 (keep the step parts) or more")
        if self.busy_neighbours < 0:
            raise ShardingError(f"--busy-neighbours {self.busy_neighbours}: a count of processes, 0 or more")
        if self.step_samples and not self.world_sizes:
            raise ShardingError(f"--step-samples {self.step_samples} measures the step's parts at --world-size sizes; give them")
        if self.busy_neighbours and self.device.type != "cpu":
            raise ShardingError("--busy-neighbours times CPU kernels beside other ranks' kernels; a GPU's ranks do not share it")

    @property
    def compute_path(self) -> Path:
        """The compute samples' file: one of its own for samples timed beside busy neighbours."""
        return self.data_dir / (f"compute_busy{self.busy_neighbours}.jsonl" if self.busy_neighbours else "compute.jsonl")


@dataclass(frozen=True)
class Calibrated:
    """A calibrated model, the report lines of its refitted step parts, and the seconds
    spent measuring compute, comm and the step parts."""

    model: NeuralCostModel
    step_lines: tuple[str, ...]
    seconds: dict[str, float]


def busy_machine_warning() -> str | None:
    """A warning when this machine's load average exceeds its cores: samples measured now
    time a loaded machine."""
    load, cores = os.getloadavg()[0], cpu_cores()
    if load <= cores:
        return None
    return (
        f"warning: this machine is busy (load average {load:.1f} on {cores} cores): the samples measured "
        "now will time a loaded machine, and so will the calibrated model. Calibrate on a quiet machine."
    )


def calibrate(base: NeuralCostModel, run: Calibration) -> Calibrated:
    """``base`` calibrated to this machine: ``run``'s samples measured here (resuming the
    files under ``run.data_dir``), the nets fine-tuned on them (``fine_tune``), and the step
    parts refitted on measured step samples when ``run.step_samples`` asks for them."""
    seconds = {}
    t0 = time.perf_counter()
    scale = WorkloadScale.for_device(run.device)
    indices = calibration_indices(synthetic_pool(), scale, run.samples)
    with busy_neighbours(run.busy_neighbours, scale):
        collect_compute(
            run.compute_path, run.samples, run.device, scale, seed=CALIBRATION_SEED, num_threads=run.threads, sample_indices=indices
        )  # fmt: skip
    seconds["compute"] = time.perf_counter() - t0
    comm_path = run.data_dir / "comm.jsonl"
    for world in run.world_sizes:
        collect_comm(comm_path, world, run.comm_samples, seed=CALIBRATION_SEED)
    seconds["comm"] = time.perf_counter() - t0 - seconds["compute"]
    rows = read_rows(run.compute_path)[: run.samples]
    for world in run.world_sizes:
        rows += [r for r in iter_kind(read_rows(comm_path), "comm") if r["world_size"] == world][: run.comm_samples]
    model = fine_tune(base, rows, epochs=run.epochs, seed=run.seed)
    t_step = time.perf_counter()
    model, step_lines = _refit_step_parts(model, run)
    seconds["step"] = time.perf_counter() - t_step
    model.meta["calibration"]["busy_neighbours"] = run.busy_neighbours
    return Calibrated(model, tuple(step_lines), seconds)


def _refit_step_parts(model: NeuralCostModel, run: Calibration) -> tuple[NeuralCostModel, list[str]]:
    """``model`` with its step parts refitted on ``run.step_samples`` samples of each kind
    measured here at ``run.world_sizes``, and a report line per part; as it is without."""
    if not run.step_samples:
        return model, []
    from torchrec_neuroshard.lab.collect_step import collect_step  # spawns ranks: imported when asked
    from torchrec_neuroshard.lab.refit_steps import refit_meta

    step_path = run.data_dir / "step.jsonl"
    collect_step(step_path, run.step_samples, run.world_sizes, seed=CALIBRATION_SEED)
    meta, lines = refit_meta(model.meta, read_rows(step_path))
    model = NeuralCostModel(model.compute_net, model.compute_norm, model.comm, meta, model.batch_scale, model.sequence)
    model.meta["calibration"]["step_samples"] = run.step_samples
    return model, lines


def summary(done: Calibrated, run: Calibration, out: str | Path, seconds: float) -> list[str]:
    """The lines ``neuroshard calibrate`` prints of a calibration saved to ``out`` that took
    ``seconds``: what was calibrated on what, the held-out error before and after, each
    refitted step part, and the time spent."""
    model, cal = done.model, done.model.meta["calibration"]
    before, after = cal["compute_holdout"]["before"], cal["compute_holdout"]["after"]
    lines = [
        f"calibrated {cal['base']['hardware']['device']} {cal['base']['hardware'].get('device_name')} model to "
        f"{model.hardware.describe()} on {cal['compute_samples']} compute samples"
        + (f" and {cal['comm_samples']} comm samples (D={list(run.world_sizes)})" if "comm_samples" in cal else "")
        + (f", compute timed beside {run.busy_neighbours} busy neighbour(s)" if run.busy_neighbours else ""),
        f"held-out compute fwd+bwd ({before['samples']} samples): MAPE {before['mape_total']:.1f}% -> "
        f"{after['mape_total']:.1f}%, Spearman {before['spearman_total']:.3f} -> {after['spearman_total']:.3f}",
    ]
    if "comm_holdout" in cal:
        comm_before, comm_after = cal["comm_holdout"]["before"], cal["comm_holdout"]["after"]
        was = f"{comm_before['mape_total']:.1f}% -> " if comm_before else "(trained from scratch) "
        lines.append(f"held-out comm per device ({comm_after['devices']} devices): MAPE {was}{comm_after['mape_total']:.1f}%")
    lines += [f"step part {line}" for line in done.step_lines]
    lines.append(
        f"saved {out}; wall time {seconds:.0f} s (measuring compute {done.seconds['compute']:.0f} s, comm {done.seconds['comm']:.0f} s, "
        f"step parts {done.seconds['step']:.0f} s, fine-tuning {cal['seconds']:.0f} s). Plan with "
        f"NeuroShardPlanner(topology, cost_model={str(out)!r})"
    )
    return lines
