"""The local search's screening, its comm shortcut, the lifted compute rows, and the
planning deadline: each against the slow exact computation it replaces."""

import dataclasses
import time

import numpy as np
import pytest

from torchrec_neuroshard.comm import AlphaBetaComm
from torchrec_neuroshard.costmodel import load_pretrained
from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.search import SearchConfig, predicted_breakdown, search
from torchrec_neuroshard.search import local as local_search
from torchrec_neuroshard.types import Shard


@pytest.fixture(scope="module")
def h200():
    comm = AlphaBetaComm(batch_size=65_536, intra_host_bw=450e6, inter_host_bw=50e6, local_world_size=8)
    return load_pretrained("h200").with_comm(comm).with_batch_size(65_536)


@pytest.mark.parametrize("world", [2, 8, 16])
def test_two_device_cost_is_the_full_embedding_cost(h200, world) -> None:
    """The O(n) pricing of candidates that change two devices equals pricing every device."""
    rng = np.random.default_rng(world)
    base = rng.random((world, 2)) * 10  # [D, 2]
    now = local_search._Devices(None, rng.integers(100, 900, world).astype(float), None, None, None, base, None, 0.0)
    n, worst = 3000, 1
    dst = rng.choice([d for d in range(world) if d != worst], n)
    new_worst, new_dst = rng.random((n, 2)) * 10, rng.random((n, 2)) * 10
    moved = rng.choice([-64.0, -8.0, 0.0, 16.0, 32.0], n)
    fast = local_search._two_device_cost(h200, now, worst, dst, new_worst, new_dst, moved)
    full = local_search._embedding_cost(h200, now, worst, dst, new_worst, new_dst, moved)
    np.testing.assert_allclose(fast, full, rtol=1e-6)


@pytest.mark.parametrize("world", [2, 8])
def test_two_device_cost_on_the_neural_comm_is_exact_where_no_forward_moves(world) -> None:
    """The neural comm's skews enter beyond the forward's wait, so the screen prices the
    rest of its comm at the skews as they stand: exact for candidates that leave every
    device's forward where it is (dims and backward still change), and still a finite
    price of the right scale for those that move it."""
    model = load_pretrained("cpu")
    rng = np.random.default_rng(world)
    base = rng.random((world, 2)) * 10  # [D, 2]
    now = local_search._Devices(None, rng.integers(100, 900, world).astype(float), None, None, None, base, None, 0.0)
    n, worst = 500, 0
    dst = rng.choice(np.arange(1, world), n)
    new_worst, new_dst = base[[worst] * n].copy(), base[dst].copy()
    new_worst[:, 1], new_dst[:, 1] = rng.random(n) * 10, rng.random(n) * 10
    moved = rng.choice([-64.0, -8.0, 0.0, 16.0, 32.0], n)
    fast = local_search._two_device_cost(model, now, worst, dst, new_worst, new_dst, moved)
    full = local_search._embedding_cost(model, now, worst, dst, new_worst, new_dst, moved)
    np.testing.assert_allclose(fast, full, rtol=1e-5)
    new_worst[:, 0] = rng.random(n) * 10  # the forward moves too: an estimate
    fast = local_search._two_device_cost(model, now, worst, dst, new_worst, new_dst, moved)
    full = local_search._embedding_cost(model, now, worst, dst, new_worst, new_dst, moved)
    assert np.isfinite(fast).all() and np.median(np.abs(fast / full - 1)) < 0.02


def test_lifted_rows_price_as_the_net_does() -> None:
    """Applying the head's first layer per shard before pooling gives the net's own costs."""
    model = load_pretrained("cpu")
    task = generate_task(synthetic_pool(), 12, 2, WorkloadScale(), seed=3)
    devices = [[Shard(t, t.dim) for t in task.tables[:5]], [Shard(t, t.dim) for t in task.tables[5:]]]
    kernel = model.pooled_kernel
    for shards in devices:
        emb = kernel.net.table(kernel.norm(kernel.priced(shards, model.batch)[0])).sum(0, keepdim=True)  # [1, embed]
        expected = np.exp(kernel.net.head(emb).detach().numpy()[0]) * kernel.batch_factor(model.batch)
        got = model.compute_cost([shards])[0]
        np.testing.assert_allclose(got, expected, rtol=1e-4)


def test_screened_local_search_is_the_exhaustive_one_where_it_prices_every_candidate(monkeypatch) -> None:
    """With a shortlist longer than any round's candidates the screen is skipped; a short
    one still moves only to plans priced lower, and lands near the exhaustive search."""
    model = load_pretrained("cpu")
    task = generate_task(synthetic_pool(), 120, 4, WorkloadScale(), seed=11)
    monkeypatch.setattr(local_search, "SHORTLIST", 10**9)
    monkeypatch.setattr(local_search.local_improve, "__defaults__", (None, 8, 10**9))
    exhaustive = search(task, model)
    monkeypatch.setattr(local_search.local_improve, "__defaults__", (None, 8, 16))
    screened = search(task, model)
    unimproved = search(task, model, SearchConfig(local_search=False))
    screened.plan.validate(task)
    assert screened.predicted_cost_ms <= unimproved.predicted_cost_ms + 1e-9
    assert screened.predicted_cost_ms <= exhaustive.predicted_cost_ms * 1.02


