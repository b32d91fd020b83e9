"""Pre-training the cost models on measured samples: the data, the loop, the metrics.

    neuroshard pretrain --data compute.jsonl comm.jsonl --out model.pt

Samples are split 80/10/10 into train/validation/test by sample group (a group is one
drawn table set or comm layout; re-measurements of it share the group), features are
z-normalised with training statistics that are saved in the model, and the checkpoint
with the best validation loss is kept (early stopping). The model also records the range
of every compute feature its nets were trained on (``costmodel.FeatureRange``).
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence, Union

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from torchrec_neuroshard.lab.collect import iter_kind, read_rows, shard_from_record
from torchrec_neuroshard.lab.collect_step import DP_KINDS
from torchrec_neuroshard.costmodel import (
    DEVICE_FEATURES,
    CommNet,
    ComputeNet,
    FeatureRange,
    NeuralComm,
    NeuralCostModel,
    Normalizer,
    device_features,
    shard_features,
)
from torchrec_neuroshard.lab.measure_compute import cpu_threads
from torchrec_neuroshard.steparts import (
    COLLECTIVES,
    LinearPart,
    StepParts,
    collective_features,
    dp_features,
    input_dist_features,
)
from torchrec_neuroshard.types import ShardingError

TRAIN_THREADS = 1
"""The nets are small: one intra-op thread trains them fastest, and far faster than two
when another process holds a core (measured 14x on this project's 2-core machines)."""
MIN_SAMPLES = 30
"""Fewest sample groups (of compute, or of comm) pre-training takes: split 80/10/10, that
leaves 3 each to early-stop on and to test with; fewer give meaningless (or NaN) metrics."""
SMALL_GROUP_OFFSET = 500_000
"""Added to a "dp_small" sample's index in its split group (``step_group``): a group apart
from the "dp" sample of the same index."""

# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class ComputeData:
    """Compute samples: shard features x [S, F] with each sample's shards contiguous,
    owning sample of each shard [S], targets y [N, 2] (forward, backward ms), group [N]."""

    x: torch.Tensor
    sample: torch.Tensor
    y: torch.Tensor
    group: np.ndarray

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
        )

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


