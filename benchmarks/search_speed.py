"""How long planning takes: NeuroShard's search vs TorchRec's EmbeddingShardingPlanner.

    python -m benchmarks.search_speed
    python -m benchmarks.search_speed --full-size ...   # production scale: benchmarks.search_speed_full

On one core (torch and BLAS limited to one thread), for tasks of T tables on D devices
from the task generator: the median of 3 NeuroShard searches (with the split states it
scored) and one TorchRec planning run on the same tables and memory; then the public API
end to end (NeuroShardPlanner.plan on a 60-table EmbeddingBagCollection, 4 ranks).
Targets: search 60 tables on 4 devices under 1 s, 856 tables on 128 devices under 10 s;
the public API on 60 tables / 4 ranks under 2 s. TorchRec's planner runs as its users run
it: its default proposers under its own ``timeout_seconds`` (``--torchrec-timeout``); a
run that fails is its row's error. ``--modules K`` deals each task's tables
into K sharded modules (EBCs), which the search also plans module by module;
``--local-world-size L`` puts L devices on a host (TorchRec's default links), so the search
prices the bytes across hosts and also tries table-row-wise.
"""

from __future__ import annotations

import argparse
import sys
import statistics
import time
from dataclasses import replace

import torch
from threadpoolctl import threadpool_limits

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import ParameterConstraints

from benchmarks import search_speed_full
from torchrec_neuroshard.lab.torchrec_baseline import run_torchrec, topology_for
from torchrec_neuroshard.planner import NeuroShardPlanner
from torchrec_neuroshard.tables import module_for_tables
from torchrec_neuroshard.costmodel import pretrained_for
from torchrec_neuroshard.hardware import model_vs_machine
from torchrec_neuroshard.search import search
from torchrec_neuroshard.types import Links
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool

GRID = ((20, 2), (60, 4), (200, 16), (500, 64), (856, 128))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--full-size" in argv:
        return search_speed_full.main([a for a in argv if a != "--full-size"])
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-torchrec", action="store_true", help="skip TorchRec's planner")
    p.add_argument("--torchrec-timeout", type=int, default=300, help="TorchRec's own timeout_seconds")
    p.add_argument("--modules", type=int, default=1, help="sharded modules each task's tables are dealt into")
    p.add_argument("--local-world-size", type=int, default=0, help="devices per host (default: all on one host, no links)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = pretrained_for("cpu")
    line, why = model_vs_machine(model.hardware, "cpu")
    print(line + "\n")
    if why:
        print(f"WARNING: {why}\n")
    pool = synthetic_pool()
    print("| T | D | NeuroShard s (median, min-max) | split states scored | TorchRec planner s |")
    print("|---|---|---|---|---|")
    with threadpool_limits(limits=1):
        for t, d in GRID:
            task = generate_task(pool, t, d, WorkloadScale(), seed=t + d)
            if args.modules > 1:
                task = replace(task, modules=tuple(tuple(x.name for x in task.tables[k :: args.modules]) for k in range(args.modules)))
            if args.local_world_size:
                task = replace(task, links=Links.of(topology_for(task, local_world_size=min(args.local_world_size, d))))
            times, states = [], 0
            for _ in range(args.repeats):
                result = search(task, model)
                times.append(result.seconds)
                states = result.states_evaluated
            tr = "skipped"
            if not args.no_torchrec:
                run = run_torchrec(task, "cpu", args.torchrec_timeout)
                tr = f"{run.seconds:.2f}" + ("" if run.status == "ok" else f" ({run.status})")
            print(
                f"| {t} | {d} | {statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f}) | {states} | {tr} |",
                flush=True,
            )
        task = generate_task(pool, 60, 4, WorkloadScale(), seed=64)
        module = module_for_tables(task.tables)
        topology = topology_for(task)
        constraints = {t.name: ParameterConstraints(pooling_factors=[t.pooling_factor]) for t in task.tables}
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            NeuroShardPlanner(topology, task.per_rank_batch, constraints=constraints, storage_reservation=0.0).plan(
                module, [EmbeddingBagCollectionSharder()]
            )
            times.append(time.perf_counter() - t0)
        print(
            f"\nPublic API, NeuroShardPlanner(...).plan(60-table EBC, 4 ranks) incl. model load: "
            f"median {statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f})"
        )


if __name__ == "__main__":
    main()
