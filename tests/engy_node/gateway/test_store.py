"""store: keys hashed, holds atomic under contention, books balanced, crashes refunded, no content on disk."""

from __future__ import annotations

import dataclasses
import random
import sqlite3
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import trio

from engy_node.gateway.billing import billable_usage, charge, worst_case_hold
from engy_node.gateway.chat import ChatRequest, Usage
from engy_node.gateway.store import (
    APPLICATION_ID,
    BUYER_KEY_PREFIX,
    KEY_ENTROPY_BYTES,
    MINER_KEY_PREFIX,
    SCHEMA_VERSION,
    Balance,
    Hold,
    RequestLogEntry,
    Store,
    StoreError,
    UsageSummary,
)
from engy_node.models import CATALOG


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def path(tmp_path) -> Path:
    return tmp_path / "gateway.sqlite3"


@pytest.fixture
def store(path, clock):
    with Store(path, clock=clock) as opened:
        yield opened


def funded(store: Store, micro_usd: int, name: str = "buyer") -> int:
    account_id, _ = store.create_buyer(name)
    store.credit(account_id, micro_usd=micro_usd, memo="test funding")
    return account_id


def entry(**overrides) -> RequestLogEntry:
    fields = dict(request_id=uuid.uuid4().hex, account_id=1, miner="key:1", model="smollm2-135m", api="openai", kind="paid",
                  status=200, prompt_tokens=10, completion_tokens=5, cached_tokens=2, cost_micro=3, ttft_ms=120.0,
                  tpot_ms=15.5, created_at=1_000.0)
    return RequestLogEntry(**{**fields, **overrides})


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def assert_books_balance(store: Store, account_id: int) -> Balance:
    balance = store.balance(account_id)
    assert balance.credited == balance.charged + balance.available + balance.held
    assert store.check_books() == []
    return balance


# -- keys ---------------------------------------------------------------------------------------


def test_a_buyer_key_authenticates_its_account_and_is_stored_only_as_a_hash(store, path):
    account_id, api_key = store.create_buyer("acme")
    assert api_key.startswith(BUYER_KEY_PREFIX) and len(api_key) > len(BUYER_KEY_PREFIX) + KEY_ENTROPY_BYTES
    account = store.authenticate(api_key)
    assert (account.account_id, account.name) == (account_id, "acme")
    with raw(path) as conn:
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


def test_credit_hold_settle_round_trip_keeps_every_micro_dollar(store, path, clock):
    account_id = funded(store, 1_000_000)
    hold = store.hold(account_id, amount=300_000, request_id="req-1")
    assert hold == Hold(hold_id=hold.hold_id, account_id=account_id, amount=300_000, request_id="req-1", created_at=clock.now)
    assert store.balance(account_id) == Balance(available=700_000, held=300_000, credited=1_000_000, charged=0)
    settlement = store.settle(hold, cost=123_456)
    assert (settlement.charged, settlement.released, settlement.applied) == (123_456, 176_544, True)
    assert assert_books_balance(store, account_id) == Balance(available=876_544, held=0, credited=1_000_000, charged=123_456)
    with raw(path) as conn:
        ledger = conn.execute("SELECT kind, amount, request_id, available_after FROM ledger ORDER BY id").fetchall()
    assert ledger == [("credit", 1_000_000, None, 1_000_000), ("hold", 300_000, "req-1", 700_000),
                      ("settle", 123_456, "req-1", 700_000), ("release", 176_544, "req-1", 876_544)]


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


# -- concurrency --------------------------------------------------------------------------------

BALANCE = 1_000
HOLD = 37  # does not divide BALANCE, so the last attempts find a remainder too small to hold
ATTEMPTS = 120


