"""Pre-training data: sample generation as the NeuroShard prototype did it, measured for real.

Datasets are JSON-lines files, one measured sample per line, appended as they are taken:
re-running continues where the file ends (sample i always draws the same tables, from
``seed`` and i), and a line cut by Ctrl-C is dropped on resume. ``.gz`` files are read too.
"""

from __future__ import annotations

import gzip
import json
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
from tqdm import tqdm

from torchrec_neuroshard.hardware import cpu_cores, cpu_name, vector_isa
from torchrec_neuroshard.lab.measure_comm import measure_comm
from torchrec_neuroshard.lab.measure_compute import Lookups, measure_compute
from torchrec_neuroshard.types import Shard, ShardingError, TableSpec
from torchrec_neuroshard.lab.workloads import DIMS, PoolTable, WorkloadScale, divisible_batch, synthetic_pool, table_spec

MAX_TABLES_PER_SAMPLE = 15
PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
COMPUTE_MEMORY_CAP_BYTES = 512 * 2**20
"""Rejection cap on a compute sample's weights at the CPU scale (x row_divisor at full size)."""


def hardware(device: torch.device, num_threads: int | None) -> dict:
    """What the measurements were taken on: device, its name, cores and vector instructions
    (CPU; rows before 2026-12-08 lack them), versions, threads."""
    import fbgemm_gpu

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {
        "device": device.type,
        "device_name": name,
        "cores": cpu_cores() if device.type == "cpu" else None,
        "torch": torch.__version__,
        "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "unknown"),
        "threads": num_threads if device.type == "cpu" else None,
        **({"vector_isa": vector_isa()} if device.type == "cpu" else {}),
    }


# ---------------------------------------------------------------- dataset files


def read_rows(path: str | Path) -> list[dict]:
    """Every complete JSON line of a dataset file (plain or gzipped)."""
    path = Path(path)
    if not path.exists():
        return []
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # a line cut by an interrupted write
            rows.append(json.loads(line))
    return rows


