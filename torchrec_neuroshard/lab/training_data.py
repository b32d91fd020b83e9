"""Measured samples as training data: compute kernels, all-to-alls and step parts turned
into feature and target arrays, and the split of samples by group.

A sample group is one drawn table set or comm layout; re-measurements of it share the
group, and a split never divides one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np
import torch

from torchrec_neuroshard.costmodel.features import device_features, shard_features
from torchrec_neuroshard.lab.collect import iter_kind, shard_from_record
from torchrec_neuroshard.lab.collect_step import DP_KINDS
from torchrec_neuroshard.steparts import COLLECTIVES, collective_features, dp_features, input_dist_features
from torchrec_neuroshard.types import ShardingError

KIND_GROUP_OFFSET = {"dp_small": 500_000, "dp_many": 250_000}
"""Added to a "dp_small" or "dp_many" sample's index in its split group (``step_group``): a
group apart from the "dp" sample of the same index."""

@dataclass(frozen=True)
class ComputeData:
    """Compute samples: shard features x [S, F] with each sample's shards contiguous (the
    log of its batch last where ``reads_batch``), owning sample of each shard [S], targets
    y [N, 2] (forward, backward ms), group [N], global batch [N], and the pair a sample was
    timed in turn with [N] (-1: none; ``lab.collect_devices``)."""

    x: torch.Tensor
    sample: torch.Tensor
    y: torch.Tensor
    group: np.ndarray
    batch_size: np.ndarray
    reads_batch: bool
    pair: np.ndarray

    def subset(self, keep: np.ndarray) -> "ComputeData":
        """The samples where ``keep`` (a boolean mask [N] or sample indices) holds."""
        idx = np.flatnonzero(keep) if np.asarray(keep).dtype == bool else np.sort(np.asarray(keep))
        counts = torch.bincount(self.sample, minlength=len(self)).numpy()
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        n = counts[idx]
        shard_idx = np.repeat(starts[idx] - np.concatenate([[0], np.cumsum(n)[:-1]]), n) + np.arange(n.sum())
        return ComputeData(
            self.x[torch.as_tensor(shard_idx)],
            torch.as_tensor(np.repeat(np.arange(len(idx)), n)),
            self.y[torch.as_tensor(idx)],
            self.group[idx],
            self.batch_size[idx],
            self.reads_batch,
            self.pair[idx],
        )

    def pairs(self) -> np.ndarray:
        """Index pairs [P, 2] of the samples timed in turn whose partner is here too."""
        paired = np.flatnonzero(self.pair >= 0)
        order = paired[np.argsort(self.pair[paired], kind="stable")]
        same = self.pair[order[:-1]] == self.pair[order[1:]]
        return np.stack([order[:-1][same], order[1:][same]], axis=1)

    def __len__(self) -> int:
        return self.y.shape[0]


@dataclass(frozen=True)
class CommData:
    """Comm samples flattened to devices: features x [M, F], targets y [M, 2] (forward,
    backward ms), sample group [M], world size [M]."""

    x: torch.Tensor
    y: torch.Tensor
    group: np.ndarray
    world_size: np.ndarray

    def subset(self, keep: np.ndarray) -> "CommData":
        """The devices where ``keep`` (a boolean mask [M] or indices) holds."""
        keep_t = torch.as_tensor(keep)
        return CommData(self.x[keep_t], self.y[keep_t], self.group[keep], self.world_size[keep])

    def __len__(self) -> int:
        return self.y.shape[0]


Data = Union[ComputeData, CommData]


POOLING_MODES = {True: "sum", False: "none"}
"""A compute row's ``pooling_mode`` for the pooled (EBC) and the unpooled (EC) kernel."""


def kernel_rows(rows: Sequence[dict], pooled: bool = True) -> list[dict]:
    """The compute rows of one kernel kind: pooled bags, or unpooled sequences."""
    return [r for r in iter_kind(rows, "compute") if r.get("pooling_mode", "sum") == POOLING_MODES[pooled]]


def compute_groups(rows: Sequence[dict]) -> np.ndarray:
    """The split group of each compute row [N]: its drawn table set (re-measurements share it)."""
    return np.asarray([r["group"] for r in rows])


def load_compute_data(rows: Sequence[dict], pooled: bool = True, reads_batch: bool | None = None) -> ComputeData:
    """The compute samples of ``rows`` of one kernel kind (``kernel_rows``), with each
    sample's batch as a feature when ``reads_batch`` (default: when they were measured at
    more than one batch, so a net can learn it)."""
    mine = kernel_rows(rows, pooled)
    if not mine:
        flag = "" if pooled else " --pooling none"
        raise ShardingError(f"no {'pooled' if pooled else 'sequence'} compute samples in the data; run `neuroshard collect compute{flag}` first")
    batches = [int(r["batch_size"]) for r in mine]
    if reads_batch is None:
        reads_batch = len(set(batches)) > 1
    feats, sample = [], []
    for k, r in enumerate(mine):
        shards = [shard_from_record(s) for s in r["shards"]]
        feats.append(shard_features(shards, batches[k] if reads_batch else None))
        sample += [k] * len(shards)
    y = torch.tensor([[r["fwd_ms"], r["bwd_ms"]] for r in mine], dtype=torch.float32)
    group = compute_groups(mine)
    pair = np.asarray([r["group"] if "pair" in r else -1 for r in mine])  # a pair's two rows share their group
    return ComputeData(torch.cat(feats), torch.tensor(sample), y, group, np.asarray(batches), reads_batch, pair)


