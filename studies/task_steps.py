"""The command line the held-out-task studies share: one step (plan, measure, report, ...)
over pools x D, the measuring steps on one thread as the judge times."""

from __future__ import annotations

import argparse
import logging
from typing import Callable, Sequence

import torch
from threadpoolctl import threadpool_limits


def task_parser(doc: str | None, steps: Sequence[str], devices: Sequence[int], pool_seeds: Sequence[int]) -> argparse.ArgumentParser:
    """A study's parser: ``step`` among ``steps``, ``--devices``, ``--pool-seeds`` and the
    judge's ``--rounds`` (2); a study adds its own options to it."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=list(steps))
    p.add_argument("--devices", type=int, nargs="+", default=list(devices))
    p.add_argument("--pool-seeds", type=int, nargs="+", default=list(pool_seeds))
    p.add_argument("--rounds", type=int, default=2)
    return p


def over_tasks(args: argparse.Namespace, step: Callable[[int, int], None], devices_first: bool = False) -> None:
    """``step(devices, pool_seed)`` on every task of ``args``, pool by pool (D by D with
    ``devices_first``), on one torch and BLAS thread, the package's logging quiet."""
    torch.set_num_threads(1)
    logging.getLogger("torchrec_neuroshard").setLevel(logging.ERROR)
    outer, inner = (args.devices, args.pool_seeds) if devices_first else (args.pool_seeds, args.devices)
    with threadpool_limits(limits=1):
        for a in outer:
            for b in inner:
                step(*((a, b) if devices_first else (b, a)))
