"""The store's SQLite file: its tables, its version stamp, opening it, its transactions, and what
each SQLite failure means to the operator (`SqliteDatabase`, the embedded default backend; the
PostgreSQL one is `postgres.py`).

Opening creates the file with the current schema if it is new and refuses one that is corrupt,
not ours (SQLite's `application_id` header field tells our file from any other SQLite database
someone points us at), or of another schema version: guessing at a layout we did not write could
only corrupt a ledger. The invariants that money depends on are in the DDL itself, so no code
path, ours or a hand-typed SQL statement, can break them: CHECKs refuse an overdraft or books
that do not balance, triggers refuse any update or delete of a ledger row (or of a published
epoch, which was signed and may be on chain), and unique indexes allow one hold per request and
one closure (settle row plus release row) per hold.

Errors. A corrupt, foreign, newer-schema, locked or unwritable file, or a full or failed disk,
raises `StoreError` naming the file and the fix (`explain`); an SQLite error that is none of
these is a bug in our SQL and propagates as itself.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

from engy_node.errors import EngyError
from engy_node.private_files import PRIVATE_DIR_MODE, make_private, private_file

SCHEMA_VERSION = 8
"""Bump with a migration (`MIGRATIONS`) whenever the schema changes; a file of a newer version,
or of an older one with no migration, is refused."""

APPLICATION_ID = int.from_bytes(b"engy", "big")
"""SQLite's header field for "which program owns this file"; tells our store from any other
SQLite database someone points us at."""

BUSY_TIMEOUT_S = 5.0
"""How long a write waits for another connection's lock before giving up. One of our write
transactions is a few indexed statements plus an fsync (about a millisecond, tens on a slow
disk), so even hundreds of queued writers clear well inside it; a lock held longer is another
process sitting on the file, which deserves an error, not a hang."""

_LEDGER_NO_UPDATE = """CREATE TRIGGER ledger_no_update BEFORE UPDATE ON ledger
       BEGIN SELECT RAISE(ABORT, 'ledger is append-only: entries are never updated'); END"""

SCHEMA: tuple[str, ...] = (
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
        kind TEXT NOT NULL CHECK (kind IN ('credit', 'deposit', 'hold', 'settle', 'release')),
        amount INTEGER NOT NULL CHECK (amount >= 0),
        request_id TEXT,
        hold_id INTEGER REFERENCES ledger(id),
        memo TEXT CHECK (memo IS NULL OR kind IN ('credit', 'deposit')),
        available_after INTEGER NOT NULL CHECK (available_after >= 0),
        created_at REAL NOT NULL,
        CHECK ((kind IN ('settle', 'release')) = (hold_id IS NOT NULL)))""",
    "CREATE INDEX ledger_by_account ON ledger(account_id, id)",
    "CREATE UNIQUE INDEX ledger_one_hold_per_request ON ledger(request_id) WHERE kind = 'hold'",
    # At most one settle and one release per hold: a second closure violates this index.
    "CREATE UNIQUE INDEX ledger_one_closure_per_hold ON ledger(hold_id, kind) WHERE hold_id IS NOT NULL",
    _LEDGER_NO_UPDATE,
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
        created_at REAL NOT NULL,
        served_greedily INTEGER NOT NULL DEFAULT 0 CHECK (served_greedily IN (0, 1)))""",
    "CREATE INDEX request_log_by_account ON request_log(account_id, created_at)",
    "CREATE INDEX request_log_by_time ON request_log(created_at)",
    """CREATE TABLE miners (
        id INTEGER PRIMARY KEY,
        name TEXT NOT NULL UNIQUE,
        hotkey TEXT UNIQUE,
        key_sha256 TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL)""",
)

_VERSION_3 = (
    # One verifier verdict per audited request. `id` is the cursor `verdicts_after` pages by: an
    # INTEGER PRIMARY KEY, because the hidden rowid of a table keyed by text may be renumbered
    # by a VACUUM, which would make a control loop's cursor skip or repeat rows.
    """CREATE TABLE verdicts (
        id INTEGER PRIMARY KEY,
        request_id TEXT NOT NULL UNIQUE,
        miner TEXT NOT NULL,
        model TEXT NOT NULL,
        kind TEXT NOT NULL CHECK (kind IN ('paid', 'probe')),
        verdict TEXT NOT NULL CHECK (verdict IN ('pass', 'cheat', 'unproven')),
        reason TEXT NOT NULL,
        verifier TEXT NOT NULL,
        request_created_at REAL NOT NULL,
        judged_at REAL NOT NULL)""",
    "CREATE INDEX verdicts_by_request_time ON verdicts(request_created_at)",
    "CREATE INDEX verdicts_by_miner ON verdicts(miner)",
    # Published epoch results, byte for byte. What was published was signed and may already
    # be on chain: the triggers refuse any change, like the ledger's, and also an INSERT OR
    # REPLACE, which deletes the old row without firing a delete trigger.
    """CREATE TABLE epochs (
        epoch_index INTEGER PRIMARY KEY CHECK (epoch_index >= 0),
        payload BLOB NOT NULL,
        digest TEXT NOT NULL,
        closed_at REAL NOT NULL)""",
    """CREATE TRIGGER epochs_no_update BEFORE UPDATE ON epochs
       BEGIN SELECT RAISE(ABORT, 'epochs are append-only: a published epoch is never updated'); END""",
    """CREATE TRIGGER epochs_no_delete BEFORE DELETE ON epochs
       BEGIN SELECT RAISE(ABORT, 'epochs are append-only: a published epoch is never deleted'); END""",
    """CREATE TRIGGER epochs_no_replace BEFORE INSERT ON epochs
       WHEN EXISTS (SELECT 1 FROM epochs WHERE epoch_index = NEW.epoch_index)
       BEGIN SELECT RAISE(ABORT, 'epochs are append-only: a published epoch is never replaced'); END""",
    """CREATE TABLE validator_heartbeats (
        hotkey TEXT PRIMARY KEY,
        version TEXT NOT NULL,
        synced_epoch INTEGER CHECK (synced_epoch >= 0),
        consensus_epoch INTEGER CHECK (consensus_epoch >= 0),
        consensus_digest TEXT,
        received_at REAL NOT NULL) WITHOUT ROWID""",
    """CREATE TABLE eligibility (
        miner TEXT NOT NULL,
        model TEXT NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('new', 'probing', 'active', 'pulled')),
        reason TEXT NOT NULL CHECK (length(reason) <= 500),
        since REAL NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (miner, model)) WITHOUT ROWID""",
)
"""Added in version 3: verdicts, epochs, validator heartbeats and traffic eligibility. The same
statements create them in a new file and migrate a version-2 one, so both end up alike."""

SCHEMA += _VERSION_3

_VERSION_4 = (
    # Who does a job only one gateway host may do at a time, until when (`leases.py`).
    "CREATE TABLE leases (name TEXT PRIMARY KEY, holder TEXT NOT NULL, expires_at REAL NOT NULL) WITHOUT ROWID",
)
"""Added in version 4: leases, for several gateway hosts on one store."""

SCHEMA += _VERSION_4

_VERSION_5 = (
    # What a buyer reads back about one request (`GET /v1/generation`, `GET /v1/usage`): the key
    # that sent it, its reasoning tokens, its finish reason, its whole duration, and whether it
    # was offered to the audit (so a missing verdict reads "pending", not "not audited").
    "ALTER TABLE request_log ADD COLUMN key_id INTEGER",
    "ALTER TABLE request_log ADD COLUMN reasoning_tokens INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE request_log ADD COLUMN finish_reason TEXT",
    "ALTER TABLE request_log ADD COLUMN total_ms REAL",
    "ALTER TABLE request_log ADD COLUMN audited INTEGER NOT NULL DEFAULT 0 CHECK (audited IN (0, 1))",
    "CREATE INDEX request_log_by_request ON request_log(request_id)",
)
"""Added in version 5: the request-log columns a buyer's generation lookup and usage read."""

