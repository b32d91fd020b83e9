"""Ground truth for compute: one fused FBGEMM TBE kernel over a device's shards, timed.

The same code runs on a CPU (``EmbeddingLocation.HOST``, perf_counter, a fixed thread
count) and a GPU (CUDA events): the device decides. On a GPU each shard sits where its
table's compute kernel keeps it, as TorchRec builds the TBE: fused in HBM
(``EmbeddingLocation.DEVICE``), fused_uvm in host memory over UVM (``MANAGED``),
fused_uvm_caching in host memory behind an HBM cache (``MANAGED_CACHING``).
"""

from __future__ import annotations

import itertools
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    DenseTableBatchedEmbeddingBagsCodegen,
    SplitTableBatchedEmbeddingBagsCodegen,
)

from torchrec_neuroshard.kernels import ComputeKernel
from torchrec_neuroshard.types import Shard, TableSpec

Lookups = tuple[torch.Tensor, torch.Tensor]
"""One table's bags for one batch: (indices int64 [N], offsets int64 [B + 1])."""
Draws = Sequence[Mapping[str, Lookups]]
"""Successive batches of the same tables (``workloads.lookups_for``'s draws), by table name."""
GPU_LOCATIONS = {
    ComputeKernel.FUSED: EmbeddingLocation.DEVICE,
    ComputeKernel.FUSED_UVM: EmbeddingLocation.MANAGED,
    ComputeKernel.FUSED_UVM_CACHING: EmbeddingLocation.MANAGED_CACHING,
}


@dataclass(frozen=True)
class Timing:
    """Repeated timings of one thing, ms: median and the interquartile range as spread."""

    median_ms: float
    iqr_ms: float
    samples_ms: tuple[float, ...]

    @staticmethod
    def of(samples_ms: Sequence[float]) -> "Timing":
        s = sorted(samples_ms)
        q = statistics.quantiles(s, n=4) if len(s) > 1 else [s[0]] * 3
        return Timing(statistics.median(s), q[2] - q[0], tuple(samples_ms))


@dataclass(frozen=True)
class ComputeMeasurement:
    """Forward and backward time of one fused multi-table kernel, ms."""

    fwd: Timing
    bwd: Timing

    @property
    def total_ms(self) -> float:
        return self.fwd.median_ms + self.bwd.median_ms


@contextmanager
def cpu_threads(num_threads: int | None) -> Iterator[None]:
    """Pin torch's intra-op threads for a CPU measurement, restoring them after."""
    if num_threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Clock:
    """Wall time of a region: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> object:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def elapsed_ms(self, start: object) -> float:
        return self.between_ms(start, self.start())

    def between_ms(self, start: object, end: object) -> float:
        """ms from one mark (a ``start()`` value) to a later one; waits for the GPU."""
        if self.cuda:
            end.synchronize()  # type: ignore[attr-defined]
            return float(start.elapsed_time(end))  # type: ignore[attr-defined]
        return (end - start) * 1e3  # type: ignore[operator]


PRECISIONS = {"fp32": SparseType.FP32, "fp16": SparseType.FP16, "bf16": SparseType.BF16}
"""Weight dtypes a kernel can be measured with (bf16 runs on CUDA only in fbgemm-gpu-cpu 1.8)."""


def cache_load_factor(shards: Sequence[Shard]) -> float | None:
    """The cache load factor of a TBE holding ``shards``: the rows-weighted mean over its
    fused_uvm_caching shards, as TorchRec's ``group_tables`` sets it; None without any."""
    cached = [s for s in shards if s.table.kernel is ComputeKernel.FUSED_UVM_CACHING]
    if not cached:
        return None
    return sum(s.table.cache_load_factor * s.num_rows for s in cached) / sum(s.num_rows for s in cached)


