"""Ground truth for communication: the pooled-embedding all-to-all on a real process group.

Every rank of an initialised group (gloo on CPU, NCCL on GPU) calls ``measure_comm`` with
the same arguments. Rank r owns shards whose widths sum to ``dims[r]``; in the forward
all-to-all it sends each rank its slice of the global batch, (B / D) x dims[r] floats, and
receives (B / D) x dims[j] from every rank j. The backward all-to-all is the reverse.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from torchrec_neuroshard.lab.measure_compute import Clock, Timing


@dataclass(frozen=True)
class CommMeasurement:
    """Per-rank all-to-all cost, ms (index = rank)."""

    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    fwd_iqr_ms: tuple[float, ...]
    bwd_iqr_ms: tuple[float, ...]


def _all_to_all(send_split: Sequence[int], recv_split: Sequence[int], device: torch.device) -> None:
    out = torch.empty(sum(recv_split), device=device)
    inp = torch.ones(sum(send_split), device=device)
    dist.all_to_all_single(out, inp, list(recv_split), list(send_split))


def measure_comm(
    dims: Sequence[int],
    skews_ms: Sequence[float],
    batch_size: int,
    device: torch.device,
    warmup: int = 2,
    repeats: int = 5,
) -> CommMeasurement:
    """Time the forward (after a per-rank skew) and backward all-to-all on every rank.

    Args:
        dims: dim sum of each rank (len = world size).
        skews_ms: how late each rank enters the forward all-to-all (its compute lateness);
            the forward cost excludes the rank's own skew but includes waiting for others.
        batch_size: global batch B, divisible by the world size.

    Returns every rank's medians (gathered to all ranks).
    """
    world = dist.get_world_size()
    rank = dist.get_rank()
    if len(dims) != world or len(skews_ms) != world:
        raise ValueError(f"need {world} dims and skews, got {len(dims)} and {len(skews_ms)}")
    if batch_size % world:
        raise ValueError(f"batch size {batch_size} is not divisible by world size {world}")
    local = batch_size // world
    fwd_send = [local * dims[rank]] * world
    fwd_recv = [local * d for d in dims]
    clock = Clock(device)
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        time.sleep(skews_ms[rank] / 1e3)
        t0 = clock.start()
        _all_to_all(fwd_send, fwd_recv, device)
        f = clock.elapsed_ms(t0)
        dist.barrier()
        t1 = clock.start()
        _all_to_all(fwd_recv, fwd_send, device)
        b = clock.elapsed_ms(t1)
        if i >= warmup:
            fwd.append(f)
            bwd.append(b)
    f, b = Timing.of(fwd), Timing.of(bwd)
    mine = torch.tensor(
        [f.median_ms, b.median_ms, f.iqr_ms, b.iqr_ms],
        dtype=torch.float64,
        device=device,
    )
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    rows = torch.stack(everyone).cpu().tolist()
    return CommMeasurement(
        tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows), tuple(r[3] for r in rows)
    )


def measure_allreduce(numel: int, device: torch.device, warmup: int = 1, repeats: int = 3) -> float:
    """Median ms of an all-reduce of ``numel`` floats (data-parallel gradient sync)."""
    buf = torch.ones(max(1, numel), device=device)
    clock = Clock(device)
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        t0 = clock.start()
        dist.all_reduce(buf)
        ms = clock.elapsed_ms(t0)
        if i >= warmup:
            times.append(ms)
    t = torch.tensor([Timing.of(times).median_ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


@dataclass(frozen=True)
class Exchange:
    """One collective of a sharded training step, as every rank of the group calls it.

    ``op`` is "all_to_all" (``counts[r][j]``: elements rank r sends rank j),
    "reduce_scatter" (every rank reduces ``sum(counts[0])`` elements, rank j keeps its
    ``counts[0][j]``), "all_gather" (its reverse) or "all_reduce" (``counts[0][0]``
    elements). ``dtype`` is a torch dtype name ("int32", "int64", "float32").
    """

    op: str
    counts: tuple[tuple[int, ...], ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.op not in ("all_to_all", "reduce_scatter", "all_gather", "all_reduce"):
            raise ValueError(f"unknown collective {self.op!r}")
        if any(c < 0 for row in self.counts for c in row):
            raise ValueError(f"{self.op}: negative element counts {self.counts}")
        if not hasattr(torch, self.dtype):
            raise ValueError(f"{self.op}: unknown dtype {self.dtype!r}; use a torch dtype name such as 'int64'")

    def run(self, device: torch.device) -> None:
        """Call the collective with buffers of the described sizes."""
        rank, dtype = dist.get_rank(), getattr(torch, self.dtype)
        if self.op == "all_to_all":
            send = [int(c) for c in self.counts[rank]]
            recv = [int(row[rank]) for row in self.counts]
            out = torch.empty(sum(recv), dtype=dtype, device=device)
            dist.all_to_all_single(out, torch.ones(sum(send), dtype=dtype, device=device), recv, send)
        elif self.op == "all_reduce":
            dist.all_reduce(torch.ones(max(1, self.counts[0][0]), dtype=dtype, device=device))
        else:
            chunks = [int(c) for c in self.counts[0]]
            full = [torch.ones(c, dtype=dtype, device=device) for c in chunks]
            if self.op == "reduce_scatter":
                dist.reduce_scatter(torch.empty(chunks[rank], dtype=dtype, device=device), full)
            else:
                dist.all_gather(full, full[rank])


@dataclass(frozen=True)
class StepCommMeasurement:
    """Per-rank time of a step's collectives, ms (index = rank): the input exchanges, the
    forward exchanges entered after each rank's compute skew, and the backward ones."""

    input_ms: tuple[float, ...]
    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]


