"""The cost nets: ``ComputeNet`` (one fused kernel's shards -> its ms), ``CommNet`` (a
device's all-to-all ms), and ``KernelNet``, a compute net with what it was trained on,
pricing shards in numpy for the search.

Compute (one net for any number of tables and devices): a per-shard MLP over the shard's
features, SUM over the shards of a device, then a head with two outputs, the log of the
fused kernel's forward and backward ms. A device with no shards costs 0.

Comm (one net for every world size D): a per-device MLP over ``DEVICE_FEATURES``; it
predicts forward and backward all-to-all ms, the forward adding the device's wait for the
latest device (max skew - own skew).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch
from torch import nn

from torchrec_neuroshard.costmodel.features import (
    DEVICE_FEATURES,
    POOLING_FEATURE,
    RANGE_TOLERANCE,
    SHARD_FEATURES,
    WIDTH_FEATURE,
    FeatureRange,
    Normalizer,
    feature_names,
    shard_features,
)
from torchrec_neuroshard.types import NUM_ACCESS_BINS, Shard

if TYPE_CHECKING:  # the shift's module builds its net with ``mlp``
    from torchrec_neuroshard.costmodel.batchshift import BatchShift


def mlp(sizes: Sequence[int]) -> nn.Sequential:
    """Linear layers of ``sizes`` with a ReLU between each two."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class ComputeNet(nn.Module):
    """Shards [S, F] with device index [S] -> log ms [N, 2] (forward, backward) per device.
    ``reads_batch``: F ends with the log of the kernel's global batch (``feature_names``).
    ``stretch_beyond`` K: a kernel of n > K shards is priced as n / K kernels of K average
    shards, in training as the planner prices it (``KernelNet.cost``); None: the head reads
    the sum of any number of shards (the planner then stretches beyond the largest trained)."""

    def __init__(
        self, num_features: int = len(SHARD_FEATURES), hidden: int = 128, embed: int = 64, reads_batch: bool = False,
        stretch_beyond: int | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        want = len(feature_names(reads_batch))
        if num_features != want:
            raise ValueError(f"a compute net with reads_batch={reads_batch} reads {want} features, not {num_features}")
        if stretch_beyond is not None and stretch_beyond < 1:
            raise ValueError(f"stretch_beyond={stretch_beyond}: give a kernel size of at least 1 table, or None")
        self.config = {"num_features": num_features, "hidden": hidden, "embed": embed, "reads_batch": reads_batch}
        if stretch_beyond is not None:  # absent from the files of nets before it
            self.config["stretch_beyond"] = stretch_beyond
        self.table = mlp([num_features, hidden, hidden, embed])
        self.head = mlp([embed, hidden, 2])

    @property
    def reads_batch(self) -> bool:
        return bool(self.config["reads_batch"])

    @property
    def stretch_beyond(self) -> int | None:
        return self.config.get("stretch_beyond")

    def forward(self, x: torch.Tensor, device_index: torch.Tensor, num_devices: int) -> torch.Tensor:
        return self.pooled_log_ms(self.table(x), device_index, num_devices, self.stretch_beyond)

    def pooled_log_ms(self, h: torch.Tensor, device_index: torch.Tensor, num_devices: int, stretch_beyond: int | None) -> torch.Tensor:
        """Log ms [N, 2] of devices from their shards' embeddings h [S, embed] (``table``'s,
        moved by a batch shift where there is one): summed per device and read by the head,
        a device of more than ``stretch_beyond`` shards as that many average ones (None: any sum)."""
        pooled = torch.zeros(num_devices, h.shape[1], dtype=h.dtype).index_add_(0, device_index, h)  # [N, embed]
        if stretch_beyond is None:
            return self.head(pooled)
        count = torch.bincount(device_index, minlength=num_devices).to(h.dtype)  # [N]
        stretch = (count / stretch_beyond).clamp_min(1.0)[:, None]  # [N, 1]
        return self.head(pooled / stretch) + stretch.log()  # log of (the average kernel's ms x stretch)


class CommNet(nn.Module):
    """Per-device features [N, F] -> (forward, backward) ms [N, 2]; the forward adds the wait."""

    def __init__(self, num_features: int = len(DEVICE_FEATURES), hidden: int = 64) -> None:
        super().__init__()
        self.config = {"num_features": num_features, "hidden": hidden}
        self.net = mlp([num_features, hidden, hidden, 2])

    def forward(self, x_norm: torch.Tensor, wait_ms: torch.Tensor) -> torch.Tensor:
        out = nn.functional.softplus(self.net(x_norm))
        return torch.stack([out[:, 0] + wait_ms, out[:, 1]], dim=1)


def numpy_layers(seq: nn.Sequential) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (weight [in, out], bias [out]) of each linear layer of ``seq``, copied to numpy."""
    return [(m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy()) for m in seq if isinstance(m, nn.Linear)]


def numpy_mlp(layers: list[tuple[np.ndarray, np.ndarray]], x: np.ndarray) -> np.ndarray:
    """``numpy_layers``' MLP applied to rows x [N, in] -> [N, out], a ReLU between layers."""
    for i, (w, b) in enumerate(layers):
        x = x @ w
        x += b
        if i < len(layers) - 1:
            np.maximum(x, 0.0, out=x)
    return x


FOOTPRINT_FORM = "work+footprint"
"""The correction form that reads a kernel's footprint as well as its work (``KernelCorrection``)."""
CORRECTION_FORMS = ("width", "work", FOOTPRINT_FORM)


ACCESS_BIN_READS = np.array([1.0] + [1.5 * 2 ** (i - 1) for i in range(1, NUM_ACCESS_BINS)])
"""[17] reads per distinct row at each access-histogram bin's middle ((2^(i-1), 2^i] for i > 0)."""


def shard_footprint(shard: Shard, batch_size: int) -> float:
    """Bytes of weights a batch of ``batch_size`` samples reads in ``shard``: its expected
    distinct rows (the lookups over the mean reads per distinct row of the table's access
    histogram, at most its rows; a row shard its share of them) x its width x bytes per element. The histogram is the
    table's at the batch it was profiled at; at another batch this is an estimate."""
    table = shard.table
    reads = float(np.dot(table.access_hist, ACCESS_BIN_READS))
    distinct = min(batch_size * table.pooling_factor / max(reads, 1.0), table.rows) * shard.num_rows / table.rows
    return distinct * shard.width * table.bytes_per_element


@dataclass(frozen=True)
class KernelCorrection:
    """A kernel's price multiplied by (x / ``reference``) ** ``slope``, where the net
    misprices kernels by what their lookups read (fitted on kernels timed in pairs,
    ``lab.kernel_correction``; ``meta["kernel_correction"]``). By ``form``, x is the
    kernel's
    - "width": lookup-weighted mean width, sum(pooling factor x width) / sum(pooling factor);
    - "work": lookups per ms as the nets price it, sum(pooling factor x width) / price (at
      the net's own batch): a slope of 1 prices kernels by their lookups alone, 0 by the
      net alone, and between them a geometric blend of the two;
    - "work+footprint": as "work", times (max(footprint, ``footprint_reference``) /
      ``footprint_reference``) ** ``footprint_slope``, footprint the bytes of rows a batch
      reads in the kernel (``shard_footprint`` summed): a kernel whose rows outgrow the
      caches reads them slower, which the net, trained on kernels of 1-15 tables, does not
      see; below the reference (the knee) a kernel keeps the price the net gives it."""

    form: str
    slope: float
    reference: float
    footprint_slope: float = 0.0
    footprint_reference: float = 1.0

    def __post_init__(self) -> None:
        if self.form not in CORRECTION_FORMS:
            raise ValueError(f"KernelCorrection(form={self.form!r}): give one of {CORRECTION_FORMS}")
        if not all(np.isfinite(x) for x in (self.slope, self.reference, self.footprint_slope, self.footprint_reference)) or min(self.reference, self.footprint_reference) <= 0:
            raise ValueError(
                f"KernelCorrection(slope={self.slope}, reference={self.reference}, footprint_slope={self.footprint_slope}, "
                f"footprint_reference={self.footprint_reference}): give finite slopes and positive references"
            )
        if self.footprint_slope and not self.reads_footprint:
            raise ValueError(f"KernelCorrection(form={self.form!r}, footprint_slope={self.footprint_slope}): only the form {FOOTPRINT_FORM!r} reads the footprint")

    @property
    def reads_footprint(self) -> bool:
        return self.form == FOOTPRINT_FORM

    @staticmethod
    def from_meta(meta: dict[str, Any]) -> "KernelCorrection | None":
        """The correction ``meta`` records; a file of format 5 or 6 named its width correction
        ``"width_correction"``."""
        stored = meta.get("kernel_correction")
        if stored is None and "width_correction" in meta:
            stored = {"form": "width", **meta["width_correction"]}
        if stored is None:
            return None
        footprint = {k: float(stored[k]) for k in ("footprint_slope", "footprint_reference") if k in stored}
        return KernelCorrection(str(stored["form"]), float(stored["slope"]), float(stored["reference"]), **footprint)

    def factor(self, lookups: np.ndarray, pooling: np.ndarray, price: np.ndarray, footprint: np.ndarray) -> np.ndarray:
        """[N, 1] each kernel's multiplier from its summed pooling factor x width, pooling
        factors and footprint (bytes; read by "work+footprint" alone) and its total ms as
        the nets price it [N, 1] each (1 where it has no lookups)."""
        denominator = pooling if self.form == "width" else price
        x = np.where(denominator > 0, lookups / np.maximum(denominator, 1e-30), self.reference)
        out = (np.maximum(x, 1e-30) / self.reference) ** self.slope
        if self.reads_footprint:
            out = out * (np.maximum(footprint, self.footprint_reference) / self.footprint_reference) ** self.footprint_slope
        return out


@dataclass(frozen=True)
class KernelNet:
    """A compute net with the normaliser of its features and what it was trained on (the
    largest kernel, the weight bytes, the range of its features, None for a model file
    written before ranges were recorded, the smallest and largest global batch), and the
    correction of its price by what the kernel's lookups read where one was fitted, and the shift
    of its shards' embeddings with the batch where one was learned (``batchshift``): the
    model of one TorchRec kernel kind."""

    net: ComputeNet
    norm: Normalizer
    max_tables_per_kernel: int | None
    bytes_per_element_trained: tuple[int, ...]
    trained_range: FeatureRange | None
    batch_sizes_trained: tuple[int, int]
    correction: KernelCorrection | None = None
    batch_shift: BatchShift | None = None

    def __post_init__(self) -> None:
        shift, (low, high) = self.batch_shift, self.batch_sizes_trained
        if shift is not None and (self.net.reads_batch or low != high or shift.reference_batch != low):
            raise ValueError(
                f"a batch shift around batch {shift.reference_batch} shifts a net trained at that one batch alone, "
                f"not one {'that reads the batch' if self.net.reads_batch else f'trained at {low}-{high}'}"
            )

    @staticmethod
    def of(net: ComputeNet, norm: Normalizer, meta: dict[str, Any], batch_size: int, batch_shift: BatchShift | None = None) -> "KernelNet":
        """``net`` with what ``meta`` (a model's meta, or its ``"sequence"`` part) records
        about its training data, and its ``batch_shift``; models before the byte field saw
        fp32 only, and those before the batch range, the model's one ``batch_size``."""
        stored = meta.get("feature_range")
        low, high = meta.get("batch_sizes_trained", (batch_size, batch_size))
        return KernelNet(
            net.eval(), norm, meta.get("max_tables_per_kernel"), tuple(meta.get("bytes_per_element_trained", [4])),
            FeatureRange.from_state(stored) if stored is not None else None, (int(low), int(high)),
            KernelCorrection.from_meta(meta), batch_shift,
        )  # fmt: skip

    def batch_factor(self, batch_size: int) -> float:
        """What the net's price at the nearest batch it was trained at is multiplied by for
        ``batch_size``: 1 inside the trained batches (a net that reads the batch prices it
        itself), linear in the batch beyond them (a first-order correction); a net trained at
        one batch with a ``batch_shift``: linear, the shift its departure from linear."""
        low, high = self.batch_sizes_trained
        return batch_size / min(max(batch_size, low), high)

    def features(self, shards: Sequence[Shard], batch_size: int) -> torch.Tensor:
        """The raw features the net reads of ``shards`` in a kernel of ``batch_size``, float32 [S, F]."""
        return shard_features(shards, batch_size if self.net.reads_batch else None)

    @cached_property
    def head(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return numpy_layers(self.net.head)

    def priced(self, shards: Sequence[Shard], batch_size: int) -> tuple[torch.Tensor, np.ndarray]:
        """The features the net prices each shard by at ``batch_size``, float32 [S, F], and each shard's
        work in copies of the shard those features describe, float64 [S] (1 inside the
        trained range).

        A shard wider, or read more times per sample, than any the net was trained on is
        priced as ``copies`` = (width / widest) x (pooling / largest pooling) shards of the
        widest width and largest pooling factor trained: a kernel's work is linear in
        columns x lookups, where clamping would price a 512-column table as a 128-column
        one. Then every feature is clamped into the trained range: a table smaller than
        any trained is priced as the smallest one, a sound bound for costs per row and per
        lookup; a batch beyond the trained ones, as the nearest (``batch_factor`` scales it).
        Without a recorded range: the shard's own features, one copy."""
        x = self.features(shards, batch_size)  # [S, F]
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
            x[torch.as_tensor(beyond)] = self.features(learned, batch_size)
        return trained.clamp(x), copies

    def outside(self, shards: Sequence[Shard]) -> list[list[str]]:
        """Per shard, its ``SHARD_FEATURES`` farther than ``RANGE_TOLERANCE`` outside the
        trained range, each as "name value (trained low..high)"; all empty without a range.
        (The batch is the model's, not a table's: ``batch_factor`` prices it.)"""
        trained = self.trained_range
        if trained is None:
            return [[] for _ in shards]
        own = len(SHARD_FEATURES)
        x = shard_features(shards)  # [S, own]
        low, high = trained.low[:own], trained.high[:own]
        far = (torch.clamp(x, low, high) - x).abs() / self.norm.std[:own] > RANGE_TOLERANCE  # [S, own]
        low, high = low.tolist(), high.tolist()
        return [
            [f"{SHARD_FEATURES[f]} {float(x[i, f]):.4g} (trained {low[f]:.4g}..{high[f]:.4g})" for f in far[i].nonzero().flatten().tolist()]
            for i in range(len(shards))
        ]  # fmt: skip

    @torch.no_grad()
    def embed(self, shards: Sequence[Shard], batch_size: int) -> np.ndarray:
        """Shard rows at ``batch_size``, float32 [S, hidden + 3 (+ 3)] = [the head's first
        layer (no bias) applied to the net's embedding of the shard as ``priced``, moved by
        the batch shift where there is one | the (forward, backward) ms its copies beyond the
        first add, each priced as that shard alone in a kernel, 0 inside the trained range |
        with a correction, its pooling factor x width, its pooling factor and its footprint
        (``shard_footprint``; 0 unless the correction reads it) | 1]. The head pools the
        embeddings by summing and its first layer is linear, so that layer commutes with the
        pooling: it is applied once per shard here, and a device's cost is the rest of the
        head (``cost``). Pooled over a device, the middle columns sum the devices' extra ms
        (and lookups, footprints) and the last counts its shards in this kernel."""
        features, copies = self.priced(shards, batch_size)
        emb = self.net.table(self.norm(features))  # [S, embed]
        if self.batch_shift is not None and batch_size != self.batch_shift.reference_batch:
            emb = emb + self.batch_shift.move(features, torch.tensor(math.log(batch_size)))
        emb = emb.numpy()
        lifted = emb @ self.head[0][0]  # [S, hidden]
        extra = np.zeros((len(shards), 2), dtype=emb.dtype)  # [S, 2]
        beyond = copies > 1
        if beyond.any():
            extra[beyond] = np.exp(self._rest_of_head(lifted[beyond])) * (copies[beyond, None] - 1)
        parts = [lifted, extra]
        if self.correction is not None:
            pooling = np.asarray([s.table.pooling_factor for s in shards], dtype=emb.dtype)  # [S]
            footprint = [shard_footprint(s, batch_size) if self.correction.reads_footprint else 0.0 for s in shards]
            parts.append(np.stack([pooling * np.asarray([s.width for s in shards], dtype=emb.dtype), pooling, np.asarray(footprint, dtype=emb.dtype)], axis=1))  # [S, 3]
        return np.concatenate([*parts, np.ones((len(shards), 1), dtype=emb.dtype)], axis=1)

    def cost(self, pooled: np.ndarray) -> np.ndarray:
        """(forward, backward) ms [N, 2] of N kernels from pooled ``embed`` rows [N, width];
        0 for a kernel of no shards; times the correction's factor where there is one.

        A kernel fusing n shards, more than the ``max_tables_per_kernel`` K it was trained
        on, is priced as n / K kernels of K average shards: linear in its work beyond the
        trained range, rather than the net's unbounded extrapolation of a sum it never saw
        (``kernel_size_warning`` says when that happens)."""
        hidden = int(self.net.config["hidden"])
        lifted, extra, count = pooled[:, :hidden], pooled[:, hidden : hidden + 2], pooled[:, -1:]  # [N, hidden], [N, 2], [N, 1]
        trained = self.max_tables_per_kernel
        if trained and count.max(initial=0.0) > trained:
            stretch = np.maximum(count / trained, 1.0)
            out = np.exp(self._rest_of_head(lifted / stretch)) * stretch + extra
        else:  # every kernel within the trained size (the search's hot path)
            out = np.exp(self._rest_of_head(lifted)) + extra
        if self.correction is not None:
            out = out * self.correction.factor(pooled[:, -4:-3], pooled[:, -3:-2], out.sum(1, keepdims=True), pooled[:, -2:-1])
        return np.where(count > 0, out, 0.0)

    def _rest_of_head(self, lifted: np.ndarray) -> np.ndarray:
        """The head's log ms [N, 2] from its first layer's output without bias [N, hidden]."""
        bias, zeros = self.head[0][1], self._zero_row  # [hidden] each
        x = lifted + bias  # [N, hidden]
        np.maximum(x, zeros, out=x)  # ReLU; against a row of zeros: faster than a scalar 0 (the search's hot path)
        return numpy_mlp(self.head[1:], x)

    @cached_property
    def _zero_row(self) -> np.ndarray:
        """[hidden] zeros of the head's dtype, the ReLU's floor (made once: the greedy calls it every step)."""
        return np.zeros_like(self.head[0][1])

    @property
    def width(self) -> int:
        """Columns of an ``embed`` row."""
        return int(self.net.config["hidden"]) + 3 + (3 if self.correction is not None else 0)
