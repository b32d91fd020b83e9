"""Models beyond HBM: NeuroShard vs TorchRec with UVM kernels, PREDICTED by both planners' estimators.

    python -m benchmarks.uvm                       # both planners, 48 tables a task
    python -m benchmarks.uvm --speed --tables 856  # NeuroShard's planning time alone
    python -m benchmarks.uvm --training-pool       # the same on pool 0, as run before 2026-12-02

Five tasks, each from its own held-out pool (``HELD_OUT_POOLS``: no training kernel came
from it; ``generate_task`` on ``synthetic_pool``, rows as in the pool, global batch 65,536;
``--tables`` each) on D = 8, 16, 64 cuda ranks (8 per host),
each rank's HBM set to send 10-90% of the tables' bytes (as TorchRec counts them, fused)
to host memory, and host memory of all the bytes per rank. Both planners plan the same
meta-device model with its pooling factors as constraints and no storage reservation:
TorchRec's ``EmbeddingShardingPlanner`` (its default proposers, analytic estimators; and,
given every table's cache statistics, with its default proposers and with its
``EmbeddingOffloadScaleupProposer``: ``torchrec_plans``) and ``NeuroShardPlanner`` (the
shipped H200 compute model, alpha-beta comm, the shipped UVM pricing).

Every plan is priced two ways, both PREDICTIONS:

- TorchRec's estimator: its ``EmbeddingPerfEstimator`` on the plan's shards (our plans'
  through ``stats.torchrec_sharding_options``), max over ranks of the summed shard perf,
  as TorchRec's partitioner rates a plan;
- our model: ``predict_step`` of the neural model with the shipped UVM pricing, fitted to UVM
  kernels measured on an H200 (``uvmcost.UvmPricedModel``).

Each is the objective one planner minimised, so neither judges the plans; the GPU
measurement of both plans' compute does (``benchmarks.uvm_gpu``). Writes ``results/uvm.jsonl``
and ``results/uvm.md`` (with ``--training-pool``: ``uvm_pool0.*``; ``--speed``: ``uvm_speed_<tables>[_pool0].md``).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections import Counter
from pathlib import Path

from torchrec_neuroshard.lab.workloads import HELD_OUT_POOL_SEEDS, WorkloadScale, generate_task, synthetic_pool

HERE = Path(__file__).parent
TASKS = ((8, 1, 0.5), (8, 4, 0.9), (16, 2, 0.3), (16, 5, 0.7), (64, 3, 0.1))
"""(devices, seed, share of the bytes the HBM cap sends to host memory)."""
HELD_OUT_POOLS = HELD_OUT_POOL_SEEDS[: len(TASKS)]
"""The pool seed each task's tables are drawn from (task k: ``HELD_OUT_POOLS[k]``)."""
SCALEUP_START = 0.1
"""The load factor ``EmbeddingOffloadScaleupProposer`` scales every cache up from (its tests' own)."""


NOTE = """The two estimators disagree most on fused_uvm_caching. TorchRec's prices every lookup of
a cached table at (cache_load_factor x HBM bandwidth + (1 - cache_load_factor) x hbm_to_ddr
bandwidth) / 10 whatever the table's access skew, so a 1% cache costs it almost what fused_uvm
costs. Ours charges each lookup a measured cache-lookup cost and the rows its cache misses (the
hottest rows cached, from the table's access histogram) at the measured UVM rate. The GPU decides:
benchmarks/results/uvm_gpu.md measures both planners' plans of these tasks on an H200.
"""


STATS_NOTE = f"""## TorchRec given cache statistics

TorchRec's planner planned each task twice more, given every table's `CacheStatistics`
(`torchrec_neuroshard.AccessCacheStatistics`: from the same access histograms our planner
reads, the unique rows a batch looks up and the share a cache of the hottest rows misses):
with its default proposers, and with `EmbeddingOffloadScaleupProposer` (every table cached
from load factor {SCALEUP_START}, the caches scaled up by cacheability, as TorchRec's tests run it).
Planning s and ms below in the order TorchRec / with statistics / scaleup / ours; every ms
is a PREDICTION.
"""