def append_rows(path: str | Path, rows: Sequence[dict]) -> None:
    """Append ``rows`` to a results file as JSON lines, gzipped when its name ends in .gz
    (each call adds a gzip member; ``read_rows`` reads them all)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "at") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _open_for_append(path: Path) -> tuple[object, int]:
    """Open ``path`` for appending after dropping a partial last line: (file, rows kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    kept = 0
    if path.exists():
        data = path.read_bytes()
        cut = data.rfind(b"\n") + 1
        if cut != len(data):
            path.write_bytes(data[:cut])
        kept = data[:cut].count(b"\n")
    return open(path, "a"), kept


def shard_record(shard: Shard) -> dict:
    t = shard.table
    return {
        "name": t.name,
        "rows": t.rows,
        "width": shard.width,
        "pooling_factor": t.pooling_factor,
        "access_hist": [round(x, 5) for x in t.access_hist],
        "bytes_per_element": t.bytes_per_element,
    }


def shard_from_record(r: dict) -> Shard:
    """The shard a record describes: a table as wide as the shard (TableSpec's own reader)."""
    spec = TableSpec.from_dict({**r, "dim": r["width"]})
    return Shard(spec, spec.dim)


# ---------------------------------------------------------------- compute samples


@dataclass(frozen=True)
class ComputeSample:
    """Which pool tables (by index) at which widths one compute measurement fuses."""

    table_ids: tuple[int, ...]
    widths: tuple[int, ...]


def draw_compute_sample(
    pool: Sequence[PoolTable],
    scale: WorkloadScale,
    seed: int,
    index: int,
    one_width: bool = False,
    tables: tuple[int, int] = (1, MAX_TABLES_PER_SAMPLE),
    cap_bytes: int = COMPUTE_MEMORY_CAP_BYTES,
) -> ComputeSample:
    """T ~ U{tables[0]..tables[1]} (default 1..15) (table, width) configs with replacement,
    redrawn until the fp32 weights are under ``cap_bytes`` at the CPU scale (x 64 /
    row_divisor at others); ``one_width``: every table at one drawn width (an unpooled
    kernel's layout)."""
    low, high = tables
    if not 1 <= low <= high:
        raise ShardingError(f"tables per compute sample must be 1 <= LOW <= HIGH, got {low} {high}")
    rng = np.random.default_rng([seed, index])
    cap = cap_bytes * 64 // scale.row_divisor
    while True:
        t = int(rng.integers(low, high + 1))
        ids = rng.integers(0, len(pool), t)
        widths = np.full(t, rng.choice(DIMS)) if one_width else rng.choice(DIMS, t)
        size = sum(max(1, pool[i].rows // scale.row_divisor) * w * 4 for i, w in zip(ids, widths))
        if size <= cap:
            return ComputeSample(tuple(int(i) for i in ids), tuple(int(w) for w in widths))


def draw_batch(seed: int, index: int, batch_sizes: tuple[int, int]) -> int:
    """Sample ``index``'s global batch: log-uniform in ``batch_sizes`` (LOW, HIGH), a
    multiple of 8 (its own random stream: the sample's tables are those of a fixed batch)."""
    low, high = batch_sizes
    if not 8 <= low <= high:
        raise ShardingError(f"compute batch sizes must be 8 <= LOW <= HIGH, got {low} {high}")
    exponent = np.random.default_rng([seed, index, 1]).uniform(np.log2(low), np.log2(high))
    return int(min(max(8 * round(2**exponent / 8), low), high))


class PoolLookups:
    """Bags of pool tables for one collection run, generated on first use, then reused.

    Owned by the caller and dropped with it: a table's ids are fixed for a whole run.
    """

    def __init__(self, pool: Sequence[PoolTable], scale: WorkloadScale) -> None:
        self.pool, self.scale = pool, scale
        self._bags: dict[int, Lookups] = {}

    def shards(self, sample: ComputeSample, bytes_per_element: int = 4) -> tuple[list[Shard], dict[str, Lookups]]:
        shards, lookups = [], {}
        for i, w in zip(sample.table_ids, sample.widths):
            spec = replace(table_spec(self.pool[i], w, self.scale, name=self.pool[i].name), bytes_per_element=bytes_per_element)
            if i not in self._bags:
                self._bags[i] = self.pool[i].lookups(self.scale, seed=i)
            shards.append(Shard(spec, w))
            lookups[spec.name] = self._bags[i]
        return shards, lookups


def collect_compute(
    out: str | Path,
    num_samples: int,
    device: torch.device,
    scale: WorkloadScale | None = None,
    seed: int = 0,
    num_threads: int = 1,
    warmup: int = 5,
    repeats: int = 10,
    progress: bool = True,
    sample_indices: Sequence[int] | None = None,
    precision: str = "fp32",
    pooled: bool = True,
    tables: tuple[int, int] = (1, MAX_TABLES_PER_SAMPLE),
    batch_sizes: tuple[int, int] | None = None,
) -> int:
    """Measure compute samples ``[rows already in out, num_samples)`` and append them.

    Row i measures sample i of ``seed``, or sample ``sample_indices[i]`` when given (a
    chosen subset, e.g. calibration's covering order). ``precision`` and ``pooled`` choose
    the kernel (``measure_compute.build_kernel``); every row records both. ``tables``: the
    range of tables one kernel fuses (``draw_compute_sample``). ``batch_sizes``: each sample
    at its own global batch drawn from that range (``draw_batch``), its tables' access
    histograms and bags those of its batch; default the scale's batch. Returns the number
    of rows in the file afterwards.
    """
    if sample_indices is not None and len(sample_indices) < num_samples:
        raise ValueError(f"{num_samples} samples asked for but only {len(sample_indices)} sample indices given")
    scale = scale or WorkloadScale.for_device(device)
    pool = synthetic_pool()
    bank = PoolLookups(pool, scale)
    hw = hardware(device, num_threads)
    f, start = _open_for_append(Path(out))
    with f:
        for i in tqdm(range(start, num_samples), initial=start, total=num_samples, disable=not progress, desc="compute samples"):
            index = i if sample_indices is None else int(sample_indices[i])
            sample = draw_compute_sample(pool, scale, seed, index, one_width=not pooled, tables=tables)
            at = scale if batch_sizes is None else replace(scale, batch_size=draw_batch(seed, index, batch_sizes))
            shards, lookups = (bank if at == scale else PoolLookups(pool, at)).shards(sample, PRECISION_BYTES[precision])
            m = measure_compute(shards, lookups, device, warmup, repeats, num_threads, precision, pooled)
            row = {
                "kind": "compute",
                "group": index,
                "batch_size": at.batch_size,
                "weights_precision": precision,
                "pooling_mode": "sum" if pooled else "none",
                "shards": [shard_record(s) for s in shards],
                "fwd_ms": round(m.fwd.median_ms, 5),
                "bwd_ms": round(m.bwd.median_ms, 5),
                "fwd_iqr_ms": round(m.fwd.iqr_ms, 5),
                "bwd_iqr_ms": round(m.bwd.iqr_ms, 5),
                "hardware": hw,
            }
            f.write(json.dumps(row) + "\n")
            f.flush()
    return max(start, num_samples)


def compute_noise(
    num_samples: int, trials: int, device: torch.device, seed: int = 0, num_threads: int = 1
) -> list[float]:
    """Coefficient of variation (std / mean of fwd+bwd ms) of each of ``num_samples`` fixed
    compute samples re-measured ``trials`` times, trials interleaved across samples."""
    scale = WorkloadScale.for_device(device)
    pool = synthetic_pool()
    bank = PoolLookups(pool, scale)
    samples = [bank.shards(draw_compute_sample(pool, scale, seed, i)) for i in range(num_samples)]
    totals: list[list[float]] = [[] for _ in samples]
    for _ in tqdm(range(trials), desc="noise trials"):
        for k, (shards, lookups) in enumerate(samples):
            totals[k].append(measure_compute(shards, lookups, device, num_threads=num_threads).total_ms)
    return [statistics.stdev(t) / statistics.mean(t) for t in totals]


# ---------------------------------------------------------------- comm samples


@dataclass(frozen=True)
class CommSample:
    """Dim sum and forward skew (ms) of every device for one all-to-all measurement."""

    dims: tuple[int, ...]
    skews_ms: tuple[float, ...]


def draw_comm_sample(world_size: int, seed: int, index: int) -> CommSample:
    """The prototype's comm sample: T ~ U[10,60) tables with dims from {4..128} placed by a
    randomised greedy (probability p ~ U(0,1) a random device, else the lightest), and
    per-device skews s_r ~ U{0..diff-1} ms, diff ~ U{1..19}, minus their minimum."""
    rng = np.random.default_rng([seed, world_size, index])
    t = int(rng.integers(10, 60))
    p = float(rng.random())
    dims = [0] * world_size
    for w in rng.choice(DIMS, t):
        d = int(rng.integers(world_size)) if rng.random() < p else int(np.argmin(dims))
        dims[d] += int(w)
    diff = int(rng.integers(1, 20))
    skews = rng.integers(0, diff, world_size)
    skews = skews - skews.min()
    return CommSample(tuple(dims), tuple(float(s) for s in skews))


def _collect_comm_worker(
    rank: int, world_size: int, out: str, num_samples: int, seed: int, batch_size: int, progress: bool
) -> int:
    from torchrec_neuroshard.lab.launch import default_device

    device = default_device(rank)
    path = Path(out)
    done = sum(1 for r in iter_kind(read_rows(path), "comm") if r["world_size"] == world_size)
    start = torch.tensor([done if rank == 0 else 0])
    torch.distributed.broadcast(start, 0)
    f = _open_for_append(path)[0] if rank == 0 else None
    hw = hardware(device, 1)
    hw["backend"] = torch.distributed.get_backend()
    try:
        it = range(int(start), num_samples)
        for i in tqdm(it, initial=int(start), total=num_samples, disable=rank != 0 or not progress, desc=f"comm samples D={world_size}"):
            s = draw_comm_sample(world_size, seed, i)
            m = measure_comm(s.dims, s.skews_ms, batch_size, device)
            if f is not None:
                row = {
                    "kind": "comm",
                    "group": i,
                    "world_size": world_size,
                    "batch_size": batch_size,
                    "dims": list(s.dims),
                    "skews_ms": list(s.skews_ms),
                    "fwd_ms": [round(x, 5) for x in m.fwd_ms],
                    "bwd_ms": [round(x, 5) for x in m.bwd_ms],
                    "hardware": hw,
                }
                f.write(json.dumps(row) + "\n")
                f.flush()
    finally:
        if f is not None:
            f.close()
    return num_samples


def collect_comm(
    out: str | Path,
    world_size: int,
    num_samples: int,
    batch_size: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> int:
    """Spawn ``world_size`` ranks and append comm samples to ``out`` (rank 0 writes).

    One file may hold several world sizes; ``num_samples`` counts this world size's rows.
    The batch is rounded down to a multiple of the world size (``divisible_batch``).
    """
    from torchrec_neuroshard.lab.launch import default_device, spawn

    batch_size = divisible_batch(batch_size or WorkloadScale.for_device(default_device()).batch_size, world_size)
    spawn(_collect_comm_worker, world_size, str(out), num_samples, seed, batch_size, progress)
    return num_samples


def _comm_noise_worker(rank: int, world_size: int, num_samples: int, trials: int, seed: int, batch_size: int) -> list[float]:
    from torchrec_neuroshard.lab.launch import default_device

    device = default_device(rank)
    samples = [draw_comm_sample(world_size, seed, i) for i in range(num_samples)]
    totals: list[list[list[float]]] = [[] for _ in samples]
    for _ in range(trials):
        for k, s in enumerate(samples):
            m = measure_comm(s.dims, s.skews_ms, batch_size, device)
            totals[k].append([f + b for f, b in zip(m.fwd_ms, m.bwd_ms)])
    cvs = []
    for per_trial in totals:
        for dev in zip(*per_trial):
            cvs.append(statistics.stdev(dev) / statistics.mean(dev))
    return cvs


def comm_noise(world_size: int, num_samples: int, trials: int, seed: int = 0, batch_size: int | None = None) -> list[float]:
    """CV of per-device fwd+bwd all-to-all ms of fixed comm samples re-measured ``trials``
    times (interleaved), one value per (sample, device)."""
    from torchrec_neuroshard.lab.launch import default_device, spawn

    batch_size = divisible_batch(batch_size or WorkloadScale.for_device(default_device()).batch_size, world_size)
    return spawn(_comm_noise_worker, world_size, num_samples, trials, seed, batch_size)[0]


def iter_kind(rows: Sequence[dict], kind: str) -> Iterator[dict]:
    return (r for r in rows if r.get("kind") == kind)
