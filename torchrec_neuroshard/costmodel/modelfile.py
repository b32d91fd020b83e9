"""The cost model file: its format, its versions, and reading and writing it.

A file holds the compute net, the sequence net and the neural comm net where there are
(an alpha-beta comm is rebuilt from the topology, never saved), their constructor args and
normalisers, and the model's ``meta``: the hardware its samples were measured on (a file
without a valid record is corrupt), the batch size and the training record.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchrec_neuroshard.costmodel.batchshift import ShiftNet
from torchrec_neuroshard.costmodel.features import DEVICE_FEATURES, SHARD_FEATURES, Normalizer
from torchrec_neuroshard.costmodel.nets import CommNet, ComputeNet
from torchrec_neuroshard.hardware import Hardware
from torchrec_neuroshard.types import ShardingError

FEATURE_VERSION = 1
MODEL_FORMAT = "torchrec-neuroshard/costmodel"
FORMAT_VERSION = 8
"""1: compute and comm nets always present. 2: the comm net is optional (a model measured on
one GPU has none) and ``meta["hardware"]`` records the core count of a CPU. 3: an optional
second compute net for the unpooled (sequence, EmbeddingCollection) kernel. 4: a compute
net may read the batch (``reads_batch`` in its config, ``BATCH_FEATURE`` after the shard
features, ``batch_sizes_trained`` in its meta); older files read as nets that do not. 5: an
optional ``meta["width_correction"]`` (``nets.KernelCorrection``'s width form) that multiplies the pooled
kernel's price; a reader before it would price without it. 6: an optional batch shift of
the pooled kernel (``costmodel.batchshift``: ``batch_shift_state``, ``batch_shift_norm``,
``meta["batch_shift"]``); a reader before it would price other batches without it. 7:
``meta["kernel_correction"]`` (``nets.KernelCorrection``: a form, ``"width"`` as version 5's
``meta["width_correction"]``, which it still reads, or ``"work"``); a reader before it would
price without it. 8: the kernel correction's form ``"work+footprint"`` (its
``footprint_slope`` and ``footprint_reference``); a reader before it would price without the
footprint. The meta also
records each compute net's ``feature_range``, added without a new version: older readers
ignore it, and files without it load with a warning."""

CORRUPT_ERRORS = (KeyError, RuntimeError, TypeError, ValueError)
"""What a file with missing or malformed parts raises as it is read."""


def corrupt(path: Path, error: Exception) -> ShardingError:
    """The error for a model file at ``path`` whose parts are missing or malformed."""
    return ShardingError(f"{path}: cost model file is incomplete or corrupt: {error}")


@dataclass(frozen=True)
class ModelFile:
    """What a model file holds: each net with its normaliser (``comm``, ``sequence`` and
    ``batch_shift`` None where the file has none) and the model's ``meta``."""

    compute: tuple[ComputeNet, Normalizer]
    comm: tuple[CommNet, Normalizer] | None
    sequence: tuple[ComputeNet, Normalizer] | None
    meta: dict[str, Any]
    batch_shift: tuple[ShiftNet, Normalizer] | None = None

    def write(self, path: str | Path) -> None:
        blob = {
            "format": MODEL_FORMAT,
            "format_version": FORMAT_VERSION,
            "feature_version": FEATURE_VERSION,
            "shard_features": list(SHARD_FEATURES),
            "device_features": list(DEVICE_FEATURES),
            "compute_state": self.compute[0].state_dict(),
            "compute_norm": self.compute[1].state(),
            "meta": self.meta,
        }
        for key, part in (("sequence", self.sequence), ("comm", self.comm), ("batch_shift", self.batch_shift)):
            if part is not None:
                blob[f"{key}_state"] = part[0].state_dict()
                blob[f"{key}_norm"] = part[1].state()
        buffer = io.BytesIO()  # torch.save names a file's archive after the file: saved to a buffer, its bytes are its content's alone
        torch.save(blob, buffer)
        Path(path).write_bytes(buffer.getvalue())

    @staticmethod
    def read(path: str | Path) -> "ModelFile":
        """The parts of the model file at ``path``; a missing, corrupt or incompatible file is
        a ``ShardingError`` saying what to do."""
        path = Path(path)
        blob = _read_blob(path)
        try:
            meta = blob["meta"]
            compute = ComputeNet(**meta["compute_config"])
            compute.load_state_dict(blob["compute_state"])
            comm = _part(blob, "comm", lambda: CommNet(**meta["comm_config"]))
            sequence = _part(blob, "sequence", lambda: ComputeNet(**meta["sequence"]["compute_config"]))
            shift = _part(blob, "batch_shift", lambda: ShiftNet(**meta["batch_shift"]["config"]))
            Hardware.from_record(meta["hardware"])  # a file without a valid hardware record is corrupt
            return ModelFile((compute, Normalizer.from_state(blob["compute_norm"])), comm, sequence, meta, shift)
        except CORRUPT_ERRORS as e:
            raise corrupt(path, e) from e


def _part(blob: dict, key: str, build: Callable[[], nn.Module]) -> tuple[Any, Normalizer] | None:
    """The (net, normaliser) of the file's optional part ``key``, its net made by ``build``
    and loaded with the stored weights; None where the file has no such part."""
    if f"{key}_state" not in blob:
        return None
    net = build()
    net.load_state_dict(blob[f"{key}_state"])
    return net, Normalizer.from_state(blob[f"{key}_norm"])


def _read_blob(path: Path) -> dict:
    """The unpickled file at ``path``, checked to be a model file of a format and feature
    version this package reads."""
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
    return blob
