"""Loader for Meta's public DLRM embedding-lookup dataset (``fbgemm_t856_bs65536*.pt.gz``).

File layout: ``indices, offsets, lengths = torch.load(gzip.open(path))`` where ``offsets``
is one flat array of T*B+1 entries over all tables (table t's bags are
``offsets[t*B:(t+1)*B+1]``) and ``lengths`` has shape [T, B].
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import torch

from torchrec_neuroshard.access import access_histogram
from torchrec_neuroshard.types import ShardingError, TableSpec


@dataclass(frozen=True)
class DatasetTable:
    """One table of the dataset: its spec (at ``dim``) and its bags for one batch."""

    spec: TableSpec
    indices: torch.Tensor  # int64 [N], ids in [0, spec.rows)
    offsets: torch.Tensor  # int64 [B + 1], starting at 0


def load_dlrm_dataset(path: str | Path, dim: int = 64, bytes_per_element: int = 4) -> list[DatasetTable]:
    """Read a dataset file into per-table specs and bags.

    The file holds no row counts: a table's rows are taken as its largest id + 1, its
    pooling factor as mean bag length, its access histogram from this batch.
    """
    path = Path(path)
    try:
        with gzip.open(path, "rb") as f:
            indices, offsets, lengths = torch.load(f, weights_only=True)
    except (OSError, EOFError, RuntimeError, ValueError, TypeError) as e:
        raise ShardingError(
            f"{path}: not a readable DLRM dataset file (expected a gzipped torch file of "
            f"(indices, offsets, lengths)): {e}"
        ) from e
    if lengths.dim() != 2:
        raise ShardingError(f"{path}: lengths must be [T, B], got shape {tuple(lengths.shape)}")
    num_tables, batch = lengths.shape
    if offsets.numel() != num_tables * batch + 1:
        raise ShardingError(
            f"{path}: offsets has {offsets.numel()} entries, expected T*B+1 = "
            f"{num_tables * batch + 1} for lengths of shape {tuple(lengths.shape)}"
        )
    if int(offsets[-1]) != indices.numel():
        raise ShardingError(
            f"{path}: offsets end at {int(offsets[-1])} but there are {indices.numel()} indices"
        )
    indices = indices.long()
    offsets = offsets.long()
    out = []
    for t in range(num_tables):
        bag_offsets = offsets[t * batch : (t + 1) * batch + 1]
        ids = indices[bag_offsets[0] : bag_offsets[-1]]
        rows = int(ids.max()) + 1 if ids.numel() else 1
        spec = TableSpec(
            name=f"dlrm_t{t}",
            rows=rows,
            dim=dim,
            pooling_factor=float(lengths[t].float().mean()),
            access_hist=access_histogram(ids),
            bytes_per_element=bytes_per_element,
        )
        out.append(DatasetTable(spec, ids.clone(), bag_offsets - bag_offsets[0]))
    return out


def save_dlrm_dataset(
    path: str | Path, bags: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Write per-table (indices, offsets) bags of one batch in the dataset's file format."""
    batch = bags[0][1].numel() - 1
    all_indices, all_offsets, all_lengths = [], [torch.zeros(1, dtype=torch.int64)], []
    base = 0
    for indices, offsets in bags:
        if offsets.numel() - 1 != batch:
            raise ShardingError("every table needs the same batch size")
        all_indices.append(indices.long())
        all_offsets.append(offsets[1:].long() + base)
        all_lengths.append(offsets[1:] - offsets[:-1])
        base += int(offsets[-1])
    with gzip.open(Path(path), "wb") as f:
        torch.save(
            (torch.cat(all_indices), torch.cat(all_offsets), torch.stack(all_lengths)), f
        )