def measure_step_comm(
    input_: Sequence[Exchange],
    fwd: Sequence[Exchange],
    bwd: Sequence[Exchange],
    skews_ms: Sequence[float],
    device: torch.device,
    warmup: int = 2,
    repeats: int = 5,
) -> StepCommMeasurement:
    """Time a step's three groups of collectives in order on every rank (medians,
    gathered to all ranks). The forward group starts after a sleep of the rank's skew and
    its cost excludes that sleep, as in ``measure_comm``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if len(skews_ms) != world:
        raise ValueError(f"need {world} skews, got {len(skews_ms)}")
    clock = Clock(device)
    times: list[list[float]] = [[], [], []]
    for i in range(warmup + repeats):
        spent = []
        for k, group in enumerate((input_, fwd, bwd)):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if k == 1:
                time.sleep(skews_ms[rank] / 1e3)
            t0 = clock.start()
            for ex in group:
                ex.run(device)
            spent.append(clock.elapsed_ms(t0))
        if i >= warmup:
            for k in range(3):
                times[k].append(spent[k])
    mine = torch.tensor([Timing.of(t).median_ms for t in times], dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    rows = torch.stack(everyone).cpu().tolist()
    return StepCommMeasurement(*(tuple(r[k] for r in rows) for k in range(3)))


def measure_exchanges(
    exchanges: Sequence[Exchange], device: torch.device, warmup: int = 2, repeats: int = 5
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Time ``exchanges`` called back to back (after a barrier) on every rank: each rank's
    (median ms, IQR ms) over ``repeats`` timed calls, gathered to all ranks."""
    world = dist.get_world_size()
    clock = Clock(device)
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = clock.start()
        for ex in exchanges:
            ex.run(device)
        ms = clock.elapsed_ms(t0)
        if i >= warmup:
            times.append(ms)
    t = Timing.of(times)
    mine = torch.tensor([t.median_ms, t.iqr_ms], dtype=torch.float64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    rows = torch.stack(everyone).cpu().tolist()
    return tuple(r[0] for r in rows), tuple(r[1] for r in rows)


def exchange_bytes(exchanges: Sequence[Exchange], rank: int) -> tuple[int, int]:
    """(bytes sent to, bytes received from) the other ranks by ``rank`` over all-to-all
    ``exchanges``; its own slice stays local and is not counted."""
    send = recv = 0
    for ex in exchanges:
        if ex.op != "all_to_all":
            raise ValueError(f"exchange_bytes counts all-to-alls only, got {ex.op!r}")
        size = getattr(torch, ex.dtype).itemsize
        send += size * sum(c for j, c in enumerate(ex.counts[rank]) if j != rank)
        recv += size * sum(row[rank] for j, row in enumerate(ex.counts) if j != rank)
    return send, recv
