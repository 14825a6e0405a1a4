"""schema: the database enforces its own invariants (on both backends); the file is versioned and
WAL; a file or database we cannot use is refused with where it is and the fix; PostgreSQL's schema
is created once however many hosts start together."""

from __future__ import annotations

import re
import sqlite3
import threading
import time

import pytest

from engy_node.gateway.store import APPLICATION_ID, SCHEMA_VERSION, Store, StoreError
from tests.engy_node.gateway.store.support import INTEGRITY_ERRORS, assert_books_balance, entry, funded, raw, verdict

# -- the database enforces its own invariants ----------------------------------------------------


def test_the_database_refuses_to_update_or_delete_ledger_rows(store, location):
    account_id = funded(store, 1_000)
    store.settle(store.hold(account_id, amount=100, request_id="r"), cost=50)
    with raw(location) as conn:
        with pytest.raises(INTEGRITY_ERRORS, match="append-only"):
            conn.execute("UPDATE ledger SET amount = 0 WHERE kind = 'settle'")
        with pytest.raises(INTEGRITY_ERRORS, match="append-only"):
            conn.execute("DELETE FROM ledger")
        # A second closure of the same hold, and an overdraft, are refused too.
        hold_id = conn.execute("SELECT id FROM ledger WHERE kind = 'hold'").fetchone()[0]
        with pytest.raises(INTEGRITY_ERRORS):
            conn.execute(
                "INSERT INTO ledger (account_id, kind, amount, request_id, hold_id, available_after, created_at) "
                "VALUES (?, 'settle', 50, 'r', ?, 0, 0)",
                (account_id, hold_id),
            )
        with pytest.raises(INTEGRITY_ERRORS):
            conn.execute("UPDATE accounts SET available = available - 2000, held = held + 2000")
        assert conn.execute("SELECT count(*) FROM ledger").fetchone()[0] == 4
    assert_books_balance(store, account_id)


def test_the_file_is_versioned_write_ahead_logged_and_auto_vacuumed(path):
    Store(path).close()
    with raw(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
        assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # INCREMENTAL


# -- files we cannot use -----------------------------------------------------------------------------


def test_a_corrupt_file_is_refused_with_its_path_and_the_fix(path):
    path.write_bytes(b"these bytes are not an SQLite database\n" * 200)
    with pytest.raises(StoreError) as raised:
        Store(path)
    assert str(path) in str(raised.value) and "move it aside" in str(raised.value) and "backup" in str(raised.value)


def test_a_foreign_sqlite_database_is_refused(path):
    with raw(path) as conn:
        conn.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY)")
    with pytest.raises(StoreError, match="some other program"):
        Store(path)


def test_a_file_of_another_schema_version_is_refused(path):
    Store(path).close()
    with raw(path) as conn:
        conn.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match=f"schema version 999, this engy-node uses {SCHEMA_VERSION}"):
        Store(path)


VERSION_3_TABLES = ("verdicts", "epochs", "validator_heartbeats", "eligibility", "leases")


def as_version_2(conn: sqlite3.Connection) -> None:
    """Rewind a current file to what version 2 wrote (dropping a table drops its indexes and triggers)."""
    for table in ("deposits", "deposit_cursor", "coldkey_links"):  # version 7's
        conn.execute(f"DROP TABLE {table}")
    for table in ("key_holds", "key_limits", "account_limits"):  # version 6's
        conn.execute(f"DROP TABLE {table}")
    for column in ("name", "hint", "expires_at", "models"):  # version 6's
        conn.execute(f"ALTER TABLE api_keys DROP COLUMN {column}")
    for table in VERSION_3_TABLES:
        conn.execute(f"DROP TABLE {table}")
    conn.execute("DROP INDEX request_log_by_request")
    for column in ("key_id", "reasoning_tokens", "finish_reason", "total_ms", "audited"):  # version 5's
        conn.execute(f"ALTER TABLE request_log DROP COLUMN {column}")
    conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")


def schema_of(path) -> list[tuple[str, str]]:
    with raw(path) as conn:
        return sorted(conn.execute("SELECT name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'").fetchall())


def test_a_version_1_file_is_migrated_and_keeps_its_rows(path):
    with Store(path) as store:
        store.log_request(entry(request_id="before", account_id=funded(store, 100)))
    with raw(path) as conn:  # the request log as version 1 wrote it
        as_version_2(conn)
        conn.execute("ALTER TABLE request_log DROP COLUMN served_greedily")
        conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    with Store(path) as store:
        store.log_request(entry(request_id="after", account_id=1, served_greedily=True))
    with raw(path) as conn:
        rows = conn.execute("SELECT request_id, served_greedily FROM request_log ORDER BY id").fetchall()
        assert rows == [("before", 0), ("after", 1)]
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)


