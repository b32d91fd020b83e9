"""Training the cost nets on measured samples: the loop (Adam, early stopping on the
validation loss), the compute and comm losses, and the metrics they are scored by."""

from __future__ import annotations

import copy
import math
from typing import Callable

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from torchrec_neuroshard.costmodel.batchshift import BatchShift, shifted_log_ms
from torchrec_neuroshard.costmodel.features import DEVICE_FEATURES, Normalizer
from torchrec_neuroshard.costmodel.nets import CommNet, ComputeNet
from torchrec_neuroshard.lab.measure_compute import cpu_threads
from torchrec_neuroshard.lab.training_data import CommData, ComputeData, Data

TRAIN_THREADS = 1
"""The nets are small: one intra-op thread trains them fastest, and far faster than two
when another process holds a core (measured 14x on this project's 2-core machines)."""

def mape(pred: torch.Tensor, true: torch.Tensor) -> float:
    """Mean absolute percentage error, %."""
    return float(((pred - true).abs() / true.abs().clamp_min(1e-6)).mean() * 100)


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation (no tie correction: measured ms rarely tie)."""
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


# ---------------------------------------------------------------- training


def _compute_predict(net: ComputeNet, norm: Normalizer, data: ComputeData) -> torch.Tensor:
    return net(norm(data.x), data.sample, len(data))


def _comm_predict(net: CommNet, norm: Normalizer, data: CommData) -> torch.Tensor:
    return net(norm(data.x), data.x[:, DEVICE_FEATURES.index("wait_ms")])


def _minibatches(data: Data, batch: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffled minibatches of about ``batch`` samples; two samples timed as a pair stay
    side by side (so the pair loss sees them together)."""
    order = rng.permutation(len(data))
    pair = getattr(data, "pair", None)
    if pair is not None and (pair >= 0).any():
        unit = np.where(pair[order] >= 0, pair[order], -1 - np.arange(len(order)))  # a pair, or the sample alone
        _, first, which = np.unique(unit, return_index=True, return_inverse=True)
        order = order[np.argsort(first[which], kind="stable")]  # each sample where its unit first comes
    return np.array_split(order, max(1, len(data) // batch))


PAIR_WEIGHT = 1.0
"""Weight of the pair loss (log ratio of two kernels timed in turn) beside the level loss."""


def _shifted_predict(net: ComputeNet, norm: Normalizer, data: ComputeData, shift: BatchShift | None) -> torch.Tensor:
    """``_compute_predict``, or with a batch shift the net's price of kernels at their own
    batches moved by it (``shifted_log_ms``; the data carry the batch, the net does not read it)."""
    if shift is None:
        return _compute_predict(net, norm, data)
    return shifted_log_ms(net, norm, shift, data.x, data.sample, data.batch_size, shift.reference_batch, net.stretch_beyond)


def _compute_loss(net: ComputeNet, norm: Normalizer, data: ComputeData, shift: BatchShift | None = None) -> torch.Tensor:
    """MSE of log (forward, backward) ms; plus, for samples timed as a pair, MSE of the log
    ratio of the two: a ratio the machine's drift does not move. ``shift``: the net's price
    moved by a frozen batch shift (``_shifted_predict``)."""
    log_pred, log_true = _shifted_predict(net, norm, data, shift), data.y.log()  # [N, 2]
    loss = ((log_pred - log_true) ** 2).mean()
    pairs = torch.as_tensor(data.pairs())  # [P, 2]
    if len(pairs):
        diff = (log_pred[pairs[:, 0]] - log_pred[pairs[:, 1]]) - (log_true[pairs[:, 0]] - log_true[pairs[:, 1]])  # [P, 2]
        loss = loss + PAIR_WEIGHT * (diff**2).mean()
    return loss


def _fit(
    net: nn.Module,
    loss_of: Callable[[Data], torch.Tensor],
    train: Data,
    val: Data,
    epochs: int,
    seed: int,
    batch: int,
    lr: float,
    patience: int,
    progress: bool,
    desc: str,
) -> dict:
    """Adam on shuffled minibatches of samples; stop after ``patience`` epochs without a
    better validation loss and restore the best weights. Returns the training log."""
    torch.manual_seed(seed)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    best, best_state, since, history = math.inf, copy.deepcopy(net.state_dict()), 0, []
    with cpu_threads(TRAIN_THREADS):
        bar = tqdm(range(epochs), desc=desc, disable=not progress)
        for _ in bar:
            net.train()
            for idx in _minibatches(train, batch, rng):
                loss = loss_of(train.subset(idx))
                opt.zero_grad()
                loss.backward()
                opt.step()
            net.eval()
            with torch.no_grad():
                val_loss = float(loss_of(val))
            history.append(val_loss)
            bar.set_postfix(val_loss=f"{val_loss:.4f}")
            if val_loss < best:
                best, best_state, since = val_loss, copy.deepcopy(net.state_dict()), 0
            else:
                since += 1
                if since >= patience:
                    break
    net.load_state_dict(best_state)
    net.eval()
    return {"val_loss": best, "epochs": len(history), "history": history}


def train_compute(
    train: ComputeData,
    val: ComputeData,
    epochs: int,
    seed: int,
    batch: int = 64,
    lr: float = 1e-3,
    patience: int = 20,
    progress: bool = True,
    start: tuple[ComputeNet, Normalizer] | None = None,
    stretch_beyond: int | None = None,
    shift: BatchShift | None = None,
) -> tuple[ComputeNet, Normalizer, dict]:
    """Fit log ms of (forward, backward) with MSE (and the pair loss, ``_compute_loss``);
    keep the best validation checkpoint. ``start``: fine-tune a copy of that net with its
    normaliser instead of a fresh one (it must read the batch where the data carry it, and
    only then; with ``shift``, the frozen batch shift of ``start``'s model, the data carry
    the batch for the shift). ``stretch_beyond``: a fresh net's ``ComputeNet.stretch_beyond``."""
    torch.manual_seed(seed)
    if start is not None and start[0].reads_batch != train.reads_batch and not (shift is not None and train.reads_batch):
        raise ValueError(f"the starting net has reads_batch={start[0].reads_batch}, the data {train.reads_batch}")
    if start is not None:
        net, norm = copy.deepcopy(start[0]), start[1]
    else:
        net = ComputeNet(train.x.shape[1], reads_batch=train.reads_batch, stretch_beyond=stretch_beyond)
        norm = Normalizer.fit(train.x)
    log = _fit(
        net, lambda d: _compute_loss(net, norm, d, shift),
        train, val, epochs, seed, batch, lr, patience, progress, "compute model" if start is None else "fine-tuning compute",
    )  # fmt: skip
    return net, norm, log


def train_comm(
    train: CommData,
    val: CommData,
    epochs: int,
    seed: int,
    batch: int = 128,
    lr: float = 1e-3,
    patience: int = 15,
    progress: bool = True,
    start: tuple[CommNet, Normalizer] | None = None,
) -> tuple[CommNet, Normalizer, dict]:
    """Fit per-device (forward, backward) ms in log space (+0.1 ms, so near-zero costs do
    not dominate); keep the best validation checkpoint. ``start``: fine-tune a copy of that
    net with its normaliser instead of a fresh one."""
    torch.manual_seed(seed)
    net, norm = (copy.deepcopy(start[0]), start[1]) if start else (CommNet(), Normalizer.fit(train.x))
    log = _fit(
        net, lambda d: ((torch.log(_comm_predict(net, norm, d) + 0.1) - torch.log(d.y + 0.1)) ** 2).mean(),
        train, val, epochs, seed, batch, lr, patience, progress, "comm model" if start is None else "fine-tuning comm",
    )  # fmt: skip
    return net, norm, log


@torch.no_grad()
def compute_metrics(net: ComputeNet, norm: Normalizer, data: ComputeData, shift: BatchShift | None = None) -> dict:
    pred = _shifted_predict(net, norm, data, shift).exp()
    total_pred, total = pred.sum(1), data.y.sum(1)
    metrics = {
        "samples": len(data),
        "mape_total": mape(total_pred, total),
        "mape_fwd": mape(pred[:, 0], data.y[:, 0]),
        "mape_bwd": mape(pred[:, 1], data.y[:, 1]),
        "spearman_total": spearman(total_pred, total),
    }
    pairs = torch.as_tensor(data.pairs())  # [P, 2]
    if len(pairs):
        ratio_pred, ratio = total_pred[pairs[:, 0]] / total_pred[pairs[:, 1]], total[pairs[:, 0]] / total[pairs[:, 1]]
        metrics["pairs"] = len(pairs)
        metrics["pair_ratio_mape"] = mape(ratio_pred, ratio)
        metrics["pair_order_agreement"] = float(((ratio_pred > 1) == (ratio > 1)).double().mean())
    return metrics


@torch.no_grad()
def comm_metrics(net: CommNet, norm: Normalizer, data: CommData) -> dict:
    pred = _comm_predict(net, norm, data)
    return {
        "devices": len(data),
        "mape_total": mape(pred.sum(1), data.y.sum(1)),
        "mape_fwd": mape(pred[:, 0], data.y[:, 0]),
        "mape_bwd": mape(pred[:, 1], data.y[:, 1]),
        "spearman_total": spearman(pred.sum(1), data.y.sum(1)),
    }


