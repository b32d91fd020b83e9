"""Does a search that prices kernels by several models at once leave its slowest device
less wrong than a search by one? Held-out pools, issue 43.

    python -m studies.ensemble train                      # cpu.pt's siblings, for neuroshard_deep
    taskset -c 1 python -m studies.ensemble plan --ensemble neuroshard_deep
    taskset -c 1 python -m studies.ensemble measure --run 2 --devices 16
    python -m studies.ensemble rank --devices 8 16 --pool-seeds 2 3 4
    python -m studies.ensemble report

A search balances its devices as its model prices them, so whatever the model gets wrong
about the devices it chose is all that is left to tell them apart: on this Intel Xeon the
shipped ``cpu.pt`` (the AMD EPYC's, which plans the scale benchmark) ranks its own plans'
devices at 0.00 / 0.17 (D = 8 / 16, steadied), where this machine's ``intel_xeon.pt``
ranks the same devices at 0.71 / 0.24 (``studies.steady_judge``). ``EnsembleCostModel``
prices a kernel at the geometric mean of its members' prices, each brought to ``cpu.pt``'s
level (``level``: the median ratio of their prices of the training pool's device-sized
kernels, no measurement), so the comm and data-parallel parts, ``cpu.pt``'s, weigh as
before; a search by it cannot run into an error only one member makes. Three ensembles:
``neuroshard_ensemble``, cpu.pt x intel_xeon.pt (measured on other machines and sessions,
so their errors are partly their own); ``neuroshard_deep``, cpu.pt x four siblings trained
on its data by its recipe with other seeds (``train``, into ``runs/ensemble/``): whether
averaging alone helps, and the form a shipped model file could take;
``neuroshard_xeon_kernels``, intel_xeon.pt's kernels alone with cpu.pt's other parts.

``plan``: the scale benchmark's search (``benchmarks.scale``'s task and links-priced comm)
by an ensemble, rows in ``results/ensemble_planned.jsonl.gz`` with the plan's imbalance as
each member prices it. ``measure``: the ensembles' plans beside the stored plans of
``PLANNERS``, by the scale benchmark's judge with a reference, into run ``--run``'s rows
(resumable; ``RUNS`` says which ensembles each run judged). ``rank``: how each model ranks
the devices of the plans ``studies.steady_judge`` timed (``results/ensemble_ranked.jsonl.gz``).
``report``: ``results/ensemble.md``, run by run and pooled over the runs.
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from benchmarks.scale import judge_task, planned_row, planning_model, scale_task, task_draws
from benchmarks.scale_report import PLANNED as SCALE_PLANNED
from benchmarks.scale_ratios import best_heuristic, interval_text
from benchmarks.scale_report import beside_stored, judged_task, ok_rows, task_lines
from studies import steady_judge
from studies.task_steps import over_tasks, task_parser
from torchrec_neuroshard.costmodel import PRETRAINED_DIR, NeuralCostModel
from torchrec_neuroshard.lab.collect import append_rows, read_rows
from torchrec_neuroshard.lab.judge import JudgeConfig
from torchrec_neuroshard.lab.judgement import Judged, rank_correlation, ratio_interval, runs_ratio_interval
from torchrec_neuroshard.lab.pretrain import pretrain_files
from torchrec_neuroshard.lab.refine import device_compute
from torchrec_neuroshard.lab.workloads import TRAINING_POOL_SEEDS
from torchrec_neuroshard.search import search
from torchrec_neuroshard.types import CostModel, Plan, Shard, TableSpec

RESULTS = Path(__file__).parent / "results"
PLANNED = RESULTS / "ensemble_planned.jsonl.gz"
REPORT = RESULTS / "ensemble.md"
RANKED = RESULTS / "ensemble_ranked.jsonl.gz"
SECOND = PRETRAINED_DIR / "intel_xeon.pt"
PLANNERS = ("neuroshard", "lookup", "size_lookup")
"""The scale benchmark's stored plans judged beside the ensembles' (``neuroshard``: cpu.pt's)."""
NAME = "neuroshard_ensemble"
"""cpu.pt with intel_xeon.pt, this machine's model."""
DEEP = "neuroshard_deep"
"""cpu.pt with its siblings: the same data and recipe, other seeds (``train``)."""
XEON = "neuroshard_xeon_kernels"
"""intel_xeon.pt's kernels alone, at cpu.pt's level, with cpu.pt's comm and step parts."""
RUNS = {1: (NAME,), 2: (NAME, DEEP), 3: (NAME, XEON)}
"""The ensembles each run of the judge timed beside ``PLANNERS``' plans."""
DATA = Path(__file__).parents[1] / "torchrec_neuroshard" / "lab" / "data"
CPU_PT_DATA = (
    "cpu_compute.jsonl.gz", "cpu_compute_batch.jsonl.gz", "cpu_compute_batch_high.jsonl.gz", "cpu_compute_fp16.jsonl.gz",
    "cpu_compute_sequence.jsonl.gz", "cpu_comm.jsonl.gz", "cpu_step.jsonl.gz", "cpu_step_dp.jsonl.gz",
)  # fmt: skip
"""The files ``make model`` pre-trains cpu.pt on (seed 0)."""
SIBLING_SEEDS = (1, 2, 3, 4)
SIBLINGS = Path(__file__).parents[1] / "runs" / "ensemble"


def measured_file(run: int) -> Path:
    """The judge's rows of run ``run`` (1: the first, cpu.pt x intel_xeon.pt only)."""
    return RESULTS / ("ensemble_measured.jsonl.gz" if run == 1 else f"ensemble_measured_run{run}.jsonl.gz")


def _width(model: NeuralCostModel) -> int:
    """The width of ``model.embed_shards``' rows."""
    return model.pooled_kernel.width + (model.sequence_kernel.width if model.sequence_kernel is not None else 0)


class EnsembleCostModel(CostModel):
    """Kernels priced at the geometric mean of its ``members``' prices, each times its
    ``levels`` entry, weighted by ``weights`` (default equal); everything else (comm, step
    parts) is the first member's. Additive as the search needs: a shard's embedding is every
    member's side by side."""

    def __init__(self, members: Sequence[NeuralCostModel], levels: Sequence[float], weights: Sequence[float] | None = None) -> None:
        weights = [1.0] * len(members) if weights is None else weights
        if not members or not len(members) == len(levels) == len(weights):
            raise ValueError(f"{len(members)} members, {len(levels)} levels, {len(weights)} weights: give one level and weight a member")
        if min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"weights {list(weights)}: give weights >= 0, one at least > 0")
        self.members, self.levels, self.weights = tuple(members), tuple(levels), tuple(weights)

    def embed_shards(self, shards: Sequence[Shard]) -> np.ndarray:
        return np.concatenate([m.embed_shards(shards) for m in self.members], axis=1)  # [S, sum of widths]

    def device_cost(self, pooled: np.ndarray) -> np.ndarray:
        ends = np.cumsum([_width(m) for m in self.members])
        with np.errstate(divide="ignore"):  # an empty device: 0 by every member, exp(-inf) = 0
            logs = [
                weight * np.log(m.device_cost(pooled[:, end - _width(m) : end]) * lvl)  # [N, 2]
                for m, lvl, weight, end in zip(self.members, self.levels, self.weights, ends)
                if weight > 0
            ]  # fmt: skip
        return np.exp(np.sum(logs, axis=0) / sum(self.weights))  # [N, 2]

    def comm_cost_array(self, dims: np.ndarray, skews_ms: np.ndarray) -> np.ndarray:
        return self.members[0].comm_cost_array(dims, skews_ms)

    def wait_free_comm(self, dims: np.ndarray) -> np.ndarray | None:
        return self.members[0].wait_free_comm(dims)

    def for_tables(self, tables: Sequence[TableSpec]) -> "EnsembleCostModel":
        return EnsembleCostModel([m.for_tables(tables) for m in self.members], self.levels, self.weights)

    def with_batch_size(self, batch_size: int) -> "EnsembleCostModel":
        return EnsembleCostModel([m.with_batch_size(batch_size) for m in self.members], self.levels, self.weights)

    @property
    def step_parts(self):
        return self.members[0].step_parts


