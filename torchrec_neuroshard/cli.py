"""The ``neuroshard`` command: collect / pretrain / plan / bench."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from torchrec_neuroshard.types import ShardingError


def _collect(args: argparse.Namespace) -> None:
    from torchrec_neuroshard import collect
    from torchrec_neuroshard.launch import default_device

    device = default_device()
    t0 = time.perf_counter()
    if args.what == "compute":
        n = collect.collect_compute(args.out, args.samples, device, seed=args.seed, num_threads=args.threads)
        print(f"{args.out}: {n} compute samples ({time.perf_counter() - t0:.0f} s this run)")
    elif args.what == "comm":
        n = collect.collect_comm(args.out, args.world_size, args.samples, seed=args.seed)
        print(f"{args.out}: {n} comm samples, D={args.world_size} ({time.perf_counter() - t0:.0f} s this run)")
    else:
        cvs = collect.compute_noise(args.samples, args.trials, device, seed=args.seed, num_threads=args.threads)
        print(
            f"compute noise over {len(cvs)} samples x {args.trials} trials: "
            f"median CV {100 * statistics.median(cvs):.1f}%, mean {100 * statistics.mean(cvs):.1f}%, "
            f"max {100 * max(cvs):.1f}%"
        )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="neuroshard", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("collect", help="measure pre-training samples on this machine")
    c.add_argument("what", choices=["compute", "comm", "noise"])
    c.add_argument("--out", default="neuroshard_data.jsonl", help="JSONL file to append to")
    c.add_argument("--samples", type=int, default=1000, help="total samples wanted in --out (noise: samples re-measured)")
    c.add_argument("--world-size", type=int, default=2, help="comm: ranks to spawn")
    c.add_argument("--trials", type=int, default=8, help="noise: re-measurements per sample")
    c.add_argument("--threads", type=int, default=1, help="CPU: torch threads for compute")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(func=_collect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ShardingError as e:
        print(f"neuroshard: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