SCHEMA += _VERSION_5

_VERSION_6 = (
    # Keys a team manages (`key_limits.py`): a name, a masked hint to tell keys apart by, an
    # expiry and the models a key may use (a JSON list; NULL: all).
    "ALTER TABLE api_keys ADD COLUMN name TEXT",
    "ALTER TABLE api_keys ADD COLUMN hint TEXT",
    "ALTER TABLE api_keys ADD COLUMN expires_at REAL",
    "ALTER TABLE api_keys ADD COLUMN models TEXT",
    # Each account's default limits, and each key's own limits and what it has used per window:
    # read under the write lock and updated in the hold's transaction, so no two requests on any
    # worker or host can both take the last unit of a limit.
    """CREATE TABLE account_limits (
        account_id INTEGER PRIMARY KEY REFERENCES accounts(id),
        rpm INTEGER, tpm INTEGER, concurrent INTEGER, daily_micro INTEGER, monthly_micro INTEGER)""",
    """CREATE TABLE key_limits (
        key_id INTEGER PRIMARY KEY REFERENCES api_keys(id),
        rpm INTEGER, tpm INTEGER, concurrent INTEGER, daily_micro INTEGER, monthly_micro INTEGER,
        in_flight INTEGER NOT NULL DEFAULT 0 CHECK (in_flight >= 0),
        minute INTEGER NOT NULL DEFAULT 0, minute_requests INTEGER NOT NULL DEFAULT 0,
        minute_tokens INTEGER NOT NULL DEFAULT 0, day INTEGER NOT NULL DEFAULT 0,
        day_micro INTEGER NOT NULL DEFAULT 0, month INTEGER NOT NULL DEFAULT 0,
        month_micro INTEGER NOT NULL DEFAULT 0)""",
    # The open holds counted against a key's limits, and what each counted: its closure gives
    # back what it did not use and deletes the row.
    """CREATE TABLE key_holds (
        hold_id INTEGER PRIMARY KEY REFERENCES ledger(id),
        key_id INTEGER NOT NULL REFERENCES api_keys(id),
        tokens INTEGER NOT NULL,
        held_at REAL NOT NULL)""",
)
"""Added in version 6: named keys with expiry and allowed models, and per-key limits."""

