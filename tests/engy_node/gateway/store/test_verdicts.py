"""verdicts: one per request, a second one changes nothing and says whether it agreed; a cursor
that pages in order; counts per miner over a half-open window; no field that can hold text."""

from __future__ import annotations

import dataclasses

import pytest

from engy_node.gateway.store import Store, VerdictRecord
from tests.engy_node.gateway.store.support import raw, verdict


def test_a_verdict_is_recorded_once_and_read_back(store):
    first = verdict(
        request_id="r1",
        verdict="cheat",
        reason="chunk:exp-mismatch",
        verifier="5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY",
    )
    assert store.record_verdict(first) == "recorded"
    assert store.verdict("r1") == first
    assert store.verdict("r2") is None


@pytest.mark.parametrize(
    ("second", "outcome"),
    [
        # Same miner, verdict and reason: the same judgement, whoever reached it and when.
        ({"verifier": "5Other", "judged_at": 2_000.0, "kind": "probe"}, "duplicate"),
        ({"verdict": "cheat"}, "conflict"),
        ({"reason": "past-eos"}, "conflict"),
        ({"miner": "key:2"}, "conflict"),
    ],
)
def test_a_second_verdict_on_a_request_changes_nothing(store, location, second, outcome):
    first = verdict(request_id="r1", verdict="pass", reason="ok")
    store.record_verdict(first)
    assert store.record_verdict(dataclasses.replace(first, **second)) == outcome
    assert store.verdict("r1") == first
    with raw(location) as conn:
        assert conn.execute("SELECT count(*) FROM verdicts").fetchone()[0] == 1


def test_two_stores_recording_the_same_request_store_one_verdict(store, location):
    with Store(location) as other:
        assert other.record_verdict(verdict(request_id="r1", verdict="pass")) == "recorded"
    assert store.record_verdict(verdict(request_id="r1", verdict="cheat")) == "conflict"
    assert store.verdict("r1").verdict == "pass"


def test_the_cursor_pages_through_verdicts_in_the_order_they_were_stored(store):
    records = [verdict(request_id=f"r{i}", request_created_at=float(100 - i)) for i in range(5)]
    for record in records:
        store.record_verdict(record)
    first = store.verdicts_after(0, limit=2)
    assert [v for _, v in first] == records[:2]
    rest = store.verdicts_after(first[-1][0])
    assert [v for _, v in rest] == records[2:]
    assert [row_id for row_id, _ in first + rest] == sorted({row_id for row_id, _ in first + rest})
    assert store.verdicts_after(rest[-1][0]) == []
    # A duplicate adds no row, so the cursor does not see it.
    store.record_verdict(records[0])
    assert store.verdicts_after(rest[-1][0]) == []
    with pytest.raises(ValueError, match="limit"):
        store.verdicts_after(0, limit=0)
    with pytest.raises(ValueError, match="row_id"):
        store.verdicts_after(-1)


def test_counts_per_miner_cover_requests_served_in_a_half_open_window(store):
    for i, (miner, kind, created) in enumerate(
        [
            ("key:1", "pass", 100.0),  # on `since`: in
            ("key:1", "cheat", 150.0),
            ("key:1", "unproven", 199.999),
            ("key:2", "pass", 150.0),
            ("key:2", "pass", 200.0),  # on `until`: out
            ("key:3", "pass", 99.999),  # before: out
        ]
    ):
        # Judged long after it was served: the window goes by when the request was served.
        store.record_verdict(
            verdict(request_id=f"r{i}", miner=miner, verdict=kind, request_created_at=created, judged_at=5_000.0)
        )
    assert store.verdict_counts(since=100.0, until=200.0) == {"key:1": (1, 1, 1), "key:2": (1, 0, 0)}
    assert store.verdict_counts(since=200.0, until=300.0) == {"key:2": (1, 0, 0)}
    assert store.verdict_counts(since=300.0, until=400.0) == {}
    with pytest.raises(ValueError, match="since"):
        store.verdict_counts(since=float("nan"), until=1.0)


@pytest.mark.parametrize(
    "overrides",
    [
        {"request_id": "has space"},
        {"miner": ""},
        {"miner": "a/b"},
        {"model": "gpt-4"},
        {"kind": "free"},
        {"verdict": "fail"},
        {"verdict": "PASS"},
        {"reason": ""},
        {"reason": "x" * 129},
        {"reason": "the proof was wrong"},
        {"reason": "bad\nreason"},
        {"reason": "päst-eos"},
        {"verifier": "local verifier"},
        {"request_created_at": float("inf")},
        {"judged_at": None},
        {"judged_at": True},
    ],
)
def test_a_malformed_verdict_is_refused(overrides):
    with pytest.raises(ValueError):
        verdict(**overrides)


@pytest.mark.parametrize(
    "reason", ["ok", "past-eos", "chunk:exp-mismatch", "shape:decode_batching_size", "+1.5", "x" * 128]
)
def test_short_reason_codes_are_accepted(reason):
    assert verdict(reason=reason).reason == reason


def test_record_verdict_takes_only_verdict_records(store):
    with pytest.raises(TypeError, match="VerdictRecord"):
        store.record_verdict(dataclasses.asdict(verdict()))


def test_the_verdict_record_has_no_field_that_can_hold_text():
    marker = "ZDR canary: the heron sings at midnight"
    for field in dataclasses.fields(VerdictRecord):
        with pytest.raises(ValueError):
            verdict(**{field.name: marker})