def load_comm_data(rows: Sequence[dict]) -> CommData:
    feats, y, group, world = [], [], [], []
    for r in iter_kind(rows, "comm"):
        d = len(r["dims"])
        feats.append(torch.from_numpy(device_features(np.asarray([r["dims"]]), np.asarray([r["skews_ms"]]))[0]))
        y += list(zip(r["fwd_ms"], r["bwd_ms"]))
        group += [r["world_size"] * 1_000_000 + r["group"]] * d
        world += [r["world_size"]] * d
    if not y:
        raise ShardingError("no comm samples in the data; run `neuroshard collect comm` first")
    return CommData(torch.cat(feats), torch.tensor(y, dtype=torch.float32), np.asarray(group), np.asarray(world))


@dataclass(frozen=True)
class PartData:
    """Samples of one step part (``steparts``): features x [N, F], ms y [N], sample group
    [N] (a rank's row of a distributed sample shares the sample's group), world size [N]."""

    x: np.ndarray
    y: np.ndarray
    group: np.ndarray
    world_size: np.ndarray

    def subset(self, keep: np.ndarray) -> "PartData":
        return PartData(self.x[keep], self.y[keep], self.group[keep], self.world_size[keep])

    def __len__(self) -> int:
        return len(self.y)


def step_group(row: dict) -> int:
    """The split group of a ``collect step`` row: world size x 1e6 + sample index, a
    "dp_small" or "dp_many" sample ``KIND_GROUP_OFFSET`` apart from the "dp" sample of its index."""
    return row["world_size"] * 1_000_000 + KIND_GROUP_OFFSET.get(row["kind"], 0) + row["group"]


def load_step_data(rows: Sequence[dict]) -> dict[str, PartData]:
    """The step parts present in ``rows`` (``neuroshard collect step``), features computed
    from each row's raw quantities by ``steparts``' functions; one row per rank for the
    distributed kinds, one per sample of the data-parallel kinds (its forward and backward
    parts, each sample a group of its own)."""
    cols: dict[str, tuple[list, list, list, list]] = {}

    def add(part: str, x: list[float], y: float, r: dict) -> None:
        xs, ys, gs, ws = cols.setdefault(part, ([], [], [], []))
        xs.append(x)
        ys.append(y)
        gs.append(step_group(r))
        ws.append(r["world_size"])

    for r in rows:
        kind, d = r.get("kind"), r.get("world_size")
        if kind == "input_dist":
            for ms, send, recv in zip(r["ms"], r["send_bytes"], r["recv_bytes"]):
                add(kind, input_dist_features(d, send, recv), ms, r)
        elif kind in COLLECTIVES:
            for ms in r["ms"]:
                add(kind, collective_features(kind, d, r["nbytes"]), ms, r)
        elif kind in DP_KINDS:
            widths = [t["width"] for t in r["tables"]]
            sizes = {t.get("bytes_per_element", 4) for t in r["tables"]}
            if len(sizes) != 1:
                raise ShardingError(f"dp sample {r['group']} (D={d}) mixes weight sizes {sorted(sizes)}; one kernel has one")
            bytes_per_element = sizes.pop()
            table_rows = [t["rows"] for t in r["tables"]]
            for part, field in (("dp_fwd", "fwd_ms"), ("dp_bwd", "bwd_ms")):
                add(part, dp_features(part, r["lookups"], widths, table_rows, r["local_batch"], bytes_per_element), r[field], r)
    return {
        part: PartData(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), np.asarray(g), np.asarray(w))
        for part, (x, y, g, w) in sorted(cols.items())
    }


def split_by_group(groups: np.ndarray, seed: int, fractions: tuple[float, float] = (0.8, 0.9)) -> tuple[np.ndarray, ...]:
    """Boolean masks (train, validation, test): whole groups go to one split."""
    unique = np.unique(groups)
    order = np.random.default_rng(seed).permutation(len(unique))
    cut1, cut2 = int(fractions[0] * len(unique)), int(fractions[1] * len(unique))
    parts = [set(unique[order[:cut1]]), set(unique[order[cut1:cut2]]), set(unique[order[cut2:]])]
    return tuple(np.isin(groups, list(p)) for p in parts)


