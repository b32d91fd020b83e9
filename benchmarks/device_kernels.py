"""Cost models on device-sized kernels (16-128 tables, ``lab.collect_devices``), held out.

    python -m benchmarks.device_kernels --models torchrec_neuroshard/pretrained/cpu.pt runs/new.pt
    python -m benchmarks.device_kernels --all-pairs --data PAIRS --models ... --name device_kernels_NAME

On the test split of the device pairs (the split ``neuroshard pretrain`` holds out, by
group: a pair is one group), each model's fwd+bwd MAPE and Spearman, its median predicted
/ measured, and on the pairs (two kernels timed in turn, so the machine's drift cancels)
the MAPE of the predicted ratio and how often the model orders the two as measured.
``--all-pairs``: every pair of ``--data`` (files none of the models trained on, such as a
calibrated model's, whose pairs are its own draw). Writes ``results/device_kernels.md``
(``--name``).
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np
import torch

from benchmarks.costmodel import CPU_DATA, DATA_DIR
from torchrec_neuroshard.costmodel import NeuralCostModel
from torchrec_neuroshard.hardware import local_hardware
from torchrec_neuroshard.lab.collect import read_rows, shard_from_record
from torchrec_neuroshard.lab.collect_devices import pairs_apart
from torchrec_neuroshard.lab.training import mape, spearman
from torchrec_neuroshard.lab.training_data import compute_groups, kernel_rows, split_by_group

OUT = Path(__file__).parent / "results" / "device_kernels.md"


def test_pairs(paths: list[Path], seed: int | None) -> list[dict]:
    """The device-pair rows in the test split ``neuroshard pretrain`` makes of ``paths``'
    pooled compute rows (by group, over all of them; every pair when ``seed`` is None),
    partners side by side."""
    rows = kernel_rows(pairs_apart([read_rows(path) for path in paths]), pooled=True)
    groups = compute_groups(rows)
    test = np.ones(len(rows), dtype=bool) if seed is None else split_by_group(groups, seed)[2]
    return sorted((r for r, keep in zip(rows, test) if keep and "pair" in r), key=lambda r: (r["pair"], r["pair_member"]))


def priced_ms(model: NeuralCostModel, rows: list[dict]) -> torch.Tensor:
    """Each row's kernel fwd+bwd ms as the planner prices it (``NeuralCostModel.kernel_ms``:
    features clamped to the trained range, a kernel beyond the trained size stretched) [N]."""
    return torch.tensor([model.kernel_ms([shard_from_record(s) for s in r["shards"]], r["batch_size"]) for r in rows], dtype=torch.float64)


def model_line(path: Path, rows: list[dict]) -> str:
    model = NeuralCostModel.load(path)
    pred, truth = priced_ms(model, rows), torch.tensor([r["fwd_ms"] + r["bwd_ms"] for r in rows], dtype=torch.float64)
    ratio_pred, ratio = pred[0::2] / pred[1::2], truth[0::2] / truth[1::2]  # [pairs]
    agree = float(((ratio_pred > 1) == (ratio > 1)).double().mean())
    return (
        f"| {path} | {model.meta.get('max_tables_per_kernel')} | {len(rows)} | {mape(pred, truth):.1f} | {spearman(pred, truth):.3f} "
        f"| {float((pred / truth).median()):.3f} | {len(ratio)} | {mape(ratio_pred, ratio):.1f} | {100 * agree:.0f}% |"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, nargs="+", required=True)
    p.add_argument(
        "--data", type=Path, nargs="+", default=[DATA_DIR / f for f in CPU_DATA],
        help="the files the models were trained on, the device pairs among them (default the shipped CPU model's)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="the split's seed (pretrain's default)")
    p.add_argument("--all-pairs", action="store_true", help="every pair of --data, not the test split (data no model trained on)")
    p.add_argument("--name", default=OUT.stem, help="the report's file name in results/")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows = test_pairs(args.data, None if args.all_pairs else args.seed)
    which = "Every device pair of the files" if args.all_pairs else f"The device pairs in the test split (seed {args.seed}) of the training files"
    command = " ".join(["python -m benchmarks.device_kernels", *(argv if argv is not None else sys.argv[1:])])
    lines = [
        "# Cost models on device-sized kernels, held out",
        "",
        f"`{command}`; {local_hardware('cpu').describe()}; "
        f"{datetime.date.today().isoformat()}. {which}: kernels of 16-128 tables "
        "from the training pools 10-19, unseen table sets. Kernels beyond a model's trained size are priced by its "
        "linear stretch. Pairs: the two kernels of a pair were timed in turn, so their ratio is free of the machine's drift.",
        "",
        "| model | tables per kernel trained | kernels | fwd+bwd MAPE % | Spearman | median predicted / measured "
        "| pairs | pair ratio MAPE % | pairs ordered as measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [model_line(path, rows) for path in args.models]
    text = "\n".join(lines) + "\n"
    OUT.with_name(f"{args.name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
