"""eligibility: the current state per (miner, model), replaced row by row, all of a save or none."""

from __future__ import annotations

import dataclasses

import pytest

from engy_node.gateway.store import MAX_REASON_CHARS, EligibilityRow
from tests.engy_node.gateway.store.support import INTEGRITY_ERRORS


def row(**overrides) -> EligibilityRow:
    fields = dict(
        miner="key:1", model="smollm2-135m", state="probing", reason="connected", since=1_000.0, updated_at=1_000.0
    )
    return EligibilityRow(**{**fields, **overrides})


def test_saving_replaces_each_rows_state_and_keeps_the_others(store):
    assert store.eligibility() == []
    store.save_eligibility([row(miner="key:2"), row(), row(model="qwen3.6-35b-a3b")])
    pulled = row(
        state="pulled", reason="breaker: 3 failures in a row (502, 502, timeout)", since=1_200.0, updated_at=1_200.0
    )
    store.save_eligibility([pulled])
    assert store.eligibility() == [row(model="qwen3.6-35b-a3b"), pulled, row(miner="key:2")]
    store.save_eligibility([])
    assert len(store.eligibility()) == 3


def test_a_save_lands_whole_or_not_at_all(store):
    store.save_eligibility([row()])
    # Past the row's own checks, so the database's CHECK refuses it after the first row is in.
    forged = row(miner="key:2")
    object.__setattr__(forged, "state", "banned")
    with pytest.raises(INTEGRITY_ERRORS):
        store.save_eligibility([row(state="active"), forged])
    assert store.eligibility() == [row()]


@pytest.mark.parametrize(
    "overrides",
    [
        {"miner": ""},
        {"miner": "key 1"},
        {"model": "gpt-4"},
        {"state": "banned"},
        {"state": "Active"},
        {"reason": "x" * (MAX_REASON_CHARS + 1)},
        {"reason": "two\nlines"},
        {"reason": None},
        {"since": float("nan")},
        {"updated_at": "now"},
    ],
)
def test_a_malformed_eligibility_row_is_refused(overrides):
    with pytest.raises(ValueError):
        row(**overrides)


def test_a_reason_may_be_a_sentence_up_to_the_cap(store):
    sentence = row(reason="p99 TTFT 2150 ms over the 2000 ms ceiling; cooldown 600 s".ljust(MAX_REASON_CHARS, "."))
    store.save_eligibility([sentence])
    assert store.eligibility() == [sentence]


def test_save_eligibility_takes_only_eligibility_rows(store):
    with pytest.raises(TypeError, match="EligibilityRow"):
        store.save_eligibility([dataclasses.asdict(row())])
    assert store.eligibility() == []