def load_compute_data(rows: Sequence[dict], pooled: bool = True) -> ComputeData:
    """The compute samples of ``rows`` of one kernel kind (``kernel_rows``)."""
    feats, sample, y, group = [], [], [], []
    for r in kernel_rows(rows, pooled):
        shards = [shard_from_record(s) for s in r["shards"]]
        feats.append(shard_features(shards))
        sample += [len(y)] * len(shards)
        y.append([r["fwd_ms"], r["bwd_ms"]])
        group.append(r["group"])
    if not y:
        flag = "" if pooled else " --pooling none"
        raise ShardingError(f"no {'pooled' if pooled else 'sequence'} compute samples in the data; run `neuroshard collect compute{flag}` first")
    return ComputeData(torch.cat(feats), torch.tensor(sample), torch.tensor(y, dtype=torch.float32), np.asarray(group))


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
    "dp_small" sample ``SMALL_GROUP_OFFSET`` apart from the "dp" sample of its index."""
    return row["world_size"] * 1_000_000 + SMALL_GROUP_OFFSET * (row["kind"] == "dp_small") + row["group"]


def load_step_data(rows: Sequence[dict]) -> dict[str, PartData]:
    """The step parts present in ``rows`` (``neuroshard collect step``), features computed
    from each row's raw quantities by ``steparts``' functions; one row per rank for the
    distributed kinds, one per sample for "dp" and "dp_small" (its forward and backward
    parts; a "dp_small" sample is a group apart from the "dp" sample of its index)."""
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


def fit_step_parts(
    data: dict[str, PartData], seed: int, exclude_world_sizes: Sequence[int] = ()
) -> tuple[StepParts, dict]:
    """Fit every part on its training split (80%, by sample group, as the nets; world sizes
    in ``exclude_world_sizes`` left out) and score it: MAPE % on its test split, and on
    every row of each excluded world size."""
    parts, metrics = {}, {}
    for name, d in data.items():
        train, _, test = split_by_group(d.group, seed)
        seen = ~np.isin(d.world_size, list(exclude_world_sizes))
        part = LinearPart.fit(name, d.x[train & seen], d.y[train & seen])
        parts[name] = part
        scores = {}
        for label, mask in [("test", test & seen)] + [(f"world_size_{w}", d.world_size == w) for w in exclude_world_sizes]:
            if mask.any():
                pred = torch.from_numpy(part.predict(d.x[mask]))
                scores[label] = {"rows": int(mask.sum()), "mape": mape(pred, torch.from_numpy(d.y[mask]))}
        metrics[name] = scores
    return StepParts(parts), metrics


def split_by_group(groups: np.ndarray, seed: int, fractions: tuple[float, float] = (0.8, 0.9)) -> tuple[np.ndarray, ...]:
    """Boolean masks (train, validation, test): whole groups go to one split."""
    unique = np.unique(groups)
    order = np.random.default_rng(seed).permutation(len(unique))
    cut1, cut2 = int(fractions[0] * len(unique)), int(fractions[1] * len(unique))
    parts = [set(unique[order[:cut1]]), set(unique[order[cut1:cut2]]), set(unique[order[cut2:]])]
    return tuple(np.isin(groups, list(p)) for p in parts)


def _pretraining_split(groups: np.ndarray, seed: int, kind: str) -> tuple[np.ndarray, ...]:
    """``split_by_group`` of ``kind`` ("compute" or "comm") samples, refusing too few."""
    count = len(np.unique(groups))
    if count < MIN_SAMPLES:
        raise ShardingError(
            f"{count} {kind} samples are too few to split 80/10/10 into train, validation and test; "
            f"pre-train on at least {MIN_SAMPLES} (`neuroshard collect {kind} --samples {MIN_SAMPLES}` or more)"
        )
    return split_by_group(groups, seed)


# ---------------------------------------------------------------- metrics


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
            for idx in np.array_split(rng.permutation(len(train)), max(1, len(train) // batch)):
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
) -> tuple[ComputeNet, Normalizer, dict]:
    """Fit log ms of (forward, backward) with MSE; keep the best validation checkpoint.
    ``start``: fine-tune a copy of that net with its normaliser instead of a fresh one."""
    torch.manual_seed(seed)
    net, norm = (copy.deepcopy(start[0]), start[1]) if start else (ComputeNet(), Normalizer.fit(train.x))
    log = _fit(
        net, lambda d: ((_compute_predict(net, norm, d) - d.y.log()) ** 2).mean(),
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
def compute_metrics(net: ComputeNet, norm: Normalizer, data: ComputeData) -> dict:
    pred = _compute_predict(net, norm, data).exp()
    total_pred, total = pred.sum(1), data.y.sum(1)
    return {
        "samples": len(data),
        "mape_total": mape(total_pred, total),
        "mape_fwd": mape(pred[:, 0], data.y[:, 0]),
        "mape_bwd": mape(pred[:, 1], data.y[:, 1]),
        "spearman_total": spearman(total_pred, total),
    }


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


def pretrain(
    rows: Sequence[dict],
    epochs: int = 200,
    seed: int = 0,
    exclude_world_sizes: Sequence[int] = (),
    progress: bool = True,
    hardware: dict | None = None,
) -> NeuralCostModel:
    """Train the compute model, the sequence-kernel compute model if ``rows`` hold unpooled
    compute samples (``pooling_mode: none``), and the comm model if they hold comm samples,
    on measured rows, and fit the step parts ``rows`` hold samples of (``fit_step_parts``,
    stored in ``meta["step_parts"]``); the model's meta holds the hardware, the nets'
    constructor args, the range of each compute net's training features and the test metrics (``test.compute``, ``test.sequence_compute``,
    ``test.comm``, ``test.step_parts``).

    ``exclude_world_sizes`` drops those world sizes from training and validation (their
    test samples are still scored: the unseen-world-size check). ``hardware`` overrides
    fields of the rows' hardware record (e.g. a CPU name or core count an older collector
    did not record).
    """
    t0 = time.perf_counter()
    compute_rows = kernel_rows(rows, pooled=True)
    cnet, cnorm, kernel_meta, test = _train_kernel(rows, True, epochs, seed, progress)
    meta = {
        "hardware": {**compute_rows[0]["hardware"], **(hardware or {})},
        "batch_size": compute_rows[0]["batch_size"],
        **kernel_meta,
        "world_sizes_trained": [],
        "seed": seed,
        "test": {"compute": test},
    }
    sequence = None
    if kernel_rows(rows, pooled=False):
        batches = {r["batch_size"] for r in iter_kind(rows, "compute")}
        if len(batches) > 1:
            raise ShardingError(
                f"the pooled and sequence compute samples were measured at batch sizes {sorted(batches)}; "
                "one model predicts at one batch size: collect both at the same scale"
            )
        # started from the pooled net's weights and normaliser (same features, related work):
        # sequence samples are few and slow to measure
        snet, snorm, meta["sequence"], meta["test"]["sequence_compute"] = _train_kernel(
            rows, False, epochs, seed, progress, start=(cnet, cnorm)
        )
        sequence = (snet, snorm)
    comm = None
    comm_rows = list(iter_kind(rows, "comm"))
    if comm_rows:  # a compute-only model (one GPU cannot measure all-to-alls) gets its comm at planning
        mdata = load_comm_data(comm_rows)
        tr, va, te = _pretraining_split(mdata.group, seed, "comm")
        seen = ~np.isin(mdata.world_size, list(exclude_world_sizes))
        if not (tr & seen).any():
            raise ShardingError(
                f"no comm samples left to train on after excluding world sizes {sorted(exclude_world_sizes)}"
            )
        mnet, mnorm, mlog = train_comm(mdata.subset(tr & seen), mdata.subset(va & seen), epochs, seed, progress=progress)
        comm_test = {}
        for d in sorted(set(mdata.world_size.tolist())):
            mask = te & (mdata.world_size == d) if d not in exclude_world_sizes else (mdata.world_size == d)
            comm_test[str(d)] = comm_metrics(mnet, mnorm, mdata.subset(mask))
        comm_test["all_seen"] = comm_metrics(mnet, mnorm, mdata.subset(te & seen))
        comm = NeuralComm(mnet, mnorm, meta["batch_size"])
        meta.update(
            comm_hardware={**comm_rows[0]["hardware"], **(hardware or {})},
            comm_config=mnet.config,
            world_sizes_trained=sorted(set(mdata.world_size[seen].tolist())),
            comm_train={k: v for k, v in mlog.items() if k != "history"},
        )
        meta["test"]["comm"] = comm_test
    step = load_step_data(rows)
    if step:
        parts, step_test = fit_step_parts(step, seed, exclude_world_sizes)
        meta["step_parts"] = parts.to_dict()
        meta["step_parts_world_sizes"] = {n: sorted(set(d.world_size.tolist()) - set(exclude_world_sizes)) for n, d in step.items()}
        meta["test"]["step_parts"] = step_test
    for name, value in _metrics(meta["test"]):
        if not math.isfinite(value):
            raise ShardingError(
                f"test metric {name} is {value}, so the trained model is not returned (nor saved): "
                "check the data for non-finite or zero times, and pre-train on more samples"
            )
    meta["train_seconds"] = round(time.perf_counter() - t0, 1)
    return NeuralCostModel(cnet, cnorm, comm, meta, sequence=sequence)


def _train_kernel(
    rows: Sequence[dict], pooled: bool, epochs: int, seed: int, progress: bool, start: tuple[ComputeNet, Normalizer] | None = None
) -> tuple[ComputeNet, Normalizer, dict, dict]:
    """The compute net of one kernel kind trained on its rows (split 80/10/10 by group),
    from ``start``'s weights and normaliser when given: (net, normaliser, what the model's
    meta records of it, its test metrics)."""
    data, (tr, va, te) = _kernel_split(rows, pooled, seed)
    net, norm, log = train_compute(data.subset(tr), data.subset(va), epochs, seed, progress=progress, start=start)
    mine = kernel_rows(rows, pooled)
    meta = {
        "max_tables_per_kernel": max(len(r["shards"]) for r in mine),
        "bytes_per_element_trained": sorted({int(sh.get("bytes_per_element", 4)) for r in mine for sh in r["shards"]}),
        "feature_range": FeatureRange.fit(data.subset(tr).x).state(),
        "compute_config": net.config,
        "compute_train": {k: v for k, v in log.items() if k != "history"},
    }
    return net, norm, meta, compute_metrics(net, norm, data.subset(te))


def _kernel_split(rows: Sequence[dict], pooled: bool, seed: int) -> tuple[ComputeData, tuple[np.ndarray, ...]]:
    """The compute samples of one kernel kind and their (train, validation, test) masks."""
    data = load_compute_data(rows, pooled)
    return data, _pretraining_split(data.group, seed, "compute")


def add_feature_ranges(model: NeuralCostModel, rows: Sequence[dict]) -> NeuralCostModel:
    """``model`` with the range of each compute net's training features recorded, taken
    from the ``rows`` it was pre-trained on (split with its seed, as ``pretrain`` split
    them): for a model file written before ranges were recorded. The nets are untouched.

    Refuses rows whose pooled training split does not reproduce the model's normaliser
    bit for bit: they are not the samples it was trained on (nor is a calibrated model's
    normaliser, its base's: re-calibrate it from a base that records ranges)."""
    seed = int(model.meta["seed"])
    data, (train, _, _) = _kernel_split(rows, True, seed)
    trained = data.subset(train).x
    fitted = Normalizer.fit(trained)
    if not (torch.equal(fitted.mean, model.compute_norm.mean) and torch.equal(fitted.std, model.compute_norm.std)):
        raise ShardingError(
            "these rows are not the samples the model was pre-trained on: their training split (seed "
            f"{seed}) does not reproduce its feature normaliser; give the data files its `neuroshard pretrain` read"
        )
    meta = {**model.meta, "feature_range": FeatureRange.fit(trained).state()}
    if model.sequence_kernel is not None:
        data, (train, _, _) = _kernel_split(rows, False, seed)
        meta["sequence"] = {**meta["sequence"], "feature_range": FeatureRange.fit(data.subset(train).x).state()}
    return NeuralCostModel(model.compute_net, model.compute_norm, model.comm, meta, model.batch_scale, model.sequence)


def _metrics(tree: dict, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(dotted name, value) of every number in a nested metrics dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _metrics(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def pretrain_files(paths: Sequence[str | Path], **kwargs) -> NeuralCostModel:
    """``pretrain`` on the rows of dataset files; a missing or unreadable file is an error."""
    rows = []
    for path in paths:
        if not Path(path).is_file():
            raise ShardingError(f"data file {str(path)!r} does not exist; give the JSONL(.gz) files `neuroshard collect` wrote")
        try:
            rows += read_rows(path)
        except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ShardingError(f"data file {str(path)!r} is not a readable JSONL(.gz) dataset: {e}") from e
    if not rows:
        raise ShardingError(f"no samples in {[str(p) for p in paths]}")
    return pretrain(rows, **kwargs)