def level(first: NeuralCostModel, second: NeuralCostModel, batch_size: int, kernels: int = 64, tables: int = 50) -> float:
    """Median of first / second's fwd+bwd price over ``kernels`` random kernels of
    ``tables`` tables of the training pool (no measurement: the models' prices only)."""
    pool = scale_task(8, TRAINING_POOL_SEEDS[0]).tables
    rng = np.random.default_rng(0)
    devices = [[Shard(pool[i], pool[i].dim) for i in rng.choice(len(pool), tables, replace=False)] for _ in range(kernels)]
    ours = first.with_batch_size(batch_size).compute_cost(devices)
    theirs = second.with_batch_size(batch_size).compute_cost(devices)
    return float(np.median([sum(a) / sum(b) for a, b in zip(ours, theirs)]))


def train_siblings() -> None:
    """``cpu.pt``'s siblings: its data and recipe (``make model``), other seeds, into ``SIBLINGS``."""
    SIBLINGS.mkdir(parents=True, exist_ok=True)
    for seed in SIBLING_SEEDS:
        model = pretrain_files([DATA / f for f in CPU_PT_DATA], seed=seed, progress=False, hardware={"device_name": "AMD EPYC", "cores": 2})
        model.save(_sibling(seed))
        print(f"{_sibling(seed)}: pooled kernels' test MAPE {model.meta['test']['compute']['mape_total']:.2f}%", flush=True)


