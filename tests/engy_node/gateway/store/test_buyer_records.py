"""The store's reads behind a buyer's generation lookup and usage report, on both backends: a
request's rows by id for its own account only, an account's rows in a window, and the ledger's
charges in the same window, which the logged costs add up to."""

from __future__ import annotations

import pytest

from engy_node.gateway.store.requests import RequestLogEntry
from tests.engy_node.gateway.store.support import entry, funded


def test_a_requests_rows_are_read_for_its_own_account_only_with_the_fields_schema_5_added(store):
    mine, theirs = funded(store, 1_000, "mine"), funded(store, 1_000, "theirs")
    failed = entry(
        request_id="r1",
        account_id=mine,
        status=502,
        prompt_tokens=0,
        completion_tokens=0,
        cached_tokens=0,
        cost_micro=0,
    )
    served = entry(
        request_id="r1",
        account_id=mine,
        key_id=1,
        reasoning_tokens=3,
        finish_reason="length",
        total_ms=250.0,
        audited=True,
    )
    store.log_requests([failed, served, entry(request_id="r2", account_id=theirs)])
    assert store.request_rows("r1", mine) == [failed, served]
    assert store.request_rows("r1", theirs) == []
    assert store.request_rows("r2", mine) == []


def test_an_accounts_rows_in_a_window_and_the_ledgers_charges_in_it(store, clock):
    account = funded(store, 10_000)
    other = funded(store, 10_000, "other")
    for at, cost in ((1_000.0, 7), (1_500.0, 11), (2_000.0, 13)):
        clock.now = at
        request_id = f"at{int(at)}"
        hold = store.hold(account, amount=100, request_id=request_id)
        store.settle_and_log(
            hold, cost=cost, entry=entry(request_id=request_id, account_id=account, created_at=at, cost_micro=0)
        )
    clock.now = 1_500.0
    store.settle_and_log(
        store.hold(other, amount=100, request_id="other"),
        cost=5,
        entry=entry(request_id="other", account_id=other, created_at=1_500.0),
    )
    rows = store.account_requests(account, since=1_000.0, until=2_000.0)
    assert [(row.request_id, row.cost_micro) for row in rows] == [("at1000", 7), ("at1500", 11)]
    assert store.charged_between(account, since=1_000.0, until=2_000.0) == 18
    assert store.charged_between(account, since=0.0, until=3_000.0) == 31 == store.balance(account).charged
    assert isinstance(store.charged_between(other, since=0.0, until=3_000.0), int)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("reasoning_tokens", 6, "exceeds completion_tokens"),
        ("finish_reason", "tool_use", "finish_reason must be"),
        ("key_id", 0, "key_id"),
        ("audited", 1, "audited must be a boolean"),
    ],
)
def test_a_log_row_with_a_nonsense_new_field_is_refused(field, value, says):
    with pytest.raises(ValueError, match=says):
        entry(**{field: value})


def test_the_new_fields_default_to_what_an_old_row_reads_as():
    row = entry()
    assert (row.key_id, row.reasoning_tokens, row.finish_reason, row.total_ms, row.audited) == (
        None,
        0,
        None,
        None,
        False,
    )
    assert isinstance(row, RequestLogEntry)
