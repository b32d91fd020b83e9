"""Hardware records, the model chosen for a topology, the alpha-beta comm stand-in, and
planning a GPU topology on this CPU-only machine."""

import logging

import numpy as np
import pytest
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import Topology

from torchrec_neuroshard.comm import AlphaBetaComm
from torchrec_neuroshard.costmodel import NeuralComm, NeuralCostModel, cost_model_for, load_pretrained
from torchrec_neuroshard.hardware import Hardware, hardware_mismatch, local_hardware
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.planner import NeuroShardPlanner
from torchrec_neuroshard.tables import module_for_tables
from torchrec_neuroshard.types import Shard, ShardingError

GIB_PER_S = 2**30 / 1000  # bytes per ms


def _with_hardware(model: NeuralCostModel, **hw) -> NeuralCostModel:
    meta = dict(model.meta, hardware=dict(model.meta["hardware"], **hw))
    return NeuralCostModel(model.compute_net, model.compute_norm, model.comm, meta)


def test_every_shipped_model_records_its_hardware() -> None:
    assert load_pretrained("cpu").hardware == Hardware("cpu", "AMD EPYC", 2)
    assert load_pretrained("h200").hardware == Hardware("cuda", "NVIDIA H200")
    assert load_pretrained("intel_xeon").hardware == Hardware("cpu", "Intel(R) Xeon(R) Processor", 2)
    with pytest.raises(ValueError, match="device 'tpu' is not one of"):
        Hardware("tpu", "x")


def test_model_follows_the_topology_and_an_explicit_model_overrides(caplog) -> None:
    cuda = cost_model_for(Topology(world_size=8, compute_device="cuda", local_world_size=8))
    assert cuda.hardware.device == "cuda" and cuda.hardware.name == "NVIDIA H200"
    assert isinstance(cuda.comm, AlphaBetaComm) and cuda.comm.local_world_size == 8
    cpu = cost_model_for(Topology(world_size=2, compute_device="cpu"))
    assert cpu.hardware.device == "cpu" and isinstance(cpu.comm, NeuralComm)
    here = local_hardware("cpu")
    if here in (Hardware("cpu", "AMD EPYC", 2), Hardware("cpu", "Intel(R) Xeon(R) Processor", 2)):
        assert cpu.hardware == here  # the shipped model measured on this very machine kind

    cpu_model = load_pretrained("cpu")
    with caplog.at_level(logging.WARNING, logger="torchrec_neuroshard.costmodel"):
        chosen = cost_model_for(Topology(world_size=2, compute_device="cuda"), cpu_model)
    assert chosen is cpu_model
    assert "measured on cpu AMD EPYC, 2 cores but the topology's compute device is cuda" in caplog.text
    assert "neuroshard calibrate --device cuda" in caplog.text


def test_a_model_of_other_hardware_is_warned_about_with_the_command_to_run(caplog) -> None:
    other = _with_hardware(load_pretrained("cpu"), device_name="Some Other CPU 9000", cores=64)
    here = local_hardware("cpu")
    assert "cores" in other.hardware.mismatch(Hardware("cpu", "Some Other CPU 9000", 2))
    task = generate_task(synthetic_pool(), 6, 2, WorkloadScale(), seed=2)
    with caplog.at_level(logging.WARNING, logger="torchrec_neuroshard.costmodel"):
        NeuroShardPlanner(Topology(world_size=2, compute_device="cpu"), cost_model=other).plan(
            module_for_tables(task.tables), [EmbeddingBagCollectionSharder()]
        )
    assert f"this machine is {here.describe()}" in caplog.text
    assert "`neuroshard calibrate --device cpu --out my_cpu.pt`" in caplog.text
    assert hardware_mismatch(_with_hardware(other, device_name=here.name, cores=here.cores).hardware, "cpu") is None


