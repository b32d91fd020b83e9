"""How a kernel's cost follows the batch, against the CPU model's predictions.

    python -m benchmarks.batch_curve [--samples 60] [--trials 2] [--model PATH ...]

The shipped CPU compute net learned the batch from samples at global batches 256-65,536
(``neuroshard collect compute --batch-sizes``); a model trained at one batch prices another
by scaling its prediction linearly (``KernelNet.batch_factor``). Here kernels are MEASURED
at 1/16x to 16x the batch the model predicts at by default (4,096) on this CPU (one
thread, as the collector times: median of 10 after 5 warm-up): compute samples of the
synthetic pool at the CPU scale (rows / 64; seed 7, never trained on), each timed at every
batch in turn, its tables' access histograms those of
that batch, as the planner sees them. Per batch and model (the shipped one, or each
``--model`` file, e.g. an earlier ``cpu.pt``): the MAPE of its prediction as it prices the
batch, and for a model that learned the batch (its net reads it, or a batch shift moves
it), of its 4,096 prediction scaled linearly.
Each kernel is measured ``--trials`` times (all first trials before any second): the
MAPE of a second trial against the first is the noise floor printed beside, and
``ANCHORS`` of the model's own training kernels near each batch are re-measured in every
trial: their median now / stored is the machine's drift since the training data. Rows
(measurements only) append to ``results/batch_curve.jsonl`` (resumable); the table goes to
``results/batch_curve.md``. Run it on a quiet machine: other work inflates timings.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from torchrec_neuroshard.costmodel import NeuralCostModel, load_pretrained
from torchrec_neuroshard.lab.collect import PoolLookups, append_rows, draw_batch, draw_compute_sample, read_rows
from torchrec_neuroshard.lab.measure_compute import measure_compute
from torchrec_neuroshard.lab.workloads import WorkloadScale, synthetic_pool, table_spec
from torchrec_neuroshard.types import Shard

HERE = Path(__file__).parent
OUT = HERE / "results" / "batch_curve.jsonl"
TRAINED_BATCH = 4096
BATCHES = tuple(int(TRAINED_BATCH * f) for f in (1 / 16, 1 / 4, 1, 4, 16))
SEED = 7
TABLES = (1, 8)
DATA_DIR = HERE.parent / "torchrec_neuroshard" / "lab" / "data"
TRAINING = {"cpu_compute_batch.jsonl.gz": (9, (256, 65_536)), "cpu_compute_batch_high.jsonl.gz": (10, (16_384, 65_536))}
"""The shipped model's batch-varied training files: the seed and batch range each was drawn with."""
ANCHORS = 10
"""Training kernels re-measured beside each batch's held-out ones, to tell drift from error."""


def sample_shards(index: int, batch: int, seed: int = SEED) -> list[tuple[int, Shard]]:
    """Sample ``index`` of ``seed`` at global ``batch``: each shard (access histogram of
    that batch) with the index of its pool table."""
    pool = synthetic_pool()
    sample = draw_compute_sample(pool, WorkloadScale(64, TRAINED_BATCH), seed, index, tables=TABLES)
    scale = WorkloadScale(64, batch)
    return [
        (i, Shard(table_spec(pool[i], width, scale, name=f"{pool[i].name}_{k}"), width))
        for k, (i, width) in enumerate(zip(sample.table_ids, sample.widths))
    ]


def measure_sample(index: int, seed: int = SEED, trial: int = 0) -> list[dict]:
    """Sample ``index`` of ``seed`` measured at every batch, one row each."""
    pool, rows = synthetic_pool(), []
    for batch in BATCHES:
        drawn = sample_shards(index, batch, seed)
        lookups = {s.table.name: pool[i].lookups(WorkloadScale(64, batch), seed=i) for i, s in drawn}
        m = measure_compute([s for _, s in drawn], lookups, torch.device("cpu"), num_threads=1)  # the collector's protocol
        rows.append({"sample": index, "trial": trial, "batch_size": batch, "tables": len(drawn), "measured_ms": m.total_ms})
    return rows


def anchors() -> list[dict]:
    """Per batch of ``BATCHES``, the first ``ANCHORS`` training kernels of the batch-varied
    files measured within 1.25x of it, with their stored ms."""
    training = [(name, r) for name in TRAINING for r in read_rows(DATA_DIR / name)]
    found = []
    for batch in BATCHES:
        near = [(name, r) for name, r in training if batch / 1.25 <= r["batch_size"] <= batch * 1.25]
        found += [
            {"anchor": name, "group": r["group"], "batch_size": r["batch_size"], "near": batch, "stored_ms": r["fwd_ms"] + r["bwd_ms"]}
            for name, r in near[:ANCHORS]
        ]  # fmt: skip
    return found


def measure_anchor(anchor: dict, trial: int) -> dict:
    """``anchor``'s training kernel, rebuilt as its collector drew it, measured again."""
    seed, batches = TRAINING[anchor["anchor"]]
    if draw_batch(seed, anchor["group"], batches) != anchor["batch_size"]:
        raise ValueError(f"{anchor['anchor']} sample {anchor['group']} was not drawn with seed {seed} over {batches}")
    pool = synthetic_pool()
    sample = draw_compute_sample(pool, WorkloadScale(64, TRAINED_BATCH), seed, anchor["group"])
    shards, lookups = PoolLookups(pool, WorkloadScale(64, anchor["batch_size"])).shards(sample)
    return {**anchor, "trial": trial, "measured_ms": measure_compute(shards, lookups, torch.device("cpu"), num_threads=1).total_ms}