def build_kernel(
    shards: Sequence[Shard], device: torch.device, precision: str = "fp32", pooled: bool = True
) -> SplitTableBatchedEmbeddingBagsCodegen:
    """One fused TBE (EXACT_SGD) with a table per shard (rows x width): pooled bags (sum,
    as an EmbeddingBagCollection runs) or unpooled sequences (as an EmbeddingCollection
    runs; every shard then has one width, as TorchRec groups sequence tables by dim). On a
    GPU each shard sits where its table's kernel keeps it (``GPU_LOCATIONS``)."""
    factor = cache_load_factor(shards)
    if device.type == "cuda":
        locations, compute = [GPU_LOCATIONS[s.table.kernel] for s in shards], ComputeDevice.CUDA
    else:
        uvm = sorted({s.table.name for s in shards if s.table.kernel is not ComputeKernel.FUSED})
        if uvm:
            raise ValueError(f"tables {uvm} are on UVM kernels, which need a GPU; measure them on a cuda device")
        locations, compute = [EmbeddingLocation.HOST] * len(shards), ComputeDevice.CPU
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose one of {sorted(PRECISIONS)}")
    if not pooled and len({s.width for s in shards}) > 1:
        raise ValueError(f"an unpooled kernel needs one width, got {sorted({s.width for s in shards})}")
    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(s.num_rows, s.width, loc, compute) for s, loc in zip(shards, locations)],
        **({"cache_load_factor": factor} if factor is not None else {}),
        optimizer=EmbOptimType.EXACT_SGD,
        learning_rate=0.01,
        weights_precision=PRECISIONS[precision],
        pooling_mode=PoolingMode.SUM if pooled else PoolingMode.NONE,
        device=device,
    )


def concat_lookups(per_shard: Sequence[Lookups], device: torch.device) -> Lookups:
    """Concatenate per-table bags into TBE's layout: indices, offsets of T*B+1 entries."""
    batch = per_shard[0][1].numel() - 1
    indices, offsets, base = [], [torch.zeros(1, dtype=torch.int64, device=per_shard[0][1].device)], 0  # bags may sit on the GPU already
    for idx, off in per_shard:
        if off.numel() - 1 != batch:
            raise ValueError("every table's bags must have the same batch size")
        indices.append(idx)
        offsets.append(off[1:] + base)
        base += int(off[-1])
    return torch.cat(indices).to(device), torch.cat(offsets).to(device)


def measure_compute(
    shards: Sequence[Shard],
    lookups: Mapping[str, Lookups] | Draws,
    device: torch.device,
    warmup: int = 5,
    repeats: int = 10,
    num_threads: int | None = 1,
    precision: str = "fp32",
    pooled: bool = True,
) -> ComputeMeasurement:
    """Time forward and backward of one fused TBE over ``shards`` on ``device``.

    Args:
        shards: the device's column shards; a table's shard reads all its rows.
        lookups: each table's bags for one batch, by table name (its shards share them);
            or several batches (``Draws``), run in turn: a cache then meets new batches.
        warmup, repeats: untimed then timed iterations; medians are reported.
        num_threads: torch intra-op threads on CPU (ignored on GPU).
        precision, pooled: the kernel's weight dtype and pooling (see ``build_kernel``).
    """
    if not shards:
        zero = Timing(0.0, 0.0, (0.0,))
        return ComputeMeasurement(zero, zero)
    with cpu_threads(num_threads if device.type == "cpu" else None):
        kernel = build_kernel(shards, device, precision, pooled)
        draws = [lookups] if isinstance(lookups, Mapping) else list(lookups)
        batches = itertools.cycle([concat_lookups([d[s.table.name] for s in shards], device) for d in draws])
        grads: dict[torch.Size, torch.Tensor] = {}  # made once per output shape, outside the timed region after warm-up

        def backward(out: torch.Tensor) -> None:
            # pooled out: [batch, sum of widths]; unpooled: [lookups, width] (one width, see build_kernel)
            if out.shape not in grads:
                grads[out.shape] = torch.ones_like(out)
            out.backward(grads[out.shape])  # the fused kernel updates its weights in backward

        measured = time_forward_backward(lambda: kernel(*next(batches)), backward, device, warmup, repeats)
    return measured


Step = tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]]
"""One training step of a kernel: its forward, and the backward (with the update) of an output."""