async def test_concurrent_trio_tasks_never_hold_more_than_the_balance(path):
    # Four stores (four connections, four limiters) on one file, so holds really do run at the
    # same time in different threads and only SQLite's locking keeps them apart.
    stores = [Store(path) for _ in range(4)]
    account_id = funded(stores[0], BALANCE)
    holds: list[Hold] = []

    async def attempt(i: int) -> None:
        store = stores[i % len(stores)]
        hold = await store.run(store.hold, account_id, amount=HOLD, request_id=f"trio-{i}")
        if hold is not None:
            holds.append(hold)

    async with trio.open_nursery() as nursery:
        for i in range(ATTEMPTS):
            nursery.start_soon(attempt, i)
    assert len(holds) == BALANCE // HOLD
    assert sum(h.amount for h in holds) <= BALANCE

    rng = random.Random(53)
    costs = {h.hold_id: rng.randrange(HOLD + 1) for h in holds}

    async def close(i: int, hold: Hold) -> None:
        store = stores[i % len(stores)]
        if i % 3 == 0:
            await store.run(store.release, hold)
        else:
            await store.run(store.settle, hold, cost=costs[hold.hold_id])
        # A retry racing the first closure must not charge again.
        retrying = stores[(i + 1) % len(stores)]
        await retrying.run(retrying.settle, hold, cost=HOLD)

    async with trio.open_nursery() as nursery:
        for i, hold in enumerate(holds):
            nursery.start_soon(close, i, hold)
    balance = assert_books_balance(stores[0], account_id)
    expected_charged = sum(costs[h.hold_id] for i, h in enumerate(holds) if i % 3 != 0)
    assert balance == Balance(available=BALANCE - expected_charged, held=0, credited=BALANCE, charged=expected_charged)
    for store in stores:
        await store.aclose()


