"""The layout the package promises: the planner core never imports the lab, and the lab's
measuring and collecting modules import without torchrec."""

import subprocess
import sys

CORE = ("types", "access", "tables", "costmodel", "search", "heuristics", "planner", "estimators", "sharding", "stats")
LAB_WITHOUT_TORCHREC = ("measure_compute", "measure_comm", "collect", "collect_step", "workloads", "pretrain")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_core_imports_nothing_from_the_lab():
    imports = "; ".join(f"import torchrec_neuroshard.{m}" for m in CORE)
    loaded = _run(f"import sys; {imports}; print(sorted(m for m in sys.modules if '.lab' in m))")
    assert loaded.strip() == "[]", f"the core pulled in lab modules: {loaded}"


def test_lab_measuring_and_collecting_import_without_torchrec():
    blocker = (
        "import sys, importlib.abc\n"
        "class NoTorchrec(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torchrec' or name.startswith('torchrec.'):\n"
        "            raise ImportError('torchrec is blocked in this test')\n"
        "sys.meta_path.insert(0, NoTorchrec())\n"
    )
    imports = "\n".join(f"import torchrec_neuroshard.lab.{m}" for m in LAB_WITHOUT_TORCHREC)
    _run(blocker + imports + "\nprint('ok')")