def setting(task, to_host: float):
    """The task's cuda topology (HBM for 1 - ``to_host`` of its bytes per rank, host memory
    for all of them), its pooling factors as constraints, and its per-rank batch."""
    from torchrec.distributed.planner import ParameterConstraints, Topology

    world = task.num_devices
    total = sum(t.memory_bytes(task.batch_size, world) for t in task.tables)
    topology = Topology(
        world_size=world, compute_device="cuda", hbm_cap=int((1 - to_host) * total / world), ddr_cap=total,
        local_world_size=min(8, world),
    )  # fmt: skip
    constraints = {t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in task.tables}
    return topology, constraints, task.per_rank_batch


def torchrec_ms(plan, module, topology, constraints, per_rank: int) -> float:
    """TorchRec's ``EmbeddingPerfEstimator`` on ``plan``: max over ranks of summed shard perf."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator
    from torchrec.distributed.planner.utils import build_sharder_data_map, sharder_name

    from torchrec_neuroshard.stats import torchrec_sharding_options

    sharders = [EmbeddingBagCollectionSharder()]
    options, _ = torchrec_sharding_options(plan, module, sharders, topology, per_rank, constraints, {})
    sharder_data = build_sharder_data_map({sharder_name(s.module_type): s for s in sharders})
    EmbeddingPerfEstimator(topology, constraints).estimate(options, sharder_data)
    per_rank_ms = Counter()
    for option in options:
        for shard in option.shards:
            per_rank_ms[shard.rank] += shard.perf.total
    return max(per_rank_ms.values())


def torchrec_plans(task, topology, constraints, per_rank: int, module) -> dict[str, tuple]:
    """TorchRec's planner as its users run it, each name -> (its ``ShardingPlan`` or None
    where it failed, planning seconds, the error or None, the constraints it planned with):

    - ``torchrec``: its defaults (its proposers, analytic estimators);
    - ``torchrec-stats``: given each table's cache statistics (``AccessCacheStatistics``,
      from the access histograms our planner reads), its default proposers;
    - ``torchrec-scaleup``: with those statistics, its ``EmbeddingOffloadScaleupProposer``
      (every table cached from ``SCALEUP_START``, the caches scaled up by cacheability)."""
    from dataclasses import replace

    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.proposers import EmbeddingOffloadScaleupProposer
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.types import CacheParams

    from torchrec_neuroshard.estimators import AccessCacheStatistics

    def stats(factor):
        return {t.name: replace(constraints[t.name], cache_params=CacheParams(load_factor=factor, stats=AccessCacheStatistics(t, task.batch_size))) for t in task.tables}

    runs = {
        "torchrec": (constraints, {}),
        "torchrec-stats": (stats(None), {}),
        "torchrec-scaleup": (stats(SCALEUP_START), {"proposer": EmbeddingOffloadScaleupProposer()}),
    }
    out = {}
    for name, (cons, kwargs) in runs.items():
        reservation = FixedPercentageStorageReservation(0.0)
        t0 = time.perf_counter()
        try:
            plan = EmbeddingShardingPlanner(topology, per_rank, storage_reservation=reservation, constraints=cons, **kwargs).plan(
                module, [EmbeddingBagCollectionSharder()]
            )
            out[name] = (plan, round(time.perf_counter() - t0, 2), None, cons)
        except Exception as e:  # noqa: BLE001 - a baseline's failure is reported, as it failed
            out[name] = (None, round(time.perf_counter() - t0, 2), f"{type(e).__name__}: {str(e).splitlines()[0].strip()}", cons)
    return out


def pool_seeds(training_pool: bool) -> tuple[int, ...]:
    """Each task's pool seed: its held-out pool, or pool 0 (the training pool) for every task."""
    return (0,) * len(TASKS) if training_pool else HELD_OUT_POOLS


def uvm_task(devices: int, seed: int, tables: int, pool_seed: int):
    """``tables`` full-size tables of pool ``pool_seed`` (drawn by ``seed``) on ``devices`` ranks."""
    return generate_task(synthetic_pool(seed=pool_seed), tables, devices, WorkloadScale(1, 65_536), seed=seed)


