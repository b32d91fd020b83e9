"""The tables of ``benchmarks/scale.py``: measured compute per pool and D, ratios with
bootstrap intervals, units won, the shipped model's plans against TorchRec's and the best
heuristic's pooled per D (``scale_ratios``), and the cost model against the measured devices.

    python -m benchmarks.scale report

Reads ``results/scale_planned.jsonl.gz`` (the last row of each pool, D and planner wins)
and ``results/scale_measured.jsonl.gz`` (per pool and D, the rows of the plans judged
last) and writes ``results/scale.md``.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import statistics
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from benchmarks.scale_ratios import TORCHREC, TaskRun, best_heuristic, interval_text, ratio_text, versus_lines
from torchrec_neuroshard.costmodel.shipped import model_file, shipped_hardware
from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.judge import JudgeConfig
from torchrec_neuroshard.lab.judge import COPY, REFERENCE
from torchrec_neuroshard.lab.judgement import Judged, copy_check, final_judgements, judgements, rank_correlation, runs_ratio_interval, wins
from torchrec_neuroshard.lab.workloads import HELD_OUT_POOL_SEEDS

RESULTS = Path(__file__).parent / "results"
PLANNED = RESULTS / "scale_planned.jsonl.gz"
"""Each planner's plan, planning time and predicted devices per pool and D (``scale.py plan`` appends)."""
MEASURED = RESULTS / "scale_measured.jsonl.gz"
"""The judge's rows: each (pass, device, draw) of each plan (``scale.py measure`` appends)."""
RESULT = RESULTS / "scale.md"
MODEL_NOTE = (
    "The judge's two passes ranked against each other (agreeing at a) say how far the measurement ranks a plan's "
    "devices at all: a model that ranked them exactly would read about (2a / (1 + a)) ** 0.5 against the medians of "
    "both passes (Spearman-Brown; 0.88 at a = 0.62, 0.58 at a = 0.2). Where a plan's devices differ by less than "
    "the judge's noise (a balanced plan), neither ranks them."
)


def latest_plans(rows: list[dict], pool_seed: int, devices: int) -> dict[str, dict]:
    """The last planning row of each planner on one task."""
    return {r["planner"]: r for r in rows if r.get("pool_seed") == pool_seed and r["devices"] == devices}


def ok_rows(rows: list[dict], pool_seed: int, devices: int, planners: Sequence[str]) -> dict[str, dict]:
    """The last planning row of each of ``planners`` on one task, where it made a plan."""
    latest = latest_plans(rows, pool_seed, devices)
    return {n: latest[n] for n in planners if n in latest and latest[n]["status"] == "ok"}


def beside_stored(rows: list[dict], pool_seed: int, devices: int, planners: Sequence[str]) -> dict[str, dict]:
    """A study's last planning rows of one task (``rows``) beside this benchmark's stored
    ones of ``planners`` (``ok_rows`` of ``PLANNED``), by planner."""
    return {**ok_rows(read_rows(PLANNED), pool_seed, devices, planners), **latest_plans(rows, pool_seed, devices)}


def last_judged(rows: list[dict], pool_seed: int, devices: int) -> list[dict]:
    """The judge's rows of the task's last judged set of plans (those of its last plans, on
    the CPU that timed them last, by the judge's configuration of then: rows since
    2026-11-29 name the CPU, older ones do not)."""
    mine = [r for r in rows if r["pool_seed"] == pool_seed and r["devices"] == devices]
    last = (mine[-1]["plans_sha"], mine[-1].get("cpu"), JudgeConfig.of(mine[-1])) if mine else None
    return [r for r in mine if (r["plans_sha"], r.get("cpu"), JudgeConfig.of(r)) == last]


def judged_task(rows: list[dict], pool_seed: int, devices: int, steady: bool = True) -> dict[str, Judged]:
    """Per planner, its measurement in the task's last judged set of plans (complete ones
    only), steadied by the run's reference where it timed one (``lab.judgement.judgements``)."""
    last = last_judged(rows, pool_seed, devices)
    if not last:
        return {}
    return judgements(last, devices, JudgeConfig.of(last[0]), steady)


