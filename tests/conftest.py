"""Test tiers (pytest.ini): a test is ``unit`` unless marked ``dmp`` (several ranks),
``measure`` (real timings) or ``slow``; ``make test-fast`` runs the unit tier alone."""

import pytest

TIERS = ("dmp", "measure", "slow")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.unit)
