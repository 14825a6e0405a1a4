"""The gateway's durable state in one SQLite file: buyer accounts and keys, the money ledger, the
request log and miner registrations (SPEC §8.3).

Posture. The ledger must never double-charge, lose a charge or let concurrent requests spend
money a buyer does not have, across crashes and across processes sharing the file. So every
write is one explicit `BEGIN IMMEDIATE` transaction (the write lock is taken before anything is
read, so a balance check and the hold it allows cannot be split by another writer, in this
process or another); ledger rows are append-only, refused by triggers in the database itself;
and every hold is closed at most once, by exactly one `settle` and one `release` row whose
amounts sum to the hold — a unique index makes a second closure impossible, so a retried settle
after a crash is a no-op rather than a second charge. Commits are fsynced (`synchronous=FULL`):
a charge the buyer was told about survives a power cut. The gateway's holds and releases are the
exception (`hold_async`, `release_async`): they commit without waiting for the disk
(`synchronous=NORMAL`, which in WAL mode is still atomic and at once visible to every
connection, and becomes durable with the next fsynced commit). Losing one to a power cut leaves
what recovery produces anyway (a hold that never was, or an open hold that start-up releases in
full), and it takes the disk's flush (0.2 ms here, milliseconds on network block storage) out of
every request's time to first token.

Where ambiguity remains, it resolves toward the buyer: refunding an orphaned hold costs the
operator cents; charging it could cost a buyer dollars for an answer they never received. Holds
left open by a crash are therefore released in full by `recover_open_holds`, and a cost above its
hold is clamped to the hold (and logged: it means the worst case was mis-computed upstream).

Trust. The store trusts its own rows, not the objects callers hand back: `settle` re-reads the
hold from the ledger. Amounts are integer micro-USD; `billing.py` decides them.

Zero data retention. Nothing here accepts prompt or completion text. The request log is
metadata only, and `RequestLogEntry` validates every string field as an identifier or catalog
id, so free text cannot reach the disk through it even by mistake.

Time. Each write method reads the injected clock once, at its start, and stamps every row of
its transaction with that value (tests pass a fake clock). The request log's `created_at` is
passed in by the caller, who knows when the request arrived.

Threads. One `Store` owns one connection. Each operation is a synchronous method (the admin
CLI, tests) with an `*_async` twin that runs it via `trio.to_thread.run_sync` behind the
store's `CapacityLimiter(1)`, so SQLite never runs on the event loop and never twice at once; a
lock serialises the synchronous methods as well. Several `Store`s (threads, processes) may
share a file; SQLite's locks and the busy timeout serialise them.

Errors. A corrupt, foreign, newer-schema, locked or unwritable file raises `StoreError` naming
the file and the fix. Unknown accounts raise `StoreError`; gateway bugs (negative amounts, a hold
that is not in this ledger) raise `ValueError`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, ParamSpec, TypeVar

import trio

from engy_node.errors import EngyError
from engy_node.models import CATALOG

log = logging.getLogger("engy.gateway.store")

SCHEMA_VERSION = 1
"""Bump with a migration whenever the schema changes; a file with another version is refused."""

APPLICATION_ID = int.from_bytes(b"engy", "big")
"""SQLite's header field for "which program owns this file"; tells our store from any other
SQLite database someone points us at."""

BUSY_TIMEOUT_S = 5.0
"""How long a write waits for another connection's lock before giving up. One of our write
transactions is a few indexed statements plus an fsync (about a millisecond, tens on a slow
disk), so even hundreds of queued writers clear well inside it; a lock held longer is another
process sitting on the file, which deserves an error, not a hang."""

KEY_ENTROPY_BYTES = 32
"""Random bytes per API or miner key: 256 bits, the security level of the sha256 that stores
it. Guessing is hopeless at any request rate, which is also why a plain sha256 suffices: slow
hashes (bcrypt, argon2) protect low-entropy human passwords from offline guessing, and would
only add ~100 ms of CPU to every request here."""

BUYER_KEY_PREFIX = "engy-sk-"
MINER_KEY_PREFIX = "engy-mk-"

RECOVERED_IDS_LOGGED = 10
"""Request ids named in the recovery log line: enough to look a few up in the request log, few
enough that a crash under heavy load still logs one readable line (the full list is returned)."""

IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""What a request id or miner id in the request log may look like. ss58 hotkeys (48 chars),
uuids (36) and `key:<id>` fit with room to spare; spaces and punctuation do not, so no sentence of
prompt or completion text can pass for one."""