SCHEMA += _VERSION_6

_VERSION_7 = (
    # Deposits from the chain (`deposits.py`): the coldkey a buyer pays from, how far the deposit
    # watcher has scanned, and each deposit credited, once per extrinsic (the unique index below), with
    # the ledger credit it made. Deposits, like the ledger, are never updated or deleted.
    """CREATE TABLE coldkey_links (
        coldkey TEXT PRIMARY KEY,
        account_id INTEGER NOT NULL REFERENCES accounts(id),
        linked_at REAL NOT NULL) WITHOUT ROWID""",
    """CREATE TABLE deposit_cursor (
        address TEXT PRIMARY KEY,
        block_number INTEGER NOT NULL CHECK (block_number >= 0),
        block_hash TEXT NOT NULL,
        updated_at REAL NOT NULL) WITHOUT ROWID""",
    """CREATE TABLE deposits (
        id INTEGER PRIMARY KEY,
        block_hash TEXT NOT NULL,
        extrinsic_index INTEGER NOT NULL CHECK (extrinsic_index >= 0),
        block_number INTEGER NOT NULL CHECK (block_number >= 0),
        account_id INTEGER NOT NULL REFERENCES accounts(id),
        coldkey TEXT NOT NULL,
        amount_rao INTEGER NOT NULL CHECK (amount_rao > 0),
        micro_usd INTEGER NOT NULL CHECK (micro_usd > 0),
        ledger_id INTEGER NOT NULL UNIQUE REFERENCES ledger(id),
        created_at REAL NOT NULL)""",
    "CREATE UNIQUE INDEX deposits_once_per_extrinsic ON deposits(block_hash, extrinsic_index)",
    "CREATE INDEX deposits_by_account ON deposits(account_id, id)",
    """CREATE TRIGGER deposits_no_update BEFORE UPDATE ON deposits
       BEGIN SELECT RAISE(ABORT, 'deposits are append-only: entries are never updated'); END""",
    """CREATE TRIGGER deposits_no_delete BEFORE DELETE ON deposits
       BEGIN SELECT RAISE(ABORT, 'deposits are append-only: entries are never deleted'); END""",
)
"""Added in version 7: deposits from the chain."""

