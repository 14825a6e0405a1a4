"""What the gateway's test modules share."""

from __future__ import annotations

import pytest

from engy_node.gateway.store import Store
from tests.waiting import Changes


@pytest.fixture
def holds_closed(monkeypatch) -> Changes:
    """Told each time the gateway closes a hold (settles or releases it), so that a test waits for
    a buyer's money to settle instead of polling the ledger. The gateway runs in this process and
    closes holds from its trio tasks, through its own `Store`."""
    changes = Changes()
    run = Store.run

    async def run_and_tell(self, operation, *args, **kwargs):
        try:
            return await run(self, operation, *args, **kwargs)
        finally:
            if getattr(operation, "__name__", "") in ("settle", "settle_and_log", "release"):
                changes.notify()

    monkeypatch.setattr(Store, "run", run_and_tell)
    return changes
