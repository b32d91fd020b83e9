"""The checks every dataclass of ``types`` runs on its fields, each raising a
``ShardingError`` that names the field and the fix."""

from __future__ import annotations

import math
import numbers

from torchrec_neuroshard.errors import ShardingError


def whole_number(value: object, what: str) -> int:
    """``value`` as an int when it is a whole number (1024 or 1024.0; not True, not 1.7),
    else a ``ShardingError`` naming ``what`` and the value."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value).is_integer():
        return int(value)
    raise ShardingError(f"{what} must be a whole number, got {value!r}; give it as an integer")


def finite_non_negative(value: object) -> bool:
    """``value`` is a real number (not a bool), finite and >= 0."""
    if type(value) is float or type(value) is int:  # the common case, without the ABC checks
        return math.isfinite(value) and value >= 0
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def required_field(d: dict, key: str, what: str) -> object:
    """``d[key]``, or a ``ShardingError`` naming the missing field and where it belongs."""
    if not isinstance(d, dict):
        raise ShardingError(f"{what} must be a JSON object, got {type(d).__name__} {str(d)[:60]!r}")
    if key not in d:
        raise ShardingError(f"{what} has no {key!r} field; add it (fields: {sorted(d)})")
    return d[key]
