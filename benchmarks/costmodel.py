"""Accuracy of the shipped cost model on its held-out test split, beside TorchRec's formula.

    python -m benchmarks.costmodel

Prints, on the test split the model was trained without (same split function and seed):
compute fwd+bwd MAPE and Spearman, TorchRec's EmbeddingPerfEstimator on the same shards
(its fused-kernel fwd+bwd compute summed over a device's tables), comm MAPE per device
for every world size, comm MAPE on a world size held out of training entirely (a comm
model re-trained without D=6, and one without D=3, each tested on all that D's samples),
the step parts' linear models (``steparts``: input distribution, collectives, the
data-parallel kernel) on their test split and refitted without D=6 / D=3, and the
measurement noise floor (CV of re-measured samples) when this machine is the model's kind
(else the datasheet's); ``--noise-samples 0 --step-noise-samples 0`` skip the re-measuring.
First it prints the model's hardware beside this machine's. The H200 model (compute only):

    python -m benchmarks.costmodel --model torchrec_neuroshard/pretrained/h200.pt \
        --data torchrec_neuroshard/lab/data/h200_compute.jsonl.gz Targets: compute MAPE <= 8% and Spearman >= 0.95; comm MAPE
<= 10%; unseen world size <= 15%.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from torchrec_neuroshard.lab.collect import compute_noise, comm_noise, iter_kind, read_rows, shard_from_record
from torchrec_neuroshard.lab.collect_step import step_noise
from torchrec_neuroshard.costmodel import PRETRAINED_DIR, NeuralCostModel
from torchrec_neuroshard.hardware import local_hardware, model_vs_machine
from torchrec_neuroshard.lab.launch import default_device
from torchrec_neuroshard.lab.pretrain import fit_step_parts
from torchrec_neuroshard.lab.training import comm_metrics, compute_metrics, mape, spearman, train_comm
from torchrec_neuroshard.lab.training_data import compute_groups, kernel_rows, load_comm_data, load_compute_data, load_step_data, split_by_group
from torchrec_neuroshard.steparts import PART_FEATURES
from torchrec_neuroshard.types import TableSpec

DATA_DIR = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data"
CPU_DATA = (
    "cpu_compute.jsonl.gz", "cpu_compute_fp16.jsonl.gz", "cpu_compute_sequence.jsonl.gz", "cpu_comm.jsonl.gz",
    "cpu_step.jsonl.gz", "cpu_step_dp.jsonl.gz",
)  # fmt: skip
"""The shipped CPU model's training data (Makefile ``model``: ``--data``)."""
CPU_SHIFT_DATA = ("cpu_compute_batch.jsonl.gz", "cpu_compute_batch_high.jsonl.gz")
"""The files the shipped CPU model's batch shift learned from (``--batch-shift-data``)."""


def torchrec_estimates(samples: Sequence[dict], world_size: int = 2, device: str = "cpu") -> list[float]:
    """TorchRec's EmbeddingPerfEstimator fwd+bwd compute (ms) of each compute sample: the
    table-wise fused shard perf of each of its tables at the sample's batch, summed
    (TorchRec's own rating)."""
    from torchrec.distributed.planner import Topology

    topology = Topology(world_size=world_size, compute_device=device, local_world_size=world_size)
    out: dict[int, float] = {}
    for batch in sorted({r["batch_size"] for r in samples}):
        mine = [i for i, r in enumerate(samples) if r["batch_size"] == batch]
        out.update(zip(mine, _torchrec_at_batch([samples[i] for i in mine], batch, topology)))
    return [out[i] for i in range(len(samples))]