def copy_text(rows: list[dict], devices: int) -> str | None:
    """The A/A check of one run's rows (``lab.judgement.copy_check``, steadied as the plans are)
    as the reports print it; None where the run timed no copy."""
    check = copy_check(rows, devices, JudgeConfig.of(rows[0])) if rows else None
    if check is None:
        return None
    resolved = check[1] <= 1.0 <= check[2]
    return f"{interval_text(check)}: {'holds 1' if resolved else 'LEAVES OUT 1, so the intervals of this run do not hold its own error'}"


def cpu_label(cpu: str | None) -> str:
    """A judge's row's ``cpu`` as the reports print the CPU kind ("AMD EPYC" of "cpu AMD
    EPYC, 1 cores"; "AMD EPYC AVX512" of rows naming the vector instructions too, since
    2026-12-07: ``scale.judged_on``); rows before 2026-11-29 did not record it (None)."""
    name, *rest = cpu.removeprefix("cpu ").split(", ") if cpu else ("not recorded",)
    return " ".join([name, *(part for part in rest if not part.endswith("cores"))])


def judge_lines(measured_rows: list[dict], tasks: Sequence[tuple[int, int]]) -> list[str]:
    """The section on the judge itself, for each task whose last run timed a copy: the copy
    against its first plan and NeuroShard against the best heuristic, read steadied by the
    reference (as the tables above are), plain (the same rows) and in the run's final round
    where it held one (``lab.final_round``); and the passes' agreement steadied and plain."""
    lines = []
    for pool_seed, devices in tasks:
        last = last_judged(measured_rows, pool_seed, devices)
        config = JudgeConfig.of(last[0]) if last else None
        if config is None or copy_check(last, devices, config) is None:
            continue
        copies, ours, agree = [], [], []
        for steady in (True, False):
            judged = judgements(last, devices, config, steady)
            copies.append(interval_text(copy_check(last, devices, config, steady)))
            ours.append(_ours_text(judged))
            agree.append(f"{statistics.median(j.passes_agree for j in judged.values()):.2f}")
        final = final_judgements(last, config)
        first = next(iter(judgements(last, devices, config)))
        copies.append(ratio_text(final[COPY], final.get(first)) if COPY in final else "-")
        ours.append(_ours_text({n: j for n, j in final.items() if n != COPY}) if final else "-")
        lines.append(f"| {pool_seed} | {devices} | {cpu_label(last[0].get('cpu'))} | " + " | ".join(copies + ours + agree) + " |")
    if not lines:
        return []
    return [
        "", "## The judge against itself", "",
        "The first plan built and timed a second time among the plans (`JudgeConfig.copy`): its copy's compute over "
        "its own, with the run's interval; beside it, from the same rows, NeuroShard over the best heuristic and the "
        "median over plans of the passes' agreement (`Judged.passes_agree`), steadied by the reference (as above) and "
        "plain. The copy shares its plan's devices, so it checks the noise at one plan's slowest devices, not the "
        "comparison of two plans' different devices, which the reference's own noise moves. Final: the run's final "
        "round, where it held one (`python -m benchmarks.scale final`: each plan's slowest devices by the steadied "
        "passes, the copy taking its plan's, built together and timed side by side, no reference).", "",
        "| pool | D | judged on | copy / first plan, steadied | plain | final | NeuroShard / best heuristic, steadied "
        "| plain | final | passes agree, steadied | plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *lines,
    ]  # fmt: skip


def _ours_text(judged: Mapping[str, Judged]) -> str:
    """NeuroShard over the best heuristic among ``judged``, the heuristic named."""
    best = best_heuristic(judged)
    return f"{ratio_text(judged['neuroshard'], judged.get(best)) if 'neuroshard' in judged else '-'} {best}"