_SCHEMA = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
    # The balance cache. Updated in the same transaction as the ledger rows that move it; the
    # CHECKs make the database itself refuse an overdraft or books that do not balance.
    """CREATE TABLE accounts (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL,
        created_at REAL NOT NULL,
        available INTEGER NOT NULL DEFAULT 0 CHECK (available >= 0),
        held INTEGER NOT NULL DEFAULT 0 CHECK (held >= 0),
        credited INTEGER NOT NULL DEFAULT 0 CHECK (credited >= 0),
        charged INTEGER NOT NULL DEFAULT 0 CHECK (charged >= 0),
        CHECK (credited = charged + available + held))""",
    """CREATE TABLE api_keys (
        id INTEGER PRIMARY KEY,
        account_id INTEGER NOT NULL REFERENCES accounts(id),
        key_sha256 TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL,
        revoked_at REAL)""",
    """CREATE TABLE ledger (
        id INTEGER PRIMARY KEY,
        account_id INTEGER NOT NULL REFERENCES accounts(id),
        kind TEXT NOT NULL CHECK (kind IN ('credit', 'hold', 'settle', 'release')),
        amount INTEGER NOT NULL CHECK (amount >= 0),
        request_id TEXT,
        hold_id INTEGER REFERENCES ledger(id),
        memo TEXT CHECK (memo IS NULL OR kind = 'credit'),
        available_after INTEGER NOT NULL CHECK (available_after >= 0),
        created_at REAL NOT NULL,
        CHECK ((kind IN ('settle', 'release')) = (hold_id IS NOT NULL)))""",
    "CREATE INDEX ledger_by_account ON ledger(account_id, id)",
    "CREATE UNIQUE INDEX ledger_one_hold_per_request ON ledger(request_id) WHERE kind = 'hold'",
    # At most one settle and one release per hold: a second closure violates this index.
    "CREATE UNIQUE INDEX ledger_one_closure_per_hold ON ledger(hold_id, kind) WHERE hold_id IS NOT NULL",
    """CREATE TRIGGER ledger_no_update BEFORE UPDATE ON ledger
       BEGIN SELECT RAISE(ABORT, 'ledger is append-only: entries are never updated'); END""",
    """CREATE TRIGGER ledger_no_delete BEFORE DELETE ON ledger
       BEGIN SELECT RAISE(ABORT, 'ledger is append-only: entries are never deleted'); END""",
    """CREATE TABLE request_log (
        id INTEGER PRIMARY KEY,
        request_id TEXT NOT NULL,
        account_id INTEGER REFERENCES accounts(id),
        miner TEXT,
        model TEXT,
        api TEXT NOT NULL CHECK (api IN ('openai', 'anthropic')),
        kind TEXT NOT NULL CHECK (kind IN ('paid', 'probe')),
        status INTEGER NOT NULL,
        prompt_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        cached_tokens INTEGER NOT NULL,
        cost_micro INTEGER NOT NULL,
        ttft_ms REAL,
        tpot_ms REAL,
        created_at REAL NOT NULL)""",
    "CREATE INDEX request_log_by_account ON request_log(account_id, created_at)",
    "CREATE INDEX request_log_by_time ON request_log(created_at)",
    """CREATE TABLE miners (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        hotkey TEXT UNIQUE,
        key_sha256 TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL)""",
)

