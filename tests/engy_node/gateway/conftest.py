"""What the gateway's test modules share."""

from __future__ import annotations

import pytest
import trio

from engy_node.gateway.role import run_gateway
from engy_node.gateway.store import Store
from engy_node.hub import Hub
from engy_node.verifier.role import run_local_verifier
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


class StoppableGateway:
    """The gateway role in the test's nursery, stopped on demand: stopping drains its request-log
    writer, so the log can be read whole afterwards."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self.stopped = trio.Event()

    async def run(
        self, config, hub: Hub | None = None, *, deposit_chain=None, task_status=trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            with self.scope:
                await run_gateway(
                    config,
                    hub or Hub(),
                    local_verifier=run_local_verifier,
                    deposit_chain=deposit_chain,
                    task_status=task_status,
                )
        finally:
            self.stopped.set()

    async def stop(self) -> None:
        self.scope.cancel()
        with trio.fail_after(30):
            await self.stopped.wait()


@pytest.fixture
def running() -> StoppableGateway:
    return StoppableGateway()
