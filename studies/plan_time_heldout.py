"""How long ``NeuroShardPlanner.plan()`` takes end to end on held-out full-size pools (issue 40).

    taskset -c 1 python -m studies.plan_time_heldout [--pools 2 3 4] [--devices 8 16 32 64 128]

What a user has: the 856 tables of a held-out pool (``scale_task``'s draw at full size: rows
as in the pool, global batch 65,536) as one ``EmbeddingBagCollection`` on the meta device,
H200s of 141 GB in hosts of 8 (``Topology(compute_device="cuda")``), TorchRec's default
sharders, each table's pooling factor as a constraint and its access histogram as
``access_hists``. Each row is one ``plan()`` call timed end to end (table collection, kinds,
offload attempts, search, the plan's checks), after one warm-up plan that loads the cost
model; the plan's step as the planner's own model predicts it beside it. Appends rows to
studies/results/plan_time_heldout.jsonl and writes studies/results/plan_time_heldout.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
from threadpoolctl import threadpool_limits
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints, Topology

from benchmarks.fullsize import FULL_SIZE, GPUS_PER_HOST
from benchmarks.scale import scale_task
from benchmarks.search_speed_full import HBM_BYTES
from torchrec_neuroshard import NeuroShardPlanner
from torchrec_neuroshard.hardware import local_hardware
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.workloads import HELD_OUT_POOL_SEEDS
from torchrec_neuroshard.tables import module_for_tables

RESULTS = Path(__file__).parent / "results" / "plan_time_heldout.jsonl"


def plan_once(pool: int, devices: int) -> dict:
    """One timed ``plan()`` of pool ``pool``'s 856 tables on ``devices`` H200s."""
    task = scale_task(devices, pool, FULL_SIZE)
    topology = Topology(world_size=devices, compute_device="cuda", hbm_cap=HBM_BYTES, local_world_size=min(GPUS_PER_HOST, devices))
    planner = NeuroShardPlanner(
        topology, task.per_rank_batch, constraints={t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in task.tables},
        debug=False, access_hists={t.name: t.access_hist for t in task.tables},
    )  # fmt: skip
    module = module_for_tables(task.tables)
    start = time.perf_counter()
    planner.plan(module, [EmbeddingBagCollectionSharder()])
    seconds = time.perf_counter() - start
    step = planner.search_result_.predicted_cost_ms if planner.search_result_ is not None else None
    return {"pool_seed": pool, "devices": devices, "tables": len(task.tables), "plan_s": round(seconds, 2), "predicted_ms": step}


def report(rows: list[dict]) -> str:
    """The plan() seconds per D (rows) and pool (columns), the last row of each."""
    last = {(r["pool_seed"], r["devices"]): r for r in rows}
    pools, devices = sorted({p for p, _ in last}), sorted({d for _, d in last})
    lines = ["| D | " + " | ".join(f"pool {p}: plan() s (predicted ms)" for p in pools) + " |", "|---" * (len(pools) + 1) + "|"]
    for d in devices:
        cells = [f"{last[p, d]['plan_s']:.2f} ({last[p, d]['predicted_ms']:.2f})" if (p, d) in last else "-" for p in pools]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pools", type=int, nargs="+", default=list(HELD_OUT_POOL_SEEDS[:3]))
    p.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        plan_once(args.pools[0], args.devices[0])  # loads the cost model once, as a planning job has
        for pool in args.pools:
            for devices in args.devices:
                row = plan_once(pool, devices)
                print(json.dumps(row), flush=True)
                with open(RESULTS, "a") as f:
                    f.write(json.dumps(row) + "\n")
    text = (
        f"# plan() end to end on held-out full-size pools\n\n`python -m studies.plan_time_heldout` "
        f"({time.strftime('%Y-%m-%d', time.gmtime())}, {local_hardware('cpu').describe()}, one thread): 856 tables, "
        "H200s of 141 GB in hosts of 8, pooling factors and access histograms given.\n\n" + report(read_rows(RESULTS)) + "\n"
    )
    print(text)
    RESULTS.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
