"""Learning a model's batch shift (``costmodel.batchshift``) on pooled kernels measured at
other batches than its compute net's one, the net frozen (``neuroshard pretrain
--batch-shift-data``).

The shift's loss is the compute net's: MSE of the log (forward, backward) ms, here of the
net's price moved by the shift, linear in the batch from the net's. Samples are split
80/10/10 by group as in pre-training; the test split's error is recorded before (linear
alone) and after the shift.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch
from torch import nn

from torchrec_neuroshard.costmodel import NeuralCostModel
from torchrec_neuroshard.costmodel.batchshift import BatchShift, ShiftNet
from torchrec_neuroshard.costmodel.features import Normalizer
from torchrec_neuroshard.costmodel.nets import KernelNet
from torchrec_neuroshard.lab.training import _fit, mape
from torchrec_neuroshard.lab.training_data import ComputeData, kernel_rows, load_compute_data, split_by_group
from torchrec_neuroshard.types import ShardingError


class ShiftedKernel(nn.Module):
    """A frozen compute net's log (forward, backward) ms [N, 2] of kernels at their own
    batches, each shard's embedding moved by ``shift`` (the one trainable part), priced as
    the planner prices it: stretched beyond the trained kernel size, linear in the batch
    from the net's one (``KernelNet.cost``, ``batch_factor``); without a shift, the net's
    linear price alone."""

    def __init__(self, kernel: KernelNet, shift: BatchShift | None) -> None:
        super().__init__()
        self.kernel, self.shift = kernel, shift
        self.net = shift.net if shift is not None else None  # registered: the parameters trained

    def forward(self, data: ComputeData) -> torch.Tensor:
        kernel, log_batch = self.kernel, data.x[:, -1]  # [S]
        x = kernel.trained_range.clamp(data.x[:, :-1]) if kernel.trained_range is not None else data.x[:, :-1]  # [S, F]
        with torch.no_grad():
            embedded = kernel.net.table(kernel.norm(x))  # [S, embed]
        if self.shift is not None:
            embedded = embedded + self.shift.move(x, log_batch)
        pooled = torch.zeros(len(data), embedded.shape[1]).index_add_(0, data.sample, embedded)  # [N, embed]
        count = torch.bincount(data.sample, minlength=len(data)).to(embedded.dtype)  # [N]
        stretch = (count / (kernel.max_tables_per_kernel or math.inf)).clamp_min(1.0)[:, None]  # [N, 1]
        linear = torch.as_tensor(np.log(data.batch_size / kernel.batch_sizes_trained[0]), dtype=embedded.dtype)  # [N]
        return kernel.net.head(pooled / stretch) + stretch.log() + linear[:, None]


def _loss(kernel: ShiftedKernel, data: ComputeData) -> torch.Tensor:
    return ((kernel(data) - data.y.log()) ** 2).mean()


@torch.no_grad()
def _test_mape(kernel: ShiftedKernel, data: ComputeData) -> float:
    """MAPE % of fwd + bwd ms over ``data``."""
    return mape(kernel(data).exp().sum(1), data.y.sum(1))


def with_batch_shift(
    model: NeuralCostModel, rows: Sequence[dict], epochs: int = 200, seed: int = 0, progress: bool = True
) -> NeuralCostModel:
    """``model`` with a batch shift of its pooled kernel learned on the pooled compute
    ``rows`` (at batches other than the one its net was trained at; rows at that batch
    teach the shift nothing), recorded in ``meta["batch_shift"]``, its test error (and the
    linear pricing's) in ``meta["test"]["batch_shift"]``."""
    kernel = model.pooled_kernel
    low, high = kernel.batch_sizes_trained
    if kernel.net.reads_batch or low != high:
        raise ShardingError(
            f"a batch shift is learned over a compute net trained at one batch, but this one learned batches "
            f"{low:,}-{high:,}: pre-train the net on kernels of one batch (--data) and give the other batches' "
            "files as --batch-shift-data"
        )
    data = load_compute_data(kernel_rows(rows, pooled=True), pooled=True, reads_batch=True)
    if len(data) == 0 or (data.batch_size == low).all():
        raise ShardingError(f"--batch-shift-data holds no pooled compute kernels at a batch other than the net's {low:,}")
    train, val, test = split_by_group(data.group, seed)
    if not (train.any() and val.any() and test.any()):
        raise ShardingError(f"{len(np.unique(data.group))} batch-shift samples are too few to split 80/10/10; collect more")
    batches = data.batch_size[train]
    torch.manual_seed(seed)  # the shift net's initial weights
    shift = BatchShift(
        ShiftNet(embed=int(kernel.net.config["embed"])), Normalizer.fit(data.subset(train).x), low,
        (int(batches.min()), int(batches.max())),
    )  # fmt: skip
    shifted, linear = ShiftedKernel(kernel, shift), ShiftedKernel(kernel, None)
    log = _fit(shifted, lambda d: _loss(shifted, d), data.subset(train), data.subset(val), epochs, seed, 64, 1e-3, 20, progress, "batch shift")
    tested = data.subset(test)
    scores = {"samples": len(tested), "mape_total_linear": _test_mape(linear, tested), "mape_total": _test_mape(shifted, tested)}
    meta = {**model.meta, "batch_shift": shift.record(train={k: v for k, v in log.items() if k != "history"})}
    meta["test"] = {**meta.get("test", {}), "batch_shift": scores}
    return NeuralCostModel(
        model.compute_net, model.compute_norm, model.comm, meta, model.batch_scale, model.sequence, (shift.net.eval(), shift.norm)
    )
