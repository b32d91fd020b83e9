"""Bad input from a user: a one-line error naming the value and the fix (the CLI: exit 2,
no traceback), never silent garbage."""

import json
import math

import pytest

from torchrec_neuroshard.types import ShardingError, TableSpec, Task

HIST = (1.0,) + (0.0,) * 16
SUITE = "benchmarks/tasks/suite.json"


def task_dict() -> dict:
    table = {"name": "t", "rows": 100, "dim": 8, "pooling_factor": 2.0, "access_hist": list(HIST)}
    return {"num_devices": 2, "memory_cap_bytes": 10**6, "batch_size": 64, "tables": [table]}


@pytest.mark.parametrize(
    "hist, message",
    [
        ((math.nan,) + (0.0,) * 16, r"table 't': access_hist bin 0 is nan; .*re-measure it with tables.profile_batches"),
        ((0.5, math.inf) + (0.0,) * 15, r"table 't': access_hist bin 1 is inf"),
        ((1.5, -0.5) + (0.0,) * 15, r"table 't': access_hist bin 1 is -0.5"),
        ((3.0, 1.0) + (0.0,) * 15, r"table 't': access_hist sums to 4, not 1.*normalise it: divide every bin by 4"),
        ((0.0,) * 17, r"table 't': access_hist sums to 0, not 1.*re-measure it"),
    ],
)
def test_nan_or_unnormalised_access_histograms_are_refused(hist, message) -> None:
    with pytest.raises(ShardingError, match=message):
        TableSpec("t", 100, 8, 2.0, hist)


def test_rounded_histograms_are_accepted() -> None:
    rounded = tuple(round(x, 5) for x in (1 / 3, 1 / 3, 1 / 3)) + (0.0,) * 14  # sums to 0.99999
    assert TableSpec("t", 100, 8, 2.0, rounded).access_hist == rounded
    assert len(Task.load_all(SUITE)) == 20  # the shipped suite's histograms are rounded too


@pytest.mark.parametrize("value", [1.7, True, "100", None])
def test_a_non_integral_row_count_is_refused_not_truncated(value) -> None:
    with pytest.raises(ShardingError, match=rf"table 't': rows must be a whole number, got {value!r}"):
        TableSpec("t", value, 8, 2.0, HIST)
    d = task_dict()
    d["tables"][0]["rows"] = value
    with pytest.raises(ShardingError, match=r"table 't': rows must be a whole number"):
        Task.from_json(json.dumps(d))


@pytest.mark.parametrize("field", ["num_devices", "memory_cap_bytes", "batch_size"])
def test_task_numbers_must_be_whole(field) -> None:
    d = task_dict()
    d[field] = 2.5
    with pytest.raises(ShardingError, match=rf"the task's {field} must be a whole number, got 2.5"):
        Task.from_json(json.dumps(d))
    d[field] = 2.0  # a whole number written as a float (1e9 in JSON) is that number
    assert getattr(Task.from_json(json.dumps(d)), field) == 2 and isinstance(getattr(Task.from_json(json.dumps(d)), field), int)


def test_task_dim_and_bytes_per_element_must_be_whole() -> None:
    for field in ("dim", "bytes_per_element"):
        d = task_dict()
        d["tables"][0][field] = 4.5
        with pytest.raises(ShardingError, match=rf"table 't': {field} must be a whole number, got 4.5"):
            Task.from_json(json.dumps(d))


def test_a_missing_field_is_named(tmp_path) -> None:
    d = task_dict()
    del d["tables"][0]["dim"]
    with pytest.raises(ShardingError, match=r"the task, table 0 has no 'dim' field; add it"):
        Task.from_json(json.dumps(d))
    d["tables"][0]["dim"] = 8
    del d["batch_size"]
    (tmp_path / "task.json").write_text(json.dumps(d))
    with pytest.raises(ShardingError, match=r"task.json has no 'batch_size' field"):
        Task.load(tmp_path / "task.json")


def test_task_files_missing_malformed_or_a_suite(tmp_path) -> None:
    with pytest.raises(ShardingError, match=r"task file '.*nope.json' does not exist"):
        Task.load(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{\"num_devices\": 2,")
    with pytest.raises(ShardingError, match=r"task file '.*bad.json' is not valid JSON: "):
        Task.load(tmp_path / "bad.json")
    with pytest.raises(ShardingError, match=r"suite.json holds 20 tasks, not one; read it with Task.load_all"):
        Task.load(SUITE)