SCHEMA += _VERSION_7

_LEDGER_KIND = (
    "kind TEXT NOT NULL CHECK (kind IN ('credit', 'hold', 'settle', 'release')),",
    "kind TEXT NOT NULL CHECK (kind IN ('credit', 'deposit', 'hold', 'settle', 'release')),",
)
_LEDGER_MEMO = (
    "memo TEXT CHECK (memo IS NULL OR kind = 'credit'),",
    "memo TEXT CHECK (memo IS NULL OR kind IN ('credit', 'deposit')),",
)


def _version_8(conn: sqlite3.Connection) -> None:
    """Version 8: a deposit's ledger row is of kind `deposit`, no longer a `credit` with a memo.

    SQLite cannot alter a CHECK, and rebuilding the ledger would drop the rows that `deposits`,
    `key_holds` and the ledger itself reference. Widening a CHECK to allow one more value is a
    change SQLite documents as safe to make in the schema's text (ALTER TABLE, "other kinds of
    table schema changes": the rows already stored satisfy it), so the ledger's `CREATE TABLE`
    text is edited to the one a new file is created with, under `writable_schema`, and the schema
    version bumped so every connection reads it again. Then the rows `deposits.ledger_id` names
    — the deposits' credits, and only those, whatever their memo says — become `deposit` rows,
    with the append-only trigger lifted for that one statement, in the migration's transaction."""
    version = conn.execute("PRAGMA schema_version").fetchone()[0]
    conn.execute("PRAGMA writable_schema = ON")
    try:
        conn.execute(
            "UPDATE sqlite_master SET sql = replace(replace(sql, ?, ?), ?, ?) WHERE type = 'table' AND name = 'ledger'",
            (*_LEDGER_KIND, *_LEDGER_MEMO),
        )
        conn.execute(f"PRAGMA schema_version = {int(version) + 1}")
    finally:
        conn.execute("PRAGMA writable_schema = OFF")
    sql = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'ledger'").fetchone()[0]
    if _LEDGER_KIND[1] not in sql or _LEDGER_MEMO[1] not in sql:
        where = conn.execute("PRAGMA database_list").fetchone()[2]
        raise StoreError(f"{where}'s ledger table is not the one engy-node wrote; restore the file from a backup")
    conn.execute("DROP TRIGGER ledger_no_update")
    conn.execute("UPDATE ledger SET kind = 'deposit' WHERE id IN (SELECT ledger_id FROM deposits)")
    conn.execute(_LEDGER_NO_UPDATE)


MIGRATIONS: dict[int, tuple[str | Callable[[sqlite3.Connection], None], ...]] = {
    1: (
        "ALTER TABLE request_log ADD COLUMN served_greedily INTEGER NOT NULL DEFAULT 0 CHECK (served_greedily IN (0, 1))",
    ),
    2: _VERSION_3,
    3: _VERSION_4,
    4: _VERSION_5,
    5: _VERSION_6,
    6: _VERSION_7,
    7: (_version_8,),
}
"""Statements that take a file from version N to N + 1, run in one transaction with the check; a
step SQL alone cannot write (`_version_8`) is a function of the connection."""

# Primary SQLite result codes (the low byte of extended codes such as SQLITE_BUSY_SNAPSHOT).
_LOCKED_CODES = {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED}
_CORRUPT_CODES = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}
_UNWRITABLE_CODES = {sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_PERM}


class StoreError(EngyError):
    """The database cannot be used as asked; the message names the file and the fix."""

    title = "store"


