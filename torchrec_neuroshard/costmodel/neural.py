"""The neural cost model: the pre-trained nets behind the ``CostModel`` interface.

TorchRec runs a device's pooled (EmbeddingBagCollection) and sequence (EmbeddingCollection)
lookups as two kernels: a model may carry a second compute net of the same shape for the
sequence kernel, and a device then costs the sum of its two kernels. The comm part is
pluggable (``comm.CommModel``): the trained ``NeuralComm``, or the alpha-beta stand-in
built from a topology for models measured on one GPU.

A shard outside the range its compute net was trained on is priced as the nearest shard
the net learned (``nets.KernelNet.priced``), never by the net's unbounded extrapolation;
``out_of_range`` names such tables.
"""

from __future__ import annotations

import logging
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from torchrec_neuroshard.comm import CommModel
from torchrec_neuroshard.costmodel.batchshift import BatchShift, ShiftNet
from torchrec_neuroshard.costmodel.features import DEVICE_FEATURES, Normalizer, device_features
from torchrec_neuroshard.costmodel.modelfile import CORRUPT_ERRORS, ModelFile, corrupt
from torchrec_neuroshard.costmodel.nets import CommNet, ComputeNet, KernelNet, numpy_layers, numpy_mlp
from torchrec_neuroshard.hardware import Hardware
from torchrec_neuroshard.steparts import StepParts
from torchrec_neuroshard.types import CostModel, Shard, ShardingError, TableSpec

logger = logging.getLogger(__name__)


class NeuralComm(CommModel):
    """The trained ``CommNet`` behind the ``CommModel`` interface; predictions scale
    linearly from the global batch it was trained at (``batch_size``) to ``batch_scale``x:
    every time scales alike, so the net reads the skews at its own batch (divided by
    ``batch_scale``) and its costs are scaled back, and the wait for the latest device is
    the skews' own, in ms, at any batch."""

    def __init__(self, net: CommNet, norm: Normalizer, batch_size: int, batch_scale: float = 1.0) -> None:
        self.net = net.eval()
        self.norm = norm
        self.batch_size = batch_size
        self.batch_scale = batch_scale

    @cached_property
    def _layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return numpy_layers(self.net.net)

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
        x = device_features(dims, np.asarray(skews_ms) / self.batch_scale).reshape(r * n, -1)
        wait = x[:, DEVICE_FEATURES.index("wait_ms")]
        z = (x - self.norm.mean.numpy()) / self.norm.std.numpy()
        out = np.logaddexp(0.0, numpy_mlp(self._layers, z))  # softplus
        out[:, 0] += wait
        return (out * self.batch_scale).reshape(r, n, 2)