def task_lines(pool_seed: int, devices: int, planned: dict[str, dict], judged: dict[str, Judged]) -> list[str]:
    """The report's rows of one task: per planner (its last plan, ``planned``), its
    measurement in the task's judged set (``judged``; "not timed" without), the ratios to
    TorchRec's and the best heuristic's, its units won, predicted ms, planning s, kinds."""
    lines = []
    best = best_heuristic(judged)
    won = wins(judged) if judged else {}
    units = next(iter(judged.values())).times.shape[0] if judged else 0
    for name, p in planned.items():
        load = f"{p['load_before']}->{p['load_after']}"
        if p["status"] != "ok":
            lines.append(f"| {devices} | {name} | - | - | - | - | - | - | {p['planning_s']} ({load}) | {p['status'][:120]} |")
            continue
        m = judged.get(name)
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(p["kinds"].items()))
        note = f"{p['note']}; " if p.get("note") else ""
        head = f"| {devices} | {name} | "
        if m is None:
            lines.append(head + f"not timed | - | - | - | - | {max(p['predicted_ms']):.1f} | {p['planning_s']} ({load}) | {note}{kinds} |")
            continue
        lines.append(
            head + f"{m.compute_ms:.1f} | {m.imbalance:.2f} | {ratio_text(m, judged.get(TORCHREC))} "
            f"| {ratio_text(m, judged.get(best)) if best else '-'} "
            f"| {won.get(name, 0)} of {units} | {max(p['predicted_ms']):.1f} | {p['planning_s']} ({load}) | {note}{kinds} |"
        )
    return lines


