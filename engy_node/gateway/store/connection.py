"""One SQLite connection and the rules every store operation follows on it: one operation at a
time, each write one explicit transaction, each commit fsynced unless a group commit allows less.

Every write is `BEGIN IMMEDIATE` (the package's posture says why). A lock (`serialised`) keeps
the connection to one operation at a time whichever thread calls it; several connections, in
threads or processes, may share the file, and SQLite's locks and the busy timeout serialise
them. Database-level failures leave an operation as `StoreError` naming the file and the fix
(`schema.explain`).

Inside a group commit (`Connection._batch`, driven by `Store.run` for the operations marked
`group_commit`) the same operations run unchanged: each `_write` becomes a savepoint, so one
failing operation rolls back only itself while the batch's single COMMIT makes all the others
durable together.

Time. Each write method reads the injected clock once, at its start, and stamps every row of
its transaction with that value (tests pass a fake clock). The times on request-log rows,
verdicts, epochs, heartbeats and eligibility rows are passed in by the caller, who knows when
the request arrived, the verdict was reached, the epoch closed or the heartbeat came in.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, ParamSpec, Self, TypeVar

from engy_node.gateway.store import schema

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])

_GROUP_COMMIT = "_store_group_commit_durable"


def serialised(method: Callable[P, R]) -> Callable[P, R]:
    """Run a store method under its lock, turning database-level failures into `StoreError`."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        store: Connection = args[0]  # type: ignore[assignment]
        with store._lock:
            try:
                return method(*args, **kwargs)
            except sqlite3.Error as error:
                explained = schema.explain(store.path, error)
                if explained is None:
                    raise
                raise explained from error

    return wrapper


def group_commit(*, durable: bool) -> Callable[[F], F]:
    """Mark an operation that `Store.run` joins to the next group commit rather than running it
    alone: the operations on every request's path, where one transaction and one fsync per batch
    of concurrent calls pays. `durable=False` lets the group's commit skip waiting for the disk
    when no other operation in it needs that (see the package's posture for which may)."""

    def mark(operation: F) -> F:
        setattr(operation, _GROUP_COMMIT, durable)
        return operation

    return mark


def group_commit_durability(operation: Callable[..., object]) -> bool | None:
    """`durable` as `group_commit` marked `operation`; None when it is not marked."""
    return getattr(operation, _GROUP_COMMIT, None)


class Connection:
    """The store's connection, its lock and its transactions; the operations live in the
    subclasses (`Ledger`, `RequestLog`, `Miners`, `Verdicts`, `Epochs`, `Validators`,
    `EligibilityTable`), which `Store` composes."""

    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], float], busy_timeout_s: float) -> None:
        self.path = Path(path)
        self._clock = clock
        # Re-entrant: a group commit runs several serialised methods inside one transaction.
        self._lock = threading.RLock()
        self._in_batch = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = schema.connect(self.path, busy_timeout_s=busy_timeout_s)
        self._sync_level: Literal["FULL", "NORMAL"] = "FULL"

    def _synchronous(self, level: Literal["FULL", "NORMAL"]) -> None:
        if level != self._sync_level:
            self._conn.execute(f"PRAGMA synchronous = {level}")
            self._sync_level = level

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        if self._in_batch:
            # Inside a group commit: a savepoint makes this operation all-or-nothing on its own
            # while the batch's one COMMIT makes every operation in it durable together.
            self._conn.execute("SAVEPOINT operation")
            try:
                yield self._conn
                self._conn.execute("RELEASE operation")
            except BaseException:
                self._conn.execute("ROLLBACK TO operation")
                self._conn.execute("RELEASE operation")
                raise
            return
        # IMMEDIATE takes the write lock before the first read, so what a transaction checks
        # (a balance, an open hold) cannot change before it writes.
        self._synchronous("FULL")
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
            self._conn.execute("COMMIT")
        except BaseException:
            # SQLite rolls back by itself after some errors (a full disk); roll back only what
            # is still open.
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        if self._in_batch:
            yield self._conn
            return
        # A deferred read transaction: several SELECTs see one consistent state.
        self._conn.execute("BEGIN")
        try:
            yield self._conn
        finally:
            self._conn.execute("COMMIT")

    @contextlib.contextmanager
    def _batch(self, *, durable: bool) -> Iterator[None]:
        """One transaction around several operations (a group commit), under the caller's hold
        of the lock. Each operation's `_write` inside it is a savepoint of its own. The commit
        waits for the disk only when `durable`."""
        try:
            self._synchronous("FULL" if durable else "NORMAL")
            self._conn.execute("BEGIN IMMEDIATE")
            self._in_batch = True
            try:
                yield
            finally:
                self._in_batch = False
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise

    @serialised
    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