def _sibling(seed: int) -> Path:
    return SIBLINGS / f"cpu_seed{seed}.pt"


def member_paths(name: str) -> list[str | None]:
    """The model files of ensemble ``name``, ``cpu.pt`` (None) first."""
    if name in (NAME, XEON):
        return [None, str(SECOND)]
    missing = [str(_sibling(s)) for s in SIBLING_SEEDS if not _sibling(s).is_file()]
    if missing:
        raise FileNotFoundError(f"{name} needs cpu.pt's siblings {missing}: run `python -m studies.ensemble train` (a few minutes)")
    return [None] + [str(_sibling(s)) for s in SIBLING_SEEDS]


def ensemble_model(devices: int, pool_seed: int, name: str = NAME):
    """(the task, ensemble ``name``: the scale benchmark's planning model beside its other members)."""
    task, first = planning_model(devices, pool_seed)
    others = [NeuralCostModel.load(p) for p in member_paths(name)[1:]]
    levels = [1.0] + [level(first, other, task.batch_size) for other in others]
    weights = [0.0 if name == XEON else 1.0] + [1.0] * len(others)
    return task, EnsembleCostModel([first] + [o.with_batch_size(task.batch_size) for o in others], levels, weights)


def priced_alone(devices: int, pool_seed: int, plan: Plan, name: str) -> list[float]:
    """``plan``'s predicted slowest / mean device compute by each member of ensemble ``name`` alone."""
    out = []
    for path in member_paths(name):
        task, model = planning_model(devices, pool_seed, path)
        compute = device_compute(model, task, plan)  # [D]
        out.append(round(float(compute.max() / compute.mean()), 4))
    return out


def plan(devices: int, pool_seed: int, name: str) -> None:
    task, model = ensemble_model(devices, pool_seed, name)
    files = " x ".join(Path(p).name if p else "cpu.pt" for p in member_paths(name))
    levels = ", ".join(f"{lvl:.3f}" for lvl in model.levels[1:])
    weights = "" if len(set(model.weights)) == 1 else f"; weights {', '.join(f'{w:g}' for w in model.weights)}"
    row = {"pool_seed": pool_seed, "devices": devices, "planner": name, "model": f"{files} (levels {levels}{weights})"}

    def searched() -> tuple[Plan, dict]:
        result = search(task, model)
        return result.plan, {"note": f"{result.states_evaluated} split states"}

    row = planned_row(row, searched, lambda p: planning_model(devices, pool_seed))
    if row["status"] == "ok":
        row["priced_alone"] = priced_alone(devices, pool_seed, Plan.from_dict(row["plan"]), name)
    append_rows(PLANNED, [row])


def _planned(devices: int, pool_seed: int) -> dict[str, dict]:
    return beside_stored(read_rows(PLANNED), pool_seed, devices, PLANNERS)


def measure(devices: int, pool_seed: int, config: JudgeConfig, run: int) -> None:
    plans = {n: Plan.from_dict(r["plan"]) for n, r in _planned(devices, pool_seed).items()}
    plans = {n: p for n, p in plans.items() if n in PLANNERS or n in RUNS[run]}
    judge_task(devices, pool_seed, plans, config, task_draws(devices, pool_seed, config.draws), measured_file(run))


def _alone(devices: int, pool_seed: int, row: dict) -> list[float]:
    """The row's plan priced by each member alone (rows of the first run's plans do not carry it)."""
    return row.get("priced_alone") or priced_alone(devices, pool_seed, Plan.from_dict(row["plan"]), row["planner"])


