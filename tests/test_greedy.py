"""Greedy runs: the device rule and runs sharing a placement, each against the rule
written plainly or the runs placed alone; and the runs against the greedy written plainly."""

import numpy as np
import pytest

from torchrec_neuroshard.lab.workloads import WorkloadScale, generate_task, synthetic_pool
from torchrec_neuroshard.types import CostModel


def _plain_choice(load, dims, mem, dim_room, mem_room):
    """The greedy's device rule written plainly: least load among the devices with room,
    ties within 1e-9 to less memory, then to the lower index; -1 without room."""
    feasible = (dims <= dim_room[:, None]) & (mem <= mem_room[:, None])
    masked = np.where(feasible, load, np.inf)
    best = masked.min(1)
    device = np.where(masked <= best[:, None] + 1e-9, mem, np.inf).argmin(1)
    device[~np.isfinite(best)] = -1
    return device, masked.argmin(1)


def _random_devices(rng, rows, devices):
    """Loads with exact ties and ties within the tolerance; whole dims and bytes."""
    load = rng.integers(0, 4, (rows, devices)) * 0.5 + rng.choice([0.0, 1e-10, 1e-6], (rows, devices))
    dims = rng.integers(0, 8, (rows, devices)) * 4.0
    mem = rng.integers(0, 4, (rows, devices)) * 1000.0
    return load, dims, mem


def test_least_loaded_with_room_is_the_plain_rule() -> None:
    from torchrec_neuroshard.search.greedy import _least_loaded_with_room

    rng = np.random.default_rng(0)
    load, dims, mem = _random_devices(rng, 500, 8)
    dim_room = rng.integers(-1, 8, 500) * 4 + rng.choice([0.0, 1e-9, 0.5], 500)  # some rows: no room at all
    mem_room = rng.integers(0, 4, 500) * 1000.0
    device, first = _least_loaded_with_room(load, dims, mem, dim_room, mem_room)
    want, want_first = _plain_choice(load, dims, mem, dim_room, mem_room)
    assert (want < 0).any() and (want != want_first).any()  # both paths exercised
    np.testing.assert_array_equal(device, want)
    np.testing.assert_array_equal(first[want >= 0], want_first[want >= 0])


def test_runs_sharing_a_placement_choose_as_each_would_alone() -> None:
    """One decision per shared placement, at the most room its runs have: a run with less
    room gets what it would choose alone, whatever the others' room or shard."""
    from torchrec_neuroshard.search.greedy import Placements, _choose_devices, _part

    rng = np.random.default_rng(1)
    held = Placements.empty(400, 8, 1)  # room for a placement per run
    held.load[:40], held.dims[:40], held.mem[:40] = _random_devices(rng, 40, 8)
    held.mem_max[:40] = held.mem[:40].max(1)  # the invariant place() keeps
    p = rng.integers(0, 40, 400)  # ten runs a placement
    shard = np.where(rng.random(400) < 0.8, 0, rng.integers(1, 3, 400))
    dim_room = rng.integers(2, 8, 400) * 4.0 + rng.choice([0.0, 0.5], 400)
    mem_room = rng.integers(1, 4, 400) * 1000.0
    device, decided = _choose_devices(held, 40, p, shard, dim_room, mem_room, shared=True)
    want, _ = _plain_choice(held.load[p], held.dims[p], held.mem[p], dim_room, mem_room)
    assert decided.any() and not decided.all()  # both the shared decision and runs deciding alone
    np.testing.assert_array_equal(device, want)
    # runs part by move: one placement per (placement, shard, device), a copy of the old one
    before = held.load.copy()
    placement = p.copy()
    n_held = _part(held, 40, placement, np.arange(400), p, shard * 8 + device, decided)
    moves = {(int(q), int(m)) for q, m in zip(p, shard * 8 + device)}
    assert len(set(placement.tolist())) == len(moves) and n_held == 40 + len(moves) - len(set(p.tolist()))
    for q, m, new_q in zip(p, shard * 8 + device, placement):
        assert {(int(q), int(m))} == {(int(a), int(b)) for a, b, c in zip(p, shard * 8 + device, placement) if c == new_q}
        np.testing.assert_array_equal(held.load[new_q], before[q])


