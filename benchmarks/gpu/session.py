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
   what unpacking took and ``LEFTOVERS_S``;
3. issue 27's leftovers: ``benchmarks.uvm_gpu measure`` (the stored UVM plans; neuroshard-room
   and torchrec-scaleup were never measured) as the next session, and
   ``tests/test_uvm_dmp_gpu.py`` (a plan with UVM kernels through DMP on one GPU).

Each step's output goes to ``$OUT/<step>.log``, and ``$OUT/session.json`` says how each
ended and took. After the call: append the rows to the committed files (``gzip -c``
``scale_full_measured.jsonl >> benchmarks/results/scale_full_measured.jsonl.gz``; the
uvm rows to ``benchmarks/results/uvm_gpu.jsonl``), so the next lent session continues.

``--device cpu`` is the dry run: the same steps at rows / 64 on ``benchmarks.scale``'s stored
CPU plans of the same tasks, 2 devices a task (``scale_full --dry-run``), no bundle, the UVM
measurement skipped (it needs a GPU) and the GPU test collected (it skips): about 40 s here.

Device time (the target: D = 16, 32, 128 for three planners within 10 device-minutes on an
H100 or H200), estimated from the dry run's work counts and the H200 kernel rows, not yet
measured on a GPU. Visits: (16 + 32 + 128) devices x 2 passes = 352, each building and
timing 3 plans' TBEs over 2 draws x 2 rounds x (1 untimed + 3 timed) steps = 16 steps a
plan. Kernel time: the slowest H200 kernel in ``lab/data/h200_compute.jsonl.gz`` runs at
about 1 ms per 6M lookups x 128 of width forward+backward; a full-size device reads the global
batch's ids of its tables (about 887M lookups x a mean width of 42 over D devices), so a
D = 16 device's step is under ~25 ms, D = 32 under ~12 ms, D = 128 under ~4 ms: 352 x 3 x 16
steps take under ~2.5 minutes, upper bound. Host time, the larger part: the ids (887M a draw,
sampled on the machine's 16 cores: about 20 s a draw from the dry run's 10 s for 265 tables on
2 cores) and each visit's TBE builds and id copies (the dry run: 0.3-2 s a visit at rows / 64
on one core; at full size the ids are 16 x, weights 64 x but built on the GPU): about 0.3 s a
plan-visit, 5 minutes. With unpacking (~30 s) and the machine's start (counted, ~2 minutes),
the three D take 8-10 device-minutes: within the target, barely; ``--budget-s`` stops before a
visit that would pass it, so an overrun loses only the visits not started.
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
        scale = ["--device", "cpu", "--dry-run", "--pool-seeds", "2", "--devices", "16", "32", "128"]
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
    args = p.parse_args(argv)
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    done = []
    if args.device == "cuda":
        if not (ROOT / ".gpu" / "fbgemm_sm90.tar.xz").exists():
            p.error("no .gpu/ bundle here: build it with `python -m benchmarks.gpu.bundle` and carry .gpu")
        done.append(run_step("unpack", ["bash", "benchmarks/gpu/run.sh", "true"], 120, args.out))
    at_scale_s = args.budget_s - (time.monotonic() - t0) - (LEFTOVERS_S if args.device == "cuda" else 0.0)
    if at_scale_s < 60:
        p.error(f"budget {args.budget_s:.0f} s leaves {at_scale_s:.0f} s for the at-scale timing: give more")
    for name, command, limit_s in steps(args.device, args.out, at_scale_s):
        remaining = args.budget_s + GRACE_S - (time.monotonic() - t0)
        done.append(run_step(name, command, min(limit_s, remaining), args.out, args.device))
    (args.out / "session.json").write_text(json.dumps({"device": args.device, "budget_s": args.budget_s, "steps": done}, indent=1))
    return 0 if all(d["rc"] == 0 for d in done) else 1


if __name__ == "__main__":
    sys.exit(main())
