"""Helpers the store's tests share: a fake clock, a funded account, a request-log row, a verdict,
a second connection that bypasses the store, and the books check most ledger tests end with."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path

from engy_node.gateway.store import LOCAL_VERIFIER, Balance, RequestLogEntry, Store, VerdictRecord


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
    fields = dict(request_id=uuid.uuid4().hex, account_id=1, miner="key:1", model="smollm2-135m", api="openai", kind="paid",
                  status=200, prompt_tokens=10, completion_tokens=5, cached_tokens=2, cost_micro=3, ttft_ms=120.0,
                  tpot_ms=15.5, created_at=1_000.0)
    return RequestLogEntry(**{**fields, **overrides})


def verdict(**overrides) -> VerdictRecord:
    fields = dict(request_id=uuid.uuid4().hex, miner="key:1", model="smollm2-135m", kind="paid", verdict="pass",
                  reason="ok", verifier=LOCAL_VERIFIER, request_created_at=1_000.0, judged_at=1_010.0)
    return VerdictRecord(**{**fields, **overrides})


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def assert_books_balance(store: Store, account_id: int) -> Balance:
    balance = store.balance(account_id)
    assert balance.credited == balance.charged + balance.available + balance.held
    assert store.check_books() == []
    return balance
