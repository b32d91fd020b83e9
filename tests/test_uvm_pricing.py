"""The UVM kernels' measured price: the shipped pricing is what ``lab.fit_uvm`` makes of the
committed H200 measurements; what it charges; the measuring code's CPU-side behaviour
(successive batches of a table, kernels built where their tables live, refused on a CPU);
offloaded tables placed by the search keep their kernels; one rank plans beyond HBM."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from torchrec_neuroshard.kernels import ComputeKernel
from torchrec_neuroshard.lab import fit_uvm
from torchrec_neuroshard.lab.measure_compute import cache_load_factor, measure_compute
from torchrec_neuroshard.lab.workloads import lookups_for
from torchrec_neuroshard.search.greedy import plan_from_shards
from torchrec_neuroshard.types import Shard, TableSpec, Task
from torchrec_neuroshard.uvmcost import SHIPPED, UvmPricing

DATA = Path(fit_uvm.__file__).parent / "data" / "uvm_compute_h200.jsonl.gz"
UVM, CACHING, FUSED = ComputeKernel.FUSED_UVM, ComputeKernel.FUSED_UVM_CACHING, ComputeKernel.FUSED
HIST = (0.5, 0.0, 0.0, 0.5) + (0.0,) * 13


def on(kernel: ComputeKernel, factor: float | None = None, rows: int = 1_000_000, pf: float = 10.0) -> Shard:
    return Shard(TableSpec("t", rows, 64, pf, HIST, kernel=kernel, cache_load_factor=factor), 64)


def test_the_shipped_pricing_is_the_fit_of_the_committed_measurements(tmp_path) -> None:
    out = tmp_path / "uvm.json"
    fit_uvm.main(["--data", str(DATA), "--out", str(out)])
    fitted, shipped = json.loads(out.read_text()), json.loads(SHIPPED.read_text())
    assert fitted["source"] == shipped["source"] and fitted["features"] == shipped["features"]
    for kernel, phases in shipped["coefficients"].items():  # to rounding: numpy and scipy are not pinned
        for phase, coefficients in phases.items():
            np.testing.assert_allclose(fitted["coefficients"][kernel][phase], coefficients, rtol=1e-6, atol=1e-9)


def test_the_measured_pricing_charges_what_moves_over_uvm() -> None:
    pricing, batch = UvmPricing.shipped(), 65_536
    assert not pricing.penalty_ms([on(FUSED)], batch).any()
    uvm = [float(pricing.penalty_ms([on(UVM, pf=pf)], batch).sum()) for pf in (1.0, 10.0, 40.0)]
    assert 0 < uvm[0] < uvm[1] < uvm[2]  # more lookups read more rows over UVM
    cached = [float(pricing.penalty_ms([on(CACHING, f)], batch).sum()) for f in (0.001, 0.01, 0.5)]
    assert cached[0] >= cached[1] >= cached[2] > 0  # a larger cache misses less; lookups still cost
    assert cached[0] <= uvm[1]
    assert "measured on an NVIDIA H200" in pricing.source
    with pytest.raises(ValueError, match="UVM pricing needs 4 forward and backward coefficients for fused_uvm"):
        UvmPricing({CACHING.value: ((0,) * 4, (0,) * 4)}, "")


def test_successive_batches_keep_a_tables_hot_rows() -> None:
    spec = TableSpec("t", 100_000, 16, 5.0, (0.2, 0.1, 0.1, 0.6) + (0.0,) * 13)
    first, again, second = lookups_for(spec, 512, seed=3), lookups_for(spec, 512, seed=3, draw=0), lookups_for(spec, 512, seed=3, draw=1)
    assert torch.equal(first[0], again[0])
    assert not torch.equal(first[0], second[0])
    hot = lambda idx: set(torch.unique(idx, return_counts=True)[0][torch.unique(idx, return_counts=True)[1] > 3].tolist())  # noqa: E731
    assert len(hot(first[0]) & hot(second[0])) >= 0.5 * len(hot(first[0])) > 0


def test_kernels_are_built_where_their_tables_live_and_refused_on_a_cpu() -> None:
    shards = [on(CACHING, 0.1, rows=300), on(CACHING, 0.4, rows=100), on(FUSED)]
    assert cache_load_factor(shards) == pytest.approx((0.1 * 300 + 0.4 * 100) / 400)  # TorchRec's rows-weighted mean
    assert cache_load_factor([on(FUSED)]) is None
    bags = {"t": (torch.tensor([0, 1]), torch.tensor([0, 1, 2]))}
    with pytest.raises(ValueError, match=r"tables \['t'\] are on UVM kernels, which need a GPU"):
        measure_compute([on(UVM, rows=10)], [bags, bags], torch.device("cpu"))
    m = measure_compute([Shard(replace(on(FUSED).table, rows=10), 64)], [bags, bags], torch.device("cpu"), warmup=1, repeats=2)
    assert m.total_ms > 0


def test_shards_the_search_places_keep_their_tables_kernels() -> None:
    tables = (
        TableSpec("a", 1000, 64, 2.0, HIST, kernel=CACHING, cache_load_factor=0.2),
        TableSpec("b", 1000, 32, 2.0, HIST),
    )
    task = Task(tables, 2, 10**9, 64, host_memory_cap_bytes=10**9)
    plan = plan_from_shards(task, [(0, 32, 0), (0, 32, 1), (1, 32, 1)])
    placed = {p.table: p for p in plan.placements}
    assert (placed["a"].kernel, placed["a"].cache_load_factor, placed["a"].widths) == (CACHING, 0.2, (32, 32))
    assert placed["b"].kernel is FUSED
    plan.validate(task)


def test_one_rank_plans_a_model_beyond_its_hbm() -> None:
    """The plan tests/test_uvm_dmp_gpu.py runs on a GPU: on one rank (no device to move
    shards to), tables in host memory beside tables in HBM."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from tests.models import two_tower
    from tests.test_uvm_dmp_gpu import uvm_plan

    _, ours = uvm_plan(two_tower(), [EmbeddingBagCollectionSharder(fused_params={"learning_rate": 0.1})])
    kernels = {p.table: p.kernel for p in ours.placements}
    assert sorted(kernels) == ["a0", "a1", "b0", "b1"]
    assert {k.in_host_memory for k in kernels.values()} == {True, False}
    assert np.unique([d for p in ours.placements for d in p.devices]).tolist() == [0]
