"""Fixtures for the store's tests: a fresh file per test, a fake clock, and a store open on both."""

from __future__ import annotations

from pathlib import Path

import pytest

from engy_node.gateway.store import Store
from tests.engy_node.gateway.store.support import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def path(tmp_path) -> Path:
    return tmp_path / "gateway.sqlite3"


@pytest.fixture
def store(path, clock):
    with Store(path, clock=clock) as opened:
        yield opened
