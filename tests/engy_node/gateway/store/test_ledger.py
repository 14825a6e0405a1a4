"""ledger: keys hashed and revocable, every micro-dollar accounted for, a hold closed at most once,
crashes refunded."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from engy_node.gateway.store import BUYER_KEY_PREFIX, KEY_ENTROPY_BYTES, Balance, Hold, KeyRevoked, Store, StoreError
from tests.engy_node.gateway.store.support import assert_books_balance, funded, raw

# -- keys ---------------------------------------------------------------------------------------


def test_a_buyer_key_authenticates_its_account_and_is_stored_only_as_a_hash(store, location):
    account_id, api_key = store.create_buyer("acme")
    assert api_key.startswith(BUYER_KEY_PREFIX) and len(api_key) > len(BUYER_KEY_PREFIX) + KEY_ENTROPY_BYTES
    account = store.authenticate(api_key)
    assert (account.account_id, account.name) == (account_id, "acme")
    with raw(location) as conn:
        stored = [row[0] for row in conn.execute("SELECT key_sha256 FROM api_keys")]
    assert len(stored) == 1 and len(stored[0]) == 64 and api_key not in stored[0]


def test_unknown_malformed_and_revoked_keys_do_not_authenticate(store):
    account_id, api_key = store.create_buyer("acme")
    assert store.authenticate(BUYER_KEY_PREFIX + "nope") is None
    assert store.authenticate("") is None
    assert store.authenticate(None) is None  # type: ignore[arg-type]
    assert store.revoke_key(api_key) is True
    assert store.authenticate(api_key) is None
    assert store.revoke_key(api_key) is False


def test_a_hold_made_with_a_revoked_key_is_refused_and_reserves_nothing(store):
    account_id, old_key = store.create_buyer("acme")
    store.credit(account_id, micro_usd=1_000)
    old = store.authenticate(old_key)
    new = store.authenticate(store.issue_key(account_id))
    assert store.hold(account_id, amount=10, request_id="before", key_id=old.key_id) is not None
    store.revoke_key(old_key)
    with pytest.raises(KeyRevoked):
        store.hold(account_id, amount=10, request_id="after", key_id=old.key_id)
    # A revoked key is refused even where the balance could not have paid either.
    with pytest.raises(KeyRevoked):
        store.hold(account_id, amount=10_000, request_id="after-too-large", key_id=old.key_id)
    assert store.hold(account_id, amount=10, request_id="other-key", key_id=new.key_id) is not None
    assert store.hold(account_id, amount=10_000, request_id="too-large", key_id=new.key_id) is None
    assert store.balance(account_id) == Balance(available=980, held=20, credited=1_000, charged=0)
    assert_books_balance(store, account_id)


def test_a_rotated_key_works_while_the_old_one_is_revoked(store):
    account_id, old_key = store.create_buyer("acme")
    new_key = store.issue_key(account_id)
    store.revoke_key(old_key)
    assert store.authenticate(new_key).account_id == account_id
    with pytest.raises(StoreError, match="no buyer account 99"):
        store.issue_key(99)


def test_keys_are_unique_per_issue(store):
    keys = {store.create_buyer(f"b{i}")[1] for i in range(20)}
    assert len(keys) == 20


# -- ledger -------------------------------------------------------------------------------------


def test_credit_hold_settle_round_trip_keeps_every_micro_dollar(store, location, clock):
    account_id = funded(store, 1_000_000)
    hold = store.hold(account_id, amount=300_000, request_id="req-1")
    assert hold == Hold(
        hold_id=hold.hold_id, account_id=account_id, amount=300_000, request_id="req-1", created_at=clock.now
    )
    assert store.balance(account_id) == Balance(available=700_000, held=300_000, credited=1_000_000, charged=0)
    settlement = store.settle(hold, cost=123_456)
    assert (settlement.charged, settlement.released, settlement.applied) == (123_456, 176_544, True)
    assert assert_books_balance(store, account_id) == Balance(
        available=876_544, held=0, credited=1_000_000, charged=123_456
    )
    with raw(location) as conn:
        ledger = conn.execute("SELECT kind, amount, request_id, available_after FROM ledger ORDER BY id").fetchall()
    assert ledger == [
        ("credit", 1_000_000, None, 1_000_000),
        ("hold", 300_000, "req-1", 700_000),
        ("settle", 123_456, "req-1", 700_000),
        ("release", 176_544, "req-1", 876_544),
    ]


def test_a_hold_the_balance_cannot_cover_is_refused_and_changes_nothing(store):
    account_id = funded(store, 1_000)
    assert store.hold(account_id, amount=1_001, request_id="too-big") is None
    assert store.hold(account_id, amount=1_000, request_id="exact") is not None
    assert store.hold(account_id, amount=1, request_id="one-more") is None
    assert assert_books_balance(store, account_id) == Balance(available=0, held=1_000, credited=1_000, charged=0)


def test_settling_twice_charges_once(store):
    account_id = funded(store, 10_000)
    hold = store.hold(account_id, amount=5_000, request_id="r")
    first = store.settle(hold, cost=2_000)
    again = store.settle(hold, cost=4_000)
    assert again == dataclasses.replace(first, applied=False)
    assert store.release(hold) == again
    assert assert_books_balance(store, account_id) == Balance(available=8_000, held=0, credited=10_000, charged=2_000)


def test_a_released_hold_cannot_be_charged_later(store):
    account_id = funded(store, 10_000)
    hold = store.hold(account_id, amount=5_000, request_id="r")
    assert store.release(hold).released == 5_000
    late = store.settle(hold, cost=5_000)
    assert (late.charged, late.applied) == (0, False)
    assert assert_books_balance(store, account_id).charged == 0


def test_a_cost_above_the_hold_is_clamped_and_logged(store, caplog):
    account_id = funded(store, 10_000)
    hold = store.hold(account_id, amount=5_000, request_id="under-estimated")
    settlement = store.settle(hold, cost=7_000)
    assert (settlement.charged, settlement.released) == (5_000, 0)
    assert "under-estimated" in caplog.text and "bug" in caplog.text
    assert assert_books_balance(store, account_id).charged == 5_000


def test_a_hold_object_that_does_not_match_the_ledger_is_refused(store):
    account_id = funded(store, 10_000)
    hold = store.hold(account_id, amount=5_000, request_id="r")
    with pytest.raises(ValueError, match="not a hold"):
        store.release(dataclasses.replace(hold, amount=9_000))
    with pytest.raises(ValueError, match="not a hold"):
        store.settle(dataclasses.replace(hold, hold_id=hold.hold_id + 100), cost=1)
    assert store.balance(account_id).held == 5_000


def test_bad_amounts_unknown_accounts_and_reused_request_ids_are_refused(store):
    account_id = funded(store, 10_000)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError):
            store.credit(account_id, micro_usd=bad)
    with pytest.raises(ValueError):
        store.hold(account_id, amount=-1, request_id="r")
    with pytest.raises(ValueError, match="request_id"):
        store.hold(account_id, amount=1, request_id="has spaces")
    with pytest.raises(StoreError, match="no buyer account 42"):
        store.credit(42, micro_usd=1)
    with pytest.raises(StoreError, match="no buyer account 42"):
        store.hold(42, amount=1, request_id="r")
    with pytest.raises(StoreError, match="no buyer account 42"):
        store.balance(42)
    store.hold(account_id, amount=1, request_id="once")
    with pytest.raises(ValueError, match="already has a hold"):
        store.hold(account_id, amount=1, request_id="once")
    hold = store.hold(account_id, amount=1, request_id="r2")
    with pytest.raises(ValueError):
        store.settle(hold, cost=-1)
    assert_books_balance(store, account_id)


# -- crash recovery -----------------------------------------------------------------------------

CRASHING_GATEWAY = """
import os, sys
from engy_node.gateway.store import Store
store = Store(sys.argv[1])
store.hold(int(sys.argv[2]), amount=400, request_id="in-flight-at-crash")
os._exit(1)  # no close, no cleanup: the process dies with the hold open
"""


def test_holds_left_open_by_a_crash_are_released_at_the_next_start(location, caplog):
    with Store(location) as before:
        account_id = funded(before, 1_000)
        settled = before.hold(account_id, amount=100, request_id="finished")
        before.settle(settled, cost=60)
    crashed = subprocess.run(
        [sys.executable, "-c", CRASHING_GATEWAY, str(location), str(account_id)], capture_output=True, text=True
    )
    assert crashed.returncode == 1, crashed.stderr
    with Store(location) as after:
        assert after.balance(account_id).held == 400
        recovered = after.recover_open_holds()
        assert [h.request_id for h in recovered] == ["in-flight-at-crash"]
        assert "in-flight-at-crash" in caplog.text
        assert assert_books_balance(after, account_id) == Balance(available=940, held=0, credited=1_000, charged=60)
        assert after.recover_open_holds() == []
        # The dead process's settle, retried late by anyone, changes nothing.
        late = after.settle(recovered[0], cost=400)
        assert (late.charged, late.applied) == (0, False)
        assert after.balance(account_id).charged == 60


def test_recovery_can_spare_holds_younger_than_the_longest_request(location, clock):
    with Store(location, clock=clock) as store:
        account_id = funded(store, 1_000)
        clock.now = 100.0
        old = store.hold(account_id, amount=10, request_id="old")
        clock.now = 200.0
        young = store.hold(account_id, amount=20, request_id="young")
        assert store.recover_open_holds(older_than=150.0) == [old]
        assert store.balance(account_id).held == 20
        assert store.settle(young, cost=5).applied


def test_the_store_summarises_accounts_by_spend(store):
    first, _ = store.create_buyer("first")
    second, _ = store.create_buyer("second")
    store.credit(second, micro_usd=5_000_000)
    hold = store.hold(second, amount=1_000_000, request_id="r1")
    store.settle(hold, cost=400_000)
    count, top = store.account_summaries(limit=1)
    assert count == 2 and [(a.account_id, a.charged, a.available, a.held) for a in top] == [
        (second, 400_000, 4_600_000, 0)
    ]
