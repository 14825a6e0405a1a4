"""Deposits in the store (engy_node/gateway/store/deposits.py), on both backends: coldkey links, the
cursor, credits exactly once per (block hash, extrinsic index) with the cursor moved in the same
transaction, and the rows append-only."""

from __future__ import annotations

import threading

import pytest

from engy_node.gateway.billing.deposits import Cursor, Deposit
from engy_node.gateway.store import Store, StoreError
from tests.engy_node.gateway.store.support import assert_books_balance

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
