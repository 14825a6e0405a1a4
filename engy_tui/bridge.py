"""The TUI's only link to the node side: a trio guest run on Textual's loop that polls a model server.

`engy_node` is trio code and Textual runs on asyncio. `trio.lowlevel.start_guest_run` runs a
trio loop inside the asyncio loop, on the same thread, so the node code runs unchanged and
the two sides need no locks: the UI reads `latest` directly, and calls trio's synchronous
APIs (`Event.set`, `CancelScope.cancel`) from host code, which trio supports in guest mode by
scheduling a guest tick for them.

The bridge never touches a widget. The trio side polls `fetch_status` every `interval_s` (each
poll bounded by `timeout_s`) and keeps the newest snapshot in `latest`; the app reads it at its
own fixed render rate. Poll rate and frame rate are then independent, and a burst of updates
costs the UI nothing extra.

Lifecycle: `start()` on the running asyncio loop (the app's `on_mount`), once. `stop()`
cancels the trio root scope and waits for the guest run to finish; the host loop must not end
before that, because trio's internals are left inconsistent if the host stops first.

Failure: `fetch_status` turns every server or network problem into a status, so the guest run
ends early only through a bug. That is reported once through `on_crash`, so the app can exit
saying so rather than freeze on a stale snapshot.

Other `engy_tui` modules import the status data types from here, not from `engy_node`.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable

import httpx
import outcome
import trio

from engy_node.serve.status import LatencySummary, ServerStatus, fetch_status

__all__ = ["POLL_INTERVAL_S", "POLL_TIMEOUT_S", "GuestRun", "LatencySummary", "ServerStatus", "StatusBridge"]

# Once a second keeps the counters feeling live; a poll is four small local GETs.
POLL_INTERVAL_S = 1.0
# sglang answers /health with a one-token generation, fast even under load (any output then
# counts); a poll that takes longer than this says the server is in trouble, and shows it.
POLL_TIMEOUT_S = 5.0


class GuestRun(abc.ABC):
    """A trio guest run hosted on the running asyncio loop: `start`, `stop`, and `_main` (the
    trio side, run inside the root cancel scope) for subclasses to define."""

    def __init__(self) -> None:
        self._root = trio.CancelScope()
        self._done: asyncio.Future[outcome.Outcome[None]] | None = None

    @property
    def running(self) -> bool:
        """The guest run has started and not yet finished."""
        return self._done is not None and not self._done.done()

    def start(self, *, on_crash: Callable[[BaseException], None]) -> None:
        """Start the guest run on the running asyncio loop; `on_crash` hears of an unexpected end."""
        if self._done is not None:
            raise RuntimeError(f"{type(self).__name__}.start() called twice; one bridge hosts one guest run")
        loop = asyncio.get_running_loop()
        done = self._done = loop.create_future()

        def finished(result: outcome.Outcome[None]) -> None:
            done.set_result(result)
            if isinstance(result, outcome.Error):
                on_crash(result.error)

        trio.lowlevel.start_guest_run(
            self._run,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=loop.call_soon,
            done_callback=finished,
        )

    async def stop(self) -> None:
        """Cancel the trio side and wait until the guest run has finished. Idempotent.

        Cancellation: if the awaiting task is cancelled, the guest run still winds down on its
        own; only the wait is abandoned.
        """
        if self._done is None:
            return
        self._root.cancel(f"engy-tui is stopping its {type(self).__name__}")
        await self._done

    async def _run(self) -> None:
        with self._root:
            await self._main()

    @abc.abstractmethod
    async def _main(self) -> None:
        """The trio side: runs until cancelled."""


class StatusBridge(GuestRun):
    """Polls one model server from a trio guest run hosted on the running asyncio loop."""

    def __init__(
        self, serve_url: str, *, interval_s: float = POLL_INTERVAL_S, timeout_s: float = POLL_TIMEOUT_S
    ) -> None:
        super().__init__()
        self.serve_url = serve_url
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.latest: ServerStatus | None = None
        """The newest poll's result; None until the first poll completes."""
        self.polls = 0
        """How many polls have completed."""
        self._wake = trio.Event()

    def refresh(self) -> None:
        """Poll now instead of at the end of the current interval."""
        self._wake.set()

    async def _main(self) -> None:
        async with httpx.AsyncClient() as client:
            while True:
                # A fresh event per poll: a refresh asked for during this poll triggers the
                # next one at once instead of being lost.
                self._wake = trio.Event()
                self.latest = await fetch_status(client, self.serve_url, timeout_s=self.timeout_s)
                self.polls += 1
                with trio.move_on_after(self.interval_s):
                    await self._wake.wait()
