"""Fixtures for the store's tests: a fake clock, and a fresh store per test on each backend — an
SQLite file and a PostgreSQL database — so one suite proves both (`backend`). Tests about the
SQLite file itself take `path` instead and run once."""

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


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request) -> str:
    return request.param


@pytest.fixture
def location(backend, request, tmp_path) -> str | Path:
    """Where the test's store lives: a file, or a database URL."""
    if backend == "sqlite":
        return tmp_path / "gateway.sqlite3"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def store(location, clock):
    with Store(location, clock=clock) as opened:
        yield opened
