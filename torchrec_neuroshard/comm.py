"""Communication cost models: the interface and the alpha-beta stand-in for GPU topologies.

Two implementations serve ``CommModel``: the neural one (``costmodel.NeuralComm``, trained
on all-to-all timings measured by ``neuroshard collect comm``) and ``AlphaBetaComm`` here,
an analytic model built from TorchRec ``Topology``'s own bandwidth fields. The alpha-beta
model is a STAND-IN for CUDA topologies until NCCL comm samples exist (one GPU cannot
measure an all-to-all): it prices bytes over links and a per-message latency, and knows
nothing of NCCL's protocols, congestion or kernel overlap. Replace it with a neural comm
model as soon as ``neuroshard collect comm`` has run on NCCL (``neuroshard calibrate
--world-size ...`` does both).
"""

from __future__ import annotations

import abc
import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from torchrec_neuroshard.types import ShardingError


class CommModel(abc.ABC):
    """Per-device pooled-embedding all-to-all cost. Units: ms. Stateless."""

    @abc.abstractmethod
    def comm_cost_array(self, dims: np.ndarray, skews_ms: np.ndarray) -> np.ndarray:
        """(forward ms, backward ms) [R, D, 2] of R plans from each device's dim sum
        ``dims`` [R, D] and forward lateness ``skews_ms`` [R, D] behind the earliest device;
        the forward cost includes the wait for the latest device."""

    def wait_free_cost(self, dims: np.ndarray) -> np.ndarray | None:
        """(forward ms, backward ms) [R, D, 2] without the forward's wait, for a model whose
        ``comm_cost_array`` is that plus the wait for the latest device and depends on the
        skews in no other way (``AlphaBetaComm``): the search then prices many plans that
        differ on two devices in O(plans). None (the default): the skews enter otherwise."""
        return None

    @abc.abstractmethod
    def with_batch_size(self, batch_size: int) -> "CommModel":
        """The same model for a global batch of ``batch_size``."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line: what kind of comm model this is and what it was built from."""


