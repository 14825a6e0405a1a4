"""Fixtures the TUI tests share."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest


@pytest.fixture
def utc() -> Iterator[None]:
    previous = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = previous
        time.tzset()