def fused_step(kernel: SplitTableBatchedEmbeddingBagsCodegen, shards: Sequence[Shard], lookups: Mapping[str, Lookups], device: torch.device) -> Step:
    """A built fused (pooled) kernel's step over ``lookups``' bags of ``shards``: the
    kernel updates its weights in backward."""
    indices, offsets = concat_lookups([lookups[s.table.name] for s in shards], device)
    grad = torch.ones((offsets.numel() - 1) // len(shards), sum(s.width for s in shards), device=device)  # [batch, width sum]
    return (lambda: kernel(indices, offsets)), (lambda out: out.backward(grad))


def dense_kernel(tables: Sequence[TableSpec], device: torch.device) -> DenseTableBatchedEmbeddingBagsCodegen:
    """FBGEMM's dense (non-fused) TBE over whole tables: TorchRec's data_parallel kernel."""
    return DenseTableBatchedEmbeddingBagsCodegen([(t.rows, t.dim) for t in tables], use_cpu=device.type == "cpu").to(device)


def replicated_step(
    kernel: DenseTableBatchedEmbeddingBagsCodegen, tables: Sequence[TableSpec], lookups: Mapping[str, Lookups], device: torch.device, learning_rate: float = 0.01
) -> Step:
    """A dense kernel's step as DMP runs data-parallel tables: forward, then backward to a
    dense gradient plus the SGD update of the whole tables the dense optimizer does."""
    indices, offsets = concat_lookups([lookups[t.name] for t in tables], device)
    grad = torch.ones((offsets.numel() - 1) // len(tables), sum(t.dim for t in tables), device=device)  # [local batch, dim sum]

    def backward(out: torch.Tensor) -> None:
        out.backward(grad)
        with torch.no_grad():
            for p in kernel.parameters():
                p.add_(p.grad, alpha=-learning_rate)
                p.grad = None

    return (lambda: kernel(indices, offsets)), backward


def measure_interleaved(
    kernels: Sequence[tuple[Sequence[Shard], Mapping[str, Lookups]]],
    device: torch.device,
    warmup: int = 3,
    repeats: int = 9,
    num_threads: int | None = 1,
) -> list[ComputeMeasurement]:
    """Several fused kernels (pooled, fp32) timed in turn, one step each per round, so a
    drift of the machine moves them alike and their ratios hold: each kernel's ``warmup``
    untimed steps, then ``repeats`` rounds, the kernels' order rotated each round."""
    with cpu_threads(num_threads if device.type == "cpu" else None):
        steps = []
        for shards, lookups in kernels:
            forward, backward = fused_step(build_kernel(shards, device), shards, lookups, device)
            for _ in range(warmup):
                backward(forward())
            steps.append((forward, backward))
        fwd: list[list[float]] = [[] for _ in steps]
        bwd: list[list[float]] = [[] for _ in steps]
        for r in range(repeats):
            for k in [(r + j) % len(steps) for j in range(len(steps))]:
                m = time_forward_backward(*steps[k], device, 0, 1)
                fwd[k].append(m.fwd.median_ms)
                bwd[k].append(m.bwd.median_ms)
    return [ComputeMeasurement(Timing.of(f), Timing.of(b)) for f, b in zip(fwd, bwd)]


def measure_replicated_compute(
    tables: Sequence[TableSpec],
    lookups: Mapping[str, Lookups],
    device: torch.device,
    warmup: int = 5,
    repeats: int = 10,
    num_threads: int | None = 1,
    learning_rate: float = 0.01,
) -> ComputeMeasurement:
    """Time data-parallel tables as DMP runs them (``replicated_step``).

    Args:
        lookups: each table's bags at the local batch (a replica sees its rank's samples).
    """
    if not tables:
        zero = Timing(0.0, 0.0, (0.0,))
        return ComputeMeasurement(zero, zero)
    with cpu_threads(num_threads if device.type == "cpu" else None):
        step = replicated_step(dense_kernel(tables, device), tables, lookups, device, learning_rate)
        measured = time_forward_backward(*step, device, warmup, repeats)
    return measured


def time_forward_backward(
    forward: Callable[[], torch.Tensor],
    backward: Callable[[torch.Tensor], None],
    device: torch.device,
    warmup: int,
    repeats: int,
) -> ComputeMeasurement:
    """The one timing loop of a kernel: ``warmup`` untimed then ``repeats`` timed
    iterations of forward, then backward on its output; medians and spreads."""
    clock = Clock(device)
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        t0 = clock.start()
        out = forward()
        f = clock.elapsed_ms(t0)
        t1 = clock.start()
        backward(out)
        b = clock.elapsed_ms(t1)
        if i >= warmup:
            fwd.append(f)
            bwd.append(b)
    return ComputeMeasurement(Timing.of(fwd), Timing.of(bwd))
