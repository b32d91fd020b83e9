"""Calibration: a shipped cost model fine-tuned to this machine in minutes.

    neuroshard calibrate --samples 200 --device-pairs 60 --out my_cpu.pt

A cost model predicts the machine its samples were measured on. Calibration measures a
small set of compute samples here (and, if asked, all-to-all samples at some world sizes,
and the step's other parts), chosen to cover the feature space (``coverage``), and
fine-tunes the shipped model on them (``lab.fine_tune``) in seconds of training. The
result is a model file for this machine, loaded like any other. Measuring appends to files
under ``--data-dir`` and resumes where they stop, like ``collect``.

Device-sized kernels: the calibration kernels fuse 1-15 tables, and a device of a production
plan runs 50-110 in one kernel, where the model's error grows with a device's lookup work.
``--device-pairs N`` also measures N pairs of 16-128-table kernels of the training pools
(``collect_devices``), the two of a pair timed in turn, and fine-tunes on their level and on
their ratio, which the machine's drift within the hour does not move.

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
from typing import Iterator

import torch

from torchrec_neuroshard.costmodel import NeuralCostModel
from torchrec_neuroshard.hardware import cpu_cores
from torchrec_neuroshard.lab.collect import PoolLookups, collect_comm, collect_compute, draw_compute_sample, iter_kind, read_rows
from torchrec_neuroshard.lab.collect_devices import collect_device_pairs
from torchrec_neuroshard.lab.coverage import CALIBRATION_SEED, calibration_indices
from torchrec_neuroshard.lab.fine_tune import fine_tune
from torchrec_neuroshard.lab.launch import rank_context, start_process
from torchrec_neuroshard.lab.measure_compute import measure_compute
from torchrec_neuroshard.lab.workloads import WorkloadScale, synthetic_pool
from torchrec_neuroshard.types import ShardingError

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
    ctx = rank_context()
    stop = ctx.Event()
    procs = [start_process(ctx, _busy_loop, scale, k, stop, daemon=True) for k in range(count)]
    try:
        time.sleep(2.0)  # the neighbours import torch and build their first kernel
        yield
    finally:
        stop.set()
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.terminate()


# ---------------------------------------------------------------- the workflow


@dataclass(frozen=True)
class Calibration:
    """What ``neuroshard calibrate`` measures on this machine and how it fine-tunes; its
    errors name the command's flags.

    Attributes:
        device: what to calibrate (a CPU or a GPU of this machine).
        data_dir: where the measured samples go; measuring resumes where its files stop.
        samples: compute samples to measure and fine-tune on (kernels of 1-15 tables).
        device_pairs: also measure this many pairs of device-sized kernels (16-128 tables
            of the training pools, ``collect_devices``), each two timed in turn, and
            fine-tune on them: their level and their ratio (a ratio the machine's drift
            does not move; issue 43).
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
    device_pairs: int = 0
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
        if self.device_pairs < 0:
            raise ShardingError(f"--device-pairs {self.device_pairs}: give 0 (none) or more pairs of device-sized kernels")
        if self.device_pairs and self.device.type != "cpu":
            raise ShardingError(
                f"--device-pairs {self.device_pairs} on {self.device}: device pairs are drawn to a CPU's memory (kernels of at "
                "most 2 GiB), far below what a GPU's devices run; calibrate a GPU without --device-pairs"
            )
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

    @property
    def pairs_path(self) -> Path:
        """The device pairs' file, beside ``compute_path`` and named as it is."""
        return self.compute_path.with_name(self.compute_path.name.replace("compute", "device_pairs"))


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
        if run.device_pairs:
            collect_device_pairs(
                run.pairs_path, run.device_pairs, run.device, seed=CALIBRATION_SEED, scale=scale, num_threads=run.threads
            )  # fmt: skip
    seconds["compute"] = time.perf_counter() - t0
    comm_path = run.data_dir / "comm.jsonl"
    for world in run.world_sizes:
        collect_comm(comm_path, world, run.comm_samples, seed=CALIBRATION_SEED)
    seconds["comm"] = time.perf_counter() - t0 - seconds["compute"]
    rows = read_rows(run.compute_path)[: run.samples]
    if run.device_pairs:
        rows += read_rows(run.pairs_path)[: 2 * run.device_pairs]
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
    model = model.with_meta(meta)
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
        + (f" (with {cal['device_pairs']} device pairs)" if "device_pairs" in cal else "")
        + (f" and {cal['comm_samples']} comm samples (D={list(run.world_sizes)})" if "comm_samples" in cal else "")
        + (f", compute timed beside {run.busy_neighbours} busy neighbour(s)" if run.busy_neighbours else ""),
        f"held-out compute fwd+bwd ({before['samples']} samples): MAPE {before['mape_total']:.1f}% -> "
        f"{after['mape_total']:.1f}%, Spearman {before['spearman_total']:.3f} -> {after['spearman_total']:.3f}",
    ]
    if cal.get("pairs_holdout", {}).get("after", {}).get("pairs"):
        pb, pa = cal["pairs_holdout"]["before"], cal["pairs_holdout"]["after"]
        lines.append(
            f"held-out device pairs ({pa['pairs']} of {cal['device_pairs']}, priced as the planner prices a device): "
            f"ratio MAPE {pb['ratio_mape']:.1f}% -> {pa['ratio_mape']:.1f}%, slower member named {pb['order_agreement']:.0%} -> "
            f"{pa['order_agreement']:.0%}, level (predicted / measured) {pb['level']:.2f} -> {pa['level']:.2f}"
        )
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
