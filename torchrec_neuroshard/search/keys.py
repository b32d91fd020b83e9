"""The distinct (table, width) shards one search meets (``Keys``): their ids, embeddings,
single-shard costs, widths and bytes, and the split states (``Widths``) that name them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from torchrec_neuroshard.stepcost import Embedder
from torchrec_neuroshard.types import CostModel, Shard, ShardingKind, Task

Widths = tuple[tuple[int, ...], ...]
"""A split state: the shard widths of each table, in task table order; () for a table the
state leaves out (replicated or split by rows)."""


def state_keys(state: Widths) -> list[tuple[int, int]]:
    """The (table index, width) key of every shard of ``state``."""
    return [(t, w) for t, ws in enumerate(state) for w in ws]


@dataclass
class Keys:
    """The distinct (table, width) shards met during one search call, with their
    embeddings, single-shard costs and sizes; grows as splits create new widths."""

    task: Task
    model: CostModel
    embed: Embedder
    index: dict[tuple[int, int], int] = field(default_factory=dict)
    emb: np.ndarray | None = None
    single: np.ndarray | None = None
    width: np.ndarray | None = None
    size: np.ndarray | None = None
    table: tuple[int, np.ndarray, np.ndarray] | None = None
    """(keys held when built, [T, W] id of each table's width or -1, [W] the widths known)."""

    def ids(self, state: Widths) -> np.ndarray:
        """[S] the id of every shard of ``state``, in ``state_keys`` order, read from a
        table of (table, width) rather than looked up one key at a time (the greedy's
        shard orders: 3,000 lookups a state); a KeyError for a shard not held."""
        counts = np.fromiter(map(len, state), dtype=np.int64, count=len(state))  # [T]
        widths = np.fromiter(itertools.chain.from_iterable(state), dtype=np.int64, count=int(counts.sum()))  # [S]
        tables = np.repeat(np.arange(len(state)), counts)  # [S]
        if self.table is None or self.table[0] != len(self.index):
            held = np.asarray(list(self.index), dtype=np.int64).reshape(-1, 2)  # [K] (table, width) by id
            known = np.unique(held[:, 1])  # [W]
            lut = np.full((len(self.task.tables), len(known)), -1, dtype=np.int64)  # [T, W]
            lut[held[:, 0], np.searchsorted(known, held[:, 1])] = np.arange(len(held))
            self.table = (len(self.index), lut, known)
        _, lut, known = self.table
        col = np.minimum(np.searchsorted(known, widths), max(len(known) - 1, 0))  # [S]
        ids = lut[tables, col] if len(known) else np.full(len(widths), -1)
        missing = (ids < 0) | (known[col] != widths if len(known) else True)
        if missing.any():
            s = int(np.flatnonzero(missing)[0])
            raise KeyError((int(tables[s]), int(widths[s])))
        return ids

    def ensure(self, keys: Sequence[tuple[int, int]]) -> None:
        """Add the (table index, width) ``keys`` not held yet."""
        new = [k for k in dict.fromkeys(keys) if k not in self.index]
        if not new:
            return
        shards = [Shard(self.task.tables[t], w) for t, w in new]
        kind = ShardingKind.COLUMN_WISE  # table-wise shards take the same memory
        emb = self.embed(shards).astype(np.float32)
        single = np.asarray(self.model.compute_cost([[s] for s in shards], self.embed)).sum(1)  # refuses inf / NaN
        for k in new:
            self.index[k] = len(self.index)
        self.emb = _extended(self.emb, emb)
        self.single = _extended(self.single, single)
        self.width = _extended(self.width, np.asarray([w for _, w in new], dtype=np.float64))
        memory = [s.memory_bytes(kind, self.task.batch_size, self.task.num_devices) for s in shards]
        self.size = _extended(self.size, np.asarray(memory, dtype=np.float64))


def _extended(rows: np.ndarray | None, more: np.ndarray) -> np.ndarray:
    """``rows`` with ``more`` after them along the first axis (``more`` alone if None)."""
    return more if rows is None else np.concatenate([rows, more])