def run_one(devices: int, seed: int, to_host: float, tables: int, pool_seed: int) -> dict:
    """Every planner on one task: each plan (TorchRec's three ways, ``torchrec_plans``, and
    ours), its kernels, host bytes and planning time, and each plan priced by TorchRec's
    estimator (without and with the cache statistics) and by our model."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from torchrec_neuroshard.planner import NeuroShardPlanner
    from torchrec_neuroshard.search import predicted_breakdown
    from torchrec_neuroshard.sharding import from_torchrec
    from torchrec_neuroshard.tables import module_for_tables

    task = uvm_task(devices, seed, tables, pool_seed)
    topology, constraints, per_rank = setting(task, to_host)
    module = module_for_tables(task.tables)
    row: dict = {
        "pool_seed": pool_seed, "devices": devices, "tables": tables, "seed": seed, "to_host": to_host, "hbm_cap": topology.devices[0].storage.hbm,
    }  # fmt: skip
    theirs = torchrec_plans(task, topology, constraints, per_rank, module)
    plans = {name: from_torchrec(plan, devices) for name, (plan, *_) in theirs.items() if plan is not None}
    row.update({f"{name}_s": secs for name, (_, secs, *_) in theirs.items()})
    row["errors"] = {name: error for name, (_, _, error, _) in theirs.items() if error}
    t0 = time.perf_counter()
    planner = NeuroShardPlanner(
        topology, per_rank, constraints=constraints, storage_reservation=0.0, access_hists={t.name: t.access_hist for t in task.tables}
    )
    planner.plan(module, [EmbeddingBagCollectionSharder()])
    row["neuroshard_s"] = round(time.perf_counter() - t0, 2)
    plans["neuroshard"] = planner.plan_
    ours_model = planner._priced_model()
    planned = planner.task_ or _task_of(task, topology)
    row["task"], row["plans"] = json.loads(planned.to_json()), {name: plan.to_dict() for name, plan in plans.items()}
    with_stats = theirs["torchrec-stats"][3]
    for name, plan in plans.items():
        plan.validate(planned)
        row[f"{name}_kernels"] = dict(Counter(f"{p.kind.value}/{p.kernel.value}" for p in plan.placements))
        row[f"{name}_host_bytes"] = sum(plan.device_host_memory(task.tables, task.batch_size))
        row[f"{name}_torchrec_ms"] = torchrec_ms(plan, module, topology, constraints, per_rank)
        row[f"{name}_torchrec_stats_ms"] = torchrec_ms(plan, module, topology, with_stats, per_rank)
        row[f"{name}_ours_ms"] = predicted_breakdown(ours_model, planned, plan)[0]
    return row


def _task_of(task, topology):
    """``task`` at the topology's memory (when the planner searched nothing, it has no task_)."""
    from dataclasses import replace

    from torchrec_neuroshard.types import Links

    storage = topology.devices[0].storage
    return replace(task, memory_cap_bytes=storage.hbm, host_memory_cap_bytes=storage.ddr, links=Links.of(topology))