def measured(rows: list[dict]) -> tuple[list[dict], dict[tuple[int, int], list[float]]]:
    """One row per (sample, batch) and the ms of each of its trials."""
    trials: dict[tuple[int, int], list[float]] = {}
    first = {}
    for r in (r for r in rows if "anchor" not in r):
        key = (r["sample"], r["batch_size"])
        trials.setdefault(key, []).append(r["measured_ms"])
        first.setdefault(key, r)
    return list(first.values()), trials


def predictions(model: NeuralCostModel, rows: list[dict]) -> tuple[list[float], list[float]]:
    """Per row, ``model``'s fwd + bwd ms as it prices the row's batch, and its prediction at
    ``TRAINED_BATCH`` scaled linearly to the row's batch."""
    at_batch, linear = [], []
    for r in rows:
        shards = [s for _, s in sample_shards(r["sample"], r["batch_size"])]
        at_batch.append(sum(model.with_batch_size(r["batch_size"]).compute_cost([shards])[0]))
        trained = sum(model.with_batch_size(TRAINED_BATCH).compute_cost([shards])[0])
        linear.append(trained * r["batch_size"] / TRAINED_BATCH)
    return at_batch, linear


def report(rows: list[dict], models: dict[str, NeuralCostModel]) -> str:
    """Per batch, each model's MAPE against the mean of a kernel's trials as it prices the
    batch (and, where it learned the batch, scaled linearly from 4,096), with the median predicted /
    measured beside; where kernels were measured twice, the MAPE of the second trial
    against the first: the noise floor."""
    kernels, trials = measured(rows)
    truth = [statistics.fmean(trials[(r["sample"], r["batch_size"])]) for r in kernels]
    columns: dict[str, list[float]] = {}
    for label, model in models.items():
        at_batch, linear = predictions(model, kernels)
        columns[label] = at_batch
        if model.compute_net.reads_batch or model.batch_shift is not None:  # what it learned of the batch, and linear
            columns[f"{label}, linear from {TRAINED_BATCH:,}"] = linear
    lines = [
        "| batch (x 4,096) | kernels | noise floor | training kernels now / stored | "
        + " | ".join(f"{c}: MAPE (median pred / measured)" for c in columns) + " |",
        "|---|---|---|---|" + "---|" * len(columns),
    ]
    for batch in BATCHES:
        keep = [i for i, r in enumerate(kernels) if r["batch_size"] == batch]
        if not keep:
            continue
        cells = []
        for predicted in columns.values():
            pairs = [(predicted[i], truth[i]) for i in keep]
            error = 100 * statistics.fmean(abs(p - m) / m for p, m in pairs)
            cells.append(f"{error:.1f}% ({statistics.median(p / m for p, m in pairs):.2f})")
        repeated = [t for t in (trials[(kernels[i]["sample"], batch)] for i in keep) if len(t) > 1]
        noise = f"{100 * statistics.fmean(abs(t[1] - t[0]) / t[0] for t in repeated):.1f}% ({len(repeated)})" if repeated else "-"
        again = [r["measured_ms"] / r["stored_ms"] for r in rows if r.get("near") == batch]
        drift = f"{statistics.median(again):.2f} ({len(again)})" if again else "-"
        lines.append(f"| {batch:,} ({batch / TRAINED_BATCH:g}x) | {len(keep)} | {noise} | {drift} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def collect(path: Path, samples: int, trials: int = 1, seed: int = SEED) -> list[dict]:
    """Samples [0, ``samples``) of ``seed`` at every batch and the ``anchors``, ``trials``
    times (one thread; every kernel's first trial before any second), those not yet in
    ``path`` measured and appended; all of its rows."""
    torch.set_num_threads(1)
    rows = read_rows(path)
    done = {(r.get("anchor"), r.get("group", r.get("sample")), r.get("near"), r.get("trial", 0)) for r in rows}
    training = anchors()
    for trial in range(trials):
        todo = [i for i in range(samples) if (None, i, None, trial) not in done]
        for index in tqdm(todo, desc=f"samples, trial {trial}"):
            append_rows(path, measure_sample(index, seed, trial))
        todo = [a for a in training if (a["anchor"], a["group"], a["near"], trial) not in done]
        append_rows(path, [measure_anchor(a, trial) for a in tqdm(todo, desc=f"training kernels, trial {trial}")])
    return read_rows(path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--trials", type=int, default=2, help="measurements of each kernel, for the noise floor")
    p.add_argument("--model", nargs="*", default=[], help="other model files to score beside the shipped cpu.pt")
    args = p.parse_args(argv)
    models = {"shipped cpu.pt": load_pretrained("cpu"), **{path: NeuralCostModel.load(path) for path in args.model}}
    text = report(collect(OUT, args.samples, args.trials), models)
    others = "".join(f" --model {path}" for path in args.model)
    (HERE / "results" / "batch_curve.md").write_text(
        "# Kernel cost against the batch: the CPU model's predictions against MEASURED kernels\n\n"
        f"`python -m benchmarks.batch_curve --samples {args.samples} --trials {args.trials}{others}` ({time.strftime('%Y-%m-%d')}; "
        f"{load_pretrained('cpu').hardware.describe()}, one thread; compute samples of seed {SEED}, "
        f"{TABLES[0]}-{TABLES[1]} tables each, every one at every batch)\n\n" + text + "\n"
    )
    print(text)


if __name__ == "__main__":
    main()
