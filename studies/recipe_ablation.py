"""Which of the shipped CPU model's training files costs it the ranking of held-out devices.

    python -m studies.recipe_ablation

``pretrained/cpu.pt`` learns from the 10,000 kernels at the benchmark's batch (4,096) and
from batch-varied, fp16 and sequence kernels; a model of the first file alone ranks the
devices of the scale benchmark's held-out plans better (``studies.device_error``). Here the
recipe is taken apart: each variant is pre-trained as ``make model`` trains ``cpu.pt`` (the
same seed, the comm file beside; its step parts are left out: they price no kernel) on a
subset of the compute files, into ``runs/recipe_ablation/`` (resumes), plus

- "levels": all files, each batch-varied file with its own learned log level (forward,
  backward) in training, so the net learns the batch's shape without the collections'
  level (the files were measured in other sessions: the machine's drift);
- the batch-4,096 recipe at seed 1 (how much the seed alone moves the figures);
- "with a batch correction": the batch-4,096 model's price, linear in the batch as it prices
  other batches, times a factor fitted on 80% of the batch-varied kernels (by group) with
  its net frozen, 1 at 4,096 (so its held-out row is that model's): ``KernelCorrection``, a
  second compute net g reading the batch, exp(g(kernel, batch) - g(kernel, 4,096));
- "with its batch shift": the product's batch shift learned the same way (``pretrain
  --batch-shift-data``, ``costmodel.batchshift``): each shard's embedding in the net moved
  by delta(shard, batch) - delta(shard, 4,096), which keeps the search's pricing of a device
  a sum of shard rows (``KernelNet.embed``); over the batch-4,096 net and over the net of
  every 4,096 file (the candidate for ``cpu.pt``).

Per variant: the within-plan error of every held-out judged device (``device_error``: log
measured / priced, less its plan's mean; its sd) at each D, and its error on the
batch-varied kernels by batch (median priced / measured and the sd of the log; the variants
that train on those files see 80% of them), and the error's spread within the device-sized
kernel pairs of ``DEVICE_FILES`` (pools and batches no variant trained on). Writes
``results/recipe_ablation.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch import nn

import torchrec_neuroshard.lab.training as training
from benchmarks.scale_report import MEASURED, PLANNED, cpu_label, last_judged
from studies.device_error import held_out_devices
from torchrec_neuroshard.costmodel import NeuralCostModel, model_named
from torchrec_neuroshard.costmodel.features import Normalizer
from torchrec_neuroshard.costmodel.nets import ComputeNet
from torchrec_neuroshard.lab.collect import read_rows, shard_from_record
from torchrec_neuroshard.lab.collect_devices import whole_pairs
from torchrec_neuroshard.lab.pretrain import pretrain
from torchrec_neuroshard.lab.training_data import ComputeData, load_compute_data, split_by_group
from torchrec_neuroshard.lab.workloads import HELD_OUT_POOL_SEEDS

OUT = Path(__file__).parent / "results" / "recipe_ablation.md"
DATA = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data"
BATCH_FILES = ("cpu_compute_batch", "cpu_compute_batch_high")
SHIPPED, ALL = "the shipped cpu.pt", "cpu.pt's (all)"
RECIPES = {
    ALL: ("cpu_compute", *BATCH_FILES, "cpu_compute_fp16", "cpu_compute_sequence"),
    "no fp16, sequence": ("cpu_compute", *BATCH_FILES),
    "no batch-varied": ("cpu_compute", "cpu_compute_fp16", "cpu_compute_sequence"),
    "batch 4,096 alone": ("cpu_compute",),
    "batch 4,096 alone, seed 1": ("cpu_compute",),
    "all, batch-varied files' levels learned": ("cpu_compute", *BATCH_FILES, "cpu_compute_fp16", "cpu_compute_sequence"),
    "batch 4,096 alone, with its batch shift": ("cpu_compute",),
    "no batch-varied, with its batch shift": ("cpu_compute", "cpu_compute_fp16", "cpu_compute_sequence"),
}
DEVICE_FILES = ("cpu_compute_devices", "cpu_compute_devices_seed1")
"""Device-sized kernels (16-128 tables of pools 10-19, batch 1,032-16,336) timed in pairs: no variant trains on them."""
CORRECTED = "batch 4,096 alone"
"""The variant the batch correction is fitted on."""
SHIFTED = "with its batch shift"
"""Recipes whose name holds this learn the product's batch shift on ``BATCH_FILES``
(``pretrain(batch_shift_rows=)``, ``costmodel.batchshift``)."""
BATCH_BINS = (256, 2048, 8192, 65537)
SESSION = 1_000_000
"""A compute row's group is offset by its file's index x this where files get levels."""


@contextlib.contextmanager
def file_levels(free: set[int], files: int) -> Iterator[None]:
    """Within: each compute net trains with a learned log level [files, 2] added to the
    price of each sample of a file in ``free`` (its group // ``SESSION``); it is dropped
    after training, so the saved net prices at the other files' level."""
    predict, fit = training._compute_predict, training._fit

    def levelled(net, norm, data):  # noqa: ANN001, ANN202 (training's own signature)
        out = predict(net, norm, data)  # [N, 2] log ms
        levels = getattr(net, "file_levels", None)
        if levels is None:
            return out
        files = data.group // SESSION  # [N]
        mask = torch.as_tensor(np.isin(files, sorted(free)))[:, None]  # [N, 1]
        return out + torch.where(mask, levels[torch.as_tensor(files)], torch.zeros(()))

    def fit_levelled(net, *args, **kwargs):  # noqa: ANN001, ANN202
        if not isinstance(net, ComputeNet):
            return fit(net, *args, **kwargs)
        net.register_parameter("file_levels", torch.nn.Parameter(torch.zeros(files, 2)))
        log = fit(net, *args, **kwargs)
        del net._parameters["file_levels"]
        return log

    training._compute_predict, training._fit = levelled, fit_levelled
    try:
        yield
    finally:
        training._compute_predict, training._fit = predict, fit


def build(name: str, files: tuple[str, ...], out_dir: Path) -> Path:
    """The variant's model file, pre-trained unless it is there."""
    path = out_dir / f"{list(RECIPES).index(name)}.pt"
    if path.exists():
        return path
    levels = "levels" in name
    rows = []
    for k, stem in enumerate((*files, "cpu_comm")):
        for r in read_rows(DATA / f"{stem}.jsonl.gz"):
            offset = SESSION * k if levels and r.get("kind") == "compute" else 0
            rows.append({**r, "group": r["group"] + offset})
    free = {files.index(f) for f in BATCH_FILES} if levels else set()
    shift = [r for f in BATCH_FILES for r in read_rows(DATA / f"{f}.jsonl.gz")] if SHIFTED in name else []
    with file_levels(free, len(files)) if levels else contextlib.nullcontext():
        model = pretrain(rows, seed=1 if "seed 1" in name else 0, hardware={"device_name": "AMD EPYC", "cores": 2}, batch_shift_rows=shift)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save(path)
    return path


def base_prices(model: NeuralCostModel, rows: list[dict]) -> torch.Tensor:
    """(forward, backward) ms [N, 2] of each row's kernel as ``model`` prices a device at the
    row's batch (stretched beyond its trained kernel size and batches: ``device_cost``)."""
    prices = []
    for r in rows:
        at = model.with_batch_size(r["batch_size"])
        prices.append(at.device_cost(at.embed_shards([shard_from_record(s) for s in r["shards"]]).sum(0, keepdims=True))[0])
    return torch.as_tensor(np.array(prices), dtype=torch.float32)


def _at_reference(x: torch.Tensor, reference_batch: int) -> torch.Tensor:
    """Shard features [S, F] (the log batch last) with the batch set to ``reference_batch``."""
    out = x.clone()
    out[:, -1] = float(np.log(reference_batch))
    return out


class KernelCorrection(nn.Module):
    """The log factor [N, 2] g(kernel, its batch) - g(kernel, the reference batch), g a compute net reading the batch."""

    def __init__(self, data: ComputeData, model: NeuralCostModel) -> None:
        super().__init__()
        self.net = ComputeNet(data.x.shape[1], reads_batch=True, stretch_beyond=model.pooled_kernel.max_tables_per_kernel)
        self.norm, self.reference = Normalizer.fit(data.x), model.batch_size

    def forward(self, data: ComputeData) -> torch.Tensor:
        at_reference = _at_reference(data.x, self.reference)
        return self.net(self.norm(data.x), data.sample, len(data)) - self.net(self.norm(at_reference), data.sample, len(data))


CORRECTIONS = {"with a kernel's batch correction": KernelCorrection}
"""The batch corrections fitted here on the batch-4,096 model, by their rows' label (its
batch shift is the product's: a recipe, ``SHIFTED``)."""


def fit_correction(kind: type[nn.Module], model: NeuralCostModel, rows: list[dict], prices: torch.Tensor, seed: int = 0) -> nn.Module:
    """A batch correction of ``kind`` on ``model`` (the module's docstring), fitted on 80% of
    ``rows`` by group; ``prices``: the model's ``base_prices`` of them [N, 2]."""
    data = load_compute_data(rows, reads_batch=True)
    ratio = replace(data, y=data.y / prices)  # [N, 2] measured / priced
    torch.manual_seed(seed)  # the correction's initial weights
    correction = kind(data, model)
    train, val, _ = split_by_group(data.group, seed)
    training._fit(
        correction, lambda d: ((correction(d) - d.y.log()) ** 2).mean(), ratio.subset(train), ratio.subset(val),
        200, seed, 64, 1e-3, 20, False, "batch correction",
    )  # fmt: skip
    return correction


def log_errors(prices: torch.Tensor, rows: list[dict], correction: nn.Module | None = None) -> np.ndarray:
    """[N] log priced / measured of each row's kernel, fwd + bwd: its ``base_prices`` [N, 2], times
    ``correction``'s factor where given."""
    if correction is not None:
        with torch.no_grad():
            prices = prices * correction(load_compute_data(rows, reads_batch=True)).exp()
    return np.log(prices.sum(1).numpy() / np.array([r["fwd_ms"] + r["bwd_ms"] for r in rows]))


def pair_differences(error: np.ndarray, rows: list[dict]) -> np.ndarray:
    """[P] the difference of the log error [N] within each whole pair of ``rows`` (kernels timed back to back)."""
    index = {id(r): i for i, r in enumerate(rows)}
    mine = error[[index[id(r)] for r in whole_pairs(rows)]].reshape(-1, 2)  # [P, 2]
    return mine[:, 0] - mine[:, 1]


def bins_text(error: np.ndarray, rows: list[dict]) -> list[str]:
    """Per batch bin: median priced / measured and the sd of the log error [N]."""
    batch = np.array([r["batch_size"] for r in rows])
    cells = []
    for low, high in zip(BATCH_BINS, BATCH_BINS[1:]):
        mine = error[(batch >= low) & (batch < high)]
        cells.append(f"{np.exp(np.median(mine)):.2f}, {mine.std():.3f}")
    return cells


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 128])
    p.add_argument("--out-dir", type=Path, default=Path("runs/recipe_ablation"))
    args = p.parse_args(argv)
    measured_rows, planned_rows = read_rows(MEASURED), read_rows(PLANNED)
    varied = [r for f in BATCH_FILES for r in read_rows(DATA / f"{f}.jsonl.gz")]
    devices = [read_rows(DATA / f"{f}.jsonl.gz") for f in DEVICE_FILES]
    pools = list(HELD_OUT_POOL_SEEDS[:3])
    lines = []
    for name, files in {SHIPPED: RECIPES[ALL], **RECIPES}.items():
        path = "cpu" if name == SHIPPED else str(build(name, files, args.out_dir))
        model = model_named(path)
        sds = [held_out_devices(path, d, pools, measured_rows, planned_rows)[0].std() for d in args.devices]
        varied_prices, device_prices = base_prices(model, varied), [base_prices(model, rows) for rows in devices]
        corrections = {"": None} | ({label: fit_correction(kind, model, varied, varied_prices) for label, kind in CORRECTIONS.items()} if name == CORRECTED else {})
        for label, correction in corrections.items():
            pairs = np.concatenate([pair_differences(log_errors(prices, rows, correction), rows) for prices, rows in zip(device_prices, devices)])
            learned = correction is not None or SHIFTED in name
            label, trained = (name if correction is None else f"{name}, {label}"), (*files, *BATCH_FILES) if learned else files
            lines.append(
                f"| {label} | {', '.join(trained)} | " + " | ".join(f"{sd:.3f}" for sd in sds)
                + " | " + " | ".join(bins_text(log_errors(varied_prices, varied, correction), varied)) + f" | {pairs.std():.3f} |"
            )  # fmt: skip
    judged_on = {d: sorted({cpu_label(last[0].get("cpu")) for p in pools if (last := last_judged(measured_rows, p, d))}) for d in args.devices}
    bins = [f"batch {low:,}-{high - 1:,}" for low, high in zip(BATCH_BINS, BATCH_BINS[1:])]
    text = "\n".join([
        "# Which training file costs the CPU model its ranking of devices", "",
        f"`python -m studies.recipe_ablation`; written {datetime.date.today()} from the committed rows of `benchmarks.scale` "
        f"(held-out pools {', '.join(map(str, pools))}, each task's last judged run, the devices of plans without row splits or "
        "replicas). Each variant: `pretrain` (seed 0 unless named) on the compute files listed and `cpu_comm`. Held-out: the sd "
        "of log(measured / priced) less its plan's mean. Batch-varied: the 3,300 kernels of "
        f"{' and '.join(BATCH_FILES)}, median priced / measured and sd of the log. Device pairs: the "
        f"{sum(len(whole_pairs(rows)) // 2 for rows in devices)} whole pairs of {' and '.join(DEVICE_FILES)} (16-128 tables of "
        "pools 10-19 a kernel, batch 1,032-16,336, timed back to back; no variant trains on them), the sd of the difference of "
        "the log error within a pair. The held-out devices were judged on "
        + "; ".join(f"D = {d}: {' and '.join(cpus)}" for d, cpus in judged_on.items()) + ".", "",
        "| variant | compute files | " + " | ".join(f"held-out sd, D = {d}" for d in args.devices) + " | " + " | ".join(bins) + " | device pairs, sd |",
        "|---|---|" + "---|" * (len(args.devices) + len(bins) + 1),
        *lines,
    ])  # fmt: skip
    OUT.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
