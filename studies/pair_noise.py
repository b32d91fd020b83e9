"""How far a device pair's measured ratio moves when the pair is timed again, hours later.

    taskset -c 1 python -m studies.pair_noise run --pairs torchrec_neuroshard/lab/data/cpu_compute_devices_seed1.jsonl.gz --seed 1 --count 30
    python -m studies.pair_noise report --models torchrec_neuroshard/pretrained/cpu.pt runs/cpu_cal_pairs.pt

Issue 43, item 3: on the pairs of device-sized kernels timed on 2026-12-04
(``cpu_compute_devices_seed1``) every model's predicted ratio is 12-13% off the measured one
(``benchmarks.device_kernels``), where the 11-28 pairs read 7%. A pair's two kernels are timed
in turn, so the machine's drift cancels in their ratio; what does not cancel is the noise of
the ratio itself. ``run`` draws the file's first ``--count`` pairs again (the draw of
``collect_devices.pair_rows`` with the file's ``--seed``; the kernels are checked to be the
file's) and times them as the collector did; rows go to ``results/pair_noise.jsonl.gz``
(resumable). ``report`` gives the MAPE between the two timings' ratios of each pair (the
floor under any model's ratio error) and each model's ratio MAPE against either timing, and
what an error of that size does to a plan the model prices level (``level_plan_imbalance``):
the search balances devices by the model, so a device's measured time is off by that
device's kernel error, and the slowest of D such devices sets the plan.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.device_kernels import priced_ms
from torchrec_neuroshard.costmodel import NeuralCostModel
from torchrec_neuroshard.hardware import local_hardware
from torchrec_neuroshard.lab.collect import append_rows, read_rows
from torchrec_neuroshard.lab.collect_devices import pair_rows
from torchrec_neuroshard.lab.workloads import TRAINING_POOL_SEEDS, WorkloadScale

RESULTS = Path(__file__).parent / "results"
ROWS = RESULTS / "pair_noise.jsonl.gz"


def run(pairs_path: Path, seed: int, count: int) -> None:
    """Pairs ``[done, count)`` of ``pairs_path`` timed again; a row per kernel, beside its first timing."""
    first = {(r["pair"], r["pair_member"]): r for r in read_rows(pairs_path)}
    done = {r["pair"] for r in read_rows(ROWS) if r["source"] == pairs_path.name} if ROWS.exists() else set()
    device, scale = torch.device("cpu"), WorkloadScale.for_device(torch.device("cpu"))
    for k in tqdm([k for k in range(count) if k not in done], desc="pairs again"):
        again = pair_rows(k, seed, TRAINING_POOL_SEEDS[1:], scale, device, warmup=3, repeats=9)
        for row in again:
            then = first[(k, row["pair_member"])]
            if [s["name"] for s in row["shards"]] != [s["name"] for s in then["shards"]] or row["batch_size"] != then["batch_size"]:
                raise ValueError(f"pair {k} drawn with --seed {seed} is not the pair in {pairs_path}: give the seed it was collected with")
            stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            append_rows(ROWS, [{**row, "source": pairs_path.name, "ms_then": then["fwd_ms"] + then["bwd_ms"], "timed": stamp}])


def level_plan_imbalance(kernel_sd: float, devices: int, draws: int = 20_000, seed: int = 0) -> float:
    """Expected slowest / mean measured device of a plan whose ``devices`` devices the model
    prices alike, when each device's kernel is off by a log error of sd ``kernel_sd`` (normal,
    independent across devices)."""
    error = np.exp(np.random.default_rng(seed).normal(0.0, kernel_sd, size=(draws, devices)))  # [draws, D]
    return float((error.max(1) / error.mean(1)).mean())


def report(model_paths: list[Path]) -> str:
    rows = sorted(read_rows(ROWS), key=lambda r: (r["source"], r["pair"], r["pair_member"]))
    now = np.array([r["fwd_ms"] + r["bwd_ms"] for r in rows])  # [2P], partners side by side
    then = np.array([r["ms_then"] for r in rows])  # [2P]
    ratio_now, ratio_then = now[0::2] / now[1::2], then[0::2] / then[1::2]  # [P]
    noise_sd = float(np.std(np.log(ratio_now / ratio_then)) / 2)  # one kernel timing's log noise: four in the disagreement
    lines = [
        "# A device pair's ratio timed twice",
        "",
        f"`python -m studies.pair_noise report --models {' '.join(map(str, model_paths))}`; rows timed "
        f"{rows[0]['timed']} to {rows[-1]['timed']} on {local_hardware('cpu').describe()}, first timed by `neuroshard collect devices` "
        f"({', '.join(sorted({r['source'] for r in rows}))}). {len(ratio_now)} pairs.",
        "",
        f"- Level, timed again / first: median {np.median(now / then):.3f} (kernels {np.min(now / then):.2f}-{np.max(now / then):.2f}).",
        f"- A pair's ratio, timed again against first: MAPE {100 * np.mean(np.abs(ratio_now / ratio_then - 1)):.1f}%, "
        f"median {100 * np.median(np.abs(ratio_now / ratio_then - 1)):.1f}%; the faster member the same in "
        f"{np.mean((ratio_now > 1) == (ratio_then > 1)):.0%}.",
        "",
        "A model's kernel log error has the sd of its pairs' log ratio error over the square root of 2 (the two members' errors "
        "independent), net of the second timing's noise; the last columns give the slowest / mean device that error leaves in a plan of D devices the model "
        "prices alike (`level_plan_imbalance`). The first row is one timing's own noise (the sd of the two timings' log ratio "
        "disagreement over 2: four kernel timings in it) and the slowest / mean it shows of D devices that are truly alike.",
        "",
        "| model | ratio MAPE against the first timing | against the second | against their geometric mean | median predicted / measured, second "
        "| kernel log error sd, second | level plan's slowest / mean, D = 8 | D = 32 |",
        "|---|---|---|---|---|---|---|---|",
        _imbalance_row("one timing's noise", noise_sd, "-", "-", "-", "-"),
    ]
    for path in model_paths:
        pred = priced_ms(NeuralCostModel.load(path), rows).numpy()  # [2P]
        ratio_pred = pred[0::2] / pred[1::2]  # [P]
        errors = [f"{100 * np.mean(np.abs(ratio_pred / r - 1)):.1f}%" for r in (ratio_then, ratio_now, np.sqrt(ratio_then * ratio_now))]
        kernel_sd = float(np.sqrt(max(np.var(np.log(ratio_now / ratio_pred)) - 2 * noise_sd**2, 0.0) / 2))
        lines.append(_imbalance_row(str(path), kernel_sd, *errors, f"{np.median(pred / now):.3f}"))
    return "\n".join(lines) + "\n"


def _imbalance_row(name: str, kernel_sd: float, *cells: str) -> str:
    tail = [f"{kernel_sd:.3f}", *(f"{level_plan_imbalance(kernel_sd, d):.3f}" for d in (8, 32))]
    return "| " + " | ".join([name, *cells, *tail]) + " |"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["run", "report"])
    p.add_argument("--pairs", type=Path, help="run: the pair file to time again")
    p.add_argument("--seed", type=int, help="run: the seed the file was collected with (`collect devices --seed`)")
    p.add_argument("--count", type=int, default=30, help="run: its first pairs to time again")
    p.add_argument("--models", type=Path, nargs="*", default=[], help="report: models whose ratio error to set beside the noise")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.step == "run":
        if args.pairs is None or args.seed is None:
            p.error("run needs --pairs and --seed")
        run(args.pairs, args.seed, args.count)
    else:
        text = report(args.models)
        (RESULTS / "pair_noise.md").write_text(text)
        print(text)


if __name__ == "__main__":
    main()