def _torchrec_at_batch(samples: Sequence[dict], batch: int, topology: "Topology") -> list[float]:
    """``torchrec_estimates`` of samples measured at one global ``batch``."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator

    from torchrec_neuroshard.tables import module_for_tables

    specs: dict[str, TableSpec] = {}
    for r in samples:
        for s in r["shards"]:
            shard = shard_from_record(s)
            name = f"{s['name']}_w{s['width']}"
            specs[name] = TableSpec(name, shard.table.rows, shard.width, shard.table.pooling_factor, shard.table.access_hist)
    cons = {
        n: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"], pooling_factors=[t.pooling_factor])
        for n, t in specs.items()
    }
    per_rank = batch // topology.world_size  # TorchRec's batch_size is per rank; a table-wise shard sees it x world_size
    enum = EmbeddingEnumerator(
        topology, per_rank, cons, estimator=[EmbeddingPerfEstimator(topology, cons), EmbeddingStorageEstimator(topology, cons)]
    )
    options = enum.enumerate(module_for_tables(specs.values()), [EmbeddingBagCollectionSharder()])
    perf = {o.name: o.shards[0].perf for o in options}
    return [
        sum(perf[f"{s['name']}_w{s['width']}"].fwd_compute + perf[f"{s['name']}_w{s['width']}"].bwd_compute for s in r["shards"])
        for r in samples
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=PRETRAINED_DIR / "cpu.pt")
    p.add_argument("--data", nargs="+", default=[str(DATA_DIR / f) for f in CPU_DATA])
    p.add_argument(
        "--batch-shift-data", nargs="*",
        help="a model with a batch shift: the files it learned from (`pretrain --batch-shift-data`), scored apart "
        "(default: the shipped CPU model's for a model with one, none for one without)",
    )  # fmt: skip
    p.add_argument("--holdout-world-sizes", type=int, nargs="+", default=[6, 3], help="each held out of training in turn")
    p.add_argument("--noise-samples", type=int, default=12, help="0 skips the noise measurement")
    p.add_argument("--step-noise-samples", type=int, default=10, help="step parts re-measured for their noise floor; 0 skips")
    p.add_argument("--step-noise-world-size", type=int, default=4)
    p.add_argument("--noise-trials", type=int, default=5)
    p.add_argument("--epochs", type=int, default=200, help="for the held-out-world-size comm model")
    p.add_argument("--holdout-seeds", type=int, default=3, help="training seeds for the held-out-world-size model")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = NeuralCostModel.load(args.model)
    device = model.hardware.device
    line, mismatch = model_vs_machine(model.hardware, device)
    print(f"{args.model.name}: {line}\n")
    seed = int(model.meta.get("seed", 0))
    rows = [r for path in args.data for r in read_rows(path)]

    test_rows = _compute_table(model, rows, seed, device)
    shift_files = args.batch_shift_data
    if shift_files is None:
        shift_files = [DATA_DIR / f for f in CPU_SHIFT_DATA] if model.batch_shift is not None else []
    _batch_shift_table(model, [r for path in shift_files for r in read_rows(path)], seed)

    if model.comm is None:
        print(
            "\nThis model is compute-only (measured on one GPU; planning pairs it with the "
            "alpha-beta comm stand-in from the topology)."
        )
    elif not any(True for _ in iter_kind(rows, "comm")):
        print("\nNo comm samples in --data: the comm model is not scored.")
    else:
        _comm_tables(args, model, rows, seed)
    here = local_hardware(device)
    quiet = here is not None and mismatch is None
    if model.step_parts is None or not any(r.get("kind") in ("input_dist", "dp") for r in rows):
        print("\nNo step parts in this model or no `collect step` samples in --data: the step parts are not scored.")
    else:
        noise = step_noise(args.step_noise_world_size, args.step_noise_samples, args.noise_trials) if quiet and args.step_noise_samples else None
        _step_tables(args, model, rows, seed, noise)
    if args.noise_samples and quiet:
        _noise(args)
    elif args.noise_samples:
        print(
            f"\nNoise floor: not measured, this machine is not the model's ({line}); see the noise "
            "floor in the model's datasheet (torchrec_neuroshard/lab/data/DATASHEET*.md)"
        )
    _inference_speed(args, model, test_rows)


def _compute_table(model: NeuralCostModel, rows: list[dict], seed: int, device: str) -> list[dict]:
    """Print the compute model's table (ours, TorchRec's estimator, sequence kernels, each
    weight dtype) on the test split; returns the test split's pooled kernel rows."""
    cdata = load_compute_data(rows, reads_batch=model.compute_net.reads_batch)
    _, _, test = split_by_group(cdata.group, seed)
    ours = compute_metrics(model.compute_net, model.compute_norm, cdata.subset(test))
    compute_rows = kernel_rows(rows, pooled=True)
    test_rows = [r for r, keep in zip(compute_rows, test) if keep]
    tr = torch.tensor(torchrec_estimates(test_rows, device=device), dtype=torch.float64)
    truth = cdata.subset(test).y.sum(1).double()
    print(f"## Compute model (test split: {ours['samples']} fused multi-table pooled kernels, unseen table sets; sequence kernels apart)\n")
    tested = cdata.subset(test)
    with torch.no_grad():
        pred = model.compute_net(model.compute_norm(tested.x), tested.sample, len(tested))
    ratio = float((pred.exp().sum(1).double() / truth).median())
    print("| estimator | fwd+bwd MAPE % | Spearman | fwd MAPE % | bwd MAPE % | median predicted / measured |")
    print("|---|---|---|---|---|---|")
    print(f"| NeuroShard (ours) | {ours['mape_total']:.1f} | {ours['spearman_total']:.3f} | {ours['mape_fwd']:.1f} | {ours['mape_bwd']:.1f} | {ratio:.3f} |")
    scale = float((truth / tr).median())
    print(f"| TorchRec EmbeddingPerfEstimator | {mape(tr, truth):.1f} | {spearman(tr, truth):.3f} | - | - | {1 / scale:.3f} |")
    print(f"| TorchRec, rescaled by its median ratio ({scale:.3g}) | {mape(tr * scale, truth):.1f} | {spearman(tr, truth):.3f} | - | - | 1 |")
    sequence_rows = kernel_rows(rows, pooled=False)
    if sequence_rows and model.sequence_kernel is not None:  # the unpooled (EmbeddingCollection) kernel's own net
        sdata = load_compute_data(rows, pooled=False, reads_batch=model.sequence_kernel.net.reads_batch)
        seq = compute_metrics(model.sequence_kernel.net, model.sequence_kernel.norm, sdata.subset(split_by_group(sdata.group, seed)[2]))
        print(f"| NeuroShard, sequence (unpooled) kernels ({seq['samples']}) | {seq['mape_total']:.1f} | {seq['spearman_total']:.3f} | {seq['mape_fwd']:.1f} | {seq['mape_bwd']:.1f} | - |")
    elif sequence_rows:
        print(f"| NeuroShard: this model has no sequence net for the {len(sequence_rows)} sequence kernels | - | - | - | - | - |")
    precision = [r.get("weights_precision", "fp32") for r in test_rows]
    at = [f"at batch {model.batch_size:,}" if r["batch_size"] == model.batch_size else "at other batches" for r in test_rows]
    total = pred.exp().sum(1).double()
    if model.pooled_kernel.correction is not None:  # the rows above price by the net alone
        priced = kernel_prices(model, test_rows)
        print(
            f"| NeuroShard through its kernel correction, as the planner prices | {mape(priced, truth):.1f} | {spearman(priced, truth):.3f} "
            f"| - | - | {float((priced / truth).median()):.3f} |"
        )  # fmt: skip
    for kinds in (precision, at):  # the held-out kernels of each weight dtype, and batch, apart
        for name in sorted(set(kinds)) if len(set(kinds)) > 1 else ():
            keep = torch.tensor([k == name for k in kinds])
            print(f"| NeuroShard, {name} kernels only ({int(keep.sum())}) | {mape(total[keep], truth[keep]):.1f} | {spearman(total[keep], truth[keep]):.3f} | - | - | - |")
    return test_rows


