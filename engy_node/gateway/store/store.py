"""`Store`: the ledger, the request log, the miner registrations, verdicts, published epochs,
validator heartbeats and traffic eligibility on one database, and how trio awaits them.

Threads. One `Store` owns one SQLite connection, or one pool of PostgreSQL connections. Each
operation is a synchronous method (the admin CLI, tests); trio awaits any of them through the
one thread hop `Store.run`, which runs it via `trio.to_thread.run_sync` behind the store's
`CapacityLimiter` (one for SQLite, the pool's size for PostgreSQL), so the database never runs
on the event loop. One generic hop rather than an async twin per method keeps a single place
that decides how an operation is awaited, and the methods' own signatures type-check the
arguments (`ParamSpec`). Several `Store`s (threads, processes, hosts) may share a database;
its locks serialise them.

Group commit (SQLite). The operations on every request's path (authenticate, hold, settle,
release, request-log rows), marked `group_commit` where they are defined, are awaited
together: calls queue while a group is being written, and the next group runs everything queued
in one transaction with one fsync, each operation in a savepoint of its own. Holds and releases
do not even wait for that fsync (see the package's posture). The whole group is answered with
one wake-up of the event loop: the task that wrote it sets every caller's event when its thread
returns. PostgreSQL groups concurrent commits into one WAL flush by itself, so there each
operation runs alone, several at once (`postgres.py`).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import trio

from engy_node.gateway.store.checks import integer
from engy_node.gateway.store.connection import group_commit, group_commit_durability, serialised
from engy_node.gateway.store.deposits import Deposits
from engy_node.gateway.store.eligibility import EligibilityTable
from engy_node.gateway.store.epochs import Epochs
from engy_node.gateway.store.leases import Leases
from engy_node.gateway.store.ledger import Hold, Ledger, Settlement
from engy_node.gateway.store.miners import Miners
from engy_node.gateway.store.requests import COST_COLUMN, RequestLog, RequestLogEntry, log_row
from engy_node.gateway.store.schema import BUSY_TIMEOUT_S
from engy_node.gateway.store.validators import Validators
from engy_node.gateway.store.verdicts import Verdicts

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_POOL_SIZE = 8
"""PostgreSQL connections per store (per gateway worker process): enough for the request path's
few short statements to run side by side under load, few enough that hosts × workers × this
stays well under the server's `max_connections` (100 by default)."""


class _Slot:
    """One queued operation of a group commit and its outcome."""

    def __init__(self, call: Callable[[], Any], *, durable: bool) -> None:
        self.call = call
        self.durable = durable
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = trio.Event()
        """Set once the group it was written in is written."""
        self.woken = trio.Event()
        """Set when it is done, or when the writing of what is queued is handed to its caller."""
        self.writes = False
        """Its caller was handed the writing of the next group."""

    def run(self) -> None:
        self.result, self.error = None, None  # a group written again runs its calls again
        try:
            self.result = self.call()
        except Exception as error:  # broad on purpose: the caller re-raises it as its own
            self.error = error

    def fail(self, error: BaseException) -> None:
        self.error = error

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class _GroupFailed(Exception):
    """An operation of a group written without savepoints failed: roll the group back."""


