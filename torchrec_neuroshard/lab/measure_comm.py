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