def held_out_kernels(rows: Sequence[dict], seed: int) -> list[dict]:
    """The pooled compute rows of ``rows`` in the test split (``split_by_group`` over their
    split groups, as pretrain splits them)."""
    rows = kernel_rows(rows, pooled=True)
    _, _, test = split_by_group(compute_groups(rows), seed)
    return [r for r, keep in zip(rows, test) if keep]


def kernel_prices(model: NeuralCostModel, rows: Sequence[dict]) -> torch.Tensor:
    """[N] fwd+bwd ms of each compute row's kernel at its batch, as the planner prices it
    (``kernel_ms``: batch shift and kernel correction included)."""
    return torch.tensor([model.kernel_ms([shard_from_record(s) for s in r["shards"]], r["batch_size"]) for r in rows], dtype=torch.float64)


def _batch_shift_table(model: NeuralCostModel, rows: list[dict], seed: int) -> None:
    """Print the batch shift's rows: its test split of the pooled kernels it learned from
    (``rows``, split as ``lab.batch_shift`` split them) priced as the planner prices them,
    with the shift and linearly without it. Refuses a model and rows that do not go together."""
    if (model.batch_shift is None) != (not rows):
        raise SystemExit(
            "--batch-shift-data: give the files a model's batch shift learned from, for a model with one (and only then); "
            f"this model has {'a' if model.batch_shift is not None else 'no'} batch shift"
        )
    if not rows:
        return
    tested = held_out_kernels(rows, seed)
    truth = torch.tensor([r["fwd_ms"] + r["bwd_ms"] for r in tested], dtype=torch.float64)
    for label, priced_by in (("through its batch shift", model), (f"linear from {model.batch_size:,}", model.without_batch_shift())):
        pred = kernel_prices(priced_by, tested)
        print(
            f"| NeuroShard, other batches {label} ({len(tested)}) | {mape(pred, truth):.1f} | {spearman(pred, truth):.3f} "
            f"| - | - | {float((pred / truth).median()):.3f} |"
        )  # fmt: skip