def explain(path: Path, error: sqlite3.Error) -> StoreError | None:
    """The user-facing error for a database-level failure, or None for a bug in our SQL."""
    code = getattr(error, "sqlite_errorcode", None)
    primary = None if code is None else code & 0xFF
    if primary in _LOCKED_CODES:
        return StoreError(
            f"{path} is locked by another process; stop the other engy-node or admin command using it, then retry"
        )
    if primary in _CORRUPT_CODES:
        return StoreError(
            f"{path} is not a readable engy database ({error}); restore it from a backup, or move it aside to start "
            "an empty one (the ledger in it is then lost)"
        )
    if primary == sqlite3.SQLITE_FULL:
        return StoreError(f"the disk holding {path} is full; free space and retry (the failed write was rolled back)")
    if primary == sqlite3.SQLITE_IOERR:
        # What a disk that failed under an open file looks like (ext4 remounted read-only after an
        # error, a vanished network volume): permissions were fine when the file was opened.
        return StoreError(
            f"cannot read or write {path} ({error}): the disk failed or turned read-only; check the kernel log "
            "(dmesg) and the filesystem, repair it, then restart (the failed write was rolled back)"
        )
    if primary in _UNWRITABLE_CODES:
        return StoreError(f"cannot use {path} ({error}); check that its directory exists and is writable by this user")
    return None


def connect(path: Path, *, busy_timeout_s: float) -> sqlite3.Connection:
    """A connection to the store at `path`, created with the current schema if the file is new,
    in WAL mode with every commit fsynced (`synchronous=FULL`) and foreign keys enforced,
    readable by this user only (`private_files`; its `-wal` and `-shm` files take its mode).
    Raises `StoreError` for a file we cannot or must not use."""
    try:
        private_file(path)
        for companion in ("-wal", "-shm"):
            make_private(path.with_name(path.name + companion))
    except OSError as error:
        raise StoreError(
            f"cannot use {path} ({error}); check that its directory exists and is writable by this user"
        ) from None
    try:
        # isolation_level=None: the sqlite3 module starts no transactions of its own; every
        # write says BEGIN IMMEDIATE explicitly. check_same_thread=False: trio runs each
        # call on whichever worker thread is free; the store's lock keeps them one at a time.
        conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as error:
        raise (explain(path, error) or error) from error
    try:
        _prepare(conn, path, busy_timeout_s=busy_timeout_s)
    except sqlite3.Error as error:
        conn.close()
        raise (explain(path, error) or error) from error
    except BaseException:
        conn.close()
        raise
    return conn


def _prepare(conn: sqlite3.Connection, path: Path, *, busy_timeout_s: float) -> None:
    # auto_vacuum takes effect only before the first table exists; on an existing file it
    # is a no-op. INCREMENTAL lets purge_request_log hand freed pages back to the disk.
    conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
    mode = _journal_mode_wal(conn, busy_timeout_s=busy_timeout_s)
    if mode != "wal":
        raise StoreError(f"{path} cannot use write-ahead logging (journal mode stays {mode!r}); put it on a local disk")
    # FULL fsyncs every commit: a charge or credit reported to anyone survives a power cut.
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute("PRAGMA foreign_keys = ON")
    conn.execute("BEGIN IMMEDIATE")
    try:
        _create_or_check(conn, path)
        conn.execute("COMMIT")
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")


def _journal_mode_wal(conn: sqlite3.Connection, *, busy_timeout_s: float) -> str:
    """Switch the file to write-ahead logging, returning the journal mode it ends in.

    Hosts opening a new file together race to switch it, and SQLite answers the losers
    SQLITE_BUSY at once, without waiting in its busy handler (to avoid a deadlock between a
    reader and a writer of a file still in rollback mode). So the switch is retried here, for as
    long as any other lock is waited for; once the file is in WAL mode it no longer fails so."""
    deadline = time.monotonic() + busy_timeout_s
    pause_s = 0.005
    while True:
        try:
            return str(conn.execute("PRAGMA journal_mode = WAL").fetchone()[0])
        except sqlite3.OperationalError as error:
            code = getattr(error, "sqlite_errorcode", None)
            if code is None or code & 0xFF not in _LOCKED_CODES or time.monotonic() + pause_s > deadline:
                raise
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, 0.1)


