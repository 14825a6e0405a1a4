"""The batched request-log writer: rows land, in batches under load, all of them on shutdown; a
store that cannot keep up costs rows, never memory without bound; late rows fall back to the caller."""

from __future__ import annotations

import uuid

import pytest
import trio

from engy_node.gateway.request.request_log import RequestLogWriter
from engy_node.gateway.store import RequestLogEntry, Store


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "gateway.sqlite3") as opened:
        yield opened


def entry(**overrides) -> RequestLogEntry:
    fields = dict(
        request_id=uuid.uuid4().hex,
        account_id=None,
        miner="key:1",
        model="smollm2-135m",
        api="openai",
        kind="probe",
        status=200,
        prompt_tokens=10,
        completion_tokens=5,
        cached_tokens=0,
        cost_micro=0,
        ttft_ms=12.0,
        tpot_ms=1.5,
        created_at=1_000.0,
    )
    return RequestLogEntry(**{**fields, **overrides})


def logged_ids(store: Store) -> list[str]:
    with store._snapshot() as conn:
        return [row[0] for row in conn.execute("SELECT request_id FROM request_log ORDER BY rowid")]


async def test_rows_queued_together_are_written_in_one_store_operation(store, monkeypatch):
    writer = RequestLogWriter(store)
    rows = [entry() for _ in range(50)]
    batches: list[int] = []
    all_written = trio.Event()
    run = store.run

    async def counting(operation, *args, **kwargs):
        if operation == store.log_requests:
            batches.append(len(args[0]))
        result = await run(operation, *args, **kwargs)
        if sum(batches) == len(rows):
            all_written.set()
        return result

    monkeypatch.setattr(store, "run", counting)
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        for row in rows:
            assert writer.add(row)
        with trio.fail_after(10):
            await all_written.wait()
        nursery.cancel_scope.cancel()
    assert logged_ids(store) == [row.request_id for row in rows]
    assert batches == [50], "all rows queued before the writer woke went in one write"


async def test_shutdown_writes_what_is_queued_then_hands_late_rows_back(store):
    writer = RequestLogWriter(store)
    queued = [entry() for _ in range(5)]
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        for row in queued:
            writer.add(row)
        nursery.cancel_scope.cancel()  # before the writer had a chance to run
    assert logged_ids(store) == [row.request_id for row in queued]
    assert writer.add(entry()) is False, "a stopped writer refuses rows so the caller writes them"


async def test_a_store_that_falls_behind_costs_rows_not_unbounded_memory(store, caplog):
    writer = RequestLogWriter(store, max_pending=3)
    rows = [entry() for _ in range(5)]
    for row in rows:  # the writer is not running: nothing drains
        assert writer.add(row)
    assert writer.dropped == 2
    assert "2 rows dropped" not in caplog.text and "1 rows dropped" in caplog.text
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        nursery.cancel_scope.cancel()
    assert logged_ids(store) == [row.request_id for row in rows[:3]]


def test_log_requests_writes_all_rows_or_none(store):
    good = entry()
    with pytest.raises(TypeError):
        store.log_requests([good, {"request_id": "not-an-entry"}])
    assert logged_ids(store) == []
    store.log_requests([good, entry()])
    assert logged_ids(store)[0] == good.request_id and len(logged_ids(store)) == 2
