"""Epochs in time and the step from request-log rows to a settled, canonical `result_json`."""

from __future__ import annotations

import json

import pytest
from bittensor.sp_core import Keypair
from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway.billing import epochs
from engy_node.gateway.billing.settlement import GateMinimums, VerdictCounts
from engy_node.gateway.store import RequestLogEntry
from engy_node.models import get_model

CLOCK = epochs.EpochClock(genesis=1000, epoch_s=100, grace_s=10)
MODEL = "smollm2-135m"
HONEST, CHEAT, KEYED, OWNER = (
    Keypair.create_from_uri(f"//{name}").ss58_address for name in ("Honest", "Cheat", "Keyed", "Owner")
)


def entry(
    miner: str | None,
    *,
    status: int = 200,
    cost: int = 5,
    kind: str = "paid",
    tokens: tuple[int, int] = (10, 20),
    at: float = 1050.0,
    ttft: float | None = 12.4,
    tpot: float | None = 3.6,
) -> RequestLogEntry:
    return RequestLogEntry(
        request_id=f"r{abs(hash((miner, status, cost, kind, at))) % 10**9}",
        account_id=None if kind == "probe" else 1,
        miner=miner,
        model=MODEL,
        api="openai",
        kind=kind,
        status=status,
        prompt_tokens=tokens[0],
        completion_tokens=tokens[1],
        cached_tokens=0,
        cost_micro=0 if kind == "probe" else cost,
        ttft_ms=ttft,
        tpot_ms=tpot,
        created_at=at,
    )


def test_the_clock_places_times_in_epochs():
    assert CLOCK.index_at(999.9) == -1
    assert CLOCK.index_at(1000) == 0 and CLOCK.index_at(1099.999) == 0 and CLOCK.index_at(1100) == 1
    assert CLOCK.window(2) == (1200, 1300) and CLOCK.closes_at(2) == 1310


def test_an_epoch_is_due_once_its_grace_is_over():
    assert CLOCK.due(now=1109.9, last_published=None, first_seen=1001) == []
    assert CLOCK.due(now=1110, last_published=None, first_seen=1001) == [0]
    assert CLOCK.due(now=1110, last_published=0, first_seen=1001) == []


def test_a_gateway_publishes_from_the_epoch_it_first_ran_in_and_catches_up_in_order():
    assert CLOCK.due(now=1550, last_published=None, first_seen=1250) == [2, 3, 4]
    assert CLOCK.due(now=1509, last_published=1, first_seen=1250) == [2, 3]
    assert CLOCK.due(now=1000 + 100 * 500, last_published=None, first_seen=1000) == list(
        range(499 - epochs.MAX_CATCH_UP_EPOCHS, 499)
    )


@given(st.integers(0, 10**6), st.integers(-1, 200), st.integers(0, 10**6))
def test_due_epochs_are_consecutive_closed_and_after_the_last_published(now, last, first_seen):
    due = CLOCK.due(now=now, last_published=None if last < 0 else last, first_seen=first_seen)
    assert due == list(range(due[0], due[0] + len(due))) if due else True
    assert len(due) <= epochs.MAX_CATCH_UP_EPOCHS
    for index in due:
        assert CLOCK.closes_at(index) <= now and (last < 0 or index > last)


@pytest.mark.parametrize("kwargs", [{"epoch_s": 0}, {"grace_s": -1}, {"genesis": 1.5}, {"epoch_s": True}])
def test_a_nonsense_clock_is_refused(kwargs):
    with pytest.raises(ValueError):
        epochs.EpochClock(**{"genesis": 0, "epoch_s": 60, "grace_s": 0, **kwargs})


def test_rows_become_records_by_the_miners_hotkey_and_rows_without_one_are_left_out():
    rows = [entry(HONEST), entry("key:1"), entry("key:2"), entry(None, status=503, cost=0), entry(HONEST, kind="probe")]
    records = epochs.settlement_records(rows, {HONEST: HONEST, "key:1": KEYED})
    assert [(r.hotkey, r.probe) for r in records] == [(HONEST, False), (KEYED, False), (HONEST, True)]
    assert (records[0].ttft_ms, records[0].tpot_ms) == (12, 4)


def test_verdict_counts_sum_per_hotkey():
    totals = epochs.verdict_totals(
        {HONEST: (3, 0, 1), "key:1": (2, 1, 0), "key:9": (5, 5, 5)}, {HONEST: HONEST, "key:1": HONEST}
    )
    assert totals == {HONEST: VerdictCounts(passed=5, cheat=1, unproven=1)}


def test_an_epoch_settles_into_canonical_result_json_with_its_window():
    rows = (
        [entry(HONEST, tokens=(100, 900))] * 3 + [entry(CHEAT, tokens=(100, 900))] * 3 + [entry(HONEST, kind="probe")]
    )
    settled = epochs.settle(
        clock=CLOCK,
        index=0,
        netuid=53,
        entries=rows,
        verdicts={HONEST: (3, 0, 0), CHEAT: (2, 1, 0)},
        hotkeys={HONEST: HONEST, CHEAT: CHEAT},
        models={MODEL: get_model(MODEL)},
        owner_hotkey=OWNER,
        minimums=GateMinimums(1, 1, 1),
    )
    result = json.loads(settled.result_json)
    assert settled.result_json == json.dumps(result, sort_keys=True, separators=(",", ":")).encode()
    assert (result["epoch_index"], result["netuid"], result["start"], result["end"]) == (0, 53, 1000, 1100)
    assert result["weights"] == [[HONEST, 65535]]
    gates = {row["hotkey"]: row["gate_reason"] for row in result["rows"]}
    assert gates == {HONEST: None, CHEAT: "cheat"}
    assert settled.settlement.weights == ((HONEST, 65535),)


def test_an_epoch_with_no_paid_traffic_burns_to_the_owner():
    settled = epochs.settle(
        clock=CLOCK,
        index=4,
        netuid=53,
        entries=[entry(HONEST, kind="probe")],
        verdicts={},
        hotkeys={HONEST: HONEST},
        models={MODEL: get_model(MODEL)},
        owner_hotkey=OWNER,
    )
    assert json.loads(settled.result_json)["weights"] == [[OWNER, 65535]]