def _create_or_check(conn: sqlite3.Connection, path: Path) -> None:
    if conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0:
        for statement in SCHEMA:
            conn.execute(statement)
        conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        return
    if conn.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
        raise StoreError(f"{path} is an SQLite database of some other program; point the gateway at its own file")
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    found = None if row is None else row[0]
    version = int(found) if found is not None and found.isdigit() else None
    while version is not None and version < SCHEMA_VERSION and version in MIGRATIONS:
        for step in MIGRATIONS[version]:
            if callable(step):
                step(conn)
            else:
                conn.execute(step)
        version += 1
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(version),))
        found = str(version)
    if found != str(SCHEMA_VERSION):
        raise StoreError(
            f"{path} has store schema version {found}, this engy-node uses {SCHEMA_VERSION}; "
            "run the engy-node version that wrote it, or move the file aside"
        )


class SqliteDatabase:
    """One SQLite connection to the store's file, its lock and its transactions (see
    `connection.Database`)."""

    errors = (sqlite3.Error,)
    concurrency = 1
    groups_commits = True
    # BEGIN IMMEDIATE already holds the whole file's write lock from the first statement on.
    for_update = ""

    def __init__(self, path: str | os.PathLike[str], *, busy_timeout_s: float) -> None:
        self.path = Path(path)
        self.where = str(self.path)
        # Re-entrant: a group commit runs several serialised methods inside one transaction.
        self.lock = threading.RLock()
        self._in_batch = False
        self._savepoints = True
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
        self._conn = connect(self.path, busy_timeout_s=busy_timeout_s)
        self._sync_level: Literal["FULL", "NORMAL"] = "FULL"

    def explain(self, error: BaseException) -> StoreError | None:
        return explain(self.path, error) if isinstance(error, sqlite3.Error) else None

    @staticmethod
    def is_unique_violation(error: BaseException) -> bool:
        return isinstance(error, sqlite3.IntegrityError) and str(error).startswith("UNIQUE constraint failed")

    def _synchronous(self, level: Literal["FULL", "NORMAL"]) -> None:
        if level != self._sync_level:
            self._conn.execute(f"PRAGMA synchronous = {level}")
            self._sync_level = level

    @contextlib.contextmanager
    def write(self, *, durable: bool, pipelined: bool = False) -> Iterator[sqlite3.Connection]:
        # `pipelined` saves round trips to a server; a file has none to save.
        if self._in_batch and not self._savepoints:
            yield self._conn
            return
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
        self._synchronous("FULL" if durable else "NORMAL")
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
    def read(self) -> Iterator[sqlite3.Connection]:
        yield self._conn

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[sqlite3.Connection]:
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
    def batch(self, *, durable: bool, savepoints: bool = True) -> Iterator[None]:
        """One transaction around several operations (a group commit), under the caller's hold
        of the lock. With `savepoints`, each operation's `write` inside it is a savepoint of its
        own; without, the operations' writes share the transaction bare, so the caller must roll
        it back whole (leave the block with an exception) when any operation fails. The commit
        waits for the disk only when `durable`."""
        try:
            self._synchronous("FULL" if durable else "NORMAL")
            self._conn.execute("BEGIN IMMEDIATE")
            self._in_batch, self._savepoints = True, savepoints
            try:
                yield
            finally:
                self._in_batch, self._savepoints = False, True
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise

    def reclaim_space(self) -> None:
        # executescript steps the pragma to completion; `execute` would free a single page
        # (the sqlite3 module steps a statement without result columns only once).
        self._conn.executescript("PRAGMA incremental_vacuum")

    def serialise_on(self, session: object, space: int, key: int) -> None:
        """Nothing to do: BEGIN IMMEDIATE already holds the file's one write lock."""

    def close(self) -> None:
        self._conn.close()
