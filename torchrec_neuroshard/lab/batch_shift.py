"""Learning a model's batch shift (``costmodel.batchshift``) on pooled kernels measured at
other batches than its compute net's one, the net frozen (``neuroshard pretrain
--batch-shift-data``).

The shift's loss is the compute net's: MSE of the log (forward, backward) ms, here of the
net's price moved by the shift, linear in the batch from the net's. Samples are split
80/10/10 by group as in pre-training; the test split's error is recorded before (linear
alone) and after the shift.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch
from torch import nn

from torchrec_neuroshard.costmodel import NeuralCostModel
from torchrec_neuroshard.costmodel.batchshift import BatchShift, ShiftNet, shifted_log_ms
from torchrec_neuroshard.costmodel.features import Normalizer
from torchrec_neuroshard.costmodel.nets import KernelNet
from torchrec_neuroshard.lab.training import _fit, mape
from torchrec_neuroshard.lab.training_data import ComputeData, kernel_rows, load_compute_data, split_by_group
from torchrec_neuroshard.types import ShardingError


class ShiftedKernel(nn.Module):
    """A frozen compute net's log (forward, backward) ms [N, 2] of kernels at their own
    batches as the planner prices them (``shifted_log_ms``, the features clamped into the
    net's range), each shard's embedding moved by ``shift``, whose net is the one part
    trained; without a shift, the net's linear price alone."""

    def __init__(self, kernel: KernelNet, shift: BatchShift | None) -> None:
        super().__init__()
        self.kernel, self.shift = kernel, shift
        self.net = shift.net if shift is not None else None  # registered: the parameters trained

    def forward(self, data: ComputeData) -> torch.Tensor:
        kernel, x = self.kernel, data.x
        if kernel.trained_range is not None:
            x = torch.cat([kernel.trained_range.clamp(x[:, :-1]), x[:, -1:]], dim=1)  # [S, F + 1]
        return shifted_log_ms(
            kernel.net, kernel.norm, self.shift, x, data.sample, data.batch_size, kernel.batch_sizes_trained[0],
            kernel.max_tables_per_kernel,
        )  # fmt: skip


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
    frozen = replace(kernel, net=copy.deepcopy(kernel.net).requires_grad_(False))  # no gradients computed for it
    shifted, linear = ShiftedKernel(frozen, shift), ShiftedKernel(frozen, None)
    log = _fit(shifted, lambda d: _loss(shifted, d), data.subset(train), data.subset(val), epochs, seed, 64, 1e-3, 20, progress, "batch shift")
    tested = data.subset(test)
    scores = {"samples": len(tested), "mape_total_linear": _test_mape(linear, tested), "mape_total": _test_mape(shifted, tested)}
    meta = {**model.meta, "batch_shift": shift.record(train={k: v for k, v in log.items() if k != "history"})}
    meta["test"] = {**meta.get("test", {}), "batch_shift": scores}
    return NeuralCostModel(
        model.compute_net, model.compute_norm, model.comm, meta, model.batch_scale, model.sequence, (shift.net.eval(), shift.norm)
    )
