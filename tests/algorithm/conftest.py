"""Fixtures of the algorithm tests."""

from __future__ import annotations

import pytest

from sao_megatron.algorithm import registry


@pytest.fixture
def package_registry(monkeypatch):
    """The registry as the package alone fills it: plug-ins that another test of this process
    imported (examples/algorithms/rebn.py, `tests/cli/test_plugins.py`) stay registered for the
    process; they are taken out for the test (restored after). Found when two xdist workers ran
    tests/cli before tests/algorithm."""
    for name, cls in list(registry._REGISTRY.items()):
        if not cls.__module__.startswith("sao_megatron."):
            monkeypatch.delitem(registry._REGISTRY, name)