class _RowWiseModel(CostModel):
    """A cost model whose prediction for a device depends on that device's shards alone
    (elementwise arithmetic; the neural model's batched matmuls round a row differently
    in another batch), so greedy runs can be compared bit for bit."""

    def embed_shards(self, shards):
        return np.asarray([[s.table.pooling_factor * s.width / 64, s.width / 64, 1.0] for s in shards], dtype=np.float32)

    def device_cost(self, pooled):
        fwd = 0.1 + np.sqrt(pooled[:, 0]) + 0.01 * pooled[:, 1] * pooled[:, 2]
        return np.stack([fwd, 2 * fwd], axis=1)

    def comm_cost_array(self, dims, skews_ms):
        return np.stack([0.01 * dims + skews_ms, 0.02 * dims], axis=2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_runs_placed_together_are_the_runs_placed_alone(seed) -> None:
    """Runs share a placement until they part: every (state, scale) run placed in one
    lockstep batch is the same as placed on its own, dying the same way, also under
    per-state memory caps (the kind grid's)."""
    from torchrec_neuroshard.search import default_scales
    from torchrec_neuroshard.search.greedy import Keys, greedy_runs, state_keys
    from torchrec_neuroshard.search.splits import _split_children
    from torchrec_neuroshard.stepcost import CachedEmbedder

    task = generate_task(synthetic_pool(), 30, 4, WorkloadScale(), seed=seed, memory_slack=1.05)
    model = _RowWiseModel()
    keys = Keys(task, model, CachedEmbedder(model))
    root = tuple((t.dim,) for t in task.tables)
    keys.ensure(state_keys(root))
    states = [root] + _split_children(root, keys, 10, [4] * len(task.tables))  # split halves tie exactly
    keys.ensure([k for s in states for k in state_keys(s)])
    scales = default_scales()
    caps = [task.memory_cap_bytes * f for f in np.linspace(0.9, 1.1, len(states))]
    together = greedy_runs(task, model, keys, states, scales, caps)
    alone = [greedy_runs(task, model, keys, [s], [x], [c]) for s, c in zip(states, caps) for x in scales]
    assert np.isfinite(together.cost).any() and not np.isfinite(together.cost).all()
    for r, run in enumerate(alone):
        n = run.assign.shape[1]
        assert run.cost[0] == together.cost[r]
        np.testing.assert_array_equal(run.assign[0], together.assign[r, :n])
        assert (run.died_at[0], run.free_at_death[0]) == (together.died_at[r], together.free_at_death[r])


def _plain_greedy(task, model, keys, state, scale, cap, memory_first=False) -> tuple[list[int], int]:
    """The greedy written plainly, one shard a step: each shard, most costly first (or
    largest first, ties most costly first), to the device of least load with room
    (``_plain_choice``). The devices it chose, and the shard index where it found no room
    (-1: none)."""
    ids = keys.ids(state)
    if memory_first:
        ids = sorted(ids, key=lambda k: (-keys.size[k], -keys.single[k]))  # (sorted is stable: ties keep the state's order)
    else:
        ids = ids[np.argsort(-keys.single[ids], kind="stable")]
    D = task.num_devices
    dim_cap = np.floor(scale * keys.width[ids].sum() / D + 1e-9)
    sums = np.zeros((D, keys.emb.shape[1]), dtype=np.float32)
    load, dims, mem = np.zeros(D), np.zeros(D), np.zeros(D)
    chosen = []
    for k, key in enumerate(ids):
        device, _ = _plain_choice(load[None], dims[None], mem[None], np.asarray([dim_cap - keys.width[key]]), np.asarray([cap - keys.size[key]]))
        if device[0] < 0:
            return chosen, k
        d = int(device[0])
        sums[d] += keys.emb[key]
        load[d] = model.device_cost(sums[d : d + 1]).sum()
        dims[d], mem[d] = dims[d] + keys.width[key], mem[d] + keys.size[key]
        chosen.append(d)
    return chosen, -1


@pytest.mark.parametrize("seed, memory_first", [(0, False), (1, False), (0, True)])
def test_greedy_runs_are_the_greedy_written_plainly(seed, memory_first) -> None:
    """Every run of two states at every scale, placed together (sharing placements, parting),
    puts each shard where the greedy written plainly does and dies at the same shard;
    caps tight enough that some runs die, dim caps that block devices; shards costliest
    first, or largest first."""
    from torchrec_neuroshard.search import default_scales
    from torchrec_neuroshard.search.greedy import Keys, greedy_runs, state_keys
    from torchrec_neuroshard.search.splits import _split_children
    from torchrec_neuroshard.stepcost import CachedEmbedder

    task = generate_task(synthetic_pool(), 150, 8, WorkloadScale(), seed=seed, memory_slack=1.02)
    assert not np.any(task.reserved)
    model = _RowWiseModel()
    keys = Keys(task, model, CachedEmbedder(model))
    root = tuple((t.dim,) for t in task.tables)
    keys.ensure(state_keys(root))
    states = [root, _split_children(root, keys, 1, [4] * len(task.tables))[0]]
    keys.ensure([k for s in states for k in state_keys(s)])
    caps, scales = [task.memory_cap_bytes * 0.97, task.memory_cap_bytes * 1.2], default_scales()
    runs = greedy_runs(task, model, keys, states, scales, caps, memory_first=memory_first)
    assert np.isfinite(runs.cost).any() and (runs.died_at >= 0).any()
    for r, (state, cap, scale) in enumerate((s, c, x) for s, c in zip(states, caps) for x in scales):
        chosen, died_at = _plain_greedy(task, model, keys, state, scale, cap, memory_first)
        assert runs.died_at[r] == died_at
        np.testing.assert_array_equal(runs.assign[r, : len(chosen)], chosen)
