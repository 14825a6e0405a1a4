"""`Store`: the ledger, the request log and the miner registrations on one connection, and how
trio awaits them.

Threads. One `Store` owns one connection. Each operation is a synchronous method (the admin
CLI, tests) with an `*_async` twin that runs it via `trio.to_thread.run_sync` behind the
store's `CapacityLimiter(1)`, so SQLite never runs on the event loop and never twice at once; a
lock serialises the synchronous methods as well. Several `Store`s (threads, processes) may
share a file; SQLite's locks and the busy timeout serialise them.

Group commit. The operations on every request's path (authenticate, hold, settle, release,
request-log rows) are awaited together: calls queue while a group is being written, and the next
group runs everything queued in one transaction with one fsync, each operation in a savepoint of
its own. Holds and releases do not even wait for that fsync (see the package's posture).
"""

from __future__ import annotations

import functools
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from engy_node.gateway.store.ledger import Account, Balance, Hold, Ledger, Settlement
from engy_node.gateway.store.miners import MinerRecord, Miners
from engy_node.gateway.store.requests import RequestLog, RequestLogEntry, UsageSummary
from engy_node.gateway.store.schema import BUSY_TIMEOUT_S, explain

R = TypeVar("R")


class _Slot:
    """One queued operation of a group commit and its outcome."""

    def __init__(self, call: Callable[[], Any], *, durable: bool) -> None:
        self.call = call
        self.durable = durable
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = trio.Event()
        self._token = trio.lowlevel.current_trio_token()

    def run(self) -> None:
        try:
            self.result = self.call()
        except Exception as error:  # broad on purpose: the caller re-raises it as its own
            self.error = error

    def fail(self, error: BaseException) -> None:
        self.error = error

    def done_threadsafe(self) -> None:
        self._token.run_sync_soon(self.done.set)

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class Store(Ledger, RequestLog, Miners):
    """The gateway store on one SQLite connection.

    Every operation comes twice: `name(...)` is synchronous (the admin CLI, tests, worker
    threads) and `name_async(...)` awaits the same work from trio — in a worker thread behind
    this store's `CapacityLimiter(1)`, so SQLite never blocks the event loop and never runs
    twice at once. A lock serialises the synchronous methods too, so both faces may be used on
    one store.

    Cancellation (`*_async`): atomic. Cancelled while waiting its turn, a call has done
    nothing. Once its thread has started, the call runs to completion and returns its result;
    the cancellation is delivered at the caller's next checkpoint. A `Hold` you receive is
    therefore always real and yours to settle or release (in a `finally`, under a shielded
    scope).

    Deadlines: a call waits at most `busy_timeout_s` for another process's lock, plus its own
    work (milliseconds); callers that must answer sooner wrap it in `trio.fail_after`.

    Opening creates the file with the current schema if it is new and refuses one that is
    corrupt, not ours, or of another schema version. Several `Store`s, in threads or
    processes, may share a file.
    """

    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time,
                 busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        super().__init__(path, clock=clock, busy_timeout_s=busy_timeout_s)
        self._limiter = trio.CapacityLimiter(1)
        self._queue: list[_Slot] = []
        self._flush_lock = trio.Lock()

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time,
             busy_timeout_s: float = BUSY_TIMEOUT_S) -> Store:
        """Open (or create) the store at `path`. Blocking: from trio, call it through
        `trio.to_thread.run_sync`."""
        return cls(path, clock=clock, busy_timeout_s=busy_timeout_s)

    async def _in_thread(self, method: Callable[..., R], /, *args: Any, **kwargs: Any) -> R:
        return await trio.to_thread.run_sync(functools.partial(method, *args, **kwargs), limiter=self._limiter)

    async def _grouped(self, method: Callable[..., R], /, *args: Any, durable: bool = True, **kwargs: Any) -> R:
        """Run `method` in the next group commit (see `_commit_group`); `durable=False` for a
        write that may be lost to a power cut (see the module's posture).

        Calls queue while a group is being written; whoever takes the flush lock next writes
        everything queued, its own call included, in one transaction. Cancellation keeps the
        class's promise: a call still queued is withdrawn and has done nothing; a call already
        in a group being written completes and returns its result."""
        slot = _Slot(functools.partial(method, *args, **kwargs), durable=durable)
        self._queue.append(slot)
        try:
            async with self._flush_lock:
                if not slot.done.is_set():
                    group, self._queue = self._queue, []
                    await trio.to_thread.run_sync(self._commit_group, group, limiter=self._limiter)
        except trio.Cancelled:
            if slot in self._queue:
                self._queue.remove(slot)
                raise
            with trio.CancelScope(shield=True):
                await slot.done.wait()
        return slot.outcome()

    def _commit_group(self, group: list[_Slot]) -> None:
        """Several operations, one transaction, one fsync. Each runs in its own savepoint, so
        one failing (a refused hold, a bad entry) rolls back only itself. The commit waits for
        the disk if any operation in the group must be durable."""
        with self._lock:
            try:
                with self._batch(durable=any(slot.durable for slot in group)):
                    for slot in group:
                        slot.run()
            except BaseException as error:  # broad on purpose: every caller in the group must hear of it
                explained = explain(self.path, error) if isinstance(error, sqlite3.Error) else None
                for slot in group:
                    slot.fail(explained or error)
            finally:
                for slot in group:
                    slot.done_threadsafe()

    # -- the same operations, awaited from trio (see the class docstring) -----------------------

    async def create_buyer_async(self, name: str) -> tuple[int, str]:
        return await self._in_thread(self.create_buyer, name)

    async def issue_key_async(self, account_id: int) -> str:
        return await self._in_thread(self.issue_key, account_id)

    async def authenticate_async(self, api_key: str) -> Account | None:
        return await self._grouped(self.authenticate, api_key)

    async def revoke_key_async(self, api_key: str) -> bool:
        return await self._in_thread(self.revoke_key, api_key)

    async def credit_async(self, account_id: int, *, micro_usd: int, memo: str = "") -> int:
        return await self._in_thread(self.credit, account_id, micro_usd=micro_usd, memo=memo)

    async def hold_async(self, account_id: int, *, amount: int, request_id: str) -> Hold | None:
        return await self._grouped(self.hold, account_id, amount=amount, request_id=request_id, durable=False)

    async def settle_async(self, hold: Hold, *, cost: int) -> Settlement:
        return await self._grouped(self.settle, hold, cost=cost)

    async def release_async(self, hold: Hold) -> Settlement:
        return await self._grouped(self.release, hold, durable=False)

    async def recover_open_holds_async(self, *, older_than: float | None = None) -> list[Hold]:
        return await self._in_thread(self.recover_open_holds, older_than=older_than)

    async def balance_async(self, account_id: int) -> Balance:
        return await self._in_thread(self.balance, account_id)

    async def check_books_async(self) -> list[int]:
        return await self._in_thread(self.check_books)

    async def log_request_async(self, entry: RequestLogEntry) -> None:
        await self._grouped(self.log_request, entry)

    async def log_requests_async(self, entries: Sequence[RequestLogEntry]) -> None:
        await self._grouped(self.log_requests, entries)

    async def usage_async(self, account_id: int, *, since: float | None = None) -> UsageSummary:
        return await self._in_thread(self.usage, account_id, since=since)

    async def purge_request_log_async(self, *, older_than: float) -> int:
        return await self._in_thread(self.purge_request_log, older_than=older_than)

    async def register_miner_async(self, name: str, *, hotkey: str | None = None) -> tuple[int, str]:
        return await self._in_thread(self.register_miner, name, hotkey=hotkey)

    async def authenticate_miner_async(self, miner_key: str) -> MinerRecord | None:
        return await self._in_thread(self.authenticate_miner, miner_key)

    async def list_miners_async(self) -> list[MinerRecord]:
        return await self._in_thread(self.list_miners)

    async def aclose(self) -> None:
        await self._in_thread(self.close)
