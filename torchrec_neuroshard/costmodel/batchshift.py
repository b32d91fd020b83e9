"""The batch shift: how a shard's embedding in a compute net trained at one batch moves with
the kernel's global batch (``neuroshard pretrain --batch-shift-data``).

A compute net trained at one batch, the reference, prices any other batch linearly from it
(``KernelNet.batch_factor``), and small batches cost more a sample than that. Training the
net on kernels across batches directly learns the batch but costs it the ranking of
device-sized kernels at the reference (studies/results/recipe_ablation.md). The shift is
learned over the frozen net instead: each shard's embedding moves by
delta(shard, batch) - delta(shard, reference) before the head pools the shards, on top of
the linear factor. So at the reference the model prices exactly as its net, and a device's
price stays a sum of shard rows (the search's pricing). Batches beyond the ones the shift
learned are read as the nearest learned one (the linear factor carries on). It shifts the
pooled kernel only; the sequence kernel prices other batches linearly. A calibrated model
keeps its base's shift, around the batch its net is tuned at (``lab.fine_tune``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from torchrec_neuroshard.costmodel.features import Normalizer, feature_names
from torchrec_neuroshard.costmodel.nets import ComputeNet, mlp
from torchrec_neuroshard.types import ShardingError


class ShiftNet(nn.Module):
    """Normalised shard features with the log batch last [S, F + 1] -> each shard's
    embedding delta [S, embed] (``embed``: the width of the compute net it shifts)."""

    def __init__(self, num_features: int = len(feature_names(True)), hidden: int = 128, embed: int = 64) -> None:
        super().__init__()
        if num_features != len(feature_names(True)):
            raise ValueError(f"a shift net reads the shard features and the log batch ({len(feature_names(True))}), not {num_features}")
        self.config = {"num_features": num_features, "hidden": hidden, "embed": embed}
        self.net = mlp([num_features, hidden, hidden, embed])

    def forward(self, x_norm: torch.Tensor) -> torch.Tensor:
        return self.net(x_norm)


@dataclass(frozen=True)
class BatchShift:
    """A trained ``ShiftNet`` with the normaliser of its inputs, the batch its compute net
    was trained at (where the shift is 0) and the smallest and largest batch it learned
    from. ``meta["batch_shift"]`` records all but the net and normaliser (``record``)."""

    net: ShiftNet
    norm: Normalizer
    reference_batch: int
    batch_sizes_trained: tuple[int, int]

    def __post_init__(self) -> None:
        low, high = self.batch_sizes_trained
        if not (self.reference_batch > 0 and 0 < low <= high):
            raise ShardingError(
                f"a batch shift needs a positive reference batch and learned batches low <= high, got reference "
                f"{self.reference_batch} and {self.batch_sizes_trained}; re-run `neuroshard pretrain --batch-shift-data`"
            )

    @staticmethod
    def of(net: ShiftNet, norm: Normalizer, record: dict[str, Any]) -> "BatchShift":
        """``net`` with what a model's ``meta["batch_shift"]`` records of it."""
        low, high = record["batch_sizes_trained"]
        return BatchShift(net.eval(), norm, int(record["reference_batch"]), (int(low), int(high)))

    def record(self, **training: Any) -> dict[str, Any]:
        """What a model's ``meta["batch_shift"]`` holds of this shift, with ``training``'s entries."""
        return {
            "config": dict(self.net.config), "reference_batch": self.reference_batch,
            "batch_sizes_trained": list(self.batch_sizes_trained), **training,
        }  # fmt: skip

    def move(self, x: torch.Tensor, log_batch: torch.Tensor) -> torch.Tensor:
        """The shift of each shard's embedding [S, embed] from its features x [S, F] (as the
        compute net reads them) in a kernel of log global batch ``log_batch`` [S] or []:
        delta(shard, batch) - delta(shard, reference), the batch read inside the learned ones."""
        low, high = (math.log(b) for b in self.batch_sizes_trained)
        batch = torch.as_tensor(log_batch, dtype=x.dtype).clamp(low, high).expand(len(x))  # [S]
        reference = torch.full_like(batch, min(max(math.log(self.reference_batch), low), high))  # [S]
        at = lambda b: self.net(self.norm(torch.cat([x, b[:, None]], dim=1)))  # noqa: E731
        return at(batch) - at(reference)


def shifted_log_ms(
    net: ComputeNet, norm: Normalizer, shift: BatchShift | None, x: torch.Tensor, sample: torch.Tensor,
    batch_sizes: np.ndarray, reference_batch: int, stretch_beyond: int | None,
) -> torch.Tensor:  # fmt: skip
    """Log (forward, backward) ms [N, 2] of N kernels at their own batches as a model with
    ``shift`` prices them (``KernelNet.cost`` at each batch; torch, for training): each shard's
    features x [S, F + 1] (the log batch last), owning kernel ``sample`` [S], global batch
    [N]; each shard's embedding moved by the shift (None: not moved), a kernel of more than
    ``stretch_beyond`` shards priced as that many average ones, linear in the batch from the
    ``reference_batch`` the net learned."""
    base_x = x[:, :-1]  # [S, F]
    embedded = net.table(norm(base_x))  # [S, embed]
    if shift is not None:
        embedded = embedded + shift.move(base_x, x[:, -1])
    linear = torch.as_tensor(np.log(batch_sizes / reference_batch), dtype=embedded.dtype)  # [N]
    return net.pooled_log_ms(embedded, sample, len(batch_sizes), stretch_beyond) + linear[:, None]
