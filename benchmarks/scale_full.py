"""The at-scale benchmark at FULL size: 856 tables on 8-128 H200s / H100s, every device of
every plan MEASURED on one lent GPU, one device at a time.

    python -m benchmarks.scale_full plan --pool-seeds 2 --devices 16 32 128   # here (CPU): results/scale_full_planned.jsonl.gz
    python -m benchmarks.scale_full measure --device cuda --budget-s 420 --out DIR   # on a lent GPU (benchmarks/gpu/session.py)
    python -m benchmarks.scale_full measure --device cpu --dry-run --out DIR         # here: rows / 64, a couple of devices
    python -m benchmarks.scale_full estimate --pool-seeds 2 --devices 16 32 128      # here: the device-minutes measure needs
    python -m benchmarks.scale_full report                                           # the committed rows' table

The tasks are ``benchmarks.scale``'s (its held-out pools, ``generate_task`` seed 1, per-device
memory 1.3 x an even share) at full size: rows as in the pool, global batch 65,536; a device
of a plan holds about 41 GB at D = 16 and 5 GB at D = 128 (up to the caps: 50 and 12 GB), so
an H100 or H200 holds any device of D >= 16 (pool 2's D = 8 plans reach 83-88 GB of a 100 GB
cap: an H200 only). Plans are made HERE beforehand, on a cuda topology
of the task's memory with 8 GPUs a host (``fullsize.topology_for``), and stored: NeuroShard
(the shipped H200 model, ``fullsize.plan_with``), TorchRec's ``EmbeddingShardingPlanner`` as
its users run it on that topology (its default proposers, its own ``timeout_seconds``; it
may send tables to UVM kernels) and the two heuristics best at the CPU scale (size_lookup,
lookup). A planner that fails is a row with its error. Each row carries the plan's predicted
compute per device (the shipped H200 model, a UVM kernel priced by the shipped UVM pricing:
``fullsize.as_planned``).

``measure`` is ``lab.judge`` on the GPU: each device's shards as the TBEs DMP builds (fused in
HBM, UVM kernels where the plan has them), timed warm with CUDA events, devices in passes of
opposite order, planners interleaved in rounds (as many plans at a time as the GPU's memory
holds). Work runs most valuable first (pool by pool, D in the order of ``DEVICES``: pool 2 at
D = 16, 32, 128 for NeuroShard, TorchRec and size_lookup first) within ``--budget-s``; every device's rows are appended to
``DIR/scale_full_measured.jsonl`` as measured, each with the device's predicted ms beside,
and devices already in ``--resume`` files (rows given back by an earlier session, committed
as ``results/scale_full_measured.jsonl.gz``) are skipped, so a cut-off session loses nothing.
``--dry-run`` (CPU): the same code at rows / 64, batch 4,096, on ``benchmarks.scale``'s stored
CPU plans of the same tasks, 2 devices a task, 1 draw, 1 round, 1 repeat.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import torch
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from benchmarks.fullsize import FULL_SIZE, as_planned, plan_with, topology_for
from benchmarks.scale import POOL_SEEDS, planned_row, scale_task
from benchmarks.scale_report import PLANNED as SCALE_PLANNED
from benchmarks.scale_report import RESULTS, judged_task, last_judged, latest_plans
from torchrec_neuroshard.costmodel import cost_model_for, load_pretrained
from torchrec_neuroshard.lab.collect import append_rows, hardware, read_rows
from torchrec_neuroshard.lab.evaluate import lookup_groups, on_kernels, task_lookups
from torchrec_neuroshard.lab.judge import JudgeConfig, judge_plans
from torchrec_neuroshard.lab.judgement import rank_correlation, ratio_interval, wins
from torchrec_neuroshard.lab.workloads import WorkloadScale
from torchrec_neuroshard.types import Plan

PLANNED = RESULTS / "scale_full_planned.jsonl.gz"
"""The full-size plans, made here (``plan``): a row per (pool, D, planner), the last one wins."""
MEASURED = RESULTS / "scale_full_measured.jsonl.gz"
"""The rows lent GPU sessions gave back, committed: ``measure --resume`` skips their devices."""
ROWS_NAME = "scale_full_measured.jsonl"
REPORT = RESULTS / "scale_full.md"
REPORT_HEAD = """# At scale, full size: plans' compute MEASURED on a GPU