@dataclass(frozen=True)
class AlphaBetaComm(CommModel):
    """Alpha-beta (latency + bytes / bandwidth) model of the collectives of a sharded step.

    Ranks ``r`` sit on hosts ``r // local_world_size``. Links run concurrently: a rank's
    time for an exchange is ``latency_ms`` per peer message plus the larger of its
    intra-host bytes / ``intra_host_bw`` and its inter-host bytes / ``inter_host_bw``
    (TorchRec's convention: one NIC per GPU, so ``inter_host_bw`` is per rank). A rank is
    bound by the larger of what it sends and what it receives.

    Attributes:
        batch_size: global batch; each rank holds ``batch_size / D`` samples.
        intra_host_bw: bytes per ms between ranks of one host (TorchRec ``Topology.intra_host_bw``).
        inter_host_bw: bytes per ms per rank between hosts (``Topology.inter_host_bw``).
        local_world_size: ranks per host (``Topology.local_world_size``).
        latency_ms: per-message latency (alpha). TorchRec's Topology has no such field, so
            the default is 0 (pure bandwidth, as TorchRec's own estimator); set one to price
            small messages.
        bytes_per_element: bytes of one pooled-embedding element (4: fp32).
    """

    batch_size: int
    intra_host_bw: float
    inter_host_bw: float
    local_world_size: int
    latency_ms: float = 0.0
    bytes_per_element: int = 4

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ShardingError(f"AlphaBetaComm: batch_size must be >= 1, got {self.batch_size}")
        for name in ("intra_host_bw", "inter_host_bw"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ShardingError(f"AlphaBetaComm: {name} must be a positive number of bytes/ms, got {v}")
        if self.local_world_size < 1:
            raise ShardingError(f"AlphaBetaComm: local_world_size must be >= 1, got {self.local_world_size}")
        if self.latency_ms < 0:
            raise ShardingError(f"AlphaBetaComm: latency_ms must be >= 0, got {self.latency_ms}")
        if self.bytes_per_element < 1:
            raise ShardingError(f"AlphaBetaComm: bytes_per_element must be >= 1, got {self.bytes_per_element}")

    @staticmethod
    def from_topology(topology: object, batch_size: int, latency_ms: float = 0.0) -> "AlphaBetaComm":
        """From a TorchRec ``Topology`` (bandwidths in bytes/ms, ranks per host)."""
        return AlphaBetaComm(
            batch_size=batch_size,
            intra_host_bw=float(topology.intra_host_bw),
            inter_host_bw=float(topology.inter_host_bw),
            local_world_size=int(topology.local_world_size),
            latency_ms=latency_ms,
        )

    def with_batch_size(self, batch_size: int) -> "AlphaBetaComm":
        return self if batch_size == self.batch_size else replace(self, batch_size=batch_size)

    def describe(self) -> str:
        return (
            f"alpha-beta stand-in (intra-host {self.intra_host_bw * 1e3 / 2**30:.1f} GiB/s, "
            f"inter-host {self.inter_host_bw * 1e3 / 2**30:.1f} GiB/s per rank, "
            f"{self.local_world_size} ranks/host, latency {self.latency_ms} ms)"
        )

    def _bw(self, world_size: int) -> float:
        """The slowest link a ring over ``world_size`` ranks crosses."""
        return self.intra_host_bw if world_size <= self.local_world_size else self.inter_host_bw

    def _exchange_ms(self, sent_intra, recv_intra, sent_inter, recv_inter, world_size: int) -> np.ndarray:
        transfer = np.maximum(
            np.maximum(sent_intra, recv_intra) / self.intra_host_bw,
            np.maximum(sent_inter, recv_inter) / self.inter_host_bw,
        )
        return transfer + self.latency_ms * (world_size - 1)

    def _hosts(self, world_size: int) -> np.ndarray:
        return np.arange(world_size) // self.local_world_size

    def _link_bytes(self, send_bytes: "np.ndarray | Exchange") -> tuple[np.ndarray, ...]:
        """(sent within the host, received within, sent to other hosts, received from
        them) [..., D] of each rank of an exchange ``send_bytes`` [..., D, D] (or an
        ``Exchange``, priced without the dense matrix)."""
        if isinstance(send_bytes, Exchange):
            return send_bytes.link_bytes(self._hosts(send_bytes.world_size))
        b = np.asarray(send_bytes, dtype=np.float64)
        intra, inter = _host_masks(b.shape[-1], self.local_world_size)
        within, across = b * intra, b * inter
        return within.sum(-1), within.sum(-2), across.sum(-1), across.sum(-2)

    def all_to_all_ms(self, send_bytes: "np.ndarray | Exchange") -> np.ndarray:
        """Per-rank ms [..., D] of an all-to-all where rank i sends ``send_bytes[..., i, j]``
        bytes to rank j (the diagonal stays local and is ignored)."""
        world = send_bytes.world_size if isinstance(send_bytes, Exchange) else np.shape(send_bytes)[-1]
        return self._exchange_ms(*self._link_bytes(send_bytes), world)

    def cross_host_ms(self, send_bytes: "np.ndarray | Exchange") -> np.ndarray:
        """Per-rank ms [..., D] that the bytes of ``send_bytes`` (as ``all_to_all_ms``)
        crossing hosts take on the rank's inter-host link, the larger of what it sends and
        receives, no latency: the least an exchange measured within one host costs across
        hosts (0 on one host)."""
        _, _, sent, received = self._link_bytes(send_bytes)
        return np.maximum(sent, received) / self.inter_host_bw

    def all_reduce_ms(self, nbytes: float, world_size: int) -> float:
        """Ring all-reduce of ``nbytes`` on every rank: 2 (D-1) steps of nbytes / D."""
        if world_size == 1:
            return 0.0
        steps = 2 * (world_size - 1)
        return steps * (self.latency_ms + nbytes / world_size / self._bw(world_size))

    def reduce_scatter_ms(self, nbytes: float, world_size: int) -> float:
        """Ring reduce-scatter of ``nbytes`` on every rank (each keeps nbytes / D): D-1 steps."""
        if world_size == 1:
            return 0.0
        steps = world_size - 1
        return steps * (self.latency_ms + nbytes / world_size / self._bw(world_size))

    def comm_cost_array(self, dims: np.ndarray, skews_ms: np.ndarray) -> np.ndarray:
        cost = self.wait_free_cost(dims)  # [R, D, 2]
        if cost.shape[1] > 1:
            skews = np.asarray(skews_ms, dtype=np.float64)
            cost[:, :, 0] += skews.max(1, keepdims=True) - skews
        return cost

    def wait_free_cost(self, dims: np.ndarray) -> np.ndarray:
        dims = np.asarray(dims, dtype=np.float64)
        r, n = dims.shape
        if n == 1:
            return np.zeros((r, 1, 2), dtype=np.float32)
        # Forward: rank i sends its pooled columns for rank j's B / D samples to every j.
        # Backward moves the same gradients the other way: per rank, sent and received swap,
        # and the cost (the larger of the two per link) is the same.
        per_peer = dims * (self.batch_size / n) * self.bytes_per_element  # [R, D]
        cost = self.all_to_all_ms(OuterExchange(per_peer, np.ones(n)))  # [R, D]: rank i sends every peer per_peer[:, i]
        return np.repeat(cost.astype(np.float32)[:, :, None], 2, axis=2)


class Exchange(abc.ABC):
    """An exchange of bytes between D ranks whose per-rank link bytes have a form in O(D):
    at 1,024 ranks the dense [D, D] matrix of who sends whom costs milliseconds to sum,
    and a search prices thousands of exchanges."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """D, the ranks of the exchange."""

    @abc.abstractmethod
    def link_bytes(self, host: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(sent within the host, received within, sent to other hosts, received from
        them) [D] of each rank, ranks on hosts ``host`` [D]."""


@dataclass(frozen=True, eq=False)
class OuterExchange(Exchange):
    """Rank i sends rank j (j != i) ``sender[..., i] * receiver[..., j]`` bytes, [..., D]
    each (a batch of exchanges over the leading axes): every rank sends every other the
    same (receiver all 1), or each rank is sent the same by all (sender all 1), or a set of
    ranks exchange among themselves (both 0 off the set)."""

    sender: np.ndarray
    receiver: np.ndarray

    @property
    def world_size(self) -> int:
        return np.shape(self.sender)[-1]

    def link_bytes(self, host: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        a = np.asarray(self.sender, dtype=np.float64)  # [..., D]
        b = np.asarray(self.receiver, dtype=np.float64)  # [..., D]
        _, index = np.unique(host, return_inverse=True)  # [D] each rank's host, 0..H-1
        member = np.eye(index.max() + 1)[index]  # [D, H]
        host_a, host_b = a @ member, b @ member  # [..., H]
        # a rank's host's total, itself included, and what the other hosts hold: [..., D]
        mates_a, mates_b = host_a[..., index], host_b[..., index]
        others_a, others_b = host_a.sum(-1, keepdims=True) - mates_a, host_b.sum(-1, keepdims=True) - mates_b
        return a * (mates_b - b), b * (mates_a - a), a * others_b, b * others_a


@dataclass(frozen=True, eq=False)
class PairExchange(Exchange):
    """Rank ``src[k]`` sends rank ``dst[k]`` ``nbytes[k]`` bytes, [K] each, on D ranks
    (``src[k] != dst[k]``)."""

    world: int
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray

    @property
    def world_size(self) -> int:
        return self.world

    def link_bytes(self, host: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        src, dst = np.asarray(self.src, dtype=np.int64), np.asarray(self.dst, dtype=np.int64)  # [K]
        nbytes = np.broadcast_to(np.asarray(self.nbytes, dtype=np.float64), src.shape)  # [K]
        same = host[src] == host[dst]  # [K]
        within, across = np.where(same, nbytes, 0.0), np.where(same, 0.0, nbytes)
        return tuple(np.bincount(ranks, weights=w, minlength=self.world) for w in (within, across) for ranks in (src, dst))


@functools.lru_cache(maxsize=16)
def _host_masks(world_size: int, local_world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[D, D] whether ranks i and j are two ranks of one host, and whether they are on
    different hosts (kept: a search prices thousands of exchanges on one topology)."""
    host = np.arange(world_size) // local_world_size
    same = host[:, None] == host[None, :]
    intra, inter = same & ~np.eye(world_size, dtype=bool), ~same
    intra.flags.writeable = inter.flags.writeable = False
    return intra, inter
