"""README's snippets are the files under examples/, and they run."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*cmd: str) -> str:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_every_readme_snippet_is_an_example_file() -> None:
    snippets = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert snippets
    examples = {p.name: p.read_text() for p in (ROOT / "examples").glob("*.py")}
    for snippet in snippets:
        assert any(snippet == text for text in examples.values()), f"README snippet is no example file:\n{snippet[:300]}"


@pytest.mark.dmp
def test_quickstart_plans_and_trains_under_dmp_on_two_gloo_ranks() -> None:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    out = _run(torchrun, "--standalone", "--nproc_per_node", "2", "examples/quickstart.py")
    assert "t_user" in out and "t_item" in out and "fused" in out


@pytest.mark.slow
def test_our_estimator_inside_torchrecs_planner_does_not_replicate_every_table() -> None:
    out = _run(sys.executable, "examples/estimator_in_torchrec.py")
    kinds = re.findall(r"^t\d\s+\|\s+(\w+)\s+\|", out, re.M)
    assert len(kinds) == 4 and set(kinds) != {"data_parallel"}, out


@pytest.mark.dmp
def test_the_demo_trains_dlrm_under_each_planners_plan_on_two_gloo_ranks() -> None:
    """``make demo``'s example, with fewer steps: both planners' plans hold all 16 tables and
    each planner gets a samples/s figure on each rank."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    out = _run(torchrun, "--standalone", "--nproc_per_node", "2", "examples/dlrm_torchrun.py", "--planner", "neuroshard,torchrec", "--steps", "2", "--warmup", "1")
    for name in ("neuroshard", "torchrec"):
        plan = out.split(f"== {name} plan")[1].split("\n\n")[0]
        assert len(re.findall(r"\bt\d+\[64\]", plan)) == 16, plan
        assert re.search(rf"^{name}\s+\d+ \(\d+-\d+\)\s+\d+ \(\d+-\d+\)$", out, re.M), out