def test_a_passed_deadline_stops_the_beam_and_the_local_search() -> None:
    """Past the deadline: the root's greedy plan or a baseline's, no splits deeper and no
    moves, the same plan as a search told to do neither."""
    model = load_pretrained("cpu")
    task = generate_task(synthetic_pool(), 60, 4, WorkloadScale(), seed=7)
    late = search(task, model, SearchConfig(deadline=time.perf_counter()))
    neither = search(task, model, SearchConfig(max_steps=0, local_search=False))
    late.plan.validate(task)
    assert late.plan == neither.plan
    assert late.states_evaluated == 1
    full = search(task, model)
    assert full.predicted_cost_ms <= late.predicted_cost_ms + 1e-9
    assert predicted_breakdown(model, task, late.plan)[0] == pytest.approx(late.predicted_cost_ms)


def test_the_local_search_stops_when_its_last_moves_gained_too_little() -> None:
    """A window of one move that must gain all of the cost stops after the first move, as
    a search allowed one move does; with no gain required it moves on, as before the rule."""
    model = load_pretrained("cpu")
    task = generate_task(synthetic_pool(), 60, 4, WorkloadScale(), seed=7)
    stalled = search(task, model, SearchConfig(local_window=1, local_min_gain=0.999))
    one_move = search(task, model, SearchConfig(max_local_moves=1, local_min_gain=0.0))
    unruled = search(task, model, SearchConfig(local_min_gain=0.0))
    assert stalled.plan == one_move.plan
    assert unruled.predicted_cost_ms < one_move.predicted_cost_ms  # the task has more than one move to make
    with pytest.raises(ValueError, match="local_window=0"):
        SearchConfig(local_window=0)


def test_tasks_without_sequence_tables_get_the_narrow_rows() -> None:
    model = load_pretrained("h200")
    task = generate_task(synthetic_pool(), 8, 2, WorkloadScale(), seed=1)
    narrow = model.for_tables(task.tables)
    assert narrow.sequence_kernel is None and model.sequence_kernel is not None
    shards = [Shard(t, t.dim) for t in task.tables]
    assert narrow.embed_shards(shards).shape[1] < model.embed_shards(shards).shape[1]
    np.testing.assert_allclose(narrow.compute_cost([shards]), model.compute_cost([shards]), rtol=1e-6)
    sequence = dataclasses.replace(task.tables[0], pooled=False)
    assert model.for_tables([*task.tables, sequence]) is model


def test_the_int32_device_scan_is_the_float_one() -> None:
    """The greedy's int32 dims (rooms floored) and its per-placement fullest device give
    the same choices as comparing every device in float."""
    from torchrec_neuroshard.search.greedy import _least_loaded_with_room

    rng = np.random.default_rng(4)
    load = rng.integers(0, 4, (300, 16)) * 0.5 + rng.choice([0.0, 1e-10, 1e-6], (300, 16))
    dims = rng.integers(0, 9, (300, 16)) * 4
    mem = rng.integers(0, 5, (300, 16)) * 1000.0
    dim_room = rng.integers(-1, 9, 300) * 4 + rng.choice([0.0, 0.5, np.inf], 300, p=[0.45, 0.45, 0.1])
    mem_room = rng.integers(0, 5, 300) * 1000.0
    want = _least_loaded_with_room(load, dims.astype(float), mem, dim_room, mem_room)
    got = _least_loaded_with_room(load, dims.astype(np.int32), mem, dim_room, mem_room, mem.max(1))
    assert (want[0] < 0).any() and (want[0] >= 0).any()
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1][want[0] >= 0], want[1][want[0] >= 0])


@pytest.mark.parametrize("model_name", ["cpu", "h200"])
def test_the_block_screen_is_the_gathered_one(h200, model_name, monkeypatch) -> None:
    """The screen block by block (``screen``, issue 41) gives every candidate the very
    estimate ``local._estimate`` gives it, in order, so the same shortlist: with room for
    every swap and with memory tight enough to drop some, blocks priced whole and in chunks
    of rows."""
    from torchrec_neuroshard.search import screen
    from torchrec_neuroshard.search.greedy import Keys
    from torchrec_neuroshard.stepcost import CachedEmbedder

    model = h200 if model_name == "h200" else load_pretrained("cpu")
    task = generate_task(synthetic_pool(), 400, 8, WorkloadScale(), seed=5)
    model = model.with_batch_size(task.batch_size).for_tables(task.tables)
    keys = Keys(task, model, CachedEmbedder(model))
    keys.ensure([(t, table.dim) for t, table in enumerate(task.tables)])
    key_of = np.arange(len(task.tables))
    dev = np.random.default_rng(5).integers(0, 8, len(task.tables))
    now = local_search._Devices.of(model, keys, key_of, dev, np.zeros((8, 2)))
    worst = int(now.per_dev.argmax())
    cheap = np.asarray([d for d in np.argsort(now.per_dev) if d != worst][:8], dtype=np.int64)
    size = keys.size[key_of]
    counts = []
    for cap in (task.memory_cap_bytes * 1e3, float(now.mem.max() + 0.5 * np.median(size))):
        cand = local_search._candidates(dev, size, now.mem, worst, cheap, cap)
        found = screen.blocks(dev, size, now.mem, worst, cheap, cap)
        counts.append(len(cand))
        assert sum(b.size for b in found) == len(cand) > 1024
        gathered = local_search._estimate(model, keys, key_of, dev, now, worst, cheap, cand)
        for chunk in (screen.CHUNK, 7 * len(np.flatnonzero(dev == worst))):  # whole, 7 rows at a time
            monkeypatch.setattr(screen, "CHUNK", chunk)
            np.testing.assert_array_equal(screen._estimates(model, keys, key_of, dev, now, worst, cheap, found), gathered)
        want = cand[np.sort(np.argpartition(gathered, 1024)[:1024])]
        np.testing.assert_array_equal(screen.shortlisted(model, keys, key_of, dev, now, worst, cheap, found, 1024), want)
    assert counts[1] < counts[0], "the tight memory drops some swaps"
