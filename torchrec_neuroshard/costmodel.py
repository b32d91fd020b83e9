"""The neural cost models: the nets, their features, and the ``CostModel`` they serve.

Compute model (one for any number of tables and devices): a per-shard MLP over the shard's
features, SUM over the shards of a device, then a head with two outputs, the log of the
fused kernel's forward and backward ms. A device with no shards costs 0. TorchRec runs a
device's pooled (EmbeddingBagCollection) and sequence (EmbeddingCollection) lookups as two
kernels: a model may carry a second net of the same shape for the sequence kernel, and a
device then costs the sum of its two kernels.

Comm model (one for every world size D): permutation-equivariant over devices. A per-device
MLP sees the device's own dim sum and skew plus summaries pooled over all devices (mean,
max, min of dim sums, max skew) and D; it predicts forward and backward all-to-all ms.
The forward prediction adds the device's wait for the latest device (max skew - own skew).
The comm part is pluggable (``comm.CommModel``): this net, or the alpha-beta stand-in
built from a topology for models measured on one GPU.

Every model file records the hardware its samples were measured on; ``cost_model_for``
picks the shipped model for a topology and this machine and warns on a mismatch. It also
records the range of every shard feature each compute net was trained on
(``FeatureRange``): a shard outside it is priced as the nearest shard the net learned
(``KernelNet.priced``), never by the net's unbounded extrapolation, and
``feature_range_warning`` names such tables.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from torchrec_neuroshard.comm import AlphaBetaComm, CommModel
from torchrec_neuroshard.hardware import Hardware, hardware_mismatch, local_hardware
from torchrec_neuroshard.steparts import COLLECTIVES, StepParts
from torchrec_neuroshard.types import CostModel, NUM_ACCESS_BINS, Shard, ShardingError, TableSpec

logger = logging.getLogger(__name__)

FEATURE_VERSION = 1
MODEL_FORMAT = "torchrec-neuroshard/costmodel"
FORMAT_VERSION = 3
"""1: compute and comm nets always present. 2: the comm net is optional (a model measured on
one GPU has none) and ``meta["hardware"]`` records the core count of a CPU. 3: an optional
second compute net for the unpooled (sequence, EmbeddingCollection) kernel. The meta also
records each compute net's ``feature_range``, added without a new version: older readers
ignore it, and files without it load with a warning."""

SHARD_FEATURES = (
    "log_rows", "width", "log_width", "pooling_factor", "log_pooling", "log_lookup_bytes",
    "log_size_bytes", "bytes_per_element",
    *(f"access_bin_{i}" for i in range(NUM_ACCESS_BINS)),
)  # fmt: skip
DEVICE_FEATURES = (
    "dim", "skew_ms", "wait_ms", "send_dim", "recv_dim", "mean_dim", "max_dim", "min_dim",
    "max_skew_ms", "world_size", "inv_world_size",
)  # fmt: skip
WIDTH_FEATURE = SHARD_FEATURES.index("width")
POOLING_FEATURE = SHARD_FEATURES.index("pooling_factor")

RANGE_TOLERANCE = 1.0
"""How far outside its trained range a shard feature may lie, in the training standard
deviations the net's normaliser divides by, before ``feature_range_warning`` names it.
Every feature is clamped into the range whatever the distance; nearer than this, the clamp
moved the shipped CPU model's price of uniformly read tables (500 to 300,000 rows) by 11%
at most, about its test error, where a 1,000-row table read 20 times per sample, 24
deviations out, moved 4-9x."""


def shard_features(shards: Sequence[Shard]) -> torch.Tensor:
    """Raw features of each shard, float32 [len(shards), len(SHARD_FEATURES)]."""
    rows = []
    for s in shards:
        t = s.table
        lookups = t.pooling_factor * s.width
        rows.append(
            [
                math.log(t.rows), s.width, math.log(s.width), t.pooling_factor,
                math.log1p(t.pooling_factor), math.log1p(lookups * t.bytes_per_element),
                math.log(t.size_bytes(s.width)), t.bytes_per_element, *t.access_hist,
            ]  # fmt: skip
        )
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(SHARD_FEATURES))


def device_features(dims: np.ndarray, skews_ms: np.ndarray) -> np.ndarray:
    """Per-device comm features of R plans: dims, skews [R, D] -> float32 [R, D, F].

    Dims are in hundreds of columns; skews in ms. Every feature is either the device's
    own or pooled symmetrically over the plan's devices, so the model is equivariant.
    """
    d = np.asarray(dims, dtype=np.float32) / 100.0
    s = np.asarray(skews_ms, dtype=np.float32)
    r, n = d.shape
    # What each rank moves in the forward all-to-all, per sample of the global batch:
    # it sends its own columns to the n - 1 others and receives theirs, each 1/n of the batch.
    send = d * (n - 1) / n
    recv = (d.sum(1, keepdims=True) - d) / n
    pooled = np.stack(
        [d.mean(1), d.max(1), d.min(1), s.max(1), np.full(r, n / 8.0), np.full(r, 1.0 / n)],
        axis=1,
    )
    own = np.stack([d, s, s.max(1, keepdims=True) - s, send, recv], axis=2)
    return np.concatenate([own, np.broadcast_to(pooled[:, None, :], (r, n, pooled.shape[1]))], axis=2).astype(np.float32)


def mlp(sizes: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class ComputeNet(nn.Module):
    """Shards [S, F] with device index [S] -> log ms [N, 2] (forward, backward) per device."""

    def __init__(self, num_features: int = len(SHARD_FEATURES), hidden: int = 128, embed: int = 64) -> None:
        super().__init__()
        self.config = {"num_features": num_features, "hidden": hidden, "embed": embed}
        self.table = mlp([num_features, hidden, hidden, embed])
        self.head = mlp([embed, hidden, 2])

    def forward(self, x: torch.Tensor, device_index: torch.Tensor, num_devices: int) -> torch.Tensor:
        h = self.table(x)
        pooled = torch.zeros(num_devices, h.shape[1], dtype=h.dtype).index_add_(0, device_index, h)
        return self.head(pooled)


class CommNet(nn.Module):
    """Per-device features [N, F] -> (forward, backward) ms [N, 2]; the forward adds the wait."""

    def __init__(self, num_features: int = len(DEVICE_FEATURES), hidden: int = 64) -> None:
        super().__init__()
        self.config = {"num_features": num_features, "hidden": hidden}
        self.net = mlp([num_features, hidden, hidden, 2])

    def forward(self, x_norm: torch.Tensor, wait_ms: torch.Tensor) -> torch.Tensor:
        out = nn.functional.softplus(self.net(x_norm))
        return torch.stack([out[:, 0] + wait_ms, out[:, 1]], dim=1)


@dataclass(frozen=True)
class Normalizer:
    """z-score statistics of a feature matrix (std floored so constant features stay 0)."""

    mean: torch.Tensor
    std: torch.Tensor

    @staticmethod
    def fit(x: torch.Tensor) -> "Normalizer":
        return Normalizer(x.mean(0), x.std(0).clamp_min(1e-3))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def state(self) -> dict:
        return {"mean": self.mean.tolist(), "std": self.std.tolist()}

    @staticmethod
    def from_state(d: dict) -> "Normalizer":
        return Normalizer(torch.tensor(d["mean"]), torch.tensor(d["std"]))


@dataclass(frozen=True)
class FeatureRange:
    """The smallest and largest value of each raw shard feature (``SHARD_FEATURES``) in the
    samples a compute net was trained on: ``low``, ``high`` float32 [F]. A model file
    records it in ``meta["feature_range"]`` (a sequence net's in ``meta["sequence"]``)."""

    low: torch.Tensor
    high: torch.Tensor

    def __post_init__(self) -> None:
        want = (len(SHARD_FEATURES),)
        if tuple(self.low.shape) != want or tuple(self.high.shape) != want:
            raise ShardingError(
                f"a feature range needs {want[0]} lows and highs (one per shard feature), got "
                f"{list(self.low.shape)} and {list(self.high.shape)}; re-run `neuroshard pretrain`"
            )
        if not (self.low.isfinite().all() and self.high.isfinite().all() and (self.low <= self.high).all()):
            raise ShardingError("a feature range needs finite lows no greater than its highs; re-run `neuroshard pretrain`")

    @staticmethod
    def fit(x: torch.Tensor) -> "FeatureRange":
        """The range of the feature rows x [N, F]."""
        return FeatureRange(x.min(0).values, x.max(0).values)

    def union(self, other: "FeatureRange") -> "FeatureRange":
        return FeatureRange(torch.minimum(self.low, other.low), torch.maximum(self.high, other.high))

    def clamp(self, x: torch.Tensor) -> torch.Tensor:
        """Feature rows x [N, F] with every feature clamped into the range: rows inside it
        come back bit for bit."""
        return torch.clamp(x, self.low, self.high)

    def state(self) -> dict:
        return {"low": self.low.tolist(), "high": self.high.tolist()}

    @staticmethod
    def from_state(d: dict) -> "FeatureRange":
        return FeatureRange(torch.tensor(d["low"], dtype=torch.float32), torch.tensor(d["high"], dtype=torch.float32))


@dataclass(frozen=True)
class KernelNet:
    """A compute net with the normaliser of its features and what it was trained on (the
    largest kernel, the weight bytes, the range of its features, None for a model file
    written before ranges were recorded): the model of one TorchRec kernel kind."""

    net: ComputeNet
    norm: Normalizer
    max_tables_per_kernel: int | None
    bytes_per_element_trained: tuple[int, ...]
    trained_range: FeatureRange | None

    @staticmethod
    def of(net: ComputeNet, norm: Normalizer, meta: dict[str, Any]) -> "KernelNet":
        """``net`` with what ``meta`` (a model's meta, or its ``"sequence"`` part) records
        about its training data; models before the byte field saw fp32 only."""
        stored = meta.get("feature_range")
        return KernelNet(
            net.eval(), norm, meta.get("max_tables_per_kernel"), tuple(meta.get("bytes_per_element_trained", [4])),
            FeatureRange.from_state(stored) if stored is not None else None,
        )  # fmt: skip

    @cached_property
    def head(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return _numpy_layers(self.net.head)

    def priced(self, shards: Sequence[Shard]) -> tuple[torch.Tensor, np.ndarray]:
        """The features the net prices each shard by, float32 [S, F], and each shard's
        work in copies of the shard those features describe, float64 [S] (1 inside the
        trained range).

        A shard wider, or read more times per sample, than any the net was trained on is
        priced as ``copies`` = (width / widest) x (pooling / largest pooling) shards of the
        widest width and largest pooling factor trained: a kernel's work is linear in
        columns x lookups, where clamping would price a 512-column table as a 128-column
        one. Then every feature is clamped into the trained range: a table smaller than
        any trained is priced as the smallest one, a sound bound for costs per row and per
        lookup. Without a recorded range: the shard's own features, one copy."""
        x = shard_features(shards)  # [S, F]
        trained = self.trained_range
        if trained is None:
            return x, np.ones(len(shards))
        # in float32, as the features and the range are: a shard at the trained maximum is 1 copy
        widest, busiest = float(trained.high[WIDTH_FEATURE]), float(trained.high[POOLING_FEATURE])
        copies = np.maximum(x[:, WIDTH_FEATURE].double().numpy() / widest, 1.0) * np.maximum(
            x[:, POOLING_FEATURE].double().numpy() / busiest, 1.0
        )  # [S]
        beyond = np.flatnonzero(copies > 1)
        if beyond.size:
            learned = [
                replace(s, table=replace(s.table, pooling_factor=min(s.table.pooling_factor, busiest)), width=min(s.width, int(widest)))
                for s in (shards[i] for i in beyond)
            ]  # fmt: skip
            x[torch.as_tensor(beyond)] = shard_features(learned)
        return trained.clamp(x), copies

    def outside(self, shards: Sequence[Shard]) -> list[list[str]]:
        """Per shard, its features farther than ``RANGE_TOLERANCE`` outside the trained
        range, each as "name value (trained low..high)"; all empty without a range."""
        trained = self.trained_range
        if trained is None:
            return [[] for _ in shards]
        x = shard_features(shards)  # [S, F]
        far = (trained.clamp(x) - x).abs() / self.norm.std > RANGE_TOLERANCE  # [S, F]
        low, high = trained.low.tolist(), trained.high.tolist()
        return [
            [f"{SHARD_FEATURES[f]} {float(x[i, f]):.4g} (trained {low[f]:.4g}..{high[f]:.4g})" for f in far[i].nonzero().flatten().tolist()]
            for i in range(len(shards))
        ]  # fmt: skip

    @torch.no_grad()
    def embed(self, shards: Sequence[Shard]) -> np.ndarray:
        """Shard rows, float32 [S, hidden + 3] = [the head's first layer (no bias) applied
        to the net's embedding of the shard as ``priced`` | the (forward, backward) ms its
        copies beyond the first add, each priced as that shard alone in a kernel, 0 inside
        the trained range | 1]. The head pools the embeddings by summing and its first
        layer is linear, so that layer commutes with the pooling: it is applied once per
        shard here, and a device's cost is the rest of the head (``cost``). Pooled over a
        device, the middle columns sum the devices' extra ms and the last counts its shards
        in this kernel."""
        features, copies = self.priced(shards)
        emb = self.net.table(self.norm(features)).numpy()  # [S, embed]
        lifted = emb @ self.head[0][0]  # [S, hidden]
        extra = np.zeros((len(shards), 2), dtype=emb.dtype)  # [S, 2]
        beyond = copies > 1
        if beyond.any():
            extra[beyond] = np.exp(self._rest_of_head(lifted[beyond])) * (copies[beyond, None] - 1)
        return np.concatenate([lifted, extra, np.ones((len(shards), 1), dtype=emb.dtype)], axis=1)

    def cost(self, pooled: np.ndarray) -> np.ndarray:
        """(forward, backward) ms [N, 2] of N kernels from pooled ``embed`` rows [N, hidden + 3];
        0 for a kernel of no shards.

        A kernel fusing n shards, more than the ``max_tables_per_kernel`` K it was trained
        on, is priced as n / K kernels of K average shards: linear in its work beyond the
        trained range, rather than the net's unbounded extrapolation of a sum it never saw
        (``kernel_size_warning`` says when that happens)."""
        lifted, extra, count = pooled[:, :-3], pooled[:, -3:-1], pooled[:, -1:]  # [N, hidden], [N, 2], [N, 1]
        trained = self.max_tables_per_kernel
        if trained and (count > trained).any():
            stretch = np.maximum(count / trained, 1.0)
            out = np.exp(self._rest_of_head(lifted / stretch)) * stretch + extra
        else:  # every kernel within the trained size (the search's hot path)
            out = np.exp(self._rest_of_head(lifted)) + extra
        return np.where(count > 0, out, 0.0)

    def _rest_of_head(self, lifted: np.ndarray) -> np.ndarray:
        """The head's log ms [N, 2] from its first layer's output without bias [N, hidden]."""
        x = lifted + self.head[0][1]  # [N, hidden]
        np.maximum(x, 0.0, out=x)
        return _numpy_mlp(self.head[1:], x)

    @property
    def width(self) -> int:
        """Columns of an ``embed`` row."""
        return int(self.net.config["hidden"]) + 3


class NeuralComm(CommModel):
    """The trained ``CommNet`` behind the ``CommModel`` interface; predictions scale
    linearly from the global batch it was trained at (``batch_size``) to ``batch_scale``x."""

    def __init__(self, net: CommNet, norm: Normalizer, batch_size: int, batch_scale: float = 1.0) -> None:
        self.net = net.eval()
        self.norm = norm
        self.batch_size = batch_size
        self.batch_scale = batch_scale

    @cached_property
    def _layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return _numpy_layers(self.net.net)

    def with_batch_size(self, batch_size: int) -> "NeuralComm":
        if batch_size / self.batch_size == self.batch_scale:
            return self
        return NeuralComm(self.net, self.norm, self.batch_size, batch_size / self.batch_size)

    def describe(self) -> str:
        return "neural (trained on measured all-to-alls)"

    def comm_cost_array(self, dims: np.ndarray, skews_ms: np.ndarray) -> np.ndarray:
        r, n = np.shape(dims)
        if n == 1:  # a single device exchanges nothing
            return np.zeros((r, 1, 2), dtype=np.float32)
        x = device_features(dims, skews_ms).reshape(r * n, -1)
        wait = x[:, DEVICE_FEATURES.index("wait_ms")]
        z = (x - self.norm.mean.numpy()) / self.norm.std.numpy()
        out = np.logaddexp(0.0, _numpy_mlp(self._layers, z))  # softplus
        out[:, 0] += wait
        return (out * self.batch_scale).reshape(r, n, 2)


class NeuralCostModel(CostModel):
    """The pre-trained compute nets and a comm model behind the ``CostModel`` interface (ms).

    ``comm`` is pluggable: the trained ``NeuralComm``, or ``AlphaBetaComm`` built from a
    topology for a model measured on one GPU (its file holds no comm net); None until one
    is attached with ``with_comm``. ``sequence`` is the (net, normaliser) of the unpooled
    kernel, EmbeddingCollection tables', when the model learned it (``meta["sequence"]``
    then records its training); without it sequence tables are refused. ``batch_scale``
    multiplies every compute prediction: the planner sets it to the ratio of the user's
    batch size to the one the model was trained at (a first-order correction);
    ``with_batch_size`` rescales the comm too. ``meta`` holds the hardware the samples
    were measured on (``hardware``), the batch size and the training record.
    """

    def __init__(
        self,
        compute_net: ComputeNet,
        compute_norm: Normalizer,
        comm: CommModel | None,
        meta: dict[str, Any],
        batch_scale: float = 1.0,
        sequence: tuple[ComputeNet, Normalizer] | None = None,
    ) -> None:
        self.compute_net = compute_net.eval()
        self.compute_norm = compute_norm
        self.comm = comm
        self.meta = meta
        self.batch_scale = batch_scale
        self.pooled_kernel = KernelNet.of(compute_net, compute_norm, meta)
        self.sequence_kernel = KernelNet.of(*sequence, meta["sequence"]) if sequence is not None else None

    @property
    def sequence(self) -> tuple[ComputeNet, Normalizer] | None:
        """The sequence kernel's (net, normaliser), the constructor's ``sequence``."""
        k = self.sequence_kernel
        return (k.net, k.norm) if k is not None else None

    @property
    def batch_size(self) -> int:
        return int(self.meta["batch_size"])

    @property
    def hardware(self) -> Hardware:
        """The machine kind the compute samples were measured on."""
        return Hardware.from_record(self.meta["hardware"])

    @cached_property
    def step_parts(self) -> StepParts | None:
        """The fitted linear models of the step's other parts (``steparts``), or None for a
        model pre-trained without `neuroshard collect step` samples (read from ``meta``
        once: the search prices many plans)."""
        stored = self.meta.get("step_parts")
        return StepParts.from_dict(stored) if stored is not None else None

    def with_batch_size(self, batch_size: int) -> "NeuralCostModel":
        """The same model with predictions scaled to ``batch_size`` (linear in the batch);
        ``self`` when that is the scale it already has."""
        comm = self.comm.with_batch_size(batch_size) if self.comm is not None else None
        if batch_size / self.batch_size == self.batch_scale and comm is self.comm:
            return self
        return NeuralCostModel(
            self.compute_net, self.compute_norm, comm, self.meta, batch_size / self.batch_size, self.sequence
        )

    def for_tables(self, tables: Sequence[TableSpec]) -> "NeuralCostModel":
        """Without the sequence kernel's columns when no table of ``tables`` is a sequence
        table: the same predictions from embeddings half as wide."""
        if self.sequence_kernel is None or any(not t.pooled for t in tables):
            return self
        return NeuralCostModel(self.compute_net, self.compute_norm, self.comm, self.meta, self.batch_scale)

    def with_comm(self, comm: CommModel) -> "NeuralCostModel":
        """The same compute model paired with ``comm`` (at this model's batch scale)."""
        batch = round(self.batch_size * self.batch_scale)
        return NeuralCostModel(
            self.compute_net, self.compute_norm, comm.with_batch_size(batch), self.meta, self.batch_scale, self.sequence
        )

    def embed_shards(self, shards: Sequence[Shard]) -> np.ndarray:
        """Shard embeddings, pooled-kernel and sequence-kernel columns side by side:
        [S, Ep + 3 (+ Es + 3)] = [pooled kernel's ``KernelNet.embed`` row | sequence
        kernel's] for a pooled shard (0s in the other kernel's columns), and the reverse for
        a sequence shard; a model without a sequence net has the pooled columns only. Summed
        over a device, each kernel's last column counts its shards (see ``device_cost``)."""
        seq = np.asarray([not s.table.pooled for s in shards], dtype=bool)  # [S]
        if seq.any() and self.sequence_kernel is None:
            name = shards[int(np.argmax(seq))].table.name
            raise ShardingError(
                f"table {name!r} is a sequence (EmbeddingCollection) table, but this cost model learned the "
                "pooled kernel only: collect sequence kernels (`neuroshard collect compute --pooling none`) "
                "and pretrain on them with the pooled data, or plan this model with TorchRec's planner"
            )
        kernels = [(self.pooled_kernel, ~seq, "pooled")]
        if self.sequence_kernel is not None:
            kernels.append((self.sequence_kernel, seq, "sequence"))
        out = np.zeros((len(shards), sum(k.width for k, _, _ in kernels)), dtype=np.float32)
        col = 0
        for kernel, mine, what in kernels:
            picked = [s for s, m in zip(shards, mine) if m]
            _check_bytes(picked, kernel.bytes_per_element_trained, what)
            if picked:
                out[mine, col : col + kernel.width] = kernel.embed(picked)
            col += kernel.width
        return out

    def device_cost(self, pooled: np.ndarray) -> np.ndarray:
        """(forward, backward) ms [N, 2] of devices from pooled ``embed_shards`` rows: the
        sum of the device's pooled kernel and its sequence kernel, each 0 without shards and
        stretched linearly beyond its trained kernel size (``KernelNet.cost``)."""
        # numpy: the search calls this with small batches thousands of times
        p = self.pooled_kernel.width
        cost = self.pooled_kernel.cost(pooled[:, :p])
        if self.sequence_kernel is not None and (pooled[:, -1] > 0).any():  # some device runs the sequence kernel
            cost = cost + self.sequence_kernel.cost(pooled[:, p:])
        return cost * self.batch_scale

    def comm_cost_array(self, dims: np.ndarray, skews_ms: np.ndarray) -> np.ndarray:
        if self.comm is None:
            raise ShardingError(
                f"this cost model (measured on {self.hardware.describe()}) has no comm part: pair "
                "it with one, model.with_comm(AlphaBetaComm.from_topology(topology, batch_size)) "
                "(NeuroShardPlanner does so for a topology), or calibrate comm with "
                "`neuroshard calibrate --world-size D`"
            )
        return self.comm.comm_cost_array(dims, skews_ms)

    def wait_free_comm(self, dims: np.ndarray) -> np.ndarray | None:
        return self.comm.wait_free_cost(dims) if self.comm is not None else None

    def out_of_range(self, tables: Sequence[TableSpec]) -> dict[str, list[str]]:
        """The features of each of ``tables``, whole (every column), that lie outside the
        range its kernel's net was trained on (``KernelNet.outside``), by table name in
        ``tables``' order; tables inside it, or of a kernel without a net, are left out."""
        found: dict[str, list[str]] = {}
        for kernel, pooled in ((self.pooled_kernel, True), (self.sequence_kernel, False)):
            mine = [t for t in tables if t.pooled == pooled]
            if kernel is not None and mine:
                found.update((t.name, far) for t, far in zip(mine, kernel.outside([Shard(t, t.dim) for t in mine])) if far)
        return {t.name: found[t.name] for t in tables if t.name in found}

    def save(self, path: str | Path) -> None:
        """Write the model file: the compute net, the sequence net and the neural comm net
        where there are (an alpha-beta comm is rebuilt from the topology, never saved),
        their constructor args and normalisers, and ``meta``."""
        neural = self.comm if isinstance(self.comm, NeuralComm) else None
        blob = {
            "format": MODEL_FORMAT,
            "format_version": FORMAT_VERSION,
            "feature_version": FEATURE_VERSION,
            "shard_features": list(SHARD_FEATURES),
            "device_features": list(DEVICE_FEATURES),
            "compute_state": self.compute_net.state_dict(),
            "compute_norm": self.compute_norm.state(),
            "meta": self.meta,
        }
        if self.sequence_kernel is not None:
            blob["sequence_state"] = self.sequence_kernel.net.state_dict()
            blob["sequence_norm"] = self.sequence_kernel.norm.state()
        if neural is not None:
            blob["comm_state"] = neural.net.state_dict()
            blob["comm_norm"] = neural.norm.state()
        torch.save(blob, Path(path))

    @staticmethod
    def load(path: str | Path) -> "NeuralCostModel":
        """Load a model file; a corrupt or incompatible file is a ``ShardingError``."""
        path = Path(path)
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise ShardingError(f"{path}: cost model file not found") from None
        except Exception as e:  # noqa: BLE001 - any unpickling failure means a corrupt file
            raise ShardingError(
                f"{path}: not a readable torchrec-neuroshard cost model ({type(e).__name__}); "
                "re-download it or re-run `neuroshard pretrain`"
            ) from e
        if not isinstance(blob, dict) or blob.get("format") != MODEL_FORMAT:
            raise ShardingError(f"{path}: not a torchrec-neuroshard cost model file")
        if blob.get("format_version", 1) > FORMAT_VERSION:
            raise ShardingError(
                f"{path}: model file format {blob['format_version']} is newer than this "
                f"torchrec-neuroshard reads ({FORMAT_VERSION}); upgrade torchrec-neuroshard"
            )
        if (
            blob.get("feature_version") != FEATURE_VERSION
            or blob.get("shard_features") != list(SHARD_FEATURES)
            or blob.get("device_features") != list(DEVICE_FEATURES)
        ):
            raise ShardingError(
                f"{path}: cost model has feature version {blob.get('feature_version')}, this "
                f"torchrec-neuroshard needs {FEATURE_VERSION}; re-train it with `neuroshard pretrain`"
            )
        try:
            meta = blob["meta"]
            compute = ComputeNet(**meta["compute_config"])
            compute.load_state_dict(blob["compute_state"])
            comm = None
            if "comm_state" in blob:
                net = CommNet(**meta["comm_config"])
                net.load_state_dict(blob["comm_state"])
                comm = NeuralComm(net, Normalizer.from_state(blob["comm_norm"]), int(meta["batch_size"]))
            sequence = None
            if "sequence_state" in blob:
                seq_net = ComputeNet(**meta["sequence"]["compute_config"])
                seq_net.load_state_dict(blob["sequence_state"])
                sequence = (seq_net, Normalizer.from_state(blob["sequence_norm"]))
            model = NeuralCostModel(compute, Normalizer.from_state(blob["compute_norm"]), comm, meta, sequence=sequence)
            Hardware.from_record(meta["hardware"])  # a file without a valid hardware record is corrupt
        except (KeyError, RuntimeError, TypeError, ValueError) as e:
            raise ShardingError(f"{path}: cost model file is incomplete or corrupt: {e}") from e
        if any(k is not None and k.trained_range is None for k in (model.pooled_kernel, model.sequence_kernel)):
            logger.warning(
                "%s: this cost model file records no range of its training features (it was written before "
                "torchrec-neuroshard recorded them), so tables outside its training data are priced by the nets' "
                "unbounded extrapolation, unnoticed. Re-run `neuroshard pretrain` on its data, or record the ranges "
                "without re-training: torchrec_neuroshard.lab.pretrain.add_feature_ranges(model, rows).save(path)",
                path,
            )
        return model


def _check_bytes(shards: Sequence[Shard], seen: Sequence[int], kernel: str) -> None:
    """Refuse a shard whose weight bytes the ``kernel`` net never saw, naming the fix."""
    unseen = next((s.table for s in shards if s.table.bytes_per_element not in seen), None)
    if unseen is not None:
        flags = "--precision fp16" + (" --pooling none" if kernel == "sequence" else "")
        raise ShardingError(
            f"table {unseen.name!r} has {unseen.bytes_per_element}-byte weights, but the cost model's {kernel} "
            f"kernel was trained on {list(seen)}-byte weights only: collect such kernels (`neuroshard collect "
            f"compute {flags}`) and pretrain, or plan this model with TorchRec's planner"
        )


def _numpy_layers(seq: nn.Sequential) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy()) for m in seq if isinstance(m, nn.Linear)]