Across = dict[tuple[int, int, str], dict[int, tuple[Judged, Judged, Judged]]]
"""(pool, D, planner) -> run -> (its plan, the run's best heuristic, neuroshard), as judged."""


def run_lines(run: int, across: Across) -> list[str]:
    """One run's report: every task's judged plans, then each ensemble against cpu.pt's
    plan; ``across`` gets the run's cells of NeuroShard's and the ensembles' plans."""
    measured = read_rows(measured_file(run))
    lines = [
        f"## Run {run}", "",
        f"Judged on {measured[-1]['cpu'] if measured else '-'}, with a reference (steadied).", "",
        "| D | planner | compute ms | slowest / mean device | / TorchRec | / best heuristic timed | units fastest "
        "| predicted ms | planning s (load) | kinds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    summary = ["", f"### Each ensemble against neuroshard (cpu.pt's plan), run {run}, same rounds", "",
               "| task | ensemble | ensemble / neuroshard (interval) | slowest / mean device: ensemble, neuroshard "
               "| the ensemble's plan priced by each member alone (cpu.pt first): slowest / mean |", "|---|---|---|---|---|"]
    ratios: dict[str, list[float]] = {}
    for pool_seed, devices in sorted({(r["pool_seed"], r["devices"]) for r in measured}):
        judged = judged_task(measured, pool_seed, devices)
        if not judged:  # not every device timed yet
            continue
        planned = {n: r for n, r in _planned(devices, pool_seed).items() if n in judged}
        lines += [f"| pool {pool_seed} | | | | | | | | | |"] + task_lines(pool_seed, devices, planned, judged)
        best = judged[best_heuristic(judged)]
        for name in (n for n in ("neuroshard",) + RUNS[run] if n in judged):
            across.setdefault((pool_seed, devices, name), {})[run] = (judged[name], best, judged["neuroshard"])
            if name == "neuroshard":
                continue
            ours, theirs = judged[name], judged["neuroshard"]
            alone = ", ".join(f"{x:.3f}" for x in _alone(devices, pool_seed, planned[name]))
            imbalance, interval = f"{ours.imbalance:.2f}, {theirs.imbalance:.2f}", ratio_interval(ours, theirs)
            summary.append(f"| pool {pool_seed}, D = {devices} | {name} | {interval_text(interval)} | {imbalance} | {alone} |")
            ratios.setdefault(name, []).append(interval[0])
    for name, values in ratios.items():
        summary += ["", f"Geomean of {name} / neuroshard over {len(values)} tasks: {float(np.exp(np.mean(np.log(values)))):.3f}."]
    return lines + summary + [""]


def across_lines(across: Across, runs: Sequence[int]) -> list[str]:
    """Each task's NeuroShard and ensemble plans, run by run and pooled over the runs
    (``runs_ratio_interval``): / best heuristic; / neuroshard."""
    lines = [
        "## Across runs", "",
        "Each cell: the plan over the run's best heuristic timed; then over neuroshard (cpu.pt's plan), same rounds "
        "(intervals: the judge's bootstrap over units). Pooled: the geometric mean over the runs that judged it, "
        "every run's units resampled on their own.", "",
        "| task | planner | " + " | ".join(f"run {run}" for run in runs) + " | pooled |",
        "|---|---|" + "---|" * (len(runs) + 1),
    ]  # fmt: skip
    for (pool_seed, devices, name), by_run in sorted(across.items()):
        cells = [_vs(name, [by_run[run]]) if run in by_run else "-" for run in runs]
        pooled = _vs(name, list(by_run.values())) if len(by_run) > 1 else "-"
        lines.append(f"| pool {pool_seed}, D = {devices} | {name} | " + " | ".join(cells) + f" | {pooled} |")
    return lines + [""]


def _vs(name: str, judged: Sequence[tuple[Judged, Judged, Judged]]) -> str:
    """A cell: ``name``'s plan over the best heuristic; then over neuroshard (not for neuroshard)."""
    best = interval_text(runs_ratio_interval([(ours, heuristic) for ours, heuristic, _ in judged]))
    return best if name == "neuroshard" else f"{best}; {interval_text(runs_ratio_interval([(ours, cpu_pt) for ours, _, cpu_pt in judged]))}"


def _rankers() -> dict[str, Callable[[int, int], tuple]]:
    """Each model ``rank`` prices the steady judge's plans with: (devices, pool) -> (task, model)."""
    files = {"cpu.pt": None, **{Path(p).name: p for p in member_paths(DEEP)[1:]}, "intel_xeon.pt": str(SECOND)}
    by_file = {n: functools.partial(planning_model, model_path=p) for n, p in files.items()}
    return {**by_file, **{n: functools.partial(ensemble_model, name=n) for n in (DEEP, NAME)}}


