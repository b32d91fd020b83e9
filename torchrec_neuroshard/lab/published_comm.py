"""A plan's communication priced from published link rates: a judge the planner never uses.

Every collective of one DMP step (``lab.evaluate.step_exchanges``: the KJT input
all-to-alls, the pooled-embedding all-to-all forward and its gradient backward, row-wise
reduce-scatter / all-gather, the data-parallel gradient all-reduce) is priced by the
bytes each rank sends and receives over each link, at the links' published peak rates:

- within a host, NVLink 4 on an H100 SXM: 900 GB/s per GPU both ways together, so
  450 GB/s each way (NVIDIA H100 Tensor Core GPU datasheet); nccl-tests reach 460-480 GB/s
  all-reduce bus bandwidth on 8 x H100 SXM, about this rate (Alaya NeW, "NCCL-tests in
  practice", 2026-05-06);
- across hosts, one ConnectX-7 NDR InfiniBand port of 400 Gb/s per GPU: 50 GB/s each way
  (NVIDIA DGX H100 user guide: eight 400 Gb/s compute ports, one per GPU);
- a fixed start-up cost per collective, ``LATENCY_MS`` within a host and
  ``CROSS_HOST_LATENCY_MS`` across hosts: ASSUMED (tens of microseconds, the order NCCL
  shows for small messages), not taken from a source.

A collective ends when its slowest rank does, so each costs its slowest rank's time and
a step's communication is their sum. Peak rates make this a lower bound of the real
time, the same bound for every planner: it ranks plans by the bytes they move.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from torchrec_neuroshard.lab.evaluate import lookup_groups, step_exchanges
from torchrec_neuroshard.lab.measure_compute import Lookups
from torchrec_neuroshard.lab.measure_comm import Exchange
from torchrec_neuroshard.types import Plan, Task

INTRA_HOST_GBPS = 450.0
INTER_HOST_GBPS = 50.0
LATENCY_MS = 0.02
CROSS_HOST_LATENCY_MS = 0.03
DTYPE_BYTES = {"int32": 4, "int64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class PublishedLinks:
    """Hosts of ``ranks_per_host`` GPUs joined by the links above (rates in GB/s = 1e9 B/s)."""

    ranks_per_host: int = 8
    intra_gbps: float = INTRA_HOST_GBPS
    inter_gbps: float = INTER_HOST_GBPS
    latency_ms: float = LATENCY_MS
    cross_host_latency_ms: float = CROSS_HOST_LATENCY_MS

    def __post_init__(self) -> None:
        if self.ranks_per_host < 1 or min(self.intra_gbps, self.inter_gbps) <= 0:
            raise ValueError(f"links need >= 1 rank per host and positive rates, got {self}")

    def all_to_all_ms(self, send_bytes: np.ndarray) -> float:
        """The slowest rank's time for ``send_bytes[r, j]`` bytes from rank r to rank j: per
        link, the larger of what it sends and receives over the link's rate."""
        world = send_bytes.shape[0]
        if world < 2:
            return 0.0
        host = np.arange(world) // self.ranks_per_host
        same = host[:, None] == host[None, :]
        send_bytes = send_bytes * (1.0 - np.eye(world))  # a rank's own slice stays where it is
        per_rank = []
        for link, gbps in ((same, self.intra_gbps), (~same, self.inter_gbps)):
            moved = np.where(link, send_bytes, 0.0)
            per_rank.append(np.maximum(moved.sum(1), moved.sum(0)) / (gbps * 1e6))  # bytes / (GB/s) -> ms
        latency = self.cross_host_latency_ms if world > self.ranks_per_host else self.latency_ms
        return latency + float((per_rank[0] + per_rank[1]).max())

    def ring_ms(self, nbytes: float, world: int, passes: int) -> float:
        """A ring collective over ``world`` ranks moving ``passes`` x (world-1)/world of
        ``nbytes`` per rank (reduce-scatter and all-gather 1, all-reduce 2), at the slowest
        link the ring crosses."""
        if world < 2:
            return 0.0
        crosses_hosts = world > self.ranks_per_host
        gbps = self.inter_gbps if crosses_hosts else self.intra_gbps
        latency = self.cross_host_latency_ms if crosses_hosts else self.latency_ms
        return latency + passes * nbytes * (world - 1) / world / (gbps * 1e6)

    def exchange_ms(self, exchange: Exchange, world: int) -> float:
        """One collective of ``lab.measure_comm``, priced."""
        size = DTYPE_BYTES[exchange.dtype]
        if exchange.op == "all_to_all":
            return self.all_to_all_ms(np.asarray(exchange.counts, dtype=float) * size)
        total = sum(exchange.counts[0]) * size
        return self.ring_ms(total, world, passes=2 if exchange.op == "all_reduce" else 1)


@dataclass(frozen=True)
class ModelledComm:
    """A plan's communication in one step at published link rates, ms."""

    input_ms: float
    forward_ms: float
    backward_ms: float

    @property
    def total_ms(self) -> float:
        return self.input_ms + self.forward_ms + self.backward_ms


def modelled_comm(
    task: Task, plan: Plan, lookups: Mapping[str, Lookups], links: PublishedLinks = PublishedLinks(),
    modules: Sequence[Sequence[str]] | None = None,
) -> ModelledComm:
    """Price every collective of ``plan``'s step (bytes from the task's own bags)."""
    modules = modules or task.modules or [[t.name for t in task.tables]]
    groups, replicated = lookup_groups(task, plan, modules)
    phases = step_exchanges(task, groups, replicated, lookups)
    input_ms, forward_ms, backward_ms = (sum(links.exchange_ms(e, task.num_devices) for e in phase) for phase in phases)
    return ModelledComm(input_ms, forward_ms, backward_ms)
