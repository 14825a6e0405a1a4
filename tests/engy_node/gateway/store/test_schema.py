"""schema: the database enforces its own invariants (on both backends); the file is versioned and
WAL; a file or database we cannot use is refused with where it is and the fix; PostgreSQL's schema
is created once however many hosts start together."""

from __future__ import annotations

import sqlite3
import threading

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
    for table in VERSION_3_TABLES:
        conn.execute(f"DROP TABLE {table}")
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
