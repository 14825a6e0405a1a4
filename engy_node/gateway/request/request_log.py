"""Request-log rows written in batches, off every request's path.

A request's metadata row (no buyer content: docs/reliability.md, "Data") is written after its
answer; the buyer must not wait for it, and one write per request would cost the event loop a
store round trip each. So rows queue here
and one task writes whatever has queued, in one store operation, whenever anything has: under
load that is many rows per write, idle it is one row as soon as it comes.

Losing rows is preferable to losing requests: if the store falls so far behind that
`max_pending` rows wait, new rows are dropped (and counted in the log) rather than growing memory
without bound. On shutdown the writer drains what is queued before it returns; from then on
`add` refuses rows, and their callers write them themselves (requests finishing during shutdown).
"""

from __future__ import annotations

import logging

import trio

from engy_node.gateway.store import RequestLogEntry, Store, StoreError

log = logging.getLogger("engy.gateway")

MAX_PENDING_ROWS = 100_000
"""About 20 MB of queued rows: minutes of traffic at this gateway's rate."""


class RequestLogWriter:
    def __init__(self, store: Store, *, max_pending: int = MAX_PENDING_ROWS) -> None:
        self.store = store
        self.max_pending = max_pending
        self.dropped = 0
        self._pending: list[RequestLogEntry] = []
        self._wake = trio.Event()
        self._closed = False

    def add(self, entry: RequestLogEntry) -> bool:
        """Queue one row; never blocks. False once the writer has stopped: write it yourself."""
        if self._closed:
            return False
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.error("request log: %d rows dropped, the store is not keeping up", self.dropped)
            return True
        self._pending.append(entry)
        self._wake.set()
        return True

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Write queued rows until cancelled, then write what is left (shielded) and return."""
        task_status.started()
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                # Shielded: a batch taken off the queue is written, not lost to a cancellation.
                with trio.CancelScope(shield=True):
                    await self._write_pending()
        finally:
            self._closed = True
            with trio.CancelScope(shield=True):
                await self._write_pending()

    async def _write_pending(self) -> None:
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            await self.store.run(self.store.log_requests, batch)
        except StoreError as error:
            # The requests themselves were served and billed; their log rows are what is lost.
            log.error("request log: could not write %d rows (%s)", len(batch), error)
