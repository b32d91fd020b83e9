"""The least fbgemm-gpu that runs our kernels on an sm_90 GPU (H100/H200), small enough to
carry to a lent GPU machine (at most 64 MiB a call), with the wheels TorchRec needs there.

    python -m benchmarks.gpu.bundle      # here: writes .gpu/ (git-ignored), ~38 MB

The machine has Python 3.12 and torch 2.11.0+cu130; fbgemm-gpu 1.6.0 (CUDA 13) matches it,
but its wheel unpacks to 2.5 GB. Its libraries keep device code for sm_80, sm_90 and sm_100
in their ``.nv_fatbin`` sections, one fatbin per translation unit. ``prune`` zeroes the
payload of every entry a training TBE with EXACT_SGD never loads on sm_90: all entries of
other architectures, every entry of the inference, VBE and GWD libraries, and the backward
library's entries for other optimizers (their kernels are named after the optimizer). The
entries' headers stay, so the libraries load; CUDA loads a module only when one of its
kernels first runs (``CUDA_MODULE_LOADING=LAZY``, which ``run.sh`` sets), and the zeros
xz away. torchrec 1.6.1 (the release beside fbgemm-gpu 1.6; torchrec 1.7 and 1.8 import
``fbgemm_gpu.tbe.monitoring``, which 1.6 lacks), the pure-Python packages it and the planner
need that the machine may lack (threadpoolctl among them) travel as wheels (pytest is the image's). The
lab's measuring code and the planner run on torchrec 1.6.1 (the planner's TorchRec calls
are those 1.6 has), so the GPU tests run there too::

    bash benchmarks/gpu/run.sh python3 -m pytest -q tests/test_uvm_dmp_gpu.py
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

OUT = Path(".gpu")
FBGEMM = "fbgemm-gpu==1.6.0"
WHEELS = (
    "torchrec==1.6.1", "tensordict==0.15.3", "iopath==0.1.9", "pyvers==0.2.3",
    "threadpoolctl==3.8.0",
)  # fmt: skip
"""pytest and its needs (pluggy, iniconfig, packaging, pygments) are in the H200 image
(KINDS.md) and stay behind: with them the bundle (47.5 MB) and the tree (20.3 MB on
2026-12-04) passed a call's 64 MiB; the GPU test ran on the image's pluggy, iniconfig,
packaging and pygments that day."""
SM = 90
CALL_LIMIT = 64 << 20
"""What one device call may send: the working tree and the carried bundle together."""
FATBIN_MAGIC = 0xBA55ED50
ZSTD_MAGIC = b"(\xb5/\xfd"
NOT_LOADED = {"fbgemm_gpu_tbe_inference.so", "fbgemm_gpu_tbe_training_backward_gwd.so", "fbgemm_gpu_tbe_training_backward_vbe.so"}
BACKWARD = "fbgemm_gpu_tbe_training_backward.so"
OPTIMIZER_TU = re.compile(rb"gen_embedding_backward_([a-z_]+?)_(?:split|dense|ssd)")


def fatbin_section(path: Path) -> tuple[int, int] | None:
    """(file offset, size) of the library's ``.nv_fatbin`` section, None without one."""
    out = subprocess.run(["readelf", "-S", "-W", str(path)], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        if " .nv_fatbin " in line:
            fields = line.split("]")[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    return None


def fatbin_entries(data: bytes | bytearray, offset: int, size: int):
    """(payload start, payload size, sm) of every entry of every fatbin in the section."""
    pos, end = offset, offset + size
    while pos < end:
        magic, _, header, body = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # alignment padding between fatbins
            continue
        entry, stop = pos + header, pos + header + body
        while entry < stop:
            _, _, entry_header, padded = struct.unpack_from("<HHII", data, entry)
            sm = struct.unpack_from("<I", data, entry + 28)[0]
            yield entry + entry_header, padded, sm
            entry += entry_header + padded
        pos = stop


def optimizers(payload: bytes) -> set[bytes]:
    """Optimizers named by the backward kernels of one entry (empty: not an optimizer's)."""
    if payload[:4] == ZSTD_MAGIC:
        try:
            import zstandard
        except ImportError:
            return set()  # compressed and unreadable here: kept
        try:
            payload = zstandard.ZstdDecompressor().decompressobj().decompress(payload)
        except zstandard.ZstdError:
            return set()
    return set(OPTIMIZER_TU.findall(payload))


def prune(path: Path) -> int:
    """Zero what a sm_90 EXACT_SGD training TBE never loads; returns the bytes kept."""
    section = fatbin_section(path)
    if section is None:
        return 0
    data = bytearray(path.read_bytes())
    kept = 0
    for start, size, sm in list(fatbin_entries(data, *section)):
        drop = sm != SM or path.name in NOT_LOADED
        if not drop and path.name == BACKWARD:
            named = optimizers(bytes(data[start : start + size]))
            drop = bool(named) and b"sgd" not in named
        if drop:
            data[start : start + size] = bytes(size)
        else:
            kept += size
    path.write_bytes(data)
    return kept


def download(spec: str, into: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
         "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64", "-d", str(into), spec],
        check=True, capture_output=True,
    )  # fmt: skip
    name = spec.split("==")[0].replace("-", "_")
    return next(into.glob(f"{name}-*.whl"))


def main() -> None:
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        unpacked = Path(tmp) / "site"
        with zipfile.ZipFile(download(FBGEMM, Path(tmp))) as wheel:
            wheel.extractall(unpacked)
        for lib in sorted((unpacked / "fbgemm_gpu").glob("*.so")):
            print(f"{lib.name}: {prune(lib) >> 20} MiB of device code kept", flush=True)
        subprocess.run(f"tar cf - -C {unpacked} . | xz -T0 -9 > {OUT / 'fbgemm_sm90.tar.xz'}", shell=True, check=True)
        for spec in WHEELS:
            wheel = download(spec, Path(tmp))
            (OUT / wheel.name).write_bytes(wheel.read_bytes())
    bundle = sum(f.stat().st_size for f in OUT.iterdir())
    print(f"wrote {OUT}: {bundle >> 20} MiB")
    tree = travelling_bytes()
    if bundle + tree > CALL_LIMIT:
        sys.exit(f"the bundle ({bundle / 1e6:.1f} MB) and the working tree ({tree / 1e6:.1f} MB) pass a device call's {CALL_LIMIT >> 20} MiB: "
                 "make the tree or the bundle smaller before asking for a GPU")  # fmt: skip
    print(f"with the working tree ({tree / 1e6:.1f} MB): {(bundle + tree) / CALL_LIMIT:.0%} of a device call's {CALL_LIMIT >> 20} MiB")


def travelling_bytes() -> int:
    """Bytes of what a device call sends besides carried paths: tracked files, and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], capture_output=True, check=True).stdout
    return sum(Path(n).stat().st_size for n in names.decode().split("\0") if n and Path(n).is_file())


if __name__ == "__main__":
    main()
