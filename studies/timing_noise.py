"""How far apart does this machine time one piece of work? A stored plan's device timed
against itself by measured refinement's own timer (``MeasuredRefiner``'s judge timer: the
two copies interleaved round by round, steadied by a reference), under timing protocols of
(rounds, repeats), the protocols interleaved:

    taskset -c 1 python -m studies.timing_noise --pool-seed 3 --devices-of 0 3 --protocols 2x3 --times 4
    taskset -c 1 python -m studies.timing_noise --pool-seed 4 --devices-of 4 --protocols 2x3 4x1 8x1 --times 8

Prints each timing's ratio (the second copy's ms over the first's) and, per protocol, the
root mean square of the log ratios: the noise ``lab.refine._Noise`` reads (research log,
"The refiner measures its own noise"). Draws of ids alternate 0, 1, 0, ...
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from benchmarks.scale import planning_model, stored_plans
from torchrec_neuroshard.lab.refine import MeasuredRefiner


def protocol(text: str) -> tuple[int, int]:
    """'2x3' -> (2 rounds, 3 repeats)."""
    rounds, _, repeats = text.partition("x")
    if not (rounds.isdigit() and repeats.isdigit()):
        raise argparse.ArgumentTypeError(f"protocol {text!r}: give rounds x repeats, such as 2x3")
    return int(rounds), int(repeats)


def main(pool_seed: int, devices: int, of: list[int], protocols: list[tuple[int, int]], times: int) -> None:
    torch.set_num_threads(1)
    task, _ = planning_model(devices, pool_seed)
    plan = stored_plans(devices, pool_seed, ("neuroshard",))["neuroshard"]
    cpu = torch.device("cpu")
    timers = {p: MeasuredRefiner(rounds=p[0], repeats=p[1])._judge_timer(task, plan, cpu) for p in protocols}
    logs: dict[tuple[int, int], list[float]] = {p: [] for p in protocols}
    for k in range(times):
        for p in protocols:
            for device in of:
                start = time.perf_counter()
                ms = timers[p](task, {"plan": plan, "again": plan}, device, k % 2)
                logs[p].append(math.log(ms["again"] / ms["plan"]))
                print(
                    f"time {k}, protocol {p[0]}x{p[1]}, device {device}, draw {k % 2}: {ms['plan']:.1f} ms, "
                    f"again / first {ms['again'] / ms['plan']:.3f} ({time.perf_counter() - start:.0f} s)", flush=True,
                )  # fmt: skip
    for p, x in logs.items():
        print(f"protocol {p[0]}x{p[1]}: {len(x)} timings, root mean square log ratio {100 * math.sqrt(np.mean(np.square(x))):.1f}%")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-seed", type=int, default=4)
    parser.add_argument("--devices", type=int, default=8, help="the stored task's D (benchmarks/results/scale_planned)")
    parser.add_argument("--devices-of", type=int, nargs="+", default=[4], help="the plan's devices timed")
    parser.add_argument("--protocols", type=protocol, nargs="+", default=[(2, 3)], help="rounds x repeats, such as 2x3")
    parser.add_argument("--times", type=int, default=8, help="timings of each device under each protocol")
    args = parser.parse_args()
    main(args.pool_seed, args.devices, args.devices_of, args.protocols, args.times)
