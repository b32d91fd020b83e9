"""Does a search that prices kernels by two models at once leave its slowest device less
wrong than a search by either? Held-out pools, issue 43.

    taskset -c 1 python -m studies.ensemble plan --devices 16 8 --pool-seeds 4 2 3
    taskset -c 1 python -m studies.ensemble measure --devices 16 8 --pool-seeds 4 2 3
    python -m studies.ensemble report

A search balances its devices as its model prices them, so whatever the model gets wrong
about the devices it chose is all that is left to tell them apart: on this Intel Xeon the
shipped ``cpu.pt`` (the AMD EPYC's, which plans the scale benchmark) ranks its own plans'
devices at 0.00 / 0.17 (D = 8 / 16, steadied), where this machine's ``intel_xeon.pt``
ranks the same devices at 0.71 / 0.24 (``studies.steady_judge``). The two were measured on
other machines and sessions, so their errors are partly their own. ``EnsembleCostModel``
prices a kernel at the geometric mean of both (``intel_xeon.pt`` brought to ``cpu.pt``'s
level by ``LEVEL``, the median ratio of their prices of the training pool's device-sized
kernels, so the comm and data-parallel parts, ``cpu.pt``'s, weigh as before); a search by
it cannot run into an error only one of them makes.

``plan``: the scale benchmark's search (``benchmarks.scale``'s task and links-priced comm)
by the ensemble, rows in ``results/ensemble_planned.jsonl.gz``. ``measure``: beside the
stored plans of ``PLANNERS``, by the scale benchmark's judge with a reference
(``results/ensemble_measured.jsonl.gz``, resumable). ``report``: ``results/ensemble.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from benchmarks.scale import judge_task, planned_row, planning_model, scale_task, task_draws
from benchmarks.scale_report import beside_stored, judged_task, task_lines
from studies.task_steps import over_tasks, task_parser
from torchrec_neuroshard.costmodel import PRETRAINED_DIR, NeuralCostModel
from torchrec_neuroshard.lab.collect import append_rows, read_rows
from torchrec_neuroshard.lab.judge import JudgeConfig, ratio_interval
from torchrec_neuroshard.lab.refine import device_compute
from torchrec_neuroshard.lab.workloads import TRAINING_POOL_SEEDS
from torchrec_neuroshard.search import search
from torchrec_neuroshard.types import CostModel, Plan, Shard, TableSpec

RESULTS = Path(__file__).parent / "results"
PLANNED = RESULTS / "ensemble_planned.jsonl.gz"
MEASURED = RESULTS / "ensemble_measured.jsonl.gz"
REPORT = RESULTS / "ensemble.md"
SECOND = PRETRAINED_DIR / "intel_xeon.pt"
PLANNERS = ("neuroshard", "lookup", "size_lookup")
"""The scale benchmark's stored plans judged beside the ensemble's (``neuroshard``: cpu.pt's)."""
NAME = "neuroshard_ensemble"


def _width(model: NeuralCostModel) -> int:
    """The width of ``model.embed_shards``' rows."""
    return model.pooled_kernel.width + (model.sequence_kernel.width if model.sequence_kernel is not None else 0)


class EnsembleCostModel(CostModel):
    """Kernels priced at the geometric mean of ``first``'s price and ``second``'s x
    ``level``; everything else (comm, step parts) is ``first``'s. Additive as the search
    needs: a shard's embedding is both models' side by side."""

    def __init__(self, first: NeuralCostModel, second: NeuralCostModel, level: float) -> None:
        self.first, self.second, self.level = first, second, level

    def embed_shards(self, shards: Sequence[Shard]) -> np.ndarray:
        return np.concatenate([self.first.embed_shards(shards), self.second.embed_shards(shards)], axis=1)  # [S, E1 + E2]

    def device_cost(self, pooled: np.ndarray) -> np.ndarray:
        split = _width(self.first)
        ours, theirs = self.first.device_cost(pooled[:, :split]), self.second.device_cost(pooled[:, split:])  # [N, 2] each
        return np.sqrt(ours * theirs * self.level)

    def comm_cost_array(self, dims: np.ndarray, skews_ms: np.ndarray) -> np.ndarray:
        return self.first.comm_cost_array(dims, skews_ms)

    def wait_free_comm(self, dims: np.ndarray) -> np.ndarray | None:
        return self.first.wait_free_comm(dims)

    def for_tables(self, tables: Sequence[TableSpec]) -> "EnsembleCostModel":
        return EnsembleCostModel(self.first.for_tables(tables), self.second.for_tables(tables), self.level)

    def with_batch_size(self, batch_size: int) -> "EnsembleCostModel":
        return EnsembleCostModel(self.first.with_batch_size(batch_size), self.second.with_batch_size(batch_size), self.level)

    @property
    def step_parts(self):
        return self.first.step_parts


def level(first: NeuralCostModel, second: NeuralCostModel, batch_size: int, kernels: int = 64, tables: int = 50) -> float:
    """Median of first / second's fwd+bwd price over ``kernels`` random kernels of
    ``tables`` tables of the training pool (no measurement: the models' prices only)."""
    pool = scale_task(8, TRAINING_POOL_SEEDS[0]).tables
    rng = np.random.default_rng(0)
    devices = [[Shard(pool[i], pool[i].dim) for i in rng.choice(len(pool), tables, replace=False)] for _ in range(kernels)]
    ours = first.with_batch_size(batch_size).compute_cost(devices)
    theirs = second.with_batch_size(batch_size).compute_cost(devices)
    return float(np.median([sum(a) / sum(b) for a, b in zip(ours, theirs)]))


def ensemble_model(devices: int, pool_seed: int):
    """(the task, the ensemble of the scale benchmark's planning model and ``SECOND``'s)."""
    task, first = planning_model(devices, pool_seed)
    second = NeuralCostModel.load(SECOND)
    return task, EnsembleCostModel(first, second.with_batch_size(task.batch_size), level(first, second, task.batch_size))


def plan(devices: int, pool_seed: int) -> None:
    task, model = ensemble_model(devices, pool_seed)
    row = {"pool_seed": pool_seed, "devices": devices, "planner": NAME, "model": f"cpu.pt x intel_xeon.pt (level {model.level:.3f})"}

    def searched() -> tuple[Plan, dict]:
        result = search(task, model)
        return result.plan, {"note": f"{result.states_evaluated} split states"}

    append_rows(PLANNED, [planned_row(row, searched, lambda p: planning_model(devices, pool_seed))])


def _planned(devices: int, pool_seed: int) -> dict[str, dict]:
    return beside_stored(read_rows(PLANNED), pool_seed, devices, PLANNERS)


def measure(devices: int, pool_seed: int, config: JudgeConfig) -> None:
    plans = {n: Plan.from_dict(r["plan"]) for n, r in _planned(devices, pool_seed).items()}
    judge_task(devices, pool_seed, plans, config, task_draws(devices, pool_seed, config.draws), MEASURED)


def priced_imbalance(devices: int, pool_seed: int) -> list[float]:
    """The ensemble's plan's predicted slowest / mean device compute by each of its models alone."""
    plan = Plan.from_dict(_planned(devices, pool_seed)[NAME]["plan"])
    out = []
    for path in (None, str(SECOND)):
        task, model = planning_model(devices, pool_seed, path)
        compute = device_compute(model, task, plan)  # [D]
        out.append(float(compute.max() / compute.mean()))
    return out


def report() -> str:
    measured = read_rows(MEASURED)
    lines = [
        "# Kernels priced by two models at once (cpu.pt x intel_xeon.pt)", "",
        "`python -m studies.ensemble plan`, `measure`, `report` (see the study's docstring): held-out pools, rows / 64, "
        f"global batch 4,096, one thread, judged on {measured[-1]['cpu'] if measured else '-'} with a reference "
        "(steadied). `neuroshard` is the scale benchmark's plan by cpu.pt; predicted ms are cpu.pt's.", "",
        "| D | planner | compute ms | slowest / mean device | / TorchRec | / best heuristic timed | units fastest "
        "| predicted ms | planning s (load) | kinds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    ratios: list[float] = []
    summary = ["", f"## {NAME} against neuroshard (cpu.pt's plan), same rounds", "",
               "| task | ensemble / neuroshard (interval) | slowest / mean device: ensemble, neuroshard "
               "| the ensemble's plan priced by cpu.pt, by intel_xeon.pt alone: slowest / mean |", "|---|---|---|---|"]
    for pool_seed, devices in sorted({(r["pool_seed"], r["devices"]) for r in measured}):
        judged = judged_task(measured, pool_seed, devices)
        lines += [f"| pool {pool_seed} | | | | | | | | | |"] + task_lines(pool_seed, devices, _planned(devices, pool_seed), judged)
        if NAME in judged and "neuroshard" in judged:
            ours, theirs = judged[NAME], judged["neuroshard"]
            ratio, low, high = ratio_interval(ours, theirs)
            alone = ", ".join(f"{x:.3f}" for x in priced_imbalance(devices, pool_seed))
            summary.append(f"| pool {pool_seed}, D = {devices} | {ratio:.3f} ({low:.3f}-{high:.3f}) | {ours.imbalance:.2f}, {theirs.imbalance:.2f} | {alone} |")
            ratios.append(ratio)
    if ratios:
        summary += ["", f"Geomean over {len(ratios)} tasks: {float(np.exp(np.mean(np.log(ratios)))):.3f}."]
    lines += summary
    REPORT.write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = task_parser(__doc__, ["plan", "measure", "report"], devices=[16, 8], pool_seeds=[4, 2, 3]).parse_args(argv)
    if args.step == "report":
        print(report())
        return
    config = JudgeConfig(rounds=args.rounds, reference=True)
    over_tasks(args, plan if args.step == "plan" else lambda devices, pool_seed: measure(devices, pool_seed, config), devices_first=True)


if __name__ == "__main__":
    main()
