"""The judge's final round (issue 43, item 2): each plan's slowest devices, as the passes
found them, built together and timed side by side in the same rounds.

The passes (``lab.judge``) time one device of every plan at a time, so two plans whose
slowest devices differ are compared across visits minutes apart, and the machine's speed
between those visits is divided out by a reference whose own noise then enters the
comparison (at 27 tables a device one run's steadied and plain readings parted by up to
0.24: research log, "The judge's fixed order"). Here every plan's ``top`` devices of the
highest median over the passes' units (its contenders) are built at once and timed in
interleaved rounds, every (plan, device) once a round in a drawn order: a plan's compute
is its slowest contender, and plans are compared round by round, seconds apart, with no
reference. The rows carry ``stage`` = ``FINAL``; ``judgement.final_judgements`` reads them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Sequence

import numpy as np
import torch

from torchrec_neuroshard.lab.evaluate import on_kernels
from torchrec_neuroshard.lab.judge import CPU, FINAL, DeviceWork, JudgeConfig, build_order, time_works
from torchrec_neuroshard.lab.judgement import Judged
from torchrec_neuroshard.lab.measure_compute import Lookups
from torchrec_neuroshard.types import Plan, Task

VISIT = 1_000_000
"""The final round's visit index for the judge's drawn orders (``judge.round_orders``), apart
from every pass's visits."""


def contenders(judged: Mapping[str, Judged], top: int) -> dict[str, list[int]]:
    """Each plan's ``top`` devices of the highest median over the passes' units, slowest first."""
    if top < 1:
        raise ValueError(f"final round: top is {top}: give at least 1 device a plan")
    return {name: [int(d) for d in np.argsort(-m.per_device, kind="stable")[:top]] for name, m in judged.items()}


def free_memory_bytes() -> int:
    """This machine's memory not in use now (the final round builds every contender at once)."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def time_final(
    task: Task,
    plans: Mapping[str, Plan],
    chosen: Mapping[str, Sequence[int]],
    draws: Sequence[Mapping[str, Lookups]],
    config: JudgeConfig,
    on: torch.device = CPU,
    memory_bytes: float | None = None,
    rounds: int | None = None,
) -> list[dict]:
    """Every plan's ``chosen`` devices built at once and timed in ``rounds`` rounds a draw
    (default ``config.rounds``: one visit, so more rounds cost little); a row per (draw,
    plan, device) as the passes' rows, with ``stage`` = ``FINAL`` and ``pass`` -1. Refused
    where the contenders' bytes (``Plan.device_memory``) exceed ``memory_bytes``."""
    need = sum(plans[n].device_memory(on_kernels(task, plans[n]).tables, task.batch_size)[d] for n, ds in chosen.items() for d in ds)
    if memory_bytes is not None and need > memory_bytes:
        raise ValueError(
            f"final round: {len(chosen)} plans' contenders need {need / 2**30:.1f} GiB at once, {memory_bytes / 2**30:.1f} GiB "
            "free: give fewer devices a plan (top) or fewer plans"
        )
    keys = [f"{name}@{d}" for name, ds in chosen.items() for d in ds]
    built = {key: _work(task, plans, key, on) for key in build_order(keys, VISIT, config.order)}
    timed = dataclasses.replace(config, rounds=rounds or config.rounds)
    rows = time_works({key: built[key] for key in keys}, -1, draws, timed, VISIT, on)
    return [{**r, **_named(r["planner"]), "stage": FINAL, "pass": -1} for r in rows]


def _work(task: Task, plans: Mapping[str, Plan], key: str, on: torch.device) -> DeviceWork:
    named = _named(key)
    return DeviceWork(task, plans[named["planner"]], named["device"], on)


def _named(key: str) -> dict:
    name, device = key.rsplit("@", 1)
    return {"planner": name, "device": int(device)}