def _numpy_mlp(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    for i, (w, b) in enumerate(layers):
        x = x @ w
        x += b
        if i < len(layers) - 1:
            np.maximum(x, 0.0, out=x)
    return x


PRETRAINED_DIR = Path(__file__).parent / "pretrained"

DEFAULT_PRETRAINED = {"cpu": "cpu", "cuda": "h200"}
"""The shipped model a device kind falls back to when none was measured on this machine."""


def load_pretrained(name: str = "cpu") -> NeuralCostModel:
    """A model shipped in ``torchrec_neuroshard/pretrained/<name>.pt``."""
    path = PRETRAINED_DIR / f"{name}.pt"
    if not path.exists():
        have = sorted(p.stem for p in PRETRAINED_DIR.glob("*.pt"))
        raise ShardingError(f"no pretrained cost model {name!r}; shipped: {have}")
    return NeuralCostModel.load(path)


@lru_cache(maxsize=None)
def shipped_hardware() -> dict[str, Hardware]:
    """The hardware each shipped model was measured on, by model name."""
    return {p.stem: NeuralCostModel.load(p).hardware for p in sorted(PRETRAINED_DIR.glob("*.pt"))}


def pretrained_for(device: str) -> NeuralCostModel:
    """The shipped model for planning ``device`` on this machine: the one measured on this
    very hardware if one is shipped, else ``DEFAULT_PRETRAINED[device]``."""
    if device not in DEFAULT_PRETRAINED:
        raise ShardingError(
            f"no shipped cost model for compute device {device!r} (shipped for {sorted(DEFAULT_PRETRAINED)}); "
            f"measure one with `neuroshard collect` and `neuroshard pretrain`, and pass cost_model="
        )
    here = local_hardware(device)
    if here is not None:
        for name, hw in shipped_hardware().items():
            if hw.mismatch(here) is None:
                return load_pretrained(name)
    return load_pretrained(DEFAULT_PRETRAINED[device])


MAX_WORLD_SIZE_EXTRAPOLATION = 4
"""Plan for up to this many times the largest world size the comm model was trained on."""


def check_world_size(model: NeuralCostModel, world: int) -> None:
    """Refuse planning ``world`` ranks with ``model`` when that is more than
    ``MAX_WORLD_SIZE_EXTRAPOLATION`` x the largest world size its comm model was trained on
    (``ShardingError`` naming the commands that fix it); warn when ``world`` is new to it
    but within reach. A model without trained world sizes or whose comm is the alpha-beta
    stand-in (``cost_model_for`` pairs one with it beyond that reach) passes."""
    trained = model.meta.get("world_sizes_trained", [])
    if world <= 1 or not trained or world in trained or not isinstance(model.comm, NeuralComm):
        return
    if world > MAX_WORLD_SIZE_EXTRAPOLATION * max(trained):
        raise ShardingError(
            f"world size {world} is far beyond the world sizes the comm model was trained "
            f"on ({trained}); collect comm samples at this size (`neuroshard collect comm "
            f"--world-size {world}`) and re-train (`neuroshard pretrain`)"
        )
    logger.warning(
        "world size %d was not in the comm model's training data %s; the equivariant model extrapolates", world, trained
    )


def kernel_size_warning(model: NeuralCostModel, kernel_sizes: dict[str, int]) -> str | None:
    """A warning text when a kernel fuses more shards than any kernel the compute model was
    trained on (``meta["max_tables_per_kernel"]``): its prediction there is an extrapolation.
    ``kernel_sizes``: shards per fused kernel, by its name (``Plan.kernel_sizes``)."""
    trained = model.meta.get("max_tables_per_kernel")
    if not trained or not kernel_sizes or max(kernel_sizes.values()) <= trained:
        return None
    worst = max(kernel_sizes, key=kernel_sizes.__getitem__)
    return (
        f"the kernel of {worst} fuses {kernel_sizes[worst]} shards, but the compute model "
        f"was trained on kernels of at most {trained} tables: its cost there is extrapolated "
        f"linearly from {trained}-table kernels. Collect compute samples with more tables per kernel "
        f"on this hardware (lab.collect MAX_TABLES_PER_SAMPLE) and re-train for plans this dense"
    )


def feature_range_warning(model: NeuralCostModel, tables: Sequence[TableSpec], named: int = 5) -> str | None:
    """A warning text naming the tables (the first ``named`` of them) and their features
    that lie outside the data the compute model was trained on (``out_of_range``), or None
    when every table lies inside it or the model records no ranges."""
    far = model.out_of_range(tables)
    if not far:
        return None
    listed = "; ".join(f"{name!r}: {', '.join(features)}" for name, features in list(far.items())[:named])
    more = f"; and {len(far) - named} more" if len(far) > named else ""
    return (
        f"{len(far)} table(s) lie outside the data the compute model was trained on ({listed}{more}). They are "
        "priced as the nearest shards it learned: every feature clamped into its trained range (a table smaller "
        "than any trained is priced as the smallest), work beyond the widest and most-read shards trained added "
        "linearly. For plans resting on measured costs, collect compute samples covering such tables on this "
        "hardware (`neuroshard collect compute`, its pool extended with them: lab.workloads.synthetic_pool) and "
        "re-train (`neuroshard pretrain`)"
    )


def cost_model_for(topology: Any, cost_model: NeuralCostModel | str | Path | None = None) -> NeuralCostModel:
    """The cost model to plan TorchRec ``topology`` with.

    ``cost_model`` (a model, a file path or a shipped name) overrides the choice; by default
    the shipped model for the topology's compute device and this machine
    (``pretrained_for``). A model measured on other hardware than the topology's device (or
    this machine's CPU / GPU, where visible) is used with a logged warning that names the
    command making a model for this machine. A model without a comm part (measured on one
    GPU) is paired with ``AlphaBetaComm`` from the topology's bandwidths: a stand-in until
    comm is measured on NCCL. So is one whose comm net was trained on world sizes more than
    ``MAX_WORLD_SIZE_EXTRAPOLATION`` times smaller than the topology's (logged as a warning).
    """
    device = topology.compute_device
    if cost_model is None:
        model = pretrained_for(device)
    elif isinstance(cost_model, NeuralCostModel):
        model = cost_model
    else:
        path = Path(cost_model)
        model = NeuralCostModel.load(path) if path.suffix == ".pt" or path.exists() else load_pretrained(str(cost_model))
    why = hardware_mismatch(model.hardware, device)
    if why:
        logger.warning("%s", why)
    elif device == "cuda" and local_hardware("cuda") is None:
        logger.info(
            "planning for cuda with a model measured on %s; no GPU is visible here to compare it with",
            model.hardware.describe(),
        )
    if model.comm is None:
        model = model.with_comm(AlphaBetaComm.from_topology(topology, model.batch_size))
        logger.info("comm cost: %s, until comm is measured on this hardware", model.comm.describe())
    return _within_reach(model, topology)


def _within_reach(model: NeuralCostModel, topology: Any) -> NeuralCostModel:
    """``model`` with every communication part measured only at world sizes more than
    ``MAX_WORLD_SIZE_EXTRAPOLATION`` times smaller than the topology's replaced by the
    topology's links (``AlphaBetaComm``; ``stepcost.Collectives`` prices a collective
    without a measured part by them), logged as a warning naming what to collect."""
    world = topology.world_size
    far = lambda sizes: bool(sizes) and world > MAX_WORLD_SIZE_EXTRAPOLATION * max(sizes)  # noqa: E731
    comm_far = isinstance(model.comm, NeuralComm) and far(model.meta.get("world_sizes_trained", []))
    measured_at = model.meta.get("step_parts_world_sizes", {})
    parts = model.meta.get("step_parts") or {}
    dropped = sorted(op for op in (*COLLECTIVES, "input_dist") if op in parts and far(measured_at.get(op, [])))
    if not comm_far and not dropped:
        return model
    meta = dict(model.meta, step_parts={op: c for op, c in parts.items() if op not in dropped})
    links = AlphaBetaComm.from_topology(topology, model.batch_size)
    logger.warning(
        "world size %d is beyond %dx the world sizes this model's communication was measured at (%s): the "
        "%s priced by the topology's links (%s) instead; for measured prices collect samples at this size "
        "(`neuroshard collect comm --world-size %d`, `neuroshard collect step`) and re-train",
        world, MAX_WORLD_SIZE_EXTRAPOLATION, model.meta.get("world_sizes_trained") or measured_at,
        ", ".join((["pooled all-to-all"] if comm_far else []) + dropped), links.describe(), world,
    )  # fmt: skip
    within = NeuralCostModel(model.compute_net, model.compute_norm, None, meta, model.batch_scale, model.sequence)
    return within.with_comm(links if comm_far else model.comm)
