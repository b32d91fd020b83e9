"""The hardware a cost model was measured on, the hardware a plan is for, and the check
that they are the same kind.

A cost model predicts the kernels and collectives of the machine its samples were measured
on: a plan made with another machine's costs is a plan for that other machine. Every model
file records its ``Hardware``; the planner compares it with the topology's device kind and,
where this process can see it, the local CPU or GPU, and warns with the command that makes a
model for this machine (``neuroshard calibrate``).
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

DEVICE_KINDS = ("cpu", "cuda")


@dataclass(frozen=True)
class Hardware:
    """One machine kind: device kind, its name, and for CPUs the cores the process may use.

    ``name`` is the CPU's ``model name`` (``/proc/cpuinfo``) or the GPU's
    ``torch.cuda.get_device_name``; ``cores`` is None for GPUs.
    """

    device: str
    name: str
    cores: int | None = None

    def __post_init__(self) -> None:
        if self.device not in DEVICE_KINDS:
            raise ValueError(f"hardware device {self.device!r} is not one of {DEVICE_KINDS}")
        if not self.name:
            raise ValueError(f"{self.device} hardware needs a name (the CPU model or GPU name)")
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"hardware {self.name!r}: cores must be >= 1 or None, got {self.cores}")

    def describe(self) -> str:
        cores = f", {self.cores} cores" if self.cores else ""
        return f"{self.device} {self.name}{cores}"

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_record(d: dict) -> "Hardware":
        """From a model file's or dataset row's ``hardware`` record (``device``,
        ``device_name``, ``cores``; older records without cores give None)."""
        cores = d.get("cores")
        return Hardware(str(d["device"]), str(d.get("device_name") or "unknown"), int(cores) if cores else None)

    def mismatch(self, other: "Hardware") -> str | None:
        """Why ``other`` is not this machine kind, or None if it is. GPUs compare by
        name; CPUs by name and core count (a core count that is unknown on either side
        is not compared)."""
        if self.device != other.device:
            return f"device kind {self.device} vs {other.device}"
        if self.name != other.name:
            return f"{self.device} {self.name!r} vs {other.name!r}"
        if self.cores and other.cores and self.cores != other.cores:
            return f"{self.cores} vs {other.cores} cores"
        return None


def cpu_name() -> str:
    """The CPU's model name as Linux reports it, else the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask, which containers restrict)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def vector_isa() -> str:
    """The vector instructions torch's CPU kernels use here ("AVX512", "AVX2", ...): two AMD
    EPYCs of one name, one with AVX-512, timed the same kernels 2x apart (2026-12-07), so
    measurements record it beside the CPU's name."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def local_hardware(device: str) -> Hardware | None:
    """This machine's hardware of kind ``device``; None for "cuda" when no GPU is visible."""
    if device == "cpu":
        return Hardware("cpu", cpu_name(), cpu_cores())
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return None
        return Hardware("cuda", torch.cuda.get_device_name(torch.cuda.current_device()))
    raise ValueError(f"unknown device kind {device!r}; expected one of {DEVICE_KINDS}")


def calibrate_command(device: str) -> str:
    """The command that makes a cost model for this machine's ``device``."""
    return f"neuroshard calibrate --device {device} --out my_{device}.pt"


def hardware_mismatch(model_hw: Hardware, device: str) -> str | None:
    """A warning text if a model measured on ``model_hw`` does not fit planning for
    ``device`` on this machine; None when it does (or when the local GPU is not visible and
    the device kinds agree: only the kind can be compared then)."""
    if model_hw.device != device:
        return (
            f"the cost model was measured on {model_hw.describe()} but the topology's compute "
            f"device is {device}: its predictions are another machine's costs. Run "
            f"`{calibrate_command(device)}` on a {device} machine and pass cost_model=\"my_{device}.pt\""
        )
    here = local_hardware(device)
    why = model_hw.mismatch(here) if here is not None else None
    if why is None:
        return None
    return (
        f"the cost model was measured on {model_hw.describe()}, this machine is "
        f"{here.describe()} ({why}): its predictions may be off by tens of percent. Run "
        f"`{calibrate_command(device)}` (a few minutes) and pass cost_model=\"my_{device}.pt\""
    )


def model_vs_machine(model_hw: Hardware, device: str) -> tuple[str, str | None]:
    """A line naming the model's hardware beside this machine's ``device``, and the mismatch
    warning (``hardware_mismatch``) or None: what every benchmark prints first."""
    here = local_hardware(device)
    line = (
        f"cost model measured on: {model_hw.describe()}; this machine: "
        f"{here.describe() if here else f'no {device} visible'}"
    )
    return line, hardware_mismatch(model_hw, device)