def test_concurrent_os_threads_with_their_own_stores_never_hold_more_than_the_balance(path):
    with Store(path) as setup:
        account_id = funded(setup, BALANCE)
    threads_n = 6
    start = threading.Barrier(threads_n)
    holds: list[Hold] = []
    charged: list[int] = []
    errors: list[BaseException] = []
    appending = threading.Lock()

    def worker(n: int) -> None:
        try:
            with Store(path) as store:
                start.wait()
                mine = [store.hold(account_id, amount=HOLD, request_id=f"thread-{n}-{i}") for i in range(ATTEMPTS // threads_n)]
                mine = [h for h in mine if h is not None]
                with appending:
                    holds.extend(mine)
                start.wait()  # every hold attempt is in before anything is returned
                for i, hold in enumerate(mine):
                    if i % 2:
                        store.release(hold)
                    else:
                        with appending:
                            charged.append(store.settle(hold, cost=HOLD - n).charged)
        except BaseException as error:  # broad on purpose: re-raised in the main thread below
            errors.append(error)
            start.abort()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(holds) == BALANCE // HOLD
    with Store(path) as store:
        balance = assert_books_balance(store, account_id)
    assert balance == Balance(available=BALANCE - sum(charged), held=0, credited=BALANCE, charged=sum(charged))


async def test_an_async_hold_cancelled_before_it_starts_reserves_nothing(store):
    account_id = funded(store, 1_000)
    with trio.CancelScope() as scope:
        scope.cancel()
        await store.run(store.hold, account_id, amount=500, request_id="never")
    assert scope.cancelled_caught
    assert store.balance(account_id).held == 0


# -- crash recovery -----------------------------------------------------------------------------

CRASHING_GATEWAY = """
import os, sys
from engy_node.gateway.store import Store
store = Store(sys.argv[1])
store.hold(int(sys.argv[2]), amount=400, request_id="in-flight-at-crash")
os._exit(1)  # no close, no cleanup: the process dies with the hold open
"""


def test_holds_left_open_by_a_crash_are_released_at_the_next_start(path, caplog):
    with Store(path) as before:
        account_id = funded(before, 1_000)
        settled = before.hold(account_id, amount=100, request_id="finished")
        before.settle(settled, cost=60)
    crashed = subprocess.run([sys.executable, "-c", CRASHING_GATEWAY, str(path), str(account_id)], capture_output=True, text=True)
    assert crashed.returncode == 1, crashed.stderr
    with Store(path) as after:
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


def test_recovery_can_spare_holds_younger_than_the_longest_request(path, clock):
    with Store(path, clock=clock) as store:
        account_id = funded(store, 1_000)
        clock.now = 100.0
        old = store.hold(account_id, amount=10, request_id="old")
        clock.now = 200.0
        young = store.hold(account_id, amount=20, request_id="young")
        assert store.recover_open_holds(older_than=150.0) == [old]
        assert store.balance(account_id).held == 20
        assert store.settle(young, cost=5).applied


# -- the database enforces its own invariants ----------------------------------------------------


def test_the_database_refuses_to_update_or_delete_ledger_rows(store, path):
    account_id = funded(store, 1_000)
    store.settle(store.hold(account_id, amount=100, request_id="r"), cost=50)
    with raw(path) as conn:
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("UPDATE ledger SET amount = 0 WHERE kind = 'settle'")
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute("DELETE FROM ledger")
        # A second closure of the same hold, and an overdraft, are refused too.
        hold_id = conn.execute("SELECT id FROM ledger WHERE kind = 'hold'").fetchone()[0]
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute("INSERT INTO ledger (account_id, kind, amount, request_id, hold_id, available_after, created_at) "
                          "VALUES (?, 'settle', 50, 'r', ?, 0, 0)", (account_id, hold_id))
        with pytest.raises(sqlite3.IntegrityError):
            conn.execute("UPDATE accounts SET available = available - 2000, held = held + 2000")
        assert conn.execute("SELECT count(*) FROM ledger").fetchone()[0] == 4
    assert_books_balance(store, account_id)


def test_the_file_is_versioned_write_ahead_logged_and_auto_vacuumed(store, path):
    with raw(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == str(SCHEMA_VERSION)
        assert conn.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2  # INCREMENTAL


# -- request log, usage, retention ---------------------------------------------------------------


def test_usage_sums_paid_requests_of_the_account_since_a_time(store):
    account_id = funded(store, 1_000)
    other = funded(store, 1_000, name="other")
    store.log_request(entry(request_id="a", account_id=account_id, created_at=100.0))
    store.log_request(entry(request_id="b", account_id=account_id, created_at=200.0))
    # A failed attempt on another miner before the retry that served it is one request.
    store.log_request(entry(request_id="b", account_id=account_id, status=502, prompt_tokens=0, completion_tokens=0,
                            cached_tokens=0, cost_micro=0, created_at=200.0))
    store.log_request(entry(request_id="c", account_id=other, created_at=200.0))
    store.log_request(entry(request_id="probe-1", account_id=None, kind="probe", cost_micro=0, created_at=200.0))
    assert store.usage(account_id) == UsageSummary(requests=2, prompt_tokens=20, completion_tokens=10, cached_tokens=4, cost_micro=6)
    assert store.usage(account_id, since=150.0) == UsageSummary(1, 10, 5, 2, 3)
    assert store.usage(42) == UsageSummary(0, 0, 0, 0, 0)


def test_purging_the_request_log_drops_old_rows_and_returns_their_pages(store, path):
    funded(store, 1)
    for i in range(2_000):
        store.log_request(entry(request_id=f"old-{i}", created_at=100.0))
    store.log_request(entry(request_id="new", created_at=300.0))
    with raw(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        pages_before = conn.execute("PRAGMA page_count").fetchone()[0]
    assert store.purge_request_log(older_than=200.0) == 2_000
    with raw(path) as conn:
        assert conn.execute("SELECT request_id FROM request_log").fetchall() == [("new",)]
        assert conn.execute("PRAGMA freelist_count").fetchone()[0] == 0
        assert conn.execute("PRAGMA page_count").fetchone()[0] < pages_before


@pytest.mark.parametrize(
    "overrides",
    [{"request_id": "has space"}, {"request_id": ""}, {"miner": "a/b"}, {"model": "gpt-4"}, {"api": "grpc"},
     {"kind": "free"}, {"status": 42}, {"prompt_tokens": -1}, {"cached_tokens": 11}, {"cost_micro": 0.5},
     {"ttft_ms": -1.0}, {"tpot_ms": float("nan")}, {"created_at": float("inf")}, {"account_id": None},
     {"kind": "probe", "account_id": None, "cost_micro": 5}, {"kind": "probe", "account_id": 1, "cost_micro": 0}],
)
def test_a_malformed_request_log_entry_is_refused(overrides):
    with pytest.raises(ValueError):
        entry(**overrides)


# -- miners ---------------------------------------------------------------------------------------


def test_a_registered_miners_key_authenticates_it(store, clock):
    miner_id, miner_key = store.register_miner("rig-1", hotkey="5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY")
    assert miner_key.startswith(MINER_KEY_PREFIX)
    record = store.authenticate_miner(miner_key)
    assert (record.miner_id, record.name, record.created_at) == (miner_id, "rig-1", clock.now)
    second_id, _ = store.register_miner("rig-2")
    assert [(m.miner_id, m.hotkey) for m in store.list_miners()] == [(miner_id, record.hotkey), (second_id, None)]
    assert store.authenticate_miner(MINER_KEY_PREFIX + "forged") is None
    _, buyer_key = store.create_buyer("buyer")
    assert store.authenticate_miner(buyer_key) is None
    assert store.authenticate(miner_key) is None


def test_miner_names_and_hotkeys_are_unique(store):
    store.register_miner("rig-1", hotkey="5Hot")
    with pytest.raises(StoreError, match="rig-1"):
        store.register_miner("rig-1")
    with pytest.raises(StoreError, match="rig-1"):
        store.register_miner("rig-9", hotkey="5Hot")


async def test_every_operation_is_awaitable(store):
    account_id, api_key = await store.run(store.create_buyer, "async")
    assert (await store.run(store.authenticate, api_key)).account_id == account_id
    assert await store.run(store.credit, account_id, micro_usd=100) == 100
    hold = await store.run(store.hold, account_id, amount=60, request_id="a1")
    assert (await store.run(store.settle, hold, cost=10)).charged == 10
    await store.run(store.release, await store.run(store.hold, account_id, amount=10, request_id="a2"))
    await store.run(store.log_request, entry(account_id=account_id))
    assert (await store.run(store.usage, account_id)).requests == 1
    assert await store.run(store.balance, account_id) == Balance(available=90, held=0, credited=100, charged=10)
    assert await store.run(store.recover_open_holds) == []
    assert await store.run(store.check_books) == []
    miner_id, miner_key = await store.run(store.register_miner, "rig")
    assert (await store.run(store.authenticate_miner, miner_key)).miner_id == miner_id
    assert len(await store.run(store.list_miners)) == 1
    second_key = await store.run(store.issue_key, account_id)
    assert await store.run(store.revoke_key, second_key)
    assert await store.run(store.purge_request_log, older_than=float("inf")) == 1


async def test_run_awaits_only_methods_of_its_own_store(store, path):
    with Store(path) as other:
        with pytest.raises(TypeError, match="method of this store"):
            await store.run(other.list_miners)
    with pytest.raises(TypeError, match="method of this store"):
        await store.run(lambda: None)


# -- zero data retention ------------------------------------------------------------------------


def database_bytes(path: Path) -> bytes:
    files = [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]
    return b"".join(f.read_bytes() for f in files if f.exists())


def test_no_prompt_or_completion_text_and_no_key_ever_reaches_the_disk(path, clock):
    marker = f"ZDR canary {uuid.uuid4().hex}: the heron sings at midnight"
    chat = ChatRequest(api="openai", model="smollm2-135m", messages=({"role": "user", "content": f"Repeat this: {marker}"},),
                       max_tokens=64, stream=True)
    completion_text = f"Sure. {marker}"
    price = CATALOG[chat.model].price
    request_id = uuid.uuid4().hex
    store = Store(path, clock=clock)

    account_id, api_key = store.create_buyer("zdr-visible-buyer-name")
    store.credit(account_id, micro_usd=5_000_000, memo="prepaid")
    account = store.authenticate(api_key)
    miner_id, miner_key = store.register_miner("rig-zdr")
    assert store.authenticate_miner(miner_key).miner_id == miner_id
    prompt_tokens = len(chat.messages[0]["content"].split())  # a whitespace tokenizer stands in for the model's
    hold = store.hold(account.account_id, amount=worst_case_hold(price=price, prompt_tokens=prompt_tokens, max_tokens=chat.max_tokens),
                      request_id=request_id)
    relayed = len(completion_text.split())
    usage = billable_usage(claimed=Usage(prompt_tokens=prompt_tokens, completion_tokens=relayed), committed_prompt=prompt_tokens,
                           committed_completion=relayed, relayed_completion=relayed)
    cost = charge(price=price, usage=usage)
    store.settle(hold, cost=cost)
    store.log_request(RequestLogEntry(
        request_id=request_id, account_id=account.account_id, miner=f"key:{miner_id}", model=chat.model, api=chat.api,
        kind="paid", status=200, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens, cost_micro=cost, ttft_ms=80.0, tpot_ms=12.0, created_at=clock.now,
    ))
    store.usage(account_id)
    failed = store.hold(account_id, amount=10, request_id=uuid.uuid4().hex)
    store.release(failed)

    secrets_ = [marker.encode(), marker.split()[2].encode(), api_key.encode(), miner_key.encode(),
                api_key[len(BUYER_KEY_PREFIX):].encode(), miner_key[len(MINER_KEY_PREFIX):].encode()]
    live = database_bytes(path)
    # The scan sees what was written (operator-chosen names are stored), so its silence means something.
    assert b"zdr-visible-buyer-name" in live and request_id.encode() in live
    assert not [s for s in secrets_ if s in live]
    store.close()
    closed = database_bytes(path)
    assert b"zdr-visible-buyer-name" in closed
    assert not [s for s in secrets_ if s in closed]


def test_the_request_log_entry_has_no_field_that_can_hold_text():
    marker = "ZDR canary: the heron sings at midnight"
    for field in dataclasses.fields(RequestLogEntry):
        with pytest.raises(ValueError):
            entry(**{field.name: marker})


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


async def test_operations_awaited_together_share_one_commit_and_one_failure_stays_its_own(store):
    account_id, _ = store.create_buyer("grouped")
    store.credit(account_id, micro_usd=1_000)
    store.hold(account_id, amount=10, request_id="taken")
    outcomes: dict[str, object] = {}

    async def hold(request_id: str, amount: int) -> None:
        try:
            outcomes[request_id] = await store.run(store.hold, account_id, amount=amount, request_id=request_id)
        except ValueError as error:
            outcomes[request_id] = error

    async with trio.open_nursery() as nursery:
        for request_id, amount in (("a", 100), ("taken", 5), ("b", 200), ("c", 10_000)):
            nursery.start_soon(hold, request_id, amount)
    assert isinstance(outcomes["taken"], ValueError), "a reused request id is refused"
    assert outcomes["a"].amount == 100 and outcomes["b"].amount == 200
    assert outcomes["c"] is None, "a hold the balance cannot cover is refused without touching the others"
    balance = store.balance(account_id)
    assert balance.held == 310 and balance.available == 690
    assert store.check_books() == []


async def test_holds_and_releases_skip_the_disk_flush_and_charges_wait_for_it(store, path):
    """A hold or release lost to a power cut is what recovery would produce anyway; a charge is not."""
    account_id, _ = store.create_buyer("flush")
    store.credit(account_id, micro_usd=1_000)
    synchronous = lambda: store._conn.execute("PRAGMA synchronous").fetchone()[0]  # noqa: E731  1 NORMAL, 2 FULL

    hold = await store.run(store.hold, account_id, amount=100, request_id="r1")
    assert synchronous() == 1
    with Store.open(path) as other:
        assert other.balance(account_id).held == 100, "committed and visible to every connection at once"
    await store.run(store.settle, hold, cost=40)
    assert synchronous() == 2
    second = await store.run(store.hold, account_id, amount=50, request_id="r2")
    await store.run(store.release, second)
    assert synchronous() == 1
    store.credit(account_id, micro_usd=5)
    assert synchronous() == 2
    assert assert_books_balance(store, account_id).charged == 40
