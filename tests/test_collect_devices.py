"""Device-sized training kernels (lab.collect_devices): many pools, never a held-out one,
two kernels timed in turn, resumable by whole pairs."""

import numpy as np
import pytest
import torch

from torchrec_neuroshard.lab.collect import read_rows
from torchrec_neuroshard.lab.collect_devices import DEVICE_GROUP_OFFSET, DEVICE_TABLES, collect_device_pairs
from torchrec_neuroshard.lab.training_data import load_compute_data
from torchrec_neuroshard.lab.workloads import HELD_OUT_POOL_SEEDS, WorkloadScale, training_pool
from torchrec_neuroshard.types import ShardingError

TINY = WorkloadScale(row_divisor=4096, batch_size=256)


def test_a_collector_refuses_a_held_out_pool_by_its_seed(tmp_path) -> None:
    with pytest.raises(ShardingError, match=f"pool seed {HELD_OUT_POOL_SEEDS[0]} is held out"):
        training_pool(HELD_OUT_POOL_SEEDS[0])
    with pytest.raises(ShardingError, match="is held out"):
        collect_device_pairs(tmp_path / "x.jsonl", 1, torch.device("cpu"), pool_seeds=(10, HELD_OUT_POOL_SEEDS[-1]))
    assert not (tmp_path / "x.jsonl").exists()  # refused before anything was measured


@pytest.mark.measure
def test_pairs_of_device_sized_kernels_come_from_many_pools_and_resume_by_whole_pairs(tmp_path) -> None:
    out = tmp_path / "pairs.jsonl"
    kwargs = {"warmup": 1, "repeats": 2, "progress": False, "scale": TINY}
    assert collect_device_pairs(out, 2, torch.device("cpu"), pool_seeds=(10, 11), **kwargs) == 2
    rows = read_rows(out)
    assert [(r["pair"], r["pair_member"], r["pool_seed"]) for r in rows] == [(0, 0, 10), (0, 1, 10), (1, 0, 11), (1, 1, 11)]
    assert all(DEVICE_TABLES[0] <= len(r["shards"]) <= DEVICE_TABLES[1] and r["fwd_ms"] > 0 and r["bwd_ms"] > 0 for r in rows)
    assert rows[0]["batch_size"] == rows[1]["batch_size"] and rows[0]["group"] == rows[1]["group"] == DEVICE_GROUP_OFFSET
    assert len(load_compute_data(rows)) == 4  # the rows are compute rows a model trains on
    assert rows[0]["hardware"]["vector_isa"] == torch.backends.cpu.get_cpu_capability()  # two EPYCs of one name time 2x apart
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:3]))  # a pair cut in half is dropped and measured again
    assert collect_device_pairs(out, 2, torch.device("cpu"), pool_seeds=(10, 11), **kwargs) == 2
    assert [r["pair"] for r in read_rows(out)] == [0, 0, 1, 1]


def test_minibatches_keep_a_pair_together_and_the_pair_loss_sees_both() -> None:


    from torchrec_neuroshard.lab.training import _minibatches

    class Paired:
        pair = np.array([-1, 7, -1, 3, 7, 3, -1, -1])

        def __len__(self) -> int:
            return len(self.pair)

    batches = _minibatches(Paired(), 2, np.random.default_rng(0))
    order = np.concatenate(batches)
    assert sorted(order) == list(range(8))
    where = {int(i): k for k, i in enumerate(order)}
    assert abs(where[1] - where[4]) == 1 and abs(where[3] - where[5]) == 1  # partners side by side


def test_the_pair_loss_adds_the_error_of_the_pairs_log_ratio() -> None:
    import dataclasses

    from torchrec_neuroshard.costmodel.features import Normalizer
    from torchrec_neuroshard.costmodel.nets import ComputeNet
    from torchrec_neuroshard.lab.collect import read_rows
    from torchrec_neuroshard.lab.training import _compute_loss, _compute_predict

    rows = [
        {"kind": "compute", "group": 5, "pair": 0, "batch_size": 512, "fwd_ms": 2.0, "bwd_ms": 4.0,
         "shards": [{"name": "a", "rows": 100, "width": 8, "pooling_factor": 2.0, "access_hist": [1.0] + [0.0] * 16}]},
        {"kind": "compute", "group": 5, "pair": 0, "batch_size": 1024, "fwd_ms": 1.0, "bwd_ms": 3.0,
         "shards": [{"name": "b", "rows": 900, "width": 16, "pooling_factor": 4.0, "access_hist": [1.0] + [0.0] * 16}]},
        {"kind": "compute", "group": 6, "batch_size": 512, "fwd_ms": 1.0, "bwd_ms": 1.0,
         "shards": [{"name": "c", "rows": 50, "width": 4, "pooling_factor": 1.0, "access_hist": [1.0] + [0.0] * 16}]},
    ]  # fmt: skip
    data = load_compute_data(rows)
    assert data.pairs().tolist() == [[0, 1]] and data.subset([0, 2]).pairs().size == 0  # a partner left out: no pair
    net = ComputeNet(data.x.shape[1], reads_batch=True)
    norm = Normalizer.fit(data.x)
    with torch.no_grad():
        log_pred, log_true = _compute_predict(net, norm, data), data.y.log()
        level = ((log_pred - log_true) ** 2).mean()
        ratio = (((log_pred[0] - log_pred[1]) - (log_true[0] - log_true[1])) ** 2).mean()
        assert float(_compute_loss(net, norm, data)) == pytest.approx(float(level + ratio), rel=1e-5)
        alone = dataclasses.replace(data, pair=np.full(3, -1))
        assert float(_compute_loss(net, norm, alone)) == pytest.approx(float(level), rel=1e-5)