def report(rows: list[dict]) -> str:
    lines = [
        "| pool | D | tables | bytes to host (cap) | host GB TorchRec / ours | planning s TorchRec / ours | TorchRec plan | our plan "
        "| TorchRec estimator: TorchRec / ours ms | our model + UVM pricing: TorchRec / ours ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kernels = {k: _kernels(r, k) for k in ("torchrec", "neuroshard")}
        lines.append(
            f"| {r.get('pool_seed', 0)} | {r['devices']} | {r['tables']} | {r['to_host']:.0%} "
            f"| {r['torchrec_host_bytes'] / 1e9:.1f} / {r['neuroshard_host_bytes'] / 1e9:.1f} | {r['torchrec_s']} / {r['neuroshard_s']} "
            f"| {kernels['torchrec']} | {kernels['neuroshard']} "
            f"| {r['torchrec_torchrec_ms']:.2f} / {r['neuroshard_torchrec_ms']:.2f} "
            f"({r['neuroshard_torchrec_ms'] / r['torchrec_torchrec_ms']:.2f}) "
            f"| {r['torchrec_ours_ms']:.2f} / {r['neuroshard_ours_ms']:.2f} ({r['neuroshard_ours_ms'] / r['torchrec_ours_ms']:.2f}) |"
        )
    return "\n".join(lines)


def body(rows: list[dict]) -> str:
    """uvm.md below its header: both planners' plans, the notes, TorchRec given cache statistics."""
    return report(rows) + "\n\n" + NOTE + "\n" + STATS_NOTE + "\n" + stats_report(rows)


VARIANTS = ("torchrec", "torchrec-stats", "torchrec-scaleup", "neuroshard")


def stats_report(rows: list[dict]) -> str:
    """TorchRec given the cache statistics (``torchrec_plans``) beside its default plan and ours."""
    lines = [
        "| pool | D | bytes to host (cap) | with statistics, default proposers | scaleup proposer | planning s | "
        "TorchRec estimator given the statistics, ms | our model + UVM pricing, ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = "the same plan" if r["plans"].get("torchrec-stats") == r["plans"]["torchrec"] else _outcome(r, "torchrec-stats")
        scaleup = _outcome(r, "torchrec-scaleup")
        priced = {key: " / ".join(f"{r[f'{v}_{key}']:.2f}" if v in r["plans"] else "-" for v in VARIANTS) for key in ("torchrec_stats_ms", "ours_ms")}
        lines.append(
            f"| {r.get('pool_seed', 0)} | {r['devices']} | {r['to_host']:.0%} | {same} | {scaleup} | {' / '.join(str(r[f'{v}_s']) for v in VARIANTS)} "
            f"| {priced['torchrec_stats_ms']} | {priced['ours_ms']} |"
        )
    return "\n".join(lines)


def _kernels(row: dict, name: str) -> str:
    return ", ".join(f"{v} {n}" for n, v in sorted(row[f"{name}_kernels"].items()))


def _outcome(row: dict, name: str) -> str:
    """``name``'s plan's kernels, or how the planner failed."""
    return _kernels(row, name) if name in row["plans"] else f"failed: {row['errors'][name]}"


REFERENCE_HBM = 1.05
"""The reference plans' HBM, a share of the tables' bytes: with none spare, the ranks cannot
hold every table whole and some go to host memory (set 1.0: the error says how many)."""


def planning_speed(tables: int, repeats: int, training_pool: bool = False) -> str:
    """NeuroShard alone on the tasks at ``tables`` tables, each planned ``repeats`` times:
    median and range of wall and CPU seconds of ``plan`` (the module built before the clock
    starts), tables sent to host memory, predicted step; and, for reference, the wall seconds
    of the same tables on HBM of ``REFERENCE_HBM`` x their bytes (nearly as full, yet no
    table in host memory: no offload stage), planned in turn with them."""
    import torch

    torch.set_num_threads(1)
    lines = [
        f"| pool | D | tables | bytes to host (cap) | wall s | CPU s | tables in host memory | predicted step ms | HBM for {REFERENCE_HBM:.0%} of the bytes, no offload: wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (devices, seed, to_host), pool_seed in zip(TASKS, pool_seeds(training_pool)):
        task = uvm_task(devices, seed, tables, pool_seed)
        walls, cpus, in_hbm = [], [], []
        for _ in range(repeats):
            wall, cpu, planner = _timed_plan(task, to_host)
            walls.append(wall)
            cpus.append(cpu)
            in_hbm.append(_reference_plan_s(task))
        step = planner.search_result_.predicted_cost_ms if planner.search_result_ else float("nan")
        lines.append(
            f"| {pool_seed} | {devices} | {tables} | {to_host:.0%} | {median_range(walls)} | {median_range(cpus)} | {len(planner.plan_.offloaded())} "
            f"| {step:.2f} | {median_range(in_hbm)} |"
        )
        print(lines[-1], flush=True)
    return "\n".join(lines)


def _reference_plan_s(task) -> float:
    """Wall s of the reference plan (``planning_speed``); an error if it sent a table to host memory."""
    wall, _, planner = _timed_plan(task, 1.0 - REFERENCE_HBM)
    if planner.plan_.offloaded():
        raise RuntimeError(
            f"the reference plan (HBM for {REFERENCE_HBM:.0%} of the bytes) sent {len(planner.plan_.offloaded())} tables "
            "to host memory: it would time the offload stage too; raise REFERENCE_HBM"
        )
    return wall


def median_range(seconds: list[float]) -> str:
    """The median of ``seconds``, with their range when there are several."""
    median = f"{statistics.median(seconds):.2f}"
    return median if len(seconds) == 1 else f"{median} ({min(seconds):.2f}-{max(seconds):.2f})"


def _timed_plan(task, to_host: float):
    """(wall s, CPU s, planner) of NeuroShard planning ``task`` in ``setting(task, to_host)``,
    on one thread, the module built before the clock starts."""
    from threadpoolctl import threadpool_limits
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from torchrec_neuroshard.planner import NeuroShardPlanner
    from torchrec_neuroshard.tables import module_for_tables

    topology, constraints, per_rank = setting(task, to_host)
    module = module_for_tables(task.tables)
    hists = {t.name: t.access_hist for t in task.tables}
    wall, cpu = time.perf_counter(), time.process_time()
    planner = NeuroShardPlanner(topology, per_rank, constraints=constraints, storage_reservation=0.0, access_hists=hists)
    with threadpool_limits(limits=1):
        planner.plan(module, [EmbeddingBagCollectionSharder()])
    return time.perf_counter() - wall, time.process_time() - cpu, planner


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=48, help="tables per task, drawn from the full-size pool")
    p.add_argument("--training-pool", action="store_true", help="every task from pool 0, the training pool (the runs before 2026-12-02)")
    p.add_argument("--out", type=Path, help="the rows (default results/uvm.jsonl, or uvm_pool0.jsonl with --training-pool)")
    p.add_argument("--speed", action="store_true", help="time NeuroShard alone; writes results/uvm_speed_<tables>[_pool0].md")
    p.add_argument("--repeats", type=int, default=3, help="with --speed: plans of each task timed (median, range)")
    args = p.parse_args(argv)
    suffix = "_pool0" if args.training_pool else ""
    pools = "pool 0, the TRAINING pool" if args.training_pool else f"held-out pools {', '.join(map(str, HELD_OUT_POOLS))}, one a task"
    command = f"python -m benchmarks.uvm{' --training-pool' if args.training_pool else ''}"
    logging.disable(logging.WARNING)  # TorchRec's topology warning, once per plan
    if args.speed:
        text = (
            f"# Planning models beyond HBM: NeuroShard's time\n\n`{command} --speed --tables {args.tables}` "
            f"({time.strftime('%Y-%m-%d')}, {pools}; one thread of this 2-core machine; median (range) of {args.repeats} plans of each "
            "task, each beside the reference in turn)\n\n" + planning_speed(args.tables, args.repeats, args.training_pool) + "\n"
        )
        (HERE / "results" / f"uvm_speed_{args.tables}{suffix}.md").write_text(text)
        return
    out = args.out or HERE / "results" / f"uvm{suffix}.jsonl"
    rows = []
    for (devices, seed, to_host), pool_seed in zip(TASKS, pool_seeds(args.training_pool)):
        rows.append(run_one(devices, seed, to_host, args.tables, pool_seed))
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("task", "plans")}), flush=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = (
        "# Models beyond HBM: NeuroShard vs TorchRec with UVM kernels (PREDICTED)\n\n"
        f"`{command} --tables {args.tables}` ({time.strftime('%Y-%m-%d')}; {pools}). Every ms below is a "
        "PREDICTION, by TorchRec's analytic estimator or by our neural model with the shipped UVM pricing "
        "(`torchrec_neuroshard/uvmcost.py`); each is the objective one of the planners minimised. Ratios in "
        "parentheses: ours / TorchRec's plan. Planning times on this 2-core machine, one run each.\n\n"
        + body(rows) + "\n"
    )
    (HERE / "results" / f"uvm{suffix}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
