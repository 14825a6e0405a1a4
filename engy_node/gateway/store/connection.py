"""The rules every store operation follows, whichever database is underneath: each write one
explicit transaction, each commit durable unless the operation allows less, database failures
turned into `StoreError`s naming the fix.

Two databases, one SQL. The operations (ledger.py and its siblings) are written once, in the SQL
both SQLite and PostgreSQL accept, with `?` placeholders; the database object underneath
(`schema.SqliteDatabase` for a file, `postgres.PostgresDatabase` for a URL) opens transactions,
translates placeholders where it must, and says what each failure means. The few places where
the two must differ are hooks on it: `for_update` (a row lock PostgreSQL needs and SQLite's
whole-database write lock makes redundant) and `reclaim_space`.

Locks. SQLite has one connection per store, so a lock (`serialised`) keeps it to one operation at
a time whichever thread calls; several connections, in threads or processes, share the file and
SQLite's own locks serialise them (`BEGIN IMMEDIATE` takes the write lock before anything is
read). PostgreSQL hands each operation a connection of its own from a pool, so operations run
side by side, and the rows they touch are locked by the statements themselves: the conditional
UPDATE that makes a hold, and `for_update` on the hold row a closure reads first.

Inside a group commit (`Connection._batch`, SQLite only, driven by `Store.run` for the
operations marked `group_commit`) the same operations run unchanged: each `_write` becomes a
savepoint, so one failing operation rolls back only itself while the batch's single COMMIT
makes all the others durable together.

Time. Each write method reads the injected clock once, at its start, and stamps every row of
its transaction with that value (tests pass a fake clock). The times on request-log rows,
verdicts, epochs, heartbeats and eligibility rows are passed in by the caller, who knows when
the request arrived, the verdict was reached, the epoch closed or the heartbeat came in.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from typing import Any, ParamSpec, Protocol, Self, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])

_GROUP_COMMIT = "_store_group_commit_durable"


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class Session(Protocol):
    """What an operation runs its SQL on: `?` placeholders, DB-API cursors back. Arguments by
    position, as sqlite3's connection takes them."""

    def execute(self, sql: str, params: Any = (), /) -> Cursor: ...
    def executemany(self, sql: str, rows: Any, /) -> Cursor: ...


class Database(Protocol):
    """One backend: how transactions open and close, and what its failures mean."""

    where: str
    """The database as messages name it: a file path, or a URL without its password."""
    concurrency: int
    """How many operations may run at once (`Store.run`'s limiter)."""
    groups_commits: bool
    """Whether `Store.run` batches the `group_commit` operations into one transaction."""
    for_update: str
    """Appended to a SELECT that must lock the rows it reads until the transaction ends."""

    # Read-only, so that a backend may hold narrower types (its driver's errors, its kind of lock).
    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        """The driver's exception types `explain` judges."""

    @property
    def lock(self) -> ContextManager[Any]: ...

    def write(self, *, durable: bool, pipelined: bool = False) -> ContextManager[Session]:
        """One write transaction. `pipelined`: the operation reads every result it needs through
        `fetchone`/`fetchall` (never `rowcount`), so a backend with round trips may send its
        statements without waiting for each answer."""

    def read(self) -> ContextManager[Session]: ...
    def snapshot(self) -> ContextManager[Session]: ...
    def batch(self, *, durable: bool, savepoints: bool = True) -> ContextManager[None]: ...
    def explain(self, error: BaseException) -> Exception | None: ...
    def is_unique_violation(self, error: BaseException) -> bool: ...
    def reclaim_space(self) -> None: ...
    def serialise_on(self, session: Session, space: int, key: int) -> None:
        """Make the rest of this write transaction wait for any other one that called this with
        the same `(space, key)`, until it ends (where the write lock does not already)."""

    def close(self) -> None: ...


def serialised(method: Callable[P, R]) -> Callable[P, R]:
    """Run a store method under its database's lock, turning database-level failures into
    `StoreError`."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        store: Connection = args[0]  # type: ignore[assignment]
        database = store._db
        with database.lock:
            try:
                return method(*args, **kwargs)
            except database.errors as error:
                explained = database.explain(error)
                if explained is None:
                    raise
                raise explained from error

    return wrapper


def group_commit(*, durable: bool) -> Callable[[F], F]:
    """Mark an operation that `Store.run` joins to the next group commit rather than running it
    alone: the operations on every request's path, where one transaction and one fsync per batch
    of concurrent calls pays. `durable=False` lets the group's commit skip waiting for the disk
    when no other operation in it needs that (see the package's posture for which may).

    A marked operation must let every failure raise, a database error above all: a group is
    first written without savepoints (`Store._commit_group`), and only an operation that fails
    tells it to undo the others' writes and write them again, each in a savepoint of its own.
    One that caught a failing statement and returned would leave that statement's companions
    written."""

    def mark(operation: F) -> F:
        setattr(operation, _GROUP_COMMIT, durable)
        return operation

    return mark


def group_commit_durability(operation: Callable[..., object]) -> bool | None:
    """`durable` as `group_commit` marked `operation`; None when it is not marked."""
    return getattr(operation, _GROUP_COMMIT, None)


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether a store location names a PostgreSQL database rather than an SQLite file."""
    return isinstance(location, str) and location.startswith(("postgresql://", "postgres://"))


def open_database(location: str | os.PathLike[str], *, busy_timeout_s: float, pool_size: int) -> Database:
    """The backend for `location`: a `postgresql://` URL, or the path of an SQLite file."""
    if is_url(location):
        from engy_node.gateway.store.postgres import PostgresDatabase

        return PostgresDatabase(str(location), busy_timeout_s=busy_timeout_s, pool_size=pool_size)
    from engy_node.gateway.store.schema import SqliteDatabase

    return SqliteDatabase(location, busy_timeout_s=busy_timeout_s)


class Connection:
    """The store's database and its transactions; the operations live in the subclasses
    (`Ledger`, `RequestLog`, `Miners`, `Verdicts`, `Epochs`, `Validators`, `EligibilityTable`),
    which `Store` composes."""

    def __init__(
        self, location: str | os.PathLike[str], *, clock: Callable[[], float], busy_timeout_s: float, pool_size: int
    ) -> None:
        self._clock = clock
        self._db = open_database(location, busy_timeout_s=busy_timeout_s, pool_size=pool_size)
        self.where = self._db.where

    def _write(self, *, durable: bool = True, pipelined: bool = False) -> ContextManager[Session]:
        """One write transaction (a savepoint inside a group commit). `durable=False`: its
        commit need not wait for the disk (holds and releases; see the package's posture).
        `pipelined`: see `Database.write`; the request path's operations use it."""
        return self._db.write(durable=durable, pipelined=pipelined)

    def _read(self) -> ContextManager[Session]:
        """A single statement's worth of reading, outside any transaction of ours."""
        return self._db.read()

    def _snapshot(self) -> ContextManager[Session]:
        """Several SELECTs that see one consistent state."""
        return self._db.snapshot()

    def _batch(self, *, durable: bool, savepoints: bool = True) -> ContextManager[None]:
        return self._db.batch(durable=durable, savepoints=savepoints)

    @serialised
    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
