"""Helpers the store's tests share: a fake clock, a funded account, a request-log row, a verdict,
a second connection that bypasses the store (on either backend), and the books check most ledger
tests end with."""

from __future__ import annotations

import contextlib
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from engy_node.gateway.store import LOCAL_VERIFIER, Balance, RequestLogEntry, Store, VerdictRecord
from engy_node.gateway.store.connection import is_url
from engy_node.gateway.store.postgres import connect_raw, translate

INTEGRITY_ERRORS = (sqlite3.IntegrityError, psycopg.IntegrityError)
"""What a refused write looks like on either backend (a CHECK, a unique index, a trigger)."""


class FakeClock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def funded(store: Store, micro_usd: int, name: str = "buyer") -> int:
    account_id, _ = store.create_buyer(name)
    store.credit(account_id, micro_usd=micro_usd, memo="test funding")
    return account_id


def entry(**overrides) -> RequestLogEntry:
    fields = dict(
        request_id=uuid.uuid4().hex,
        account_id=1,
        miner="key:1",
        model="smollm2-135m",
        api="openai",
        kind="paid",
        status=200,
        prompt_tokens=10,
        completion_tokens=5,
        cached_tokens=2,
        cost_micro=3,
        ttft_ms=120.0,
        tpot_ms=15.5,
        created_at=1_000.0,
    )
    return RequestLogEntry(**{**fields, **overrides})


def verdict(**overrides) -> VerdictRecord:
    fields = dict(
        request_id=uuid.uuid4().hex,
        miner="key:1",
        model="smollm2-135m",
        kind="paid",
        verdict="pass",
        reason="ok",
        verifier=LOCAL_VERIFIER,
        request_created_at=1_000.0,
        judged_at=1_010.0,
    )
    return VerdictRecord(**{**fields, **overrides})


class _RawPostgres:
    """A psycopg connection taking the store's `?` SQL, in autocommit like `raw`'s SQLite one."""

    def __init__(self, url: str) -> None:
        self._conn = connect_raw(url)

    def execute(self, sql: str, params: Any = ()) -> psycopg.Cursor:
        return self._conn.execute(translate(sql), params or None)

    def close(self) -> None:
        self._conn.close()


@contextlib.contextmanager
def raw(location: str | Path) -> Iterator[Any]:
    """A connection to the store's database that bypasses the store, in autocommit, closed on exit."""
    conn = _RawPostgres(location) if is_url(location) else sqlite3.connect(location, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def assert_books_balance(store: Store, account_id: int) -> Balance:
    balance = store.balance(account_id)
    assert balance.credited == balance.charged + balance.available + balance.held
    assert store.check_books() == []
    return balance
