"""The planners the benchmarks compare: one task's plan by name, the calibrated-model
variant and its file, the hardware check, and the geometric mean their figures use.

Shared by ``benchmarks.compare`` (the evaluator) and the DMP harness (``lab.dmp_measure``).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from torchrec_neuroshard.costmodel import NeuralCostModel
from torchrec_neuroshard.hardware import model_vs_machine
from torchrec_neuroshard.heuristics import baseline_plan
from torchrec_neuroshard.lab.launch import default_device
from torchrec_neuroshard.lab.torchrec_baseline import torchrec_plan
from torchrec_neuroshard.search import SearchConfig, default_scales, search
from torchrec_neuroshard.sharding import from_torchrec
from torchrec_neuroshard.tables import sharder_choices
from torchrec_neuroshard.types import Plan, ShardingError, Task

CALIBRATED = "neuroshard_calibrated"
"""NeuroShard's search with a calibrated model file (``--calibrated``): not in PLANNERS,
the option adds it."""
RIVALS = {"neuroshard": CALIBRATED, CALIBRATED: "neuroshard"}
"""The NeuroShard variant each one's "fastest / cheapest of all planners" leaves out."""
SHA256_PREFIX = 16

@dataclass(frozen=True)
class CalibratedModel:
    """A model file made by ``neuroshard calibrate``: what plans the ``neuroshard_calibrated``
    rows, each of which records its path and sha256 prefix (``record``)."""

    path: Path
    sha256: str
    model: NeuralCostModel

    @staticmethod
    def load(path: Path) -> "CalibratedModel":
        model = NeuralCostModel.load(path)
        if "calibration" not in model.meta:
            raise ShardingError(
                f"{path} is not a calibrated model (its meta has no 'calibration' record); make one on this "
                f"machine with `neuroshard calibrate --out {path}`"
            )
        return CalibratedModel(Path(path), hashlib.sha256(Path(path).read_bytes()).hexdigest(), model)

    def record(self) -> dict:
        return {"path": str(self.path), "sha256": self.sha256[:SHA256_PREFIX]}

    def check_resumes(self, rows: Sequence[dict], results: Path) -> None:
        """Refuse to add rows to a results file whose calibrated rows another file planned."""
        others = {json.dumps(r["cost_model_file"]) for r in rows if r.get("cost_model_file", self.record()) != self.record()}
        if others:
            raise ShardingError(
                f"{results} holds {CALIBRATED} rows planned by {sorted(others)}, not by {self.record()}; pass that "
                "model file to --calibrated to resume, or --name a new results file"
            )


def check_machine(model: NeuralCostModel, allow_mismatch: bool, which: str = "") -> None:
    """Print the model's hardware beside this machine's (``model_vs_machine``); a mismatch
    is an error unless ``allow_mismatch``. ``which`` names the model in both."""
    line, why = model_vs_machine(model.hardware, default_device().type)
    print(f"{which}{line}")
    if why:
        if not allow_mismatch:
            raise ShardingError(f"{which}{why}. Or pass --allow-mismatch to measure the mismatch itself")
        print(f"WARNING (--allow-mismatch): {which}{why}")


def calibrated_files(rows: Sequence[dict]) -> str:
    """The model files (path, sha256 prefix) that planned the calibrated rows, as text."""
    files = dict.fromkeys(f"`{r['cost_model_file']['path']}` (sha256 {r['cost_model_file']['sha256']})" for r in rows if "cost_model_file" in r)
    return ", ".join(files) or "an unrecorded model file"


def plan_task(name: str, task: Task, model: NeuralCostModel, calibrated: NeuralCostModel | None = None) -> Plan:
    """``name``'s plan of ``task``; NeuroShard's variants search with ``model`` (the shipped
    one) or ``calibrated`` (``neuroshard_calibrated``)."""
    device_type = default_device().type
    choices = sharder_choices(task.tables, device_type)  # what TorchRec's default sharder offers here
    if name == "neuroshard":
        return search(task, model, choices=choices).plan
    if name == CALIBRATED:
        if calibrated is None:
            raise ShardingError(f"{CALIBRATED} plans with a calibrated model file: pass --calibrated PATH")
        return search(task, calibrated, choices=choices).plan
    if name == "neuroshard_nolocal":
        return search(task, model, SearchConfig(local_search=False), choices).plan
    if name == "neuroshard_prototype":
        # the published algorithm alone: no baseline seeding, no local pass, no
        # unconstrained last grid point
        config = SearchConfig(scales=default_scales()[:-1], local_search=False, seed_with_baselines=False)
        return search(task, model, config, choices).plan
    if name == "torchrec":
        return from_torchrec(torchrec_plan(task, device_type), task.num_devices)
    if name == "torchrec_neural":
        return from_torchrec(torchrec_plan(task, device_type, neural=model), task.num_devices)
    if name == "torchrec_default_memory":
        return from_torchrec(torchrec_plan(task, device_type, default_memory=True), task.num_devices)
    return baseline_plan(name, task)



def geomean(xs: Sequence[float]) -> float:
    return math.exp(statistics.mean(math.log(x) for x in xs)) if xs else float("nan")


def ratio_cells(values: Mapping[str, float], names: Sequence[str], ratios: dict[str, list[float]], missing: str, digits: int = 2) -> list[str]:
    """A table row's cells: each planner's value and, in parentheses, its ratio to
    TorchRec's (``values["torchrec"]``), ``missing`` where a planner has none; each ratio
    is also appended to ``ratios[name]`` (TorchRec's own included)."""
    ref = values.get("torchrec")
    cells = []
    for name in names:
        if name not in values:
            cells.append(missing)
            continue
        if ref:
            ratios[name].append(values[name] / ref)
        cells.append(f"{values[name]:.2f}" + (f" ({values[name] / ref:.{digits}f})" if ref else ""))
    return cells

