"""README's `pip install .` from a clone, into a fresh virtual environment: the installed
package plans with its shipped models, and holds none of the lab's datasets."""

import shutil
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[1]
CLONE_FILES = ("setup.py", "README.md", "torchrec_neuroshard")

PLAN = """
import pathlib, torchrec_neuroshard
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import Topology
from torchrec_neuroshard import NeuroShardPlanner
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.tables import module_for_tables

package = pathlib.Path(torchrec_neuroshard.__file__).parent
print("package", package)
print("models", sorted(p.name for p in (package / "pretrained").glob("*.pt")))
print("datasets", sorted(p.name for p in package.rglob("*.jsonl*")))
task = generate_task(synthetic_pool(), 8, 2, WorkloadScale(), seed=0)
topology = Topology(world_size=2, compute_device="cpu", local_world_size=2, ddr_cap=task.memory_cap_bytes)
plan = NeuroShardPlanner(topology, task.batch_size // 2).plan(module_for_tables(task.tables), [EmbeddingBagCollectionSharder()])
print("tables", len(next(iter(plan.plan.values()))))
"""


def test_pip_install_from_a_clone_plans_with_the_shipped_models_and_no_datasets(tmp_path) -> None:
    clone = tmp_path / "clone"
    for name in CLONE_FILES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            clone.mkdir(exist_ok=True)
            shutil.copy(source, clone / name)
    env = tmp_path / "env"
    venv.create(env)  # no pip, setuptools or anything else of its own
    python = env / "bin" / "python"
    # torch, torchrec, pip and setuptools come from this interpreter's packages, offline;
    # the venv's own site-packages, where the package installs, come first
    purelib = subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True)
    (Path(purelib.strip()) / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [python, "-m", "pip", "install", "--quiet", "--no-index", "--no-build-isolation", str(clone)]
    subprocess.run(install, check=True, cwd=tmp_path)
    out = subprocess.run([python, "-c", PLAN], check=True, cwd=tmp_path, capture_output=True, text=True).stdout
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert lines["package"].startswith(str(env)), out  # the installed copy, not the checkout
    assert lines["models"] == "['cpu.pt', 'h200.pt', 'intel_xeon.pt']"
    assert lines["datasets"] == "[]"
    assert lines["tables"] == "8"
    assert (env / "bin" / "neuroshard").exists()
