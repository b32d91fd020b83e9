"""studies.device_error: what a device holds, and the error's spread and trend on it."""

import numpy as np
import pytest

from studies.device_error import error_line, holdings
from torchrec_neuroshard.costmodel.nets import shard_footprint
from torchrec_neuroshard.lab.workloads import WorkloadScale, synthetic_pool, table_spec
from torchrec_neuroshard.types import Shard


def test_holdings_are_the_logs_of_mean_width_shards_heaviest_share_lookups_per_ms_and_footprint() -> None:
    pool = synthetic_pool()
    shards = [Shard(table_spec(pool[i], w, WorkloadScale()), w) for i, w in ((0, 16), (1, 64))]
    lookups = np.array([s.table.pooling_factor * s.width for s in shards])
    pooling = np.array([s.table.pooling_factor for s in shards])
    size = sum(shard_footprint(s, 4096) for s in shards)
    expected = np.log([lookups.sum() / pooling.sum(), 2, lookups.max() / lookups.sum(), lookups.sum() / 8.0, size])
    assert holdings(shards, 8.0, 4096) == pytest.approx(expected)


def test_an_error_that_follows_the_mean_width_reads_as_its_slope() -> None:
    rng = np.random.default_rng(0)
    held = rng.normal(size=(50, 5))
    line = error_line("held out", "m.pt", 0.3 * held[:, 0], held)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:3] == ["held out", "m.pt", "50"] and cells[4] == "+1.00" and cells[-1] == "+0.300"