def test_a_version_2_file_is_migrated_keeps_its_rows_and_matches_a_new_file(path, tmp_path):
    with Store(path) as store:
        account_id = funded(store, 1_000)
        store.settle(store.hold(account_id, amount=100, request_id="before"), cost=40)
        store.log_request(entry(request_id="before", account_id=account_id, served_greedily=True))
    with raw(path) as conn:
        as_version_2(conn)
    with Store(path) as store:
        assert [e.request_id for e in store.requests_in(since=0.0, until=2_000.0)] == ["before"]
        assert assert_books_balance(store, account_id).charged == 40
        assert store.record_verdict(verdict(request_id="before")) == "recorded"
        assert store.save_epoch(0, b"{}", "0" * 64, closed_at=1_000.0)
    with raw(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("DELETE FROM epochs")
    Store(tmp_path / "new.sqlite3").close()
    assert schema_of(path) == schema_of(tmp_path / "new.sqlite3")


def test_a_file_locked_by_another_process_gives_an_error_not_a_hang(path):
    with Store(path, busy_timeout_s=0.05) as store:
        account_id = funded(store, 100)
        with raw(path) as other:
            other.execute("BEGIN IMMEDIATE")
            with pytest.raises(StoreError, match="locked by another process") as raised:
                store.credit(account_id, micro_usd=1)
            assert str(path) in str(raised.value)
            with pytest.raises(StoreError, match="locked"):
                Store(path, busy_timeout_s=0.05)
            other.execute("ROLLBACK")
        assert assert_books_balance(store, account_id).credited == 100


def test_a_new_file_another_host_is_still_writing_is_waited_for_not_refused(path):
    # SQLite refuses the switch to write-ahead logging at once, without its busy wait, while
    # another connection writes the file in rollback mode: what hosts opening a new file
    # together meet (a CI run saw one of six threads refused so).
    holding = threading.Event()

    def write_briefly() -> None:
        with raw(path) as other:
            other.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            other.execute("BEGIN IMMEDIATE")
            other.execute("PRAGMA user_version = 1")
            holding.set()
            time.sleep(0.2)
            other.execute("COMMIT")

    other_host = threading.Thread(target=write_briefly)
    other_host.start()
    try:
        assert holding.wait(timeout=10.0)
        with Store(path, busy_timeout_s=10.0) as store:
            assert_books_balance(store, funded(store, 100))
    finally:
        other_host.join()
    with raw(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_new_file_another_host_keeps_writing_is_refused_once_the_wait_runs_out(path):
    with raw(path) as other:
        other.execute(f"PRAGMA application_id = {APPLICATION_ID}")
        other.execute("BEGIN IMMEDIATE")
        other.execute("PRAGMA user_version = 1")
        with pytest.raises(StoreError, match="locked by another process"):
            Store(path, busy_timeout_s=0.05)
        other.execute("ROLLBACK")


# -- PostgreSQL databases ---------------------------------------------------------------------------


def test_a_postgres_database_is_versioned_and_names_its_owner(postgres_url):
    Store(postgres_url).close()
    with raw(postgres_url) as conn:
        assert dict(conn.execute("SELECT key, value FROM meta").fetchall()) == {
            "application": "engy-gateway",
            "schema_version": str(SCHEMA_VERSION),
        }


def test_a_postgres_database_of_some_other_program_is_refused(postgres_url):
    with raw(postgres_url) as conn:
        conn.execute("CREATE TABLE photos (id BIGINT PRIMARY KEY)")
    with pytest.raises(StoreError, match="tables of some other program"):
        Store(postgres_url)


def test_a_postgres_database_of_a_newer_schema_version_is_refused(postgres_url):
    Store(postgres_url).close()
    with raw(postgres_url) as conn:
        conn.execute("UPDATE meta SET value = '999' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match=f"schema version 999, this engy-node uses {SCHEMA_VERSION}"):
        Store(postgres_url)


def test_hosts_opening_a_new_postgres_database_together_create_its_schema_once(postgres_url):
    opened: list[Store] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        try:
            opened.append(Store(postgres_url))
        except BaseException as error:  # broad on purpose: re-raised in the main thread below
            errors.append(error)

    threads = [threading.Thread(target=open_one) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    account_id = funded(opened[0], 100)
    assert opened[-1].balance(account_id).available == 100
    for store in opened:
        store.close()


def test_an_unreachable_postgres_server_is_refused_with_the_url_and_the_fix(postgres_cluster):
    url = postgres_cluster.url("nowhere").replace(f":{postgres_cluster.port}/", ":1/")
    with pytest.raises(StoreError, match="check that PostgreSQL is up") as raised:
        Store(url, busy_timeout_s=2.0)
    assert "127.0.0.1:1/nowhere" in str(raised.value)


def test_a_password_never_appears_in_the_stores_messages(postgres_cluster):
    url = postgres_cluster.url("nowhere").replace("engy@", "engy:hunter2@").replace(f":{postgres_cluster.port}/", ":1/")
    with pytest.raises(StoreError) as raised:
        Store(url, busy_timeout_s=2.0)
    assert "hunter2" not in str(raised.value) and "engy:***@127.0.0.1:1" in str(raised.value)


# ---- the two backends' schemas agree ------------------------------------------------------------

_TYPES = {
    "INTEGER": "integer",
    "BIGINT": "integer",
    "REAL": "real",
    "DOUBLE PRECISION": "real",
    "TEXT": "text",
    "BLOB": "bytes",
    "BYTEA": "bytes",
    "BOOLEAN": "boolean",
}
_CREATE_TABLE = re.compile(r"CREATE TABLE (\w+) \((.*)\)", re.S)
_CREATE_INDEX = re.compile(r"CREATE (UNIQUE )?INDEX (\w+) ON (\w+)\s*\(([^)]*)\)(?: WHERE (.*))?", re.S)


def _column(definition: str) -> tuple[str, str, bool, bool, bool, str | None]:
    """(name, type, not null, primary key, unique, references) of one column definition."""
    name, rest = definition.split(None, 1)
    kind = next(words for words in sorted(_TYPES, key=len, reverse=True) if rest.startswith(words))
    normalised = _TYPES[kind]
    if normalised == "integer" and re.search(rf"CHECK \({name} IN \(0, 1\)\)", rest):
        normalised = "boolean"  # SQLite has no boolean: a 0/1 integer stands in for one
    references = re.search(r"REFERENCES (\w+\(\w+\))", rest)
    return (
        name,
        normalised,
        "NOT NULL" in rest or "PRIMARY KEY" in rest,
        "PRIMARY KEY" in rest,
        "UNIQUE" in rest,
        references.group(1) if references else None,
    )


def _split_top_level(body: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in body:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return [*parts, current.strip()]


def described(schema: tuple[str, ...]) -> dict[str, object]:
    """Every table's columns and constraints, and every index, in backend-neutral words."""
    found: dict[str, object] = {}
    for statement in schema:
        statement = " ".join(statement.replace("WITHOUT ROWID", "").split())
        if table := _CREATE_TABLE.fullmatch(statement):
            parts = _split_top_level(table.group(2))
            columns = [_column(part) for part in parts if not part.startswith(("CHECK", "PRIMARY KEY"))]
            constraints = sorted(" ".join(part.split()) for part in parts if part.startswith(("CHECK", "PRIMARY KEY")))
            checks = sorted(re.findall(r"CHECK \(((?:[^()]|\([^()]*\))*)\)", table.group(2)))
            found[f"table {table.group(1)}"] = (columns, constraints, [c for c in checks if " IN (0, 1)" not in c])
        elif index := _CREATE_INDEX.fullmatch(statement):
            found[f"index {index.group(2)}"] = (bool(index.group(1)), index.group(3), index.group(4), index.group(5))
    return found


def test_postgres_and_sqlite_define_the_same_tables_and_indexes():
    from engy_node.gateway.store import postgres, schema

    sqlite_schema, postgres_schema = described(schema.SCHEMA), described(postgres.SCHEMA)
    # PostgreSQL only: a fleet host starting up releases only the holds older than any live request
    # (`recover_open_holds(older_than=…)`, only with `gateway.store_url`), a scan by time.
    only_postgres = {"index ledger_holds_by_time"}
    assert set(postgres_schema) - set(sqlite_schema) == only_postgres
    assert set(sqlite_schema) - set(postgres_schema) == set()
    for name, shape in sqlite_schema.items():
        assert postgres_schema[name] == shape, name
    assert len([name for name in sqlite_schema if name.startswith("table")]) == 17


def test_the_schema_comparison_sees_a_column_that_differs():
    base = ("CREATE TABLE t (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL CHECK (amount >= 0))",)
    assert described(base) == described(
        ("CREATE TABLE t (id BIGINT PRIMARY KEY, amount BIGINT NOT NULL CHECK (amount >= 0))",)
    )
    assert described(base) != described(("CREATE TABLE t (id BIGINT PRIMARY KEY, amount BIGINT CHECK (amount >= 0))",))
    assert described(base) != described(
        ("CREATE TABLE t (id BIGINT PRIMARY KEY, amount DOUBLE PRECISION NOT NULL CHECK (amount >= 0))",)
    )
    assert described(base) != described(
        ("CREATE TABLE t (id BIGINT PRIMARY KEY, amount BIGINT NOT NULL CHECK (amount > 0))",)
    )