def test_alpha_beta_units_and_monotonicity() -> None:
    ab = AlphaBetaComm(batch_size=1024, intra_host_bw=100 * GIB_PER_S, inter_host_bw=10 * GIB_PER_S, local_world_size=4)
    # 2 ranks on one host, 256 columns each: each sends 256 x 512 samples x 4 B to the other
    out = ab.comm_cost_array(np.array([[256, 256]]), np.zeros((1, 2)))
    np.testing.assert_allclose(out[0, :, 1], 256 * 512 * 4 / (100 * GIB_PER_S), rtol=1e-5)
    assert np.allclose(out[0, :, 0], out[0, :, 1])  # no skew: forward = backward
    skewed = ab.comm_cost_array(np.array([[256, 256]]), np.array([[0.0, 2.0]]))
    np.testing.assert_allclose(skewed[0, :, 0] - out[0, :, 0], [2.0, 0.0], atol=1e-5)  # the wait for the late rank

    base = ab.comm_cost_array(np.array([[64, 64, 64, 64]]), np.zeros((1, 4)))[0, :, 1]
    wider = ab.comm_cost_array(np.array([[128, 64, 64, 64]]), np.zeros((1, 4)))[0, :, 1]
    assert (wider >= base).all() and wider[0] > base[0]
    assert (ab.with_batch_size(4096).comm_cost_array(np.array([[64] * 4]), np.zeros((1, 4))) > base.max()).all()
    slower = AlphaBetaComm(1024, 50 * GIB_PER_S, 10 * GIB_PER_S, 4).comm_cost_array(np.array([[64] * 4]), np.zeros((1, 4)))
    assert (slower[0, :, 1] > base).all()
    # 8 ranks over 2 hosts: the inter-host link bounds the exchange
    two_hosts = ab.comm_cost_array(np.array([[64] * 8]), np.zeros((1, 8)))[0, :, 1]
    np.testing.assert_allclose(two_hosts, 64 * 128 * 4 * 4 / (10 * GIB_PER_S), rtol=1e-5)
    assert ab.comm_cost_array(np.array([[500]]), np.zeros((1, 1))).sum() == 0
    # ring collectives: bytes / bandwidth x 2(D-1)/D (all-reduce) and (D-1)/D (reduce-scatter)
    assert ab.all_reduce_ms(2**30, 4) == pytest.approx(2 * 3 / 4 * 2**30 / (100 * GIB_PER_S))
    assert ab.reduce_scatter_ms(2**30, 4) == pytest.approx(ab.all_reduce_ms(2**30, 4) / 2)
    assert ab.all_reduce_ms(2**30, 8) > ab.all_reduce_ms(2**30, 4) > ab.all_reduce_ms(2**29, 4) > 0
    assert ab.all_reduce_ms(2**30, 1) == ab.reduce_scatter_ms(2**30, 1) == 0
    with pytest.raises(ShardingError, match="inter_host_bw must be a positive number of bytes/ms, got 0"):
        AlphaBetaComm(1024, 1.0, 0.0, 4)


def test_alpha_beta_reads_the_topologys_bandwidth_fields() -> None:
    t = Topology(world_size=16, compute_device="cuda", local_world_size=8, intra_host_bw=3e8, inter_host_bw=2e7)
    ab = AlphaBetaComm.from_topology(t, 65_536)
    assert (ab.intra_host_bw, ab.inter_host_bw, ab.local_world_size, ab.batch_size) == (3e8, 2e7, 8, 65_536)


def test_compute_only_model_needs_a_comm_part() -> None:
    h200 = load_pretrained("h200")
    assert h200.comm is None
    with pytest.raises(ShardingError, match="has no comm part.*with_comm"):
        h200.comm_cost_array(np.array([[8, 8]]), np.zeros((1, 2)))
    ab = AlphaBetaComm(65_536, 1e8, 1e7, 8)
    paired = h200.with_comm(ab).with_batch_size(65_536 // 2)
    assert paired.comm.batch_size == 65_536 // 2 and paired.batch_scale == 0.5


def test_plan_a_cuda_topology_on_a_meta_device_model_without_a_gpu(caplog) -> None:
    task = generate_task(synthetic_pool(), 10, 4, WorkloadScale(1, 65_536), seed=3)
    module = module_for_tables(task.tables, device="meta")
    topology = Topology(world_size=4, compute_device="cuda", hbm_cap=2 * task.memory_cap_bytes, local_world_size=4)
    with caplog.at_level(logging.INFO):
        plan = NeuroShardPlanner(topology, batch_size=65_536 // 4).plan(module, [EmbeddingBagCollectionSharder()])
    shardings = next(iter(plan.plan.values()))
    assert set(shardings) == {t.name for t in task.tables}
    assert all(s.compute_kernel == "fused" for s in shardings.values())
    placements = {str(m.placement) for s in shardings.values() for m in s.sharding_spec.shards}
    assert all("cuda" in p for p in placements)
    assert "a model measured on cuda NVIDIA H200" in caplog.text  # the GPU model, chosen by the topology
    assert "alpha-beta stand-in" in caplog.text


def test_a_model_priced_by_the_links_keeps_its_kernels_and_prices_every_collective_by_the_topology() -> None:
    from torchrec_neuroshard.costmodel.shipped import priced_by_links

    topology = Topology(world_size=8, compute_device="cpu", local_world_size=8)
    measured = cost_model_for(topology, "cpu")  # the AMD EPYC model, whose comm and collectives were measured
    assert isinstance(measured.comm, NeuralComm) and {"all_reduce", "input_dist", "dp_fwd"} <= set(measured.step_parts.to_dict())
    linked = priced_by_links(measured, topology)
    assert isinstance(linked.comm, AlphaBetaComm) and linked.comm.intra_host_bw == float(topology.intra_host_bw)
    assert set(linked.meta["step_parts"]) == {"dp_fwd", "dp_bwd"}  # the data-parallel kernel is compute: kept
    task = generate_task(synthetic_pool(), 6, 8, WorkloadScale(), seed=2)
    shards = [Shard(t, t.dim) for t in task.tables]
    pooled = measured.embed_shards(shards).sum(0, keepdims=True)
    assert np.array_equal(measured.device_cost(pooled), linked.device_cost(linked.embed_shards(shards).sum(0, keepdims=True)))
    dims = np.array([[256.0] * 8])
    assert linked.comm_cost_array(dims, np.zeros_like(dims)).sum() < measured.comm_cost_array(dims, np.zeros_like(dims)).sum()