def rank(devices: int, pool_seed: int) -> None:
    """How each model (``_rankers``) ranks the devices of the plans ``studies.steady_judge``
    measured (steadied): rows in ``RANKED``, one a model and plan; a model already ranked
    on the task is skipped."""
    judged = judged_task(read_rows(steady_judge.MEASURED), pool_seed, devices)
    planned = ok_rows(read_rows(SCALE_PLANNED), pool_seed, devices, steady_judge.PLANNERS)
    done = {r["model"] for r in read_rows(RANKED) if (r["pool_seed"], r["devices"]) == (pool_seed, devices)}
    rows = []
    for label, priced in _rankers().items():
        if label in done:
            continue
        task, model = priced(devices, pool_seed)
        for name, measured in judged.items():
            predicted = device_compute(model, task, Plan.from_dict(planned[name]["plan"]))  # [D]
            rho = rank_correlation(predicted, measured.per_device)
            rows.append({"pool_seed": pool_seed, "devices": devices, "model": label, "planner": name, "rho": rho})
    if rows:
        append_rows(RANKED, rows)


def ranking_lines() -> list[str]:
    """Per D and model: the rank correlation on NeuroShard's plans (pools in order) and the median over every plan."""
    rows = read_rows(RANKED)
    lines = ["| D | model | NeuroShard's plans (pools 2, 3, 4) | median | every plan: median |", "|---|---|---|---|---|"]
    for devices in sorted({r["devices"] for r in rows}):
        for label in dict.fromkeys(r["model"] for r in rows):
            ranked = [r for r in sorted(rows, key=lambda r: r["pool_seed"]) if r["devices"] == devices and r["model"] == label]
            mine = [r["rho"] for r in ranked if r["planner"] == "neuroshard"]
            every = [r["rho"] for r in ranked]
            cells = ", ".join(f"{x:+.2f}" for x in mine)
            lines.append(f"| {devices} | {label} | {cells} | {statistics.median(mine):+.2f} | {statistics.median(every):+.2f} |")
    return lines


def report() -> str:
    runs = [run for run in RUNS if measured_file(run).exists()]
    lines = [
        "# Kernels priced by several models at once", "",
        "`python -m studies.ensemble train`, `plan`, `measure`, `report` (see the study's docstring): held-out pools, "
        "rows / 64, global batch 4,096, one thread. `neuroshard` is the scale benchmark's plan by cpu.pt; predicted ms are "
        f"cpu.pt's. `{NAME}`: cpu.pt x intel_xeon.pt; `{DEEP}`: cpu.pt x its siblings of seeds "
        f"{', '.join(map(str, SIBLING_SEEDS))}; `{XEON}`: intel_xeon.pt's kernels alone with cpu.pt's parts.", "",
    ]  # fmt: skip
    across: Across = {}
    for run in runs:
        lines += run_lines(run, across)
    lines += across_lines(across, runs)
    if RANKED.exists():
        lines += [
            "## Which model ranks the devices the steady judge measured", "",
            "`rank`: the rank correlation of each model's predicted compute with the steadied measured compute of a "
            "plan's devices, on the scale benchmark's stored plans as `studies.steady_judge` timed them (none of them "
            "an ensemble's plan).", "",
        ] + ranking_lines() + [""]  # fmt: skip
    REPORT.write_text("\n".join(lines))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = task_parser(__doc__, ["train", "plan", "measure", "rank", "report"], devices=[16, 8], pool_seeds=[4, 2, 3])
    parser.add_argument("--ensemble", choices=[NAME, DEEP, XEON], default=NAME, help="plan: which ensemble")
    parser.add_argument("--run", type=int, choices=sorted(RUNS), default=1, help="measure: which run (``RUNS``)")
    args = parser.parse_args(argv)
    if args.step == "train":
        train_siblings()
        return
    if args.step == "report":
        print(report())
        return
    config = JudgeConfig(rounds=args.rounds, reference=True)
    steps = {"plan": lambda d, p: plan(d, p, args.ensemble), "measure": lambda d, p: measure(d, p, config, args.run), "rank": rank}
    step = steps[args.step]
    over_tasks(args, step, devices_first=True)


if __name__ == "__main__":
    main()