# Primary SQLite result codes (the low byte of extended codes such as SQLITE_BUSY_SNAPSHOT).
_LOCKED_CODES = {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED}
_CORRUPT_CODES = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}
_UNWRITABLE_CODES = {sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_PERM}


class StoreError(EngyError):
    """The database cannot be used as asked; the message names the file and the fix."""

    title = "store"


@dataclasses.dataclass(frozen=True, slots=True)
class Account:
    account_id: int
    name: str


@dataclasses.dataclass(frozen=True, slots=True)
class Balance:
    """Micro-USD. Always `credited == charged + available + held`."""

    available: int
    """What new holds can reserve."""
    held: int
    """Reserved by requests in flight."""
    credited: int
    """Everything ever credited."""
    charged: int
    """Everything ever charged."""


@dataclasses.dataclass(frozen=True, slots=True)
class Hold:
    """A reservation on an account's balance; `hold_id` is the ledger row that made it."""

    hold_id: int
    account_id: int
    amount: int
    request_id: str
    created_at: float


@dataclasses.dataclass(frozen=True, slots=True)
class Settlement:
    """How a hold was closed: `charged + released == hold.amount`."""

    hold_id: int
    charged: int
    released: int
    applied: bool
    """False when the hold was already closed: this call changed nothing, and `charged` and
    `released` report the earlier closure."""


@dataclasses.dataclass(frozen=True, slots=True)
class UsageSummary:
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_micro: int
    """Micro-USD, summed over the logged requests."""


@dataclasses.dataclass(frozen=True, slots=True)
class MinerRecord:
    miner_id: int
    name: str
    hotkey: str | None
    created_at: float


def _identifier(name: str, value: object) -> str:
    if not isinstance(value, str) or IDENTIFIER.fullmatch(value) is None:
        raise ValueError(f"{name} must be an identifier matching {IDENTIFIER.pattern}, got {value!r}")
    return value


