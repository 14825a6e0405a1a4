"""requests: usage summed per request, old rows purged and their pages returned, and no field of a
row that can hold text."""

from __future__ import annotations

import dataclasses

import pytest

from engy_node.gateway.store import RequestLogEntry, Store, UsageSummary
from tests.engy_node.gateway.store.support import entry, funded, raw


def test_usage_sums_paid_requests_of_the_account_since_a_time(store):
    account_id = funded(store, 1_000)
    other = funded(store, 1_000, name="other")
    store.log_request(entry(request_id="a", account_id=account_id, created_at=100.0))
    store.log_request(entry(request_id="b", account_id=account_id, created_at=200.0))
    # A failed attempt on another miner before the retry that served it is one request.
    store.log_request(
        entry(
            request_id="b",
            account_id=account_id,
            status=502,
            prompt_tokens=0,
            completion_tokens=0,
            cached_tokens=0,
            cost_micro=0,
            created_at=200.0,
        )
    )
    store.log_request(entry(request_id="c", account_id=other, created_at=200.0))
    store.log_request(entry(request_id="probe-1", account_id=None, kind="probe", cost_micro=0, created_at=200.0))
    assert store.usage(account_id) == UsageSummary(
        requests=2, prompt_tokens=20, completion_tokens=10, cached_tokens=4, cost_micro=6
    )
    assert store.usage(account_id, since=150.0) == UsageSummary(1, 10, 5, 2, 3)
    assert store.usage(42) == UsageSummary(0, 0, 0, 0, 0)


def test_purging_the_request_log_drops_old_rows(store, location):
    funded(store, 1)
    store.log_requests([entry(request_id=f"old-{i}", created_at=100.0) for i in range(50)])
    store.log_request(entry(request_id="new", created_at=300.0))
    assert store.purge_request_log(older_than=200.0) == 50
    with raw(location) as conn:
        assert conn.execute("SELECT request_id FROM request_log").fetchall() == [("new",)]


def test_purging_the_request_log_returns_the_files_pages(path):
    with Store(path) as store:
        funded(store, 1)
        for i in range(2_000):
            store.log_request(entry(request_id=f"old-{i}", created_at=100.0))
        store.log_request(entry(request_id="new", created_at=300.0))
        with raw(path) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            pages_before = conn.execute("PRAGMA page_count").fetchone()[0]
        assert store.purge_request_log(older_than=200.0) == 2_000
    with raw(path) as conn:
        assert conn.execute("PRAGMA freelist_count").fetchone()[0] == 0
        assert conn.execute("PRAGMA page_count").fetchone()[0] < pages_before


@pytest.mark.parametrize(
    "overrides",
    [
        {"request_id": "has space"},
        {"request_id": ""},
        {"miner": "a/b"},
        {"model": "gpt-4"},
        {"api": "grpc"},
        {"kind": "free"},
        {"status": 42},
        {"prompt_tokens": -1},
        {"cached_tokens": 11},
        {"cost_micro": 0.5},
        {"ttft_ms": -1.0},
        {"tpot_ms": float("nan")},
        {"created_at": float("inf")},
        {"account_id": None},
        {"kind": "probe", "account_id": None, "cost_micro": 5},
        {"kind": "probe", "account_id": 1, "cost_micro": 0},
    ],
)
def test_a_malformed_request_log_entry_is_refused(overrides):
    with pytest.raises(ValueError):
        entry(**overrides)


def test_the_request_log_entry_has_no_field_that_can_hold_text():
    marker = "ZDR canary: the heron sings at midnight"
    for field in dataclasses.fields(RequestLogEntry):
        with pytest.raises(ValueError):
            entry(**{field.name: marker})


def test_an_epoch_window_reads_the_rows_created_in_it_in_the_order_logged(store):
    funded(store, 1)
    for request_id, created_at in (("on-since", 100.0), ("before", 99.5), ("inside", 150.0), ("on-until", 200.0)):
        store.log_request(entry(request_id=request_id, created_at=created_at))
    store.log_request(
        entry(request_id="probe", account_id=None, kind="probe", cost_micro=0, created_at=120.0, served_greedily=True)
    )
    window = store.requests_in(since=100.0, until=200.0)
    assert [e.request_id for e in window] == ["on-since", "inside", "probe"]
    assert window[2] == entry(
        request_id="probe", account_id=None, kind="probe", cost_micro=0, created_at=120.0, served_greedily=True
    )
    assert store.requests_in(since=200.0, until=100.0) == []


def test_the_cursor_pages_through_the_log_and_survives_a_purge(store):
    funded(store, 1)
    logged = [entry(request_id=f"r{i}", created_at=100.0 + i) for i in range(5)]
    store.log_requests(logged)
    first = store.requests_after(0, limit=3)
    assert [e for _, e in first] == logged[:3]
    cursor = store.requests_after(first[-1][0])[-1][0]
    assert store.requests_after(cursor) == []
    # Purging everything keeps the newest row, so ids never restart below the cursor.
    assert store.purge_request_log(older_than=1_000.0) == 4
    store.log_request(entry(request_id="later", created_at=2_000.0))
    assert [e.request_id for _, e in store.requests_after(cursor)] == ["later"]
    with pytest.raises(ValueError, match="limit"):
        store.requests_after(0, limit=0)