class NeuralCostModel(CostModel):
    """The pre-trained compute nets and a comm model behind the ``CostModel`` interface (ms).

    ``comm`` is pluggable: the trained ``NeuralComm``, or ``AlphaBetaComm`` built from a
    topology for a model measured on one GPU (its file holds no comm net); None until one
    is attached with ``with_comm``. ``sequence`` is the (net, normaliser) of the unpooled
    kernel, EmbeddingCollection tables', when the model learned it (``meta["sequence"]``
    then records its training); without it sequence tables are refused. The model predicts
    at the global batch ``batch_size`` x ``batch_scale`` (``with_batch_size`` sets it, and
    rescales the comm, linear in the batch): a compute net trained across batches reads it
    as a feature, one trained at a single batch scales linearly from it
    (``KernelNet.batch_factor``), its ``batch_shift`` (net, normaliser; ``meta["batch_shift"]``
    records the rest) moving the pooled kernel's shards off that batch where it learned one
    (``costmodel.batchshift``). ``meta`` holds the hardware the samples were measured on
    (``hardware``), the batch size the comm and the default prediction are at, and the
    training record.
    """

    def __init__(
        self,
        compute_net: ComputeNet,
        compute_norm: Normalizer,
        comm: CommModel | None,
        meta: dict[str, Any],
        batch_scale: float = 1.0,
        sequence: tuple[ComputeNet, Normalizer] | None = None,
        batch_shift: tuple[ShiftNet, Normalizer] | None = None,
    ) -> None:
        self.compute_net = compute_net.eval()
        self.compute_norm = compute_norm
        self.comm = comm
        self.meta = meta
        self.batch_scale = batch_scale
        shift = BatchShift.of(*batch_shift, meta["batch_shift"]) if batch_shift is not None else None
        self.pooled_kernel = KernelNet.of(compute_net, compute_norm, meta, self.batch_size, shift)
        self.sequence_kernel = KernelNet.of(*sequence, meta["sequence"], self.batch_size) if sequence is not None else None

    @property
    def sequence(self) -> tuple[ComputeNet, Normalizer] | None:
        """The sequence kernel's (net, normaliser), the constructor's ``sequence``."""
        k = self.sequence_kernel
        return (k.net, k.norm) if k is not None else None

    @property
    def batch_shift(self) -> tuple[ShiftNet, Normalizer] | None:
        """The pooled kernel's batch shift's (net, normaliser), the constructor's ``batch_shift``."""
        shift = self.pooled_kernel.batch_shift
        return (shift.net, shift.norm) if shift is not None else None

    def without_batch_shift(self) -> "NeuralCostModel":
        """The same model pricing other batches linearly from its net's one, as it would
        without its batch shift (to compare the two); ``self`` where it has none."""
        if self.batch_shift is None:
            return self
        return self._rebuilt(batch_shift=None, meta={k: v for k, v in self.meta.items() if k != "batch_shift"})

    def _rebuilt(self, **changes: Any) -> "NeuralCostModel":
        """A model of this one's parts with ``changes`` (constructor arguments) in place:
        every derived model is built here, so none drops a part."""
        parts = dict(
            compute_net=self.compute_net, compute_norm=self.compute_norm, comm=self.comm, meta=self.meta,
            batch_scale=self.batch_scale, sequence=self.sequence, batch_shift=self.batch_shift,
        )  # fmt: skip
        return NeuralCostModel(**{**parts, **changes})

    @property
    def batch_size(self) -> int:
        """The batch the model predicts at by default (its comm was measured at)."""
        return int(self.meta["batch_size"])

    @property
    def batch(self) -> int:
        """The global batch the model predicts at (``with_batch_size``)."""
        return round(self.batch_size * self.batch_scale)

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
        """The same model predicting at the global ``batch_size``; ``self`` when that is the
        batch it already predicts at."""
        comm = self.comm.with_batch_size(batch_size) if self.comm is not None else None
        if batch_size / self.batch_size == self.batch_scale and comm is self.comm:
            return self
        return self._rebuilt(comm=comm, batch_scale=batch_size / self.batch_size)

    def batch_note(self, batch_size: int) -> str:
        """How this model prices the global ``batch_size``: by the nets that learned it, or
        scaled linearly from the nearest batch they learned; the comm, linearly from its own."""
        kernels = [("compute", self.pooled_kernel), ("sequence compute", self.sequence_kernel)]
        parts = []
        for what, kernel in ((w, k) for w, k in kernels if k is not None):
            low, high = kernel.batch_sizes_trained
            learned = f"{low:,}" if low == high else f"{low:,}-{high:,}"
            factor = kernel.batch_factor(batch_size)
            how = "priced by its net" if factor == 1.0 else f"scaled linearly by {factor:.3g}"
            shift = kernel.batch_shift
            moved = ""
            if shift is not None and batch_size != shift.reference_batch:
                moved = ", moved by its batch shift (learned at {:,}-{:,})".format(*shift.batch_sizes_trained)
            parts.append(f"{what} {how} (learned at {learned}){moved}")
        if self.comm is not None and batch_size != self.batch_size:
            parts.append(f"comm scaled linearly from {self.batch_size:,}")
        return "; ".join(parts)

    def for_tables(self, tables: Sequence[TableSpec]) -> "NeuralCostModel":
        """Without the sequence kernel's columns when no table of ``tables`` is a sequence
        table: the same predictions from embeddings half as wide."""
        if self.sequence_kernel is None or any(not t.pooled for t in tables):
            return self
        return self._rebuilt(sequence=None)

    def with_meta(self, meta: dict[str, Any]) -> "NeuralCostModel":
        """The same nets, comm and batch scale with ``meta`` in place of this model's (a
        refit's step parts, a fitted width correction, a calibration's record)."""
        return self._rebuilt(meta=meta)

    def with_comm(self, comm: CommModel) -> "NeuralCostModel":
        """The same compute model paired with ``comm`` (at this model's batch scale)."""
        return self._rebuilt(comm=comm.with_batch_size(self.batch))

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
                out[mine, col : col + kernel.width] = kernel.embed(picked, self.batch)
            col += kernel.width
        return out

    def device_cost(self, pooled: np.ndarray) -> np.ndarray:
        """(forward, backward) ms [N, 2] of devices from pooled ``embed_shards`` rows: the
        sum of the device's pooled kernel and its sequence kernel, each 0 without shards,
        stretched linearly beyond its trained kernel size (``KernelNet.cost``) and beyond
        its trained batches (``KernelNet.batch_factor``)."""
        # numpy: the search calls this with small batches thousands of times
        p = self.pooled_kernel.width
        pooled_factor, sequence_factor = self._batch_factors
        cost = self.pooled_kernel.cost(pooled[:, :p]) * pooled_factor
        if self.sequence_kernel is not None and (pooled[:, -1] > 0).any():  # some device runs the sequence kernel
            cost = cost + self.sequence_kernel.cost(pooled[:, p:]) * sequence_factor
        return cost

    def kernel_ms(self, shards: Sequence[Shard], batch_size: int) -> float:
        """fwd+bwd ms of ``shards`` run as one device's kernel at the global ``batch_size``,
        as the search prices a device (``embed_shards`` pooled, ``device_cost``)."""
        at = self.with_batch_size(batch_size)
        return float(at.device_cost(at.embed_shards(shards).sum(0, keepdims=True)).sum())  # [1, E] -> [1, 2]

    @cached_property
    def _batch_factors(self) -> tuple[float, float]:
        """Each kernel's ``batch_factor`` at this model's batch (1 for a missing kernel)."""
        return tuple(k.batch_factor(self.batch) if k is not None else 1.0 for k in (self.pooled_kernel, self.sequence_kernel))

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
        """Write the model file (``modelfile``): the nets this model has, and ``meta``."""
        neural = self.comm if isinstance(self.comm, NeuralComm) else None
        comm = (neural.net, neural.norm) if neural is not None else None
        ModelFile((self.compute_net, self.compute_norm), comm, self.sequence, self.meta, self.batch_shift).write(path)

    @staticmethod
    def load(path: str | Path) -> "NeuralCostModel":
        """Load a model file; a corrupt or incompatible file is a ``ShardingError``."""
        file = ModelFile.read(path)
        try:
            comm = NeuralComm(*file.comm, int(file.meta["batch_size"])) if file.comm is not None else None
            model = NeuralCostModel(*file.compute, comm, file.meta, sequence=file.sequence, batch_shift=file.batch_shift)
        except CORRUPT_ERRORS as e:
            raise corrupt(Path(path), e) from e
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
