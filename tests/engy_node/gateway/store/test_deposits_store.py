"""Deposits in the store (engy_node/gateway/store/deposits.py), on both backends: coldkey links, the
cursor, credits exactly once per (block hash, extrinsic index) with the cursor moved in the same
transaction, and the rows append-only."""

from __future__ import annotations

import threading

import pytest

from engy_node.gateway.billing.deposits import Cursor, Deposit
from engy_node.gateway.store import SCHEMA_VERSION, Store, StoreError
from engy_node.gateway.store.connection import is_url
from tests.engy_node.gateway.store.support import INTEGRITY_ERRORS, assert_books_balance, raw
from tests.engy_node.gateway.store.test_schema import schema_of

ADDRESS = "5Deposit"


def deposit(account_id: int, *, block_hash: str = "h11", index: int = 1, micro: int = 400_000_000) -> Deposit:
    return Deposit(11, block_hash, index, account_id, "5Buyer", 10**9, micro)


def test_a_coldkey_links_to_one_account(store):
    first, _ = store.create_buyer("a")
    second, _ = store.create_buyer("b")
    assert store.link_coldkey(first, "5Buyer") and not store.link_coldkey(first, "5Buyer")
    with pytest.raises(StoreError, match="already linked to account"):
        store.link_coldkey(second, "5Buyer")
    with pytest.raises(StoreError, match="no buyer account 99"):
        store.link_coldkey(99, "5Other")
    assert store.coldkey_links() == {"5Buyer": first}


def test_the_cursor_starts_once_and_then_stays_where_it_was_moved(store):
    assert store.deposit_cursor(ADDRESS, start=Cursor(10, "h10")) == Cursor(10, "h10")
    assert store.deposit_cursor(ADDRESS, start=Cursor(99, "h99")) == Cursor(10, "h10")
    assert store.record_deposits(ADDRESS, expected=Cursor(10, "h10"), moved=Cursor(12, "h12"), deposits=[]) == []
    assert store.deposit_cursor(ADDRESS) == Cursor(12, "h12")
    assert store.deposit_cursor("5Elsewhere") is None


def test_a_deposit_is_credited_once_whatever_replays_it(store):
    account_id, _ = store.create_buyer("a")
    start = store.deposit_cursor(ADDRESS, start=Cursor(10, "h10"))
    credited = store.record_deposits(ADDRESS, expected=start, moved=Cursor(11, "h11"), deposits=[deposit(account_id)])
    assert credited == [deposit(account_id)]
    # The same scan again (a restart that read the old cursor, another host): refused as stale.
    again = store.record_deposits(ADDRESS, expected=start, moved=Cursor(11, "h11"), deposits=[deposit(account_id)])
    assert again is None
    # A scan from the moved cursor offered it again (a bug upstream): the unique pair holds.
    moved = Cursor(11, "h11")
    assert store.record_deposits(ADDRESS, expected=moved, moved=Cursor(12, "h12"), deposits=[deposit(account_id)]) == []
    balance = assert_books_balance(store, account_id)
    assert balance.credited == balance.available == 400_000_000
    (record,) = store.deposits_of(account_id)
    assert (record.extrinsic_id, record.amount_rao, record.micro_usd) == ("11-0001", 10**9, 400_000_000)