def model_lines(planned: dict, judged: dict) -> list[str]:
    """Per D and model, its per-device error on the plans it priced, NeuroShard's own and every
    plan (the baselines' priced by the shipped model), beside the judge's passes' agreement."""
    lines = [
        "| D | model | plans | predicted / measured per device (median), every plan | MAPE per device, its NeuroShard plans "
        "| every plan it priced | rank correlation within a plan (median), its NeuroShard plans | every plan "
        "| the measurement against itself (pass 1 vs pass 2, median), its NeuroShard plans | every plan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    levels: dict[tuple[int, str], list[float]] = {}
    errors: dict[tuple[int, str, bool], list[float]] = {}
    ranks: dict[tuple[int, str, bool], list[float]] = {}
    itself: dict[tuple[int, str, bool], list[float]] = {}  # the judge's passes against each other
    shipped = file_sha256(model_file("cpu"))
    for (pool_seed, d), by_planner in judged.items():
        if pool_seed not in HELD_OUT_POOL_SEEDS:
            continue
        for name, m in by_planner.items():
            row = planned[pool_seed, d][name]
            model = "shipped cpu.pt" if row.get("model_sha256") == shipped else row.get("model", "shipped cpu.pt")  # a copy of it too
            predicted = np.asarray(row["predicted_ms"])
            levels.setdefault((d, model), []).extend(predicted / m.per_device)
            for ours in {name.startswith("neuroshard"), False}:
                errors.setdefault((d, model, ours), []).extend(np.abs(predicted / m.per_device - 1))
                ranks.setdefault((d, model, ours), []).append(rank_correlation(predicted, m.per_device))
                itself.setdefault((d, model, ours), []).append(m.passes_agree)
    for d, model in sorted({(d, model) for d, model, _ in errors}):
        mine, every = (d, model, True), (d, model, False)
        lines.append(
            f"| {d} | {model} | {len(ranks[every])} | {statistics.median(levels[d, model]):.3f} "
            f"| {_pct(errors.get(mine, []))} | {_pct(errors[every])} "
            f"| {_median(ranks.get(mine, []))} | {_median(ranks[every])} | {_median(itself.get(mine, []))} | {_median(itself[every])} |"
        )
    return lines


def run_key(row: dict) -> tuple:
    """The judged run a judge's row belongs to: (pool seed, D, plans digest, CPU, judge configuration)."""
    return row["pool_seed"], row["devices"], row["plans_sha"], row.get("cpu"), JudgeConfig.of(row)


def judged_runs(rows: list[dict]) -> dict[tuple, dict[str, Judged]]:
    """Every judged run of the held-out pools, steadied as the tables are: ``run_key`` ->
    the planners it measured in full."""
    runs: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["pool_seed"] in HELD_OUT_POOL_SEEDS:
            runs.setdefault(run_key(r), []).append(r)
    return {key: judgements(run, key[1], key[4]) for key, run in runs.items()}


def plans_digest(plans: Mapping[str, dict]) -> str:
    """The digest of a task's plans (each ``Plan.to_dict()``) by planner name: the judge's
    rows carry it as ``plans_sha``."""
    return hashlib.sha1(json.dumps(dict(plans), sort_keys=True).encode()).hexdigest()[:12]


def run_plans(planned_rows: list[dict], pool_seed: int, devices: int, names: Sequence[str], sha: str) -> dict[str, dict] | None:
    """The plan each of ``names`` had in the judged run of digest ``sha``: of the plans ever
    stored under those names on the task, the combination of that digest (None: none)."""
    stored: dict[str, dict[str, dict]] = {n: {} for n in names}  # name -> plan's json -> plan
    for r in planned_rows:
        if r.get("pool_seed") == pool_seed and r["devices"] == devices and r["planner"] in stored and r["status"] == "ok":
            stored[r["planner"]][json.dumps(r["plan"], sort_keys=True)] = r["plan"]
    for plans in itertools.product(*(list(stored[n].values()) for n in names)):
        if plans_digest(dict(zip(names, plans))) == sha:
            return dict(zip(names, plans))
    return None


def plan_label(latest: Mapping[str, dict], name: str, plan: dict) -> str:
    """What a judged plan of planner ``name`` is reported as: ``name`` while it is that
    planner's last plan (``latest``: the task's last row by planner); after a re-plan, the
    label the plan was kept under (``scale.keep``), or ``name (an earlier plan)``."""
    if name in latest and latest[name]["plan"] == plan:
        return name
    kept = [n for n, r in latest.items() if n.startswith("neuroshard_") and r.get("plan") == plan]
    return kept[0] if kept else f"{name} (an earlier plan)"


def _run_labels(planned_rows: list[dict], measured_rows: list[dict]) -> dict[tuple, dict[str, str]]:
    """Per judged run of the held-out pools (``run_key``): each neuroshard_LABEL's
    ``plan_label`` (its own name where the run's plans cannot be told)."""
    names: dict[tuple, dict[str, None]] = {}
    for r in measured_rows:
        if r["pool_seed"] in HELD_OUT_POOL_SEEDS and r["planner"] not in (COPY, REFERENCE):
            names.setdefault(run_key(r), {})[r["planner"]] = None
    labels = {}
    for key, run in names.items():
        pool_seed, devices, sha = key[:3]
        plans, latest = run_plans(planned_rows, pool_seed, devices, list(run), sha), latest_plans(planned_rows, pool_seed, devices)
        labels[key] = {n: plan_label(latest, n, plans[n]) if plans else n for n in run if n.startswith("neuroshard_")}
    return labels


def variant_lines(measured_rows: list[dict], planned_rows: list[dict]) -> list[str]:
    """Per neuroshard_LABEL (another model, a kept plan), D and CPU kind: its compute over the shipped
    model's plan's in every run that judged both, pooled over runs (``runs_ratio_interval``:
    geometric mean, each run's units resampled), and NeuroShard's over the best heuristic's
    in the same runs. A plan is pooled under the label it has now (``plan_label``): a run
    of a plan since re-planned counts for the label it was kept under."""
    pairs: dict[tuple[str, int, str], list[tuple[Judged, Judged, Judged]]] = {}
    labels = _run_labels(planned_rows, measured_rows)
    for key, judged in judged_runs(measured_rows).items():
        best = best_heuristic(judged)
        for name in (n for n in judged if n.startswith("neuroshard_") and "neuroshard" in judged and best):
            pairs.setdefault((labels[key].get(name, name), key[1], cpu_label(key[3])), []).append((judged[name], judged["neuroshard"], judged[best]))
    if not pairs:
        return []
    lines = ["", "## NeuroShard against its variants (held-out pools, every run that judged both)", "",
             "| variant | D | judged on | runs (pool x run) | variant / neuroshard, pooled | variant / best heuristic "
             "| neuroshard / best heuristic |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (name, devices, cpu), judged in sorted(pairs.items()):
        ours = [interval_text(runs_ratio_interval([(a, b) for a, b, _ in judged]))]
        ours += [interval_text(runs_ratio_interval([(a, h) for a, _, h in judged])), interval_text(runs_ratio_interval([(b, h) for _, b, h in judged]))]
        lines.append(f"| {name} | {devices} | {cpu} | {len(judged)} | " + " | ".join(ours) + " |")
    return lines


def _pct(values: list[float]) -> str:
    return f"{100 * statistics.fmean(values):.1f}%" if values else "-"


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def file_sha256(path: Path) -> str:
    """The digest a planning row records of its model file (``model_sha256``)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def shipped_text(planned: Mapping[tuple, Mapping[str, dict]]) -> str:
    """Whose plans NeuroShard's rows are (``planned``: each task's last row by planner, as
    stored): the shipped ``cpu.pt``'s, or an earlier shipped file's, naming the rows whose
    planning model is the file shipped now."""
    sha = file_sha256(model_file("cpu"))
    made = _neuroshard_models(planned)
    if made <= {sha}:
        return "NeuroShard's rows are the plans of the shipped `cpu.pt`"
    now = _planned_by(planned, sha)
    return (
        f"NeuroShard's rows are the plans of the `cpu.pt` shipped when they were made (model sha256 "
        f"{', '.join(sorted(str(m) for m in made - {sha}))}), not of the file shipped now ({sha}), whose plans are the "
        f"rows {', '.join(now) or '(none yet)'}"
    )


def _neuroshard_models(planned: Mapping[tuple, Mapping[str, dict]]) -> set[str | None]:
    """The digests of the model files that made the "neuroshard" rows' plans."""
    return {r.get("model_sha256") for rows in planned.values() if (r := rows.get("neuroshard")) and r["status"] == "ok"}


def _planned_by(planned: Mapping[tuple, Mapping[str, dict]], sha: str) -> list[str]:
    """The neuroshard_LABEL rows planned by the model file of digest ``sha``."""
    return sorted({n for rows in planned.values() for n, r in rows.items() if n.startswith("neuroshard_") and r.get("model_sha256") == sha})


def shipped_planner(planned: Mapping[tuple, Mapping[str, dict]]) -> str | None:
    """The rows that hold the shipped ``cpu.pt``'s plans: "neuroshard" where that file made
    them, else the first neuroshard_LABEL it made (``shipped_text`` names them all). Read
    before ``scale.price_with_shipped`` re-prices the rows."""
    sha = file_sha256(model_file("cpu"))
    if _neuroshard_models(planned) <= {sha}:
        return "neuroshard"
    return next(iter(_planned_by(planned, sha)), None)


def shipped_lines(shipped: str, planned: Mapping[tuple, Mapping[str, dict]], judged: Mapping[tuple, Mapping[str, Judged]], measured_rows: list[dict]) -> list[str]:
    """``scale_ratios.versus_lines`` of ``shipped`` over the held-out tasks' last runs (``judged``: their passes)."""
    runs = {}
    for (pool_seed, devices), passes in judged.items():
        last = last_judged(measured_rows, pool_seed, devices)
        if pool_seed in HELD_OUT_POOL_SEEDS and last:
            config = JudgeConfig.of(last[0])
            status = planned[pool_seed, devices].get(TORCHREC, {}).get("status", "not planned")
            runs[pool_seed, devices] = TaskRun(passes, final_judgements(last, config), range(config.first_draw, config.first_draw + config.draws), status)
    return versus_lines(shipped, runs)


def write_report(machine: str, price: Callable[[int, int, dict[str, dict]], None] | None = None) -> str:
    """scale.md from the stored rows; ``price(pool_seed, devices, plans)``, if given, may
    replace a task's plans' predictions in place (``scale.price_with_shipped``)."""
    planned_rows, measured_rows = read_rows(PLANNED), read_rows(MEASURED)
    tasks = sorted({(r["pool_seed"], r["devices"]) for r in planned_rows if "pool_seed" in r}, key=lambda t: (t[0] not in HELD_OUT_POOL_SEEDS, t))
    planned = {t: latest_plans(planned_rows, *t) for t in tasks}
    whose, shipped = shipped_text(planned), shipped_planner(planned)  # read before ``price`` re-prices them
    for t in tasks if price else []:
        price(*t, planned[t])
    judged = {t: judged_task(measured_rows, *t) for t in tasks}
    lines = [
        "# 856 tables on 8 to 128 devices, measured device by device",
        "",
        f"`python -m benchmarks.scale plan && python -m benchmarks.scale measure && python -m benchmarks.scale final && python -m benchmarks.scale report`; "
        f"report written on {machine}, {datetime.date.today().isoformat()}; each task's rows are its last judged run, "
        "one thread, on the CPU the judge's table names ('judged on'). Compute: each device of every plan "
        "timed as DMP runs it (fused kernels, and the data-parallel tables' dense kernel and update at the device's "
        "local batch; rows / 64, global batch 4,096) by `lab.judge`; a plan's compute is its slowest device's median over "
        "units (pass x draw x round); ratios of compute with a 90% paired bootstrap interval over units; 'units fastest': "
        "the units in which the plan's slowest device was the least of all timed plans. Predicted: the slowest device as "
        "the shipped model prices it now (a neuroshard_LABEL row planned by another model file: as that model priced it). Planning s with the machine's 1-min load average before -> after. "
        f"{whose}, measured on {shipped_hardware()['cpu'].describe()}: a planner on "
        "another CPU kind loads that kind's shipped model where there is one (`costmodel.pretrained_for`): a row "
        "neuroshard_LABEL planned with it is what a user there gets."
        + (" Where a run timed the judge's reference, each time is divided by the reference's in its round (`JudgeConfig.reference`)." if any(r.get("reference") for r in measured_rows) else ""),
    ]
    for pool_seed in dict.fromkeys(p for p, _ in tasks):
        label = "held out: no training kernel came from it" if pool_seed in HELD_OUT_POOL_SEEDS else "the TRAINING pool: claims are not made on it"
        lines += [
            "", f"## Pool seed {pool_seed} ({label})", "",
            "| D | planner | compute ms | slowest / mean device | / TorchRec | / best heuristic timed | units fastest "
            "| predicted ms | planning s (load) | kinds |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]  # fmt: skip
        for t in (t for t in tasks if t[0] == pool_seed):
            lines += task_lines(*t, planned[t], judged[t])
    lines += shipped_lines(shipped, planned, judged, measured_rows) if shipped else []
    lines += judge_lines(measured_rows, tasks)
    lines += variant_lines(measured_rows, planned_rows)
    lines += ["", "## The cost model against the measured devices (held-out pools)", "", MODEL_NOTE]
    cpus = {t: cpu_label(last[0].get("cpu")) for t in tasks if (last := last_judged(measured_rows, *t))}
    for cpu in sorted(set(cpus.values())):  # a model's level is the CPU's: one table a CPU kind
        lines += ["", f"Judged on {cpu}:", ""] + model_lines(planned, {t: j for t, j in judged.items() if cpus.get(t) == cpu})
    text = "\n".join(lines) + "\n"
    RESULT.write_text(text)
    return text