class Store(Ledger, RequestLog, Miners, Verdicts, Epochs, Validators, EligibilityTable, Leases, Deposits):
    """The gateway store: an SQLite file (a path) or a PostgreSQL database (a `postgresql://` URL).

    Every operation is a synchronous method (the admin CLI, tests, worker threads);
    `await store.run(store.name, ...)` awaits the same work from trio — in a worker thread
    behind this store's `CapacityLimiter`, so the database never blocks the event loop. On
    SQLite a lock serialises the synchronous calls too, so both ways may be used on one store.

    Cancellation (`run`): atomic. Cancelled while waiting its turn, a call has done
    nothing. Once its thread has started, the call runs to completion and returns its result;
    the cancellation is delivered at the caller's next checkpoint. A `Hold` you receive is
    therefore always real and yours to settle or release (in a `finally`, under a shielded
    scope).

    Deadlines: a call waits at most `busy_timeout_s` for another process's lock, plus its own
    work (milliseconds); callers that must answer sooner wrap it in `trio.fail_after`.

    Opening creates the tables at the current schema if the database is new, migrates an older
    one, and refuses one that is corrupt, not ours, or of a newer schema version. Several
    `Store`s, in threads, processes or (PostgreSQL) hosts, may share a database.
    `pool_size` bounds a PostgreSQL store's connections (and so its operations at once).
    """

    def __init__(
        self,
        location: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
        pool_size: int = DEFAULT_POOL_SIZE,
    ) -> None:
        super().__init__(location, clock=clock, busy_timeout_s=busy_timeout_s, pool_size=pool_size)
        self._limiter = trio.CapacityLimiter(self._db.concurrency)
        self._queue: list[_Slot] = []
        self._writing = False
        """A group is being written, or its writing was handed to a queued caller (`_grouped`)."""

    @classmethod
    def open(
        cls,
        location: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        busy_timeout_s: float = BUSY_TIMEOUT_S,
        pool_size: int = DEFAULT_POOL_SIZE,
    ) -> Store:
        """Open (or create) the store at `location`: an SQLite file's path, or a
        `postgresql://` URL. Blocking: from trio, call it through `trio.to_thread.run_sync`."""
        return cls(location, clock=clock, busy_timeout_s=busy_timeout_s, pool_size=pool_size)

    async def run(self, operation: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Await `operation`, a method of this store, from trio, e.g.
        `hold = await store.run(store.hold, account_id, amount=amount, request_id=request_id)`.

        An operation marked `group_commit` joins the next group commit; any other runs alone in
        a worker thread. Cancellation is atomic either way (see the class docstring)."""
        if getattr(operation, "__self__", None) is not self:
            raise TypeError(f"Store.run awaits a method of this store, such as store.hold; got {operation!r}")
        call = functools.partial(operation, *args, **kwargs)
        durable = group_commit_durability(operation)
        if durable is None or not self._db.groups_commits:
            return await trio.to_thread.run_sync(call, limiter=self._limiter)
        return await self._grouped(call, durable=durable)

    @group_commit(durable=True)
    @serialised
    def settle_and_log(self, hold: Hold, *, cost: int, entry: RequestLogEntry) -> Settlement:
        """`settle` the hold and append the request's log row with the cost the ledger charged,
        in one transaction: the request's one durable write after its answer (the row lands
        with the charge or not at all, and an epoch settled from the log sees exactly what the
        ledger charged). `entry.cost_micro` is replaced by that charge."""
        integer("cost", cost)
        if not isinstance(entry, RequestLogEntry):
            raise TypeError(f"settle_and_log takes a RequestLogEntry, got {type(entry).__name__}")
        if entry.request_id != hold.request_id:
            raise ValueError(f"the log row is for request {entry.request_id}, the hold for {hold.request_id}")
        if entry.kind != "paid":
            raise ValueError(
                f"settle_and_log settles a paid request; a {entry.kind} row has no hold (log it with log_request)"
            )
        now = self._clock()
        row = log_row(entry)
        with self._write(pipelined=True) as conn:
            settlement = self._close_in(
                conn, hold, cost=cost, now=now, used_tokens=entry.prompt_tokens + entry.completion_tokens
            )
            # The charge is an integer from 0 to the hold's amount, so the row stays one that the
            # entry's checks pass, without building and checking an entry again.
            row[COST_COLUMN] = settlement.charged
            self._insert_rows(conn, [row])
        return settlement

    async def aclose(self) -> None:
        await self.run(self.close)

    async def _grouped(self, call: Callable[[], Any], *, durable: bool) -> Any:
        """Run `call` in the next group commit (see `_commit_group`); `durable=False` for a
        write that may be lost to a power cut (see the package's posture).

        The first caller while no group is being written writes everything queued, its own call
        included, in one transaction; calls that come meanwhile queue, and when that group is
        written the first of them is handed the writing of the next. Each waiting caller is woken
        once, by its own event (one pass on the loop answers a whole group), where a lock would
        wake them one after another. Cancellation keeps the class's promise: a call still queued
        is withdrawn and has done nothing (one handed the writing hands it on); a group once
        taken is written whatever happens to its writer, and every call in it completes and
        returns its result."""
        await trio.lowlevel.checkpoint_if_cancelled()  # a call in a cancelled scope does nothing
        slot = _Slot(call, durable=durable)
        self._queue.append(slot)
        if self._writing:
            try:
                await slot.woken.wait()
            except trio.Cancelled:
                if slot in self._queue:
                    self._queue.remove(slot)
                    if slot.writes:
                        self._hand_on()
                    raise
                with trio.CancelScope(shield=True):
                    await slot.done.wait()
                return slot.outcome()
            if slot.done.is_set():
                return slot.outcome()
        self._writing = True
        group, self._queue = self._queue, []
        try:
            # Shielded: the group's calls are no longer queued, so they are answered only by
            # being written, however long the store's thread takes to be free.
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self._commit_group, group, limiter=self._limiter)
        finally:
            for queued in group:
                queued.done.set()
                queued.woken.set()
            self._hand_on()
        return slot.outcome()

    def _hand_on(self) -> None:
        """Hand the writing of what is queued to the first queued caller, or stop writing."""
        if self._queue:
            first = self._queue[0]
            first.writes = True
            first.woken.set()
        else:
            self._writing = False

    def _commit_group(self, group: list[_Slot]) -> None:
        """Several operations, one transaction, one fsync. One failing (a reused request id, a
        bad entry) rolls back only itself, as if each ran in a savepoint of its own. The commit
        waits for the disk if any operation in the group must be durable.

        Savepoints are taken only when needed: the group is first written bare, and if an
        operation fails, the whole transaction is rolled back and the group written again with
        each operation in its own savepoint. Failures are rare (bugs, a request id used twice),
        and the savepoints would cost two statements per operation every time, each a return to
        the GIL, which this thread shares with the event loop."""
        durable = any(slot.durable for slot in group)
        with self._db.lock:
            try:
                if not self._written(group, durable=durable, savepoints=False) and len(group) > 1:
                    self._written(group, durable=durable, savepoints=True)
            except BaseException as error:  # broad on purpose: every caller in the group must hear of it
                explained = self._db.explain(error)
                for slot in group:
                    slot.fail(explained or error)

    def _written(self, group: list[_Slot], *, durable: bool, savepoints: bool) -> bool:
        """Write the group in one transaction. False when, without savepoints, an operation
        failed: then nothing is written, and the failing operation's error stays in its slot."""
        try:
            with self._batch(durable=durable, savepoints=savepoints):
                for slot in group:
                    slot.run()
                    if slot.error is not None and not savepoints:
                        raise _GroupFailed
        except _GroupFailed:
            return False
        return True
