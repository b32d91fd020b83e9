"""Refit only the step parts of a saved model on new ``collect step`` rows (or fit them into
a model that has none); its nets stay bit for bit as they are.

    python -m torchrec_neuroshard.lab.refit_steps --model torchrec_neuroshard/pretrained/cpu.pt \
        --data torchrec_neuroshard/lab/data/cpu_step_dp.jsonl.gz [--out cpu.pt]

The parts are fitted as ``pretrain`` fits them (``fit_step_parts`` with the model's seed, no
world size excluded), so a full ``neuroshard pretrain`` on the same rows stores the same
parts. Prints each part's coefficients and test MAPE before (the stored parts, scored on
the new split) and after. Rows measured on other hardware than the model's are refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.pretrain import fit_step_parts
from torchrec_neuroshard.lab.training import mape
from torchrec_neuroshard.lab.training_data import load_step_data, split_by_group
from torchrec_neuroshard.steparts import LinearPart
from torchrec_neuroshard.types import ShardingError

NETS = ("compute_state", "compute_norm", "sequence_state", "sequence_norm", "comm_state", "comm_norm")
"""The checkpoint's entries that must not change."""


def refit(checkpoint: dict, rows: list[dict]) -> tuple[dict, list[str]]:
    """A copy of ``checkpoint`` with meta's step parts and their test metrics refitted on
    ``rows`` (``refit_meta``), and one report line per part."""
    meta, lines = refit_meta(checkpoint["meta"], rows)
    return {**checkpoint, "meta": meta}, lines


def refit_meta(meta: dict, rows: list[dict]) -> tuple[dict, list[str]]:
    """A copy of a model's ``meta`` with its step parts and their test metrics refitted on
    ``rows``, and one report line per part. A stored part of which ``rows`` hold no
    samples is kept as it is (a file of "dp" rows refits the data-parallel parts only)."""
    _check_hardware(meta["hardware"], rows)
    seed = meta["seed"]
    data = load_step_data(rows)
    if not data:
        raise ShardingError("no `collect step` samples in the rows given; pass the files `neuroshard collect step` wrote")
    parts, test = fit_step_parts(data, seed)
    stored = meta.get("step_parts", {})
    lines = []
    for name, d in data.items():
        _, _, held = split_by_group(d.group, seed)
        after = f"{test[name]['test']['mape']:.1f}; coef {[round(c, 4) for c in parts.parts[name].coef]}"
        try:  # the stored part, if its features are still this part's
            old = LinearPart(name, tuple(stored[name]))
        except (KeyError, ShardingError):
            lines.append(f"{name}: {len(d)} rows, test MAPE % (stored part absent or of other features) -> {after}")
            continue
        before = mape(torch.from_numpy(old.predict(d.x[held])), torch.from_numpy(d.y[held]))
        lines.append(f"{name}: {len(d)} rows, test MAPE % {before:.1f}; coef {[round(c, 4) for c in old.coef]} -> {after}")
    kept = sorted(set(stored) - set(data))
    if kept:
        lines.append(f"kept as stored (no samples of them given): {', '.join(kept)}")
    new_meta = {
        **meta,
        "step_parts": {**stored, **parts.to_dict()},
        "step_parts_world_sizes": {
            **meta.get("step_parts_world_sizes", {}),
            **{n: sorted(set(d.world_size.tolist())) for n, d in data.items()},
        },
        "test": {**meta.get("test", {}), "step_parts": {**meta.get("test", {}).get("step_parts", {}), **test}},
    }
    return new_meta, lines


def _check_hardware(model_hardware: dict, rows: list[dict]) -> None:
    """Refuse step rows measured on other hardware than the model's nets (device and its
    name): parts and nets of one model must price one machine."""
    want = (model_hardware.get("device"), model_hardware.get("device_name"))
    other = sorted({(r["hardware"].get("device"), r["hardware"].get("device_name")) for r in rows if "hardware" in r} - {want})
    if other:
        raise ShardingError(
            f"step rows measured on {other}, but the model's nets were measured on {want}; "
            "pass only `collect step` files from the model's hardware"
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--data", required=True, nargs="+", type=Path, help="`collect step` files (others' rows are ignored)")
    p.add_argument("--out", type=Path, help="where to write the refitted model (default: print only)")
    args = p.parse_args(argv)
    checkpoint = torch.load(args.model, map_location="cpu", weights_only=False)
    rows = [r for path in args.data for r in read_rows(path)]
    new, lines = refit(checkpoint, rows)
    print("\n".join(lines))
    for key in NETS:
        if key in checkpoint and key not in new:
            raise ShardingError(f"refit dropped {key!r}")
    if args.out:
        torch.save(new, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