def _integer(name: str, value: object, *, minimum: int = 0) -> int:
    # bool is an int subclass; True micro-dollars is always a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _duration(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
        raise ValueError(f"{name} must be a finite number of ms >= 0 or None, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True, slots=True)
class RequestLogEntry:
    """One request's metadata. Every field is a number, a closed choice, a catalog id or an
    identifier (validated on construction), so no prompt or completion text fits anywhere."""

    request_id: str
    """The gateway's id for the buyer request (an `IDENTIFIER`)."""
    account_id: int | None
    """The buyer; None for probes, which no buyer pays for."""
    miner: str | None
    """Hotkey or `key:<miner id>` of the miner that served it; None when none was reached."""
    model: str | None
    """Catalog id; None when the request named no catalog model (a 404)."""
    api: Literal["openai", "anthropic"]
    kind: Literal["paid", "probe"]
    status: int
    """HTTP status the buyer got (or would have got, for a probe)."""
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cost_micro: int
    """Micro-USD charged; 0 for probes."""
    ttft_ms: float | None
    tpot_ms: float | None
    created_at: float
    """Unix seconds when the request arrived."""

    def __post_init__(self) -> None:
        _identifier("request_id", self.request_id)
        if self.miner is not None:
            _identifier("miner", self.miner)
        if self.model is not None and self.model not in CATALOG:
            raise ValueError(f"model must be a catalog id ({', '.join(sorted(CATALOG))}) or None, got {self.model!r}")
        if self.api not in ("openai", "anthropic"):
            raise ValueError(f"api must be 'openai' or 'anthropic', got {self.api!r}")
        if self.kind == "paid":
            _integer("account_id", self.account_id, minimum=1)
        elif self.kind == "probe":
            if self.account_id is not None or self.cost_micro != 0:
                raise ValueError("a probe has no account and costs nothing")
        else:
            raise ValueError(f"kind must be 'paid' or 'probe', got {self.kind!r}")
        if _integer("status", self.status, minimum=100) > 599:
            raise ValueError(f"status must be an HTTP status code, got {self.status!r}")
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens", "cost_micro"):
            _integer(name, getattr(self, name))
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens ({self.cached_tokens}) exceeds prompt_tokens ({self.prompt_tokens})")
        _duration("ttft_ms", self.ttft_ms)
        _duration("tpot_ms", self.tpot_ms)
        if isinstance(self.created_at, bool) or not isinstance(self.created_at, (int, float)) or not math.isfinite(self.created_at):
            raise ValueError(f"created_at must be unix seconds, got {self.created_at!r}")


def _sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _new_key(prefix: str) -> tuple[str, str]:
    key = prefix + secrets.token_urlsafe(KEY_ENTROPY_BYTES)
    return key, _sha256(key)


def _explain(path: Path, error: sqlite3.Error) -> StoreError | None:
    """The user-facing error for a database-level failure, or None for a bug in our SQL."""
    code = getattr(error, "sqlite_errorcode", None)
    primary = None if code is None else code & 0xFF
    if primary in _LOCKED_CODES:
        return StoreError(f"{path} is locked by another process; stop the other engy-node or admin command using it, then retry")
    if primary in _CORRUPT_CODES:
        return StoreError(
            f"{path} is not a readable engy database ({error}); restore it from a backup, or move it aside to start "
            "an empty one (the ledger in it is then lost)"
        )
    if primary == sqlite3.SQLITE_FULL:
        return StoreError(f"the disk holding {path} is full; free space and retry (the failed write was rolled back)")
    if primary in _UNWRITABLE_CODES:
        return StoreError(f"cannot use {path} ({error}); check that its directory exists and is writable by this user")
    return None


P = ParamSpec("P")
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


def _serialised(method: Callable[P, R]) -> Callable[P, R]:
    """Run a `Store` method under its lock, turning database-level failures into `StoreError`."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        store: Store = args[0]  # type: ignore[assignment]
        with store._lock:
            try:
                return method(*args, **kwargs)
            except sqlite3.Error as error:
                explained = _explain(store.path, error)
                if explained is None:
                    raise
                raise explained from error

    return wrapper


class Store:
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
        self.path = Path(path)
        self._clock = clock
        # Re-entrant: a group commit runs several serialised methods inside one transaction.
        self._lock = threading.RLock()
        self._limiter = trio.CapacityLimiter(1)
        self._in_batch = False
        self._queue: list[_Slot] = []
        self._flush_lock = trio.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # isolation_level=None: the sqlite3 module starts no transactions of its own; every
            # write says BEGIN IMMEDIATE explicitly. check_same_thread=False: trio runs each
            # call on whichever worker thread is free; the lock keeps them one at a time.
            self._conn = sqlite3.connect(self.path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as error:
            raise (_explain(self.path, error) or error) from error
        try:
            self._prepare()
        except sqlite3.Error as error:
            self._conn.close()
            raise (_explain(self.path, error) or error) from error
        except BaseException:
            self._conn.close()
            raise

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
                self._synchronous("FULL" if any(slot.durable for slot in group) else "NORMAL")
                self._conn.execute("BEGIN IMMEDIATE")
                self._in_batch = True
                try:
                    for slot in group:
                        slot.run()
                finally:
                    self._in_batch = False
                self._conn.execute("COMMIT")
            except BaseException as error:  # broad on purpose: every caller in the group must hear of it
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                explained = _explain(self.path, error) if isinstance(error, sqlite3.Error) else None
                for slot in group:
                    slot.fail(explained or error)
            finally:
                for slot in group:
                    slot.done_threadsafe()

    def _prepare(self) -> None:
        # auto_vacuum takes effect only before the first table exists; on an existing file it
        # is a no-op. INCREMENTAL lets purge_request_log hand freed pages back to the disk.
        self._conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
        mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            raise StoreError(f"{self.path} cannot use write-ahead logging (journal mode stays {mode!r}); put it on a local disk")
        # FULL fsyncs every commit: a charge or credit reported to anyone survives a power cut.
        self._conn.execute("PRAGMA synchronous = FULL")
        self._sync_level = "FULL"
        self._conn.execute("PRAGMA foreign_keys = ON")
        with self._write() as conn:
            if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0:
                for statement in _SCHEMA:
                    conn.execute(statement)
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                return
            if conn.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
                raise StoreError(f"{self.path} is an SQLite database of some other program; point the gateway at its own file")
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            found = None if row is None else row[0]
            if found != str(SCHEMA_VERSION):
                raise StoreError(
                    f"{self.path} has store schema version {found}, this engy-node uses {SCHEMA_VERSION}; "
                    "run the engy-node version that wrote it, or move the file aside"
                )

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

    @_serialised
    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- accounts and keys --------------------------------------------------------------------

    @_serialised
    def create_buyer(self, name: str) -> tuple[int, str]:
        """A new account with no balance and its first API key: `(account_id, api_key)`.

        The key is returned once and stored only as its sha256; it cannot be shown again.
        """
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"a buyer needs a non-empty name, got {name!r}")
        now = self._clock()
        with self._write() as conn:
            account_id = conn.execute("INSERT INTO accounts (name, created_at) VALUES (?, ?)", (name, now)).lastrowid
            return account_id, self._insert_key(conn, account_id=account_id, now=now)

    @_serialised
    def issue_key(self, account_id: int) -> str:
        """Another API key for an existing account (key rotation); shown once, stored hashed."""
        now = self._clock()
        with self._write() as conn:
            self._require_account(conn, account_id)
            return self._insert_key(conn, account_id=account_id, now=now)

    def _insert_key(self, conn: sqlite3.Connection, *, account_id: int, now: float) -> str:
        key, digest = _new_key(BUYER_KEY_PREFIX)
        conn.execute("INSERT INTO api_keys (account_id, key_sha256, created_at) VALUES (?, ?, ?)", (account_id, digest, now))
        return key

    @_serialised
    def authenticate(self, api_key: str) -> Account | None:
        """The account an unrevoked API key belongs to, or None.

        No constant-time comparison: the lookup is by the sha256 of the presented key, so
        whatever its timing leaks is about hashes of the attacker's own guesses, and learning
        how close a hash came to a stored one does not help find a key that hashes to it.
        """
        if not isinstance(api_key, str) or not api_key.startswith(BUYER_KEY_PREFIX):
            return None
        row = self._conn.execute(
            "SELECT a.id, a.name FROM api_keys k JOIN accounts a ON a.id = k.account_id "
            "WHERE k.key_sha256 = ? AND k.revoked_at IS NULL",
            (_sha256(api_key),),
        ).fetchone()
        return None if row is None else Account(account_id=row[0], name=row[1])

    @_serialised
    def revoke_key(self, api_key: str) -> bool:
        """Stop accepting `api_key`. False when it was unknown or already revoked."""
        now = self._clock()
        with self._write() as conn:
            cursor = conn.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE key_sha256 = ? AND revoked_at IS NULL", (now, _sha256(api_key))
            )
            return cursor.rowcount == 1

    def _require_account(self, conn: sqlite3.Connection, account_id: int) -> None:
        if conn.execute("SELECT 1 FROM accounts WHERE id = ?", (account_id,)).fetchone() is None:
            raise StoreError(f"no buyer account {account_id} in {self.path}; use the id that creating the buyer printed")

    # -- ledger -------------------------------------------------------------------------------

    @_serialised
    def credit(self, account_id: int, *, micro_usd: int, memo: str = "") -> int:
        """Add `micro_usd` (> 0) to the account; returns the available balance after it."""
        _integer("micro_usd", micro_usd, minimum=1)
        now = self._clock()
        with self._write() as conn:
            row = conn.execute(
                "UPDATE accounts SET available = available + ?1, credited = credited + ?1 WHERE id = ?2 RETURNING available",
                (micro_usd, account_id),
            ).fetchone()
            if row is None:
                self._require_account(conn, account_id)
            available = row[0]
            conn.execute(
                "INSERT INTO ledger (account_id, kind, amount, memo, available_after, created_at) VALUES (?, 'credit', ?, ?, ?, ?)",
                (account_id, micro_usd, memo, available, now),
            )
            return available

    @_serialised
    def hold(self, account_id: int, *, amount: int, request_id: str) -> Hold | None:
        """Reserve `amount` for `request_id`, or None when the available balance cannot cover it
        (the caller answers 402).

        Atomic: the balance check and the reservation are one conditional UPDATE inside one
        `BEGIN IMMEDIATE` transaction, so concurrent holds, from any thread or process, can
        never together reserve more than the balance. `request_id` may hold only once.
        """
        _integer("amount", amount)
        _identifier("request_id", request_id)
        now = self._clock()
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM ledger WHERE kind = 'hold' AND request_id = ?", (request_id,)).fetchone():
                raise ValueError(f"request {request_id} already has a hold; request ids must be unique")
            row = conn.execute(
                "UPDATE accounts SET available = available - ?1, held = held + ?1 "
                "WHERE id = ?2 AND available >= ?1 RETURNING available",
                (amount, account_id),
            ).fetchone()
            if row is None:
                self._require_account(conn, account_id)
                return None
            hold_id = conn.execute(
                "INSERT INTO ledger (account_id, kind, amount, request_id, available_after, created_at) "
                "VALUES (?, 'hold', ?, ?, ?, ?)",
                (account_id, amount, request_id, row[0], now),
            ).lastrowid
            return Hold(hold_id=hold_id, account_id=account_id, amount=amount, request_id=request_id, created_at=now)

    @_serialised
    def settle(self, hold: Hold, *, cost: int) -> Settlement:
        """Charge `min(cost, hold.amount)` and release the rest of the hold.

        Idempotent per hold: if the hold is already closed (settled, released, or recovered
        after a crash) nothing changes and the earlier closure is reported with
        `applied=False`, so a retry never charges twice. A cost above the hold is clamped to it
        and logged as a bug upstream: the buyer agreed to the hold, not to more.
        """
        _integer("cost", cost)
        return self._close(hold, cost=cost)

    @_serialised
    def release(self, hold: Hold) -> Settlement:
        """Return the whole hold to the available balance (the request failed or was never
        served). Idempotent exactly like `settle`."""
        return self._close(hold, cost=0)

    def _close(self, hold: Hold, *, cost: int) -> Settlement:
        now = self._clock()
        with self._write() as conn:
            earlier = self._closure(conn, hold.hold_id)
            if earlier is not None:
                return earlier
            row = conn.execute("SELECT account_id, amount, request_id FROM ledger WHERE id = ? AND kind = 'hold'", (hold.hold_id,)).fetchone()
            if row is None or (row[0], row[1]) != (hold.account_id, hold.amount):
                raise ValueError(f"{hold} is not a hold in {self.path}")
            account_id, amount, request_id = row
            if cost > amount:
                log.warning("request %s cost %d µUSD, above its %d µUSD hold; charged the hold (the worst case was "
                            "under-estimated upstream: a bug)", request_id, cost, amount)
            charged = min(cost, amount)
            self._write_closure(conn, account_id=account_id, hold_id=hold.hold_id, request_id=request_id,
                                charged=charged, released=amount - charged, now=now)
            return Settlement(hold_id=hold.hold_id, charged=charged, released=amount - charged, applied=True)

    @staticmethod
    def _closure(conn: sqlite3.Connection, hold_id: int) -> Settlement | None:
        rows = dict(conn.execute("SELECT kind, amount FROM ledger WHERE hold_id = ?", (hold_id,)).fetchall())
        if not rows:
            return None
        return Settlement(hold_id=hold_id, charged=rows["settle"], released=rows["release"], applied=False)

    @staticmethod
    def _write_closure(conn: sqlite3.Connection, *, account_id: int, hold_id: int, request_id: str,
                       charged: int, released: int, now: float) -> None:
        # Both rows are always written, zero amounts included, so "closed" has one meaning the
        # unique index can enforce: this hold has its settle row and its release row.
        available = conn.execute(
            "UPDATE accounts SET held = held - ?1 - ?2, charged = charged + ?1, available = available + ?2 "
            "WHERE id = ?3 RETURNING available",
            (charged, released, account_id),
        ).fetchone()[0]
        insert = ("INSERT INTO ledger (account_id, kind, amount, request_id, hold_id, available_after, created_at) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?)")
        conn.execute(insert, (account_id, "settle", charged, request_id, hold_id, available - released, now))
        conn.execute(insert, (account_id, "release", released, request_id, hold_id, available, now))

    @_serialised
    def recover_open_holds(self, *, older_than: float | None = None) -> list[Hold]:
        """Release every hold still open (created before `older_than`, when given) and return them.

        Run at start-up: a hold open then belongs to a request that died with the previous
        process, and whether its answer reached the buyer is unknowable. Refunding it costs
        the operator at most that request's price; charging it could bill a buyer for nothing.
        When several gateway processes share the file, pass `older_than = now - the longest
        request time (the catalog's max_request_s)` so holds of live siblings are left alone.
        A late `settle` of a recovered hold is a no-op.
        """
        now = self._clock()
        cutoff = math.inf if older_than is None else older_than
        with self._write() as conn:
            # Only accounts with something held can have an open hold; that bounds the scan.
            rows = conn.execute(
                "SELECT h.id, h.account_id, h.amount, h.request_id, h.created_at FROM ledger h "
                "JOIN accounts a ON a.id = h.account_id AND a.held > 0 "
                "WHERE h.kind = 'hold' AND h.created_at < ? "
                "AND NOT EXISTS (SELECT 1 FROM ledger c WHERE c.hold_id = h.id) ORDER BY h.id",
                (cutoff,),
            ).fetchall()
            recovered = [Hold(hold_id=r[0], account_id=r[1], amount=r[2], request_id=r[3], created_at=r[4]) for r in rows]
            for hold in recovered:
                self._write_closure(conn, account_id=hold.account_id, hold_id=hold.hold_id, request_id=hold.request_id,
                                    charged=0, released=hold.amount, now=now)
        if recovered:
            named = ", ".join(h.request_id for h in recovered[:RECOVERED_IDS_LOGGED])
            more = len(recovered) - RECOVERED_IDS_LOGGED
            log.warning("released %d hold(s) left open by an earlier run (%d µUSD refunded): %s%s", len(recovered),
                        sum(h.amount for h in recovered), named, f" and {more} more" if more > 0 else "")
        return recovered

    @_serialised
    def balance(self, account_id: int) -> Balance:
        row = self._conn.execute("SELECT available, held, credited, charged FROM accounts WHERE id = ?", (account_id,)).fetchone()
        if row is None:
            self._require_account(self._conn, account_id)
        return Balance(*row)

    @_serialised
    def check_books(self) -> list[int]:
        """Ids of accounts whose cached balance disagrees with their ledger (empty: all agree)."""
        with self._snapshot() as conn:
            rows = conn.execute(
                """SELECT a.id FROM accounts a LEFT JOIN (
                       SELECT account_id,
                              sum(CASE kind WHEN 'credit' THEN amount ELSE 0 END) AS credited,
                              sum(CASE kind WHEN 'hold' THEN amount ELSE 0 END) AS held_ever,
                              sum(CASE kind WHEN 'settle' THEN amount ELSE 0 END) AS charged,
                              sum(CASE kind WHEN 'release' THEN amount ELSE 0 END) AS released
                       FROM ledger GROUP BY account_id) l ON l.account_id = a.id
                   WHERE a.credited != coalesce(l.credited, 0)
                      OR a.charged != coalesce(l.charged, 0)
                      OR a.held != coalesce(l.held_ever - l.charged - l.released, 0)
                      OR a.available != coalesce(l.credited - l.held_ever + l.released, 0)
                   ORDER BY a.id"""
            ).fetchall()
        return [row[0] for row in rows]

    # -- request log --------------------------------------------------------------------------

    def log_request(self, entry: RequestLogEntry) -> None:
        """Append one request's metadata (no content; see `RequestLogEntry`)."""
        self.log_requests([entry])

    @_serialised
    def log_requests(self, entries: Sequence[RequestLogEntry]) -> None:
        """Append several requests' metadata in one transaction: all of them, or none."""
        for entry in entries:
            if not isinstance(entry, RequestLogEntry):
                raise TypeError(f"log_requests takes RequestLogEntry rows, got {type(entry).__name__}")
        columns = [field.name for field in dataclasses.fields(RequestLogEntry)]
        with self._write() as conn:
            conn.executemany(
                f"INSERT INTO request_log ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                [[getattr(entry, column) for column in columns] for entry in entries],
            )

    @_serialised
    def usage(self, account_id: int, *, since: float | None = None) -> UsageSummary:
        """Paid requests of the account logged at or after `since` (unix seconds), as far back
        as the request log is retained (`purge_request_log`); lifetime spend is `balance().charged`."""
        row = self._conn.execute(
            "SELECT count(DISTINCT request_id), coalesce(sum(prompt_tokens), 0), coalesce(sum(completion_tokens), 0), "
            "coalesce(sum(cached_tokens), 0), coalesce(sum(cost_micro), 0) FROM request_log "
            "WHERE account_id = ? AND kind = 'paid' AND created_at >= ?",
            (account_id, -math.inf if since is None else since),
        ).fetchone()
        return UsageSummary(*row)

    @_serialised
    def purge_request_log(self, *, older_than: float) -> int:
        """Delete request-log rows created before `older_than` (unix seconds) and give the freed
        pages back to the filesystem; returns how many rows went. The ledger is never purged."""
        with self._write() as conn:
            deleted = conn.execute("DELETE FROM request_log WHERE created_at < ?", (older_than,)).rowcount
        # executescript steps the pragma to completion; `execute` would free a single page
        # (the sqlite3 module steps a statement without result columns only once).
        self._conn.executescript("PRAGMA incremental_vacuum")
        return deleted

    # -- miners -------------------------------------------------------------------------------

    @_serialised
    def register_miner(self, name: str, *, hotkey: str | None = None) -> tuple[int, str]:
        """Register a miner allowed to connect with a key: `(miner_id, miner_key)`. The key is
        shown once and stored only as its sha256. Names and hotkeys are unique `IDENTIFIER`s
        (a name shows up in logs and the TUI, so it stays short and printable)."""
        _identifier("name", name)
        if hotkey is not None:
            _identifier("hotkey", hotkey)
        now = self._clock()
        key, digest = _new_key(MINER_KEY_PREFIX)
        with self._write() as conn:
            clash = conn.execute("SELECT name FROM miners WHERE name = ? OR hotkey = ?", (name, hotkey)).fetchone()
            if clash is not None:
                raise StoreError(f"miner {clash[0]!r} already has that name or hotkey; choose another name, or keep using its key")
            miner_id = conn.execute(
                "INSERT INTO miners (name, hotkey, key_sha256, created_at) VALUES (?, ?, ?, ?)", (name, hotkey, digest, now)
            ).lastrowid
        return miner_id, key

    @_serialised
    def authenticate_miner(self, miner_key: str) -> MinerRecord | None:
        """The miner a key was issued to, or None (hash lookup: see `authenticate`)."""
        if not isinstance(miner_key, str) or not miner_key.startswith(MINER_KEY_PREFIX):
            return None
        row = self._conn.execute(
            "SELECT id, name, hotkey, created_at FROM miners WHERE key_sha256 = ?", (_sha256(miner_key),)
        ).fetchone()
        return None if row is None else MinerRecord(*row)

    @_serialised
    def list_miners(self) -> list[MinerRecord]:
        return [MinerRecord(*row) for row in self._conn.execute("SELECT id, name, hotkey, created_at FROM miners ORDER BY id")]

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
