"""The cost models shipped with the package, which one plans a topology, and the warnings
a user gets when a model is used beyond what it learned.

Every model file records the hardware its samples were measured on; ``cost_model_for``
picks the shipped model for a topology and this machine and warns on a mismatch, and
prices a world beyond the comm model's reach by the topology's links (``_within_reach``).
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from torchrec_neuroshard.comm import AlphaBetaComm
from torchrec_neuroshard.costmodel.neural import NeuralComm, NeuralCostModel
from torchrec_neuroshard.hardware import Hardware, hardware_mismatch, local_hardware
from torchrec_neuroshard.steparts import COLLECTIVES
from torchrec_neuroshard.types import ShardingError, TableSpec

logger = logging.getLogger(__name__)

PRETRAINED_DIR = Path(__file__).parents[1] / "pretrained"

DEFAULT_PRETRAINED = {"cpu": "cpu", "cuda": "h200"}
"""The shipped model a device kind falls back to when none was measured on this machine."""


def shipped_file(name: str) -> Path:
    """The file of the shipped model ``name``: ``torchrec_neuroshard/pretrained/<name>.pt``."""
    path = PRETRAINED_DIR / f"{name}.pt"
    if not path.exists():
        have = sorted(p.stem for p in PRETRAINED_DIR.glob("*.pt"))
        raise ShardingError(f"no pretrained cost model {name!r}; shipped: {have}, or pass the path of a .pt file")
    return path


def load_pretrained(name: str = "cpu") -> NeuralCostModel:
    """A model shipped in ``torchrec_neuroshard/pretrained/<name>.pt``."""
    return NeuralCostModel.load(shipped_file(name))


def model_file(name: str | Path) -> Path:
    """The file of the model ``name``: ``name`` itself where it is a path ending in .pt or any
    file that exists, else the shipped model of that name."""
    path = Path(name)
    return path if path.suffix == ".pt" or path.exists() else shipped_file(str(name))


def model_named(name: str | Path) -> NeuralCostModel:
    """The model in the file ``name`` (``model_file``)."""
    return NeuralCostModel.load(model_file(name))


@lru_cache(maxsize=None)
def shipped_hardware() -> dict[str, Hardware]:
    """The hardware each shipped model was measured on, by model name."""
    return {p.stem: NeuralCostModel.load(p).hardware for p in sorted(PRETRAINED_DIR.glob("*.pt"))}


def pretrained_for(device: str) -> NeuralCostModel:
    """The shipped model for planning ``device`` on this machine: the one measured on this
    very hardware if one is shipped, else ``DEFAULT_PRETRAINED[device]``."""
    if device not in DEFAULT_PRETRAINED:
        raise ShardingError(
            f"no shipped cost model for compute device {device!r} (shipped for {sorted(DEFAULT_PRETRAINED)}); "
            f"measure one with `neuroshard collect` and `neuroshard pretrain`, and pass cost_model="
        )
    here = local_hardware(device)
    if here is not None:
        for name, hw in shipped_hardware().items():
            if hw.mismatch(here) is None:
                return load_pretrained(name)
    return load_pretrained(DEFAULT_PRETRAINED[device])


MAX_WORLD_SIZE_EXTRAPOLATION = 4
"""Plan for up to this many times the largest world size the comm model was trained on."""


def check_world_size(model: NeuralCostModel, world: int) -> None:
    """Refuse planning ``world`` ranks with ``model`` when that is more than
    ``MAX_WORLD_SIZE_EXTRAPOLATION`` x the largest world size its comm model was trained on
    (``ShardingError`` naming the commands that fix it); warn when ``world`` is new to it
    but within reach. A model without trained world sizes or whose comm is the alpha-beta
    stand-in (``cost_model_for`` pairs one with it beyond that reach) passes."""
    trained = model.meta.get("world_sizes_trained", [])
    if world <= 1 or not trained or world in trained or not isinstance(model.comm, NeuralComm):
        return
    if world > MAX_WORLD_SIZE_EXTRAPOLATION * max(trained):
        raise ShardingError(
            f"world size {world} is far beyond the world sizes the comm model was trained "
            f"on ({trained}); collect comm samples at this size (`neuroshard collect comm "
            f"--world-size {world}`) and re-train (`neuroshard pretrain`)"
        )
    logger.warning(
        "world size %d was not in the comm model's training data %s; the equivariant model extrapolates", world, trained
    )


def kernel_size_warning(model: NeuralCostModel, kernel_sizes: dict[str, int]) -> str | None:
    """A warning text when a kernel fuses more shards than any kernel the compute model was
    trained on (``meta["max_tables_per_kernel"]``): its prediction there is an extrapolation.
    ``kernel_sizes``: shards per fused kernel, by its name (``Plan.kernel_sizes``)."""
    trained = model.meta.get("max_tables_per_kernel")
    if not trained or not kernel_sizes or max(kernel_sizes.values()) <= trained:
        return None
    worst = max(kernel_sizes, key=kernel_sizes.__getitem__)
    return (
        f"the kernel of {worst} fuses {kernel_sizes[worst]} shards, but the compute model "
        f"was trained on kernels of at most {trained} tables: its cost there is extrapolated "
        f"linearly from {trained}-table kernels. Collect compute samples with more tables per kernel "
        f"on this hardware (lab.collect MAX_TABLES_PER_SAMPLE) and re-train for plans this dense"
    )


def feature_range_warning(model: NeuralCostModel, tables: Sequence[TableSpec], named: int = 5) -> str | None:
    """A warning text naming the tables (the first ``named`` of them) and their features
    that lie outside the data the compute model was trained on (``out_of_range``), or None
    when every table lies inside it or the model records no ranges."""
    far = model.out_of_range(tables)
    if not far:
        return None
    listed = "; ".join(f"{name!r}: {', '.join(features)}" for name, features in list(far.items())[:named])
    more = f"; and {len(far) - named} more" if len(far) > named else ""
    return (
        f"{len(far)} table(s) lie outside the data the compute model was trained on ({listed}{more}). They are "
        "priced as the nearest shards it learned: every feature clamped into its trained range (a table smaller "
        "than any trained is priced as the smallest), work beyond the widest and most-read shards trained added "
        "linearly. For plans resting on measured costs, collect compute samples covering such tables on this "
        "hardware (`neuroshard collect compute`, its pool extended with them: lab.workloads.synthetic_pool) and "
        "re-train (`neuroshard pretrain`)"
    )


def cost_model_for(topology: Any, cost_model: NeuralCostModel | str | Path | None = None) -> NeuralCostModel:
    """The cost model to plan TorchRec ``topology`` with.

    ``cost_model`` (a model, a file path or a shipped name) overrides the choice; by default
    the shipped model for the topology's compute device and this machine
    (``pretrained_for``). A model measured on other hardware than the topology's device (or
    this machine's CPU / GPU, where visible) is used with a logged warning that names the
    command making a model for this machine. A model without a comm part (measured on one
    GPU) is paired with ``AlphaBetaComm`` from the topology's bandwidths: a stand-in until
    comm is measured on NCCL. So is one whose comm net was trained on world sizes more than
    ``MAX_WORLD_SIZE_EXTRAPOLATION`` times smaller than the topology's (logged as a warning).
    """
    device = topology.compute_device
    if cost_model is None:
        model = pretrained_for(device)
    elif isinstance(cost_model, NeuralCostModel):
        model = cost_model
    else:
        model = model_named(cost_model)
    why = hardware_mismatch(model.hardware, device)
    if why:
        logger.warning("%s", why)
    elif device == "cuda" and local_hardware("cuda") is None:
        logger.info(
            "planning for cuda with a model measured on %s; no GPU is visible here to compare it with",
            model.hardware.describe(),
        )
    if model.comm is None:
        model = model.with_comm(AlphaBetaComm.from_topology(topology, model.batch_size))
        logger.info("comm cost: %s, until comm is measured on this hardware", model.comm.describe())
    return _within_reach(model, topology)


def _within_reach(model: NeuralCostModel, topology: Any) -> NeuralCostModel:
    """``model`` with every communication part measured only at world sizes more than
    ``MAX_WORLD_SIZE_EXTRAPOLATION`` times smaller than the topology's replaced by the
    topology's links (``AlphaBetaComm``; ``stepcost.Collectives`` prices a collective
    without a measured part by them), logged as a warning naming what to collect."""
    world = topology.world_size
    far = lambda sizes: bool(sizes) and world > MAX_WORLD_SIZE_EXTRAPOLATION * max(sizes)  # noqa: E731
    comm_far = isinstance(model.comm, NeuralComm) and far(model.meta.get("world_sizes_trained", []))
    measured_at = model.meta.get("step_parts_world_sizes", {})
    parts = model.meta.get("step_parts") or {}
    dropped = sorted(op for op in (*COLLECTIVES, "input_dist") if op in parts and far(measured_at.get(op, [])))
    if not comm_far and not dropped:
        return model
    links = AlphaBetaComm.from_topology(topology, model.batch_size)
    logger.warning(
        "world size %d is beyond %dx the world sizes this model's communication was measured at (%s): the "
        "%s priced by the topology's links (%s) instead; for measured prices collect samples at this size "
        "(`neuroshard collect comm --world-size %d`, `neuroshard collect step`) and re-train",
        world, MAX_WORLD_SIZE_EXTRAPOLATION, model.meta.get("world_sizes_trained") or measured_at,
        ", ".join((["pooled all-to-all"] if comm_far else []) + dropped), links.describe(), world,
    )  # fmt: skip
    return _with_comm_parts(model, links if comm_far else model.comm, dropped)


def priced_by_links(model: NeuralCostModel, topology: Any) -> NeuralCostModel:
    """``model``'s compute with every communication part (pooled all-to-all, collectives,
    input distribution) priced by ``topology``'s links (``AlphaBetaComm``): for devices
    whose network is not the one the model measured, e.g. a cluster emulated device by
    device on a CPU, whose kernels the model prices but whose gloo loopback it would not pay."""
    parts = model.meta.get("step_parts") or {}
    dropped = [op for op in (*COLLECTIVES, "input_dist") if op in parts]
    return _with_comm_parts(model, AlphaBetaComm.from_topology(topology, model.batch_size), dropped)


def _with_comm_parts(model: NeuralCostModel, comm: Any, dropped: Sequence[str]) -> NeuralCostModel:
    """``model`` with ``comm`` for its all-to-all and the step parts ``dropped`` (priced by
    the links ``stepcost.Collectives`` falls back to)."""
    meta = dict(model.meta, step_parts={op: c for op, c in (model.meta.get("step_parts") or {}).items() if op not in dropped})
    return model.with_meta(meta).with_comm(comm)