def _comm_tables(args: argparse.Namespace, model: NeuralCostModel, rows: list[dict], seed: int) -> None:
    mdata = load_comm_data(rows)
    mtrain, mval, mtest = split_by_group(mdata.group, seed)
    print("\n## Comm model (per device, test split)\n")
    print("| world size | devices | fwd+bwd MAPE % | fwd MAPE % | bwd MAPE % | Spearman |")
    print("|---|---|---|---|---|---|")
    for d in sorted(set(mdata.world_size.tolist())):
        m = comm_metrics(model.comm.net, model.comm.norm, mdata.subset(mtest & (mdata.world_size == d)))
        print(f"| {d} | {m['devices']} | {m['mape_total']:.1f} | {m['mape_fwd']:.1f} | {m['mape_bwd']:.1f} | {m['spearman_total']:.3f} |")
    for held in args.holdout_world_sizes:
        seen = mdata.world_size != held
        if seen.all():
            print(f"| {held}: no samples of this world size in --data | - | - | - | - | - |")
            continue
        unseen = []
        for s in range(args.holdout_seeds):
            net, norm, _ = train_comm(mdata.subset(mtrain & seen), mdata.subset(mval & seen), args.epochs, seed + s, progress=False)
            unseen.append(comm_metrics(net, norm, mdata.subset(~seen)))
        avg = {k: statistics.mean(m[k] for m in unseen) for k in ("mape_total", "mape_fwd", "mape_bwd", "spearman_total")}
        spread = [m["mape_total"] for m in unseen]
        print(
            f"| {held}, never seen in training (mean of {len(unseen)} training seeds; fwd+bwd "
            f"{min(spread):.1f}-{max(spread):.1f}) | {unseen[0]['devices']} | {avg['mape_total']:.1f} | "
            f"{avg['mape_fwd']:.1f} | {avg['mape_bwd']:.1f} | {avg['spearman_total']:.3f} |"
        )