856 tables of the held-out pools (no training kernel came from them), rows as in the pool,
global batch 65,536, planned here beforehand for cuda topologies (NeuroShard on the shipped
h200.pt, TorchRec's default proposers under its own 300 s `timeout_seconds`, size_lookup);
every device of every plan timed on one lent GPU as DMP builds its kernels, with CUDA events,
in 2 passes of opposite device order x 2 draws of ids x 2 rounds (8 units), the plans
built and timed in an order drawn per device and round. A plan's compute is its slowest device (median over units); ratios with a 90%
paired bootstrap interval over units; 'fastest in': the units in which the plan's slowest
device was the least. Predicted: the stored plans' per-device prediction by h200.pt; rank
correlation: Spearman's over the plan's devices, predicted against measured.

"""
REPORT_TAIL = """

Reproduce: here `python -m benchmarks.gpu.bundle`; on a lent GPU (carry .gpu)
`python3 benchmarks/gpu/session.py --budget-s 530 --out $OUT`, which resumes from the
committed rows; here `gzip -c scale_full_measured.jsonl >> benchmarks/results/scale_full_measured.jsonl.gz`
and `python -m benchmarks.scale_full report`.
"""
PLANNERS = ("neuroshard", "torchrec_timeout", "size_lookup", "lookup")
"""Planned and timed; the first three are the target's (``PRIORITY``)."""
PRIORITY = PLANNERS[:3]
HEURISTICS = PLANNERS[2:]
DEVICES = (16, 32, 128, 64, 8)
"""Most valuable first: the target's three D, then 64, then 8 (an H200 only)."""


def full_task(num_devices: int, pool_seed: int, scale: WorkloadScale = FULL_SIZE):
    return scale_task(num_devices, pool_seed, scale)


def plan_task(num_devices: int, pool_seed: int, planners: tuple[str, ...], torchrec_timeout: int) -> list[dict]:
    """``planners`` on one full-size task, each row appended to ``PLANNED`` as it ends."""
    task = full_task(num_devices, pool_seed)
    topology = topology_for(task)
    model = cost_model_for(topology, load_pretrained("h200")).with_batch_size(task.batch_size)
    rows = []
    for name in planners:
        row = {"pool_seed": pool_seed, "devices": num_devices, "planner": name, "rows": "full", "batch": task.batch_size, "hbm_cap_bytes": task.memory_cap_bytes}
        if name == "neuroshard":
            row["model"] = "shipped h200.pt, alpha-beta comm of the topology"
        row = planned_row(row, lambda: plan_with(name, task, model, torchrec_timeout), lambda plan: as_planned(task, model, plan, topology))
        append_rows(PLANNED, [row])
        rows.append(row)
    return rows


# ---------------------------------------------------------------- measure

GPU_JUDGE = JudgeConfig(passes=2, draws=2, rounds=2, repeats=3)
DRY_RUN = JudgeConfig(passes=2, draws=1, rounds=1, repeats=1)
DRY_RUN_DEVICES = 2
"""The dry run times devices 0 and 1 of each task (both passes), on the CPU."""
IDS_S = 95.0
"""Seconds a full-size pool's ids take on the lent H200 machine, both draws (measured
2026-12-04: 94.0, 94.6 and 96.6 s; the estimate's host rates had put it at 13 s)."""
MEMORY_SHARE = 0.8
"""Of the GPU's free memory, what the plans built together at a device may take (as
TorchRec counts bytes); the rest holds the ids, outputs and gradients."""


@dataclasses.dataclass(frozen=True)
class Session:
    """Where and how ``measure`` times: the device, the scale and plans it takes, the judge's
    config, the devices a task times (None: all), and its budget."""

    on: torch.device
    config: JudgeConfig
    budget_s: float
    devices_per_task: int | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.on.type not in ("cpu", "cuda"):
            raise ValueError(f"device {self.on}: measure on cpu (a dry run at rows / 64) or cuda (full size)")
        if self.budget_s <= 0:
            raise ValueError(f"budget {self.budget_s} s: give the seconds this session may spend measuring")

    @property
    def deadline(self) -> float:
        return self.started + self.budget_s

    @property
    def full_size(self) -> bool:
        return self.on.type == "cuda"

    @property
    def planned(self) -> Path:
        """Full-size plans on a GPU; ``benchmarks.scale``'s CPU-scale plans of the same tasks on a CPU."""
        return PLANNED if self.full_size else SCALE_PLANNED

    def task(self, num_devices: int, pool_seed: int):
        return full_task(num_devices, pool_seed, FULL_SIZE if self.full_size else WorkloadScale())

    def memory_bytes(self) -> float | None:
        return MEMORY_SHARE * torch.cuda.mem_get_info(self.on)[0] if self.full_size else None


def hardware_name(on: torch.device) -> str:
    return hardware(on, 1)["device_name"]


def within(deadline: float, visits: Iterable) -> Iterator:
    """``visits`` while the longest one so far still ends before ``deadline`` (monotonic s)."""
    longest = 0.0
    for visit in visits:
        start = time.monotonic()
        if start + longest > deadline:
            print(f"budget: stopped before {visit} (a visit takes up to {longest:.1f} s)", flush=True)
            return
        yield visit
        longest = max(longest, time.monotonic() - start)


def tables_at(task, plans: dict[str, Plan], devices: Sequence[int] | None) -> list[str] | None:
    """The tables ``devices`` of ``plans`` read (None: every device, so every table)."""
    if devices is None:
        return None
    names: set[str] = set()
    for plan in plans.values():
        groups, replicated = lookup_groups(task, plan, [[t.name for t in task.tables]])
        names |= {n for g in groups for d in devices for n, *_ in g.shards[d]} | set(replicated[0])
    return sorted(names)


def measure_task(session: Session, num_devices: int, pool_seed: int, planners: Sequence[str], out: Path, done_rows: list[dict], draws: dict) -> int:
    """The judge over one task's stored plans of ``planners`` on ``session``'s device; each
    device's rows (its predicted ms beside) appended to ``out`` as measured, a (pass, device)
    in ``done_rows`` for the same plans, hardware and config skipped. ``draws`` caches each
    pool's ids. Returns the devices measured."""
    task, planned = session.task(num_devices, pool_seed), latest_plans(read_rows(session.planned), pool_seed, num_devices)
    rows = {n: planned[n] for n in planners if planned.get(n, {}).get("status") == "ok"}
    plans = {n: Plan.from_dict(r["plan"]) for n, r in rows.items()}
    sha = hashlib.sha1(json.dumps({n: rows[n]["plan"] for n in plans}, sort_keys=True).encode()).hexdigest()[:12]
    key = {"pool_seed": pool_seed, "devices": num_devices, "plans_sha": sha, "hardware": hardware_name(session.on), **dataclasses.asdict(session.config)}
    done = {(r["pass"], r["device"]) for r in done_rows if all(r.get(k) == v for k, v in key.items())}
    devices = None if session.devices_per_task is None else list(range(session.devices_per_task))
    if not plans or {(p, d) for p in range(session.config.passes) for d in devices or range(num_devices)} <= done:
        return 0
    if not ids(session, task, pool_seed, tables_at(task, plans, devices), draws):
        return 0
    memory = session.memory_bytes()  # what the ids left
    for name in [n for n, plan in plans.items() if memory is not None and max(plan.device_memory(on_kernels(task, plan).tables, task.batch_size)) > memory]:
        print(f"pool {pool_seed} D={num_devices}: {name}'s largest device needs more than {memory / 1e9:.0f} GB here: not timed", flush=True)
        del plans[name]

    def append(measured: list[dict]) -> None:
        append_rows(out, [{**key, **r, "predicted_ms": rows[r["planner"]]["predicted_ms"][r["device"]]} for r in measured])

    measured = judge_plans(
        task, plans, draws[pool_seed], session.config, done, append,
        progress=lambda it: within(session.deadline, tqdm(it, desc=f"pool {pool_seed} D={num_devices} visits")),
        on=session.on, memory_bytes=memory, devices=devices,
    )  # fmt: skip
    return len({(r["pass"], r["device"]) for r in measured})


def ids(session: Session, task, pool_seed: int, names: list[str] | None, draws: dict) -> bool:
    """``draws[pool_seed]``: each draw's bags of ``names`` (None: all tables) added where
    missing (the same bags whichever are asked for: ``task_lookups``' seeds are the tables'
    indices), sampled on every core; at full size kept on the GPU, so a row block's ids are
    picked there (887M ids, 7 GB a draw). False, drawing nothing, where the budget left at
    full size is less than a pool's ids take (``IDS_S``): the pool is left to the next session."""
    have = draws.setdefault(pool_seed, [{} for _ in range(session.config.draws)])
    missing = [t.name for t in task.tables if (names is None or t.name in names) and t.name not in have[0]]
    if not missing:
        return True
    left = session.deadline - time.monotonic()
    if session.full_size and left < IDS_S:
        print(f"budget: {left:.0f} s left, less than pool {pool_seed}'s ids take ({IDS_S:.0f} s): not drawn", flush=True)
        return False
    t0 = time.monotonic()
    for k, bags in enumerate(have):
        new = task_lookups(task, draw=k, workers=os.cpu_count() or 1, only=set(missing))
        bags.update({n: (i.to(session.on), o.to(session.on)) for n, (i, o) in new.items()})
    print(f"pool {pool_seed}: {session.config.draws} draws of ids for {len(missing)} tables in {time.monotonic() - t0:.1f} s", flush=True)
    return True


# ---------------------------------------------------------------- estimate

H200_ROWS = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data" / "h200_compute.jsonl.gz"
HOST = {"fill_gbps": 500.0, "filter_gelems": 50.0, "visit_s": 0.1}
"""Assumed rates on the lent machine: TBE weights initialised at 500 GB/s on the GPU, a row
block's ids picked on the GPU at 50 G ids/s, 0.1 s of Python and launches a plan's visit
(a pool's ids: ``IDS_S``, measured)."""


def kernel_bound() -> tuple[float, float]:
    """(ms, ms per G looked-up elements) bounding the H200 rows' fused kernels: the 95th
    percentile of the smallest tenth's time, and of the larger half's ms per element."""
    rows = read_rows(H200_ROWS)
    work = np.array([sum(s["pooling_factor"] * r["batch_size"] * s["width"] for s in r["shards"]) for r in rows])  # [kernels]
    ms = np.array([r["fwd_ms"] + r["bwd_ms"] for r in rows])  # [kernels]
    big = work > np.median(work)
    return float(np.quantile(ms[work < np.quantile(work, 0.1)], 0.95)), float(np.quantile(ms[big] / work[big], 0.95) * 1e9)


def device_work(task, plan: Plan, device: int) -> tuple[list[float], float, float]:
    """(elements each kernel of the device looks up a step, its ids' count, row-block ids picked from)."""
    groups, (replicated,) = lookup_groups(task, plan, [[t.name for t in task.tables]])
    kernels, ids, filtered = [], 0.0, 0.0
    for g in (g for g in groups if g.shards[device]):
        shares = [(task.table(n), w, rows) for n, w, _, rows in g.shards[device]]
        kernels.append(sum(t.pooling_factor * task.batch_size * w * r / t.rows for t, w, r in shares))
        ids += sum(t.pooling_factor * task.batch_size * r / t.rows for t, _, r in shares)
        filtered += sum(t.pooling_factor * task.batch_size for t, _, _ in shares) if g.kind.splits_rows else 0.0
    if replicated:
        dense = [task.table(n) for n in replicated]
        kernels.append(sum(t.pooling_factor * task.per_rank_batch * t.dim + 3 * t.rows * t.dim for t in dense))
    return kernels, ids, filtered


def estimate(pool_seed: int, devices: Sequence[int], planners: Sequence[str], config: JudgeConfig) -> None:
    """Device-seconds of ``measure`` on the stored plans, from ``kernel_bound`` and ``HOST``."""
    fixed, per_g = kernel_bound()
    print(f"H200 fused kernel bound: {fixed:.2f} ms + {per_g:.1f} ms per G looked-up elements (fwd+bwd)")
    steps, total = config.draws * config.rounds * (1 + config.repeats), 0.0
    for d in devices:
        task, planned = full_task(d, pool_seed), latest_plans(read_rows(PLANNED), pool_seed, d)
        kernel_s = host_s = 0.0
        for name in (n for n in planners if planned.get(n, {}).get("status") == "ok"):
            plan = Plan.from_dict(planned[name]["plan"])
            weights = plan.device_memory(on_kernels(task, plan).tables, task.batch_size)
            for k in range(d):
                kernels, _, filtered = device_work(task, plan, k)
                kernel_s += config.passes * steps * sum(fixed + per_g * w / 1e9 for w in kernels) / 1e3
                host_s += config.passes * (weights[k] / HOST["fill_gbps"] / 1e9 + HOST["visit_s"] + config.draws * filtered / HOST["filter_gelems"] / 1e9)
        total += kernel_s + host_s
        print(f"D={d}: {config.passes * d} visits x {len(planners)} plans: kernels under {kernel_s:.0f} s, host {host_s:.0f} s")
    count = sum(t.pooling_factor * task.batch_size for t in task.tables)
    print(f"ids of pool {pool_seed} ({count / 1e6:.0f}M a draw): {IDS_S:.0f} s (measured); in all {(total + IDS_S) / 60:.1f} device-minutes (+ start and unpacking)")


def measure(session: Session, work: Sequence[tuple[int, int]], planners: Sequence[str], out: Path, resume: Sequence[Path]) -> None:
    """``measure_task`` over ``work`` ((pool, D), most valuable first) until the budget ends."""
    done_rows = [r for path in [*resume, out] for r in read_rows(path)]
    draws: dict = {}
    for pool_seed, d in work:
        for other in [k for k in draws if k != pool_seed]:
            del draws[other]  # a full-size pool's ids are 14 GB of host memory: one pool at a time
        if time.monotonic() > session.deadline:
            print(f"budget: {session.budget_s:.0f} s spent before pool {pool_seed} D={d}", flush=True)
            break
        n = measure_task(session, d, pool_seed, planners, out, done_rows, draws)
        print(f"pool {pool_seed} D={d}: {n} device visits measured, {time.monotonic() - session.started:.0f} s in", flush=True)


# ---------------------------------------------------------------- report


def report(paths: Sequence[Path]) -> str:
    """Per GPU, pool and D: each plan's compute (its slowest device, median over units), its
    ratio to TorchRec's with the paired interval (NeuroShard's to the faster heuristic's too), the units in which it was the fastest, and
    our model's prediction beside: the slowest device, the per-device error and the rank
    correlation of the plan's devices, predicted against measured. Tasks not measured in full
    are counted."""
    rows = [r for path in paths for r in read_rows(path)]
    lines = [
        "| GPU | pool | D | planner | compute ms | slowest / mean | / TorchRec (90% interval) | / best heuristic | fastest in "
        "| predicted ms | MAPE per device | rank correlation |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    partial = []
    for gpu in sorted({r["hardware"] for r in rows}):
        mine = [r for r in rows if r["hardware"] == gpu]
        for pool_seed, d in sorted({(r["pool_seed"], r["devices"]) for r in mine}):
            judged = judged_task(mine, pool_seed, d)
            last = last_judged(mine, pool_seed, d)
            predicted = {r["planner"]: {} for r in last}
            for r in last:
                predicted[r["planner"]][r["device"]] = r["predicted_ms"]
            partial += [f"{gpu} pool {pool_seed} D={d} {n}: {len(v)} of {d} devices" for n, v in predicted.items() if n not in judged]
            won = wins(judged) if judged else {}
            heuristics = [judged[n] for n in HEURISTICS if n in judged]
            best = min(heuristics, key=lambda h: h.compute_ms) if heuristics else None
            for name, m in judged.items():
                p = np.array([predicted[name][k] for k in range(d)])  # [devices]
                torchrec = judged.get("torchrec_timeout")
                ratio = "-" if torchrec is None else "{:.3f} ({:.3f}-{:.3f})".format(*ratio_interval(m, torchrec))
                ours = "-" if best is None or name != "neuroshard" else "{:.3f} ({:.3f}-{:.3f})".format(*ratio_interval(m, best))
                lines.append(
                    f"| {gpu} | {pool_seed} | {d} | {name} | {m.compute_ms:.2f} | {m.imbalance:.2f} | {ratio} | {ours} | {won[name]} of {m.times.shape[0]} "
                    f"| {p.max():.2f} | {100 * np.mean(np.abs(p / m.per_device - 1)):.1f}% | {rank_correlation(p, m.per_device):.2f} |"
                )
    return "\n".join(lines + ([""] + ["Not measured in full: " + "; ".join(partial)] if partial else []))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["plan", "measure", "estimate", "report"])
    p.add_argument("--devices", type=int, nargs="+", default=list(DEVICES))
    p.add_argument("--pool-seeds", type=int, nargs="+", default=list(POOL_SEEDS))
    p.add_argument("--planners", nargs="+", choices=PLANNERS, help=f"plan: default all; measure: default {' '.join(PRIORITY)}")
    p.add_argument("--torchrec-timeout", type=int, default=300, help="plan: TorchRec's own timeout_seconds")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="measure: cuda (full size) or cpu (rows / 64)")
    p.add_argument("--dry-run", action="store_true", help=f"measure: {DRY_RUN_DEVICES} devices a task, judge {DRY_RUN}")
    p.add_argument("--budget-s", type=float, default=420.0, help="measure: no device visit starts that would end past it")
    p.add_argument("--out", type=Path, help="measure: the folder the rows are appended to (as ROWS_NAME)")
    p.add_argument("--resume", type=Path, nargs="*", default=[MEASURED], help="measure: rows of earlier sessions, their devices skipped; report: the rows")
    args = p.parse_args(argv)
    if args.step == "plan":
        torch.set_num_threads(1)
        with threadpool_limits(limits=1):
            for pool_seed in args.pool_seeds:
                for d in args.devices:
                    plan_task(d, pool_seed, tuple(args.planners or PLANNERS), args.torchrec_timeout)
        return
    if args.step == "report":
        text = report(args.resume)
        print(text)
        REPORT.write_text(REPORT_HEAD + text + REPORT_TAIL)
        return
    if args.step == "estimate":
        estimate(args.pool_seeds[0], args.devices, args.planners or PRIORITY, GPU_JUDGE)
        return
    if args.out is None:
        p.error("measure: give --out DIR (on a lent GPU: $OUT)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("measure --device cuda: no GPU here; a dry run is --device cpu --dry-run")
    config = DRY_RUN if args.dry_run else GPU_JUDGE
    session = Session(torch.device(args.device), config, args.budget_s, DRY_RUN_DEVICES if args.dry_run else None)
    work = [(pool_seed, d) for pool_seed in args.pool_seeds for d in args.devices]
    if args.device == "cpu":
        torch.set_num_threads(1)  # as benchmarks.scale times the CPU: one thread
    measure(session, work, args.planners or PRIORITY, args.out / ROWS_NAME, args.resume)


if __name__ == "__main__":
    main()