def test_concurrent_scans_of_the_same_blocks_credit_once(location, clock):
    with Store(location, clock=clock) as store:
        account_id, _ = store.create_buyer("a")
        start = store.deposit_cursor(ADDRESS, start=Cursor(10, "h10"))
    results = []

    def scan_once() -> None:
        with Store(location, clock=clock) as mine:
            results.append(
                mine.record_deposits(ADDRESS, expected=start, moved=Cursor(11, "h11"), deposits=[deposit(account_id)])
            )

    threads = [threading.Thread(target=scan_once) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(results, key=lambda r: r is None) == [[deposit(account_id)], None, None, None]
    with Store(location, clock=clock) as store:
        assert store.balance(account_id).credited == 400_000_000


def test_deposit_rows_are_append_only(store, backend):
    account_id, _ = store.create_buyer("a")
    start = store.deposit_cursor(ADDRESS, start=Cursor(10, "h10"))
    store.record_deposits(ADDRESS, expected=start, moved=Cursor(11, "h11"), deposits=[deposit(account_id)])
    with pytest.raises(Exception, match="append-only"):
        with store._write() as conn:
            conn.execute("DELETE FROM deposits")


# -- deposits are their own ledger kind (store schema 8) -----------------------------------------


def ledger_kinds(location) -> list[tuple[str, str | None]]:
    with raw(location) as conn:
        return [tuple(row) for row in conn.execute("SELECT kind, memo FROM ledger ORDER BY id").fetchall()]


def credit_and_deposit(store: Store) -> int:
    """An account credited by the operator, with a memo that only looks like a deposit's, and by a deposit."""
    account_id, _ = store.create_buyer("a")
    store.credit(account_id, micro_usd=25_000_000, memo="deposit 11-0001 from 5Buyer")
    start = store.deposit_cursor(ADDRESS, start=Cursor(10, "h10"))
    store.record_deposits(ADDRESS, expected=start, moved=Cursor(11, "h11"), deposits=[deposit(account_id)])
    return account_id


def test_a_deposit_is_a_ledger_row_of_its_own_kind_and_a_window_lists_it(store, location, clock):
    account_id = credit_and_deposit(store)
    assert ledger_kinds(location) == [
        ("credit", "deposit 11-0001 from 5Buyer"),
        ("deposit", "deposit 11-0001 from 5Buyer"),
    ]
    assert assert_books_balance(store, account_id).credited == 425_000_000
    operator, chain = store.credits_between(account_id, since=0.0, until=clock() + 1)
    assert (operator.kind, operator.micro_usd, operator.extrinsic_id, operator.memo) == (
        "credit",
        25_000_000,
        None,
        "deposit 11-0001 from 5Buyer",
    )
    assert (chain.kind, chain.micro_usd, chain.extrinsic_id, chain.coldkey, chain.amount_rao) == (
        "deposit",
        400_000_000,
        "11-0001",
        "5Buyer",
        10**9,
    )
    assert chain.ledger_id == store.deposits_of(account_id)[0].ledger_id
    assert store.credits_between(account_id, since=clock() + 1, until=clock() + 2) == []


def as_version_7(location) -> None:
    """Rewind a store to what version 7 wrote: a deposit's ledger row a `credit`, the CHECKs without `deposit`."""
    old_kind = "kind IN ('credit', 'hold', 'settle', 'release')"
    new_kind = "kind IN ('credit', 'deposit', 'hold', 'settle', 'release')"
    with raw(location) as conn:
        if is_url(location):
            conn.execute("ALTER TABLE ledger DISABLE TRIGGER ledger_no_update")
            conn.execute("UPDATE ledger SET kind = 'credit' WHERE kind = 'deposit'")
            conn.execute("ALTER TABLE ledger ENABLE TRIGGER ledger_no_update")
            for name, check in (
                ("ledger_kind_check", old_kind),
                ("ledger_check", "memo IS NULL OR kind = 'credit'"),
            ):
                conn.execute(f"ALTER TABLE ledger DROP CONSTRAINT {name}")
                conn.execute(f"ALTER TABLE ledger ADD CONSTRAINT {name} CHECK ({check})")
        else:
            trigger = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'ledger_no_update'").fetchone()[0]
            conn.execute("DROP TRIGGER ledger_no_update")
            conn.execute("UPDATE ledger SET kind = 'credit' WHERE kind = 'deposit'")
            conn.execute(trigger)
            version = conn.execute("PRAGMA schema_version").fetchone()[0]
            conn.execute("PRAGMA writable_schema = ON")
            conn.execute(
                "UPDATE sqlite_master SET sql = replace(replace(sql, ?, ?), ?, ?) WHERE name = 'ledger'",
                (new_kind, old_kind, "kind IN ('credit', 'deposit'))", "kind = 'credit')"),
            )
            conn.execute(f"PRAGMA schema_version = {version + 1}")
            conn.execute("PRAGMA writable_schema = OFF")
        conn.execute("UPDATE meta SET value = '7' WHERE key = 'schema_version'")


def test_a_version_7_store_relabels_its_deposits_credits_and_only_those(location, clock, tmp_path):
    with Store(location, clock=clock) as store:
        account_id = credit_and_deposit(store)
    as_version_7(location)
    with raw(location) as conn:
        with pytest.raises(INTEGRITY_ERRORS):  # version 7's ledger knows no deposit kind
            conn.execute(
                "INSERT INTO ledger (account_id, kind, amount, available_after, created_at) VALUES (?, 'deposit', 1, 1, 0)",
                (account_id,),
            )
    assert [kind for kind, _ in ledger_kinds(location)] == ["credit", "credit"]
    with Store(location, clock=clock) as store:
        # Relabelled by the deposit that names the row, not by the memo, which the other credit shares.
        assert [kind for kind, _ in ledger_kinds(location)] == ["credit", "deposit"]
        assert assert_books_balance(store, account_id).credited == 425_000_000
        assert [c.kind for c in store.credits_between(account_id, since=0.0, until=clock() + 1)] == [
            "credit",
            "deposit",
        ]
        with raw(location) as conn:
            assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(
                SCHEMA_VERSION
            )
            with pytest.raises(INTEGRITY_ERRORS, match="append-only"):
                conn.execute("UPDATE ledger SET kind = 'credit'")
            with pytest.raises(INTEGRITY_ERRORS):
                conn.execute(
                    "INSERT INTO ledger (account_id, kind, amount, available_after, created_at) VALUES (?, 'refund', 1, 1, 0)",
                    (account_id,),
                )
    if not is_url(location):
        Store(tmp_path / "new.sqlite3").close()
        assert schema_of(location) == schema_of(tmp_path / "new.sqlite3")