def _step_tables(
    args: argparse.Namespace, model: NeuralCostModel, rows: list[dict], seed: int, noise: dict[str, list[float]] | None
) -> None:
    """Each step part: the model's fit on its test split, the noise floor, and refits
    without each held-out world size scored on all of that world size's rows."""
    data = load_step_data(rows)
    held = [d for d in args.holdout_world_sizes if any((part.world_size == d).any() for part in data.values())]
    refits = {d: fit_step_parts(data, seed, [d])[1] for d in held}
    noise_col = f"noise floor, median CV % (D={args.step_noise_world_size})"
    print("\n## Step parts (linear, per rank; test split)\n")
    print(f"| part | features | coefficients (ms per feature) | test rows | test MAPE % | {noise_col} | "
          + " | ".join(f"MAPE % at D={d}, unseen" for d in held) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(held))
    for name, d in data.items():
        _, _, test = split_by_group(d.group, seed)
        truth = torch.from_numpy(d.y[test])
        pred = torch.from_numpy(model.step_parts.predict(name, d.x[test]))
        floor = f"{100 * statistics.median(noise[name]):.1f}" if noise and name in noise else "-"
        unseen = " | ".join(f"{refits[h][name][f'world_size_{h}']['mape']:.1f}" for h in held)
        coef = ", ".join(f"{f} {c:.3g}" for f, c in zip(PART_FEATURES[name], model.step_parts.parts[name].coef))
        print(f"| {name} | {', '.join(PART_FEATURES[name])} | {coef} | {int(test.sum())} | {mape(pred, truth):.1f} | {floor} | {unseen} |")
    if noise:
        print(
            f"\nNoise floor: {args.step_noise_samples} fixed samples of each part re-measured {args.noise_trials} times, "
            "interleaved; one CV per (sample, rank) for the collectives and the input distribution."
        )


def _noise(args: argparse.Namespace) -> None:
    """The measurement noise floor on this machine (the model's own kind)."""
    device = default_device()
    cv = compute_noise(args.noise_samples, args.noise_trials, device)
    print(f"\nNoise floor, compute: median CV {100 * statistics.median(cv):.1f}% "
          f"(mean {100 * statistics.mean(cv):.1f}%) over {len(cv)} samples x {args.noise_trials} re-measurements")
    for d in (2, *args.holdout_world_sizes):
        cv = comm_noise(d, args.noise_samples, args.noise_trials)
        print(f"Noise floor, comm D={d}: median CV {100 * statistics.median(cv):.1f}% "
              f"(mean {100 * statistics.mean(cv):.1f}%) over {len(cv)} sample-devices x {args.noise_trials}")


def _inference_speed(args: argparse.Namespace, model: NeuralCostModel, test_rows: list[dict]) -> None:
    shards = [shard_from_record(s) for r in test_rows for s in r["shards"]][:10_000]
    devices = [[s] for s in shards] * (10_000 // max(1, len(shards)) + 1)
    devices = devices[:10_000]
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        model.compute_cost(devices)
        times.append(time.perf_counter() - t0)
    pooled = model.embed_shards([d[0] for d in devices])
    head = []
    for _ in range(20):
        t0 = time.perf_counter()
        model.device_cost(pooled)
        head.append(time.perf_counter() - t0)
    print(
        f"\nBatched inference, 10,000 device-shards in one call: compute_cost {1e3 * statistics.median(times):.1f} ms "
        f"(features + nets), device_cost on pooled embeddings (the search's hot path) "
        f"{1e3 * statistics.median(head):.2f} ms; medians of 5 and 20 calls"
    )
    meta = model.meta
    size_kb = args.model.stat().st_size / 1024
    params = sum(p.numel() for p in model.compute_net.parameters()) + (sum(p.numel() for p in model.comm.net.parameters()) if model.comm is not None else 0)
    print(f"\nModel {args.model.name}: {params:,} parameters, {size_kb:.0f} KiB, trained in {meta['train_seconds']} s "
          f"on samples measured on {model.hardware.describe()}, batch {meta['batch_size']}, "
          f"world sizes {meta['world_sizes_trained']}")


if __name__ == "__main__":
    main()
