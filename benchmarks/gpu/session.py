"""A lent GPU's whole session, prepared: one call times what is most worth timing and
writes everything under $OUT.

    python3 benchmarks/gpu/session.py --budget-s 540 --out "$OUT"   # on the GPU (carry .gpu)
    python -m benchmarks.gpu.session --device cpu --out DIR           # here: the dry run (tests/test_gpu_session.py)

On the GPU (``run(command="python3 benchmarks/gpu/session.py --budget-s 540 --out $OUT",
carry=[".gpu"], timeout_s=600)``, after ``python -m benchmarks.gpu.bundle`` here):

1. unpacks the carried fbgemm bundle (``run.sh``: fbgemm-gpu 1.6 for sm_90, torchrec 1.6.1);
2. ``benchmarks.scale_full measure``: the full-size plans of held-out pool 2 at D = 16, 32,
   128, then 64 and 8 (and pools 3, 4 where plans are stored), NeuroShard, TorchRec and
   size_lookup, each device timed as DMP builds it, rows appended as measured to
   ``$OUT/scale_full_measured.jsonl``, devices already given back (committed as
   ``benchmarks/results/scale_full_measured.jsonl.gz``) skipped. It gets the budget less
   what unpacking took and ``--leftovers-s``;
3. ``benchmarks.uvm_gpu measure``: the stored UVM plans of the held-out tasks (planned
   2026-12-02; pool 0's were measured in sessions 1-2 and are kept as such) as the next session, and
   ``tests/test_uvm_dmp_gpu.py`` (a plan with UVM kernels through DMP on one GPU).

Each step's output goes to ``$OUT/<step>.log``, and ``$OUT/session.json`` says how each
ended and took. After the call: append the rows to the committed files (``gzip -c``
``scale_full_measured.jsonl >> benchmarks/results/scale_full_measured.jsonl.gz``; the
uvm rows to ``benchmarks/results/uvm_gpu.jsonl``), so the next lent session continues.

``--device cpu`` is the dry run: the same steps at rows / 64 on ``benchmarks.scale``'s stored
CPU plans of the same tasks at D = 32 and 128, 2 devices a task (``scale_full --dry-run``), no bundle, the UVM
measurement skipped (it needs a GPU) and the GPU test collected (it skips): about 40 s here.

Device time, MEASURED (2026-12-04, the first lent session, an H200; ``--budget-s 530``, then
``scale_full measure --budget-s 220`` on the warm machine): unpacking 6 s; a pool's ids 94-97 s
(both draws; the estimate's host rates had said 13 s, so ``scale_full.IDS_S`` now refuses to
start a pool that the budget left cannot draw); pool 2's visits at D = 16, 32, 128, 64, 8:
53, 55, 101, about 75 and 53 s for three plans. One call's at-scale step (374 s of a 530 s
budget) holds one pool's ids and its D = 16, 32 and 128 with room to spare; the UVM step's
100 s deadline held one round of its first task. Pool 2 is measured at every D; pools 3 and
4 at D = 16, 32, 128 are next (``python -m benchmarks.scale_full estimate`` still bounds the
kernels from the H200 rows).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEFTOVERS_S = 150.0
"""Of the budget, what issue 27's leftovers get after the at-scale timing (UVM plans 100 s, the test 50 s)."""
GRACE_S = 60.0
"""Past its budget, how long a step may run before it is killed (a visit in flight ends)."""
UVM_ROWS = ROOT / "benchmarks" / "results" / "uvm_gpu.jsonl"
OLDEST = Path(sys.prefix) / "torchrec-1.6.1"
"""The dry run's torchrec where ``make venv`` unpacked it: the lent GPUs' release (bundle.py)."""


def python_path(device: str) -> str:
    """The steps' PYTHONPATH: on a GPU ``run.sh`` puts the bundle first; the dry run runs on
    torchrec 1.6.1 too where it is unpacked, as ``tests/test_oldest_torchrec.py`` does."""
    return os.pathsep.join([str(OLDEST)] * (device == "cpu" and OLDEST.is_dir()) + [str(ROOT)])


def next_uvm_session() -> int:
    """The label of this session's UVM rows: one past the committed rows' last."""
    if not UVM_ROWS.exists():
        return 1
    return 1 + max((json.loads(line)["session"] for line in UVM_ROWS.read_text().splitlines() if line.strip()), default=0)


def steps(device: str, out: Path, at_scale_s: float) -> list[tuple[str, list[str], float]]:
    """(name, command, seconds it may take) of each step after unpacking."""
    if device == "cuda":
        python = ["bash", "benchmarks/gpu/run.sh", "python3"]
        scale = ["--device", "cuda"]
    else:
        python = [sys.executable]
        # D = 16 runs the same code as D = 32, and its two devices' 265 tables took 40 s here
        scale = ["--device", "cpu", "--dry-run", "--pool-seeds", "2", "--devices", "32", "128"]
    out_dir = ["--out", str(out)]
    measure = [*python, "-m", "benchmarks.scale_full", "measure", *scale, "--budget-s", f"{at_scale_s:.0f}", *out_dir]
    uvm = [*python, "-m", "benchmarks.uvm_gpu", "measure", *out_dir, "--deadline-s", "100", "--session", str(next_uvm_session())]
    test = [*python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_uvm_dmp_gpu.py"]
    plan = [("scale_full", measure, at_scale_s + GRACE_S), ("uvm_gpu", uvm, 100 + GRACE_S), ("test_uvm_dmp_gpu", test, 50 + GRACE_S)]
    return [s for s in plan if device == "cuda" or s[0] != "uvm_gpu"]  # the UVM kernels need a GPU


def run_step(name: str, command: list[str], limit_s: float, out: Path, device: str = "cuda") -> dict:
    """Run one step, its output to ``out/<name>.log``; killed past ``limit_s``."""
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        try:
            env = dict(os.environ, PYTHONPATH=python_path(device), PYTHONWARNINGS="ignore")
            rc = subprocess.run(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            rc = "killed: past its limit"
    done = {"step": name, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "command": " ".join(command), "pythonpath": python_path(device)}
    print(json.dumps(done), flush=True)
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-s", type=float, default=540.0, help="seconds the whole session may take (a call: at most 600)")
    p.add_argument("--out", type=Path, required=True, help="where everything goes ($OUT on the GPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the dry run")
    p.add_argument("--leftovers-s", type=float, default=LEFTOVERS_S, help="of the budget, what issue 27's leftovers keep (0: all to the at-scale timing)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    done = []
    if args.device == "cuda":
        if not (ROOT / ".gpu" / "fbgemm_sm90.tar.xz").exists():
            p.error("no .gpu/ bundle here: build it with `python -m benchmarks.gpu.bundle` and carry .gpu")
        done.append(run_step("unpack", ["bash", "benchmarks/gpu/run.sh", "true"], 120, args.out))
    at_scale_s = args.budget_s - (time.monotonic() - t0) - (args.leftovers_s if args.device == "cuda" else 0.0)
    if at_scale_s < 60:
        p.error(f"budget {args.budget_s:.0f} s leaves {at_scale_s:.0f} s for the at-scale timing: give more")
    for name, command, limit_s in steps(args.device, args.out, at_scale_s):
        remaining = args.budget_s + GRACE_S - (time.monotonic() - t0)
        done.append(run_step(name, command, min(limit_s, remaining), args.out, args.device))
    (args.out / "session.json").write_text(json.dumps({"device": args.device, "budget_s": args.budget_s, "steps": done}, indent=1))
    return 0 if all(d["rc"] == 0 for d in done) else 1


if __name__ == "__main__":
    sys.exit(main())
