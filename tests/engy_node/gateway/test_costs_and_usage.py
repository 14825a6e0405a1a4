"""The pure parts of costs, generations and usage: dollars from µUSD exactly, the cost's parts,
how a buyer asks for the cost, a generation's record, and the usage report's grouping and sums."""

from __future__ import annotations

import csv
import io
import json
from decimal import Decimal

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway.api import cost_fields
from engy_node.gateway.api.chat import GatewayError, Usage
from engy_node.gateway.api.generations import generation_body, request_id_of, verification
from engy_node.gateway.billing import billing
from engy_node.gateway.billing.costs import cost_details, cost_number, cost_usd, usage_cost
from engy_node.gateway.billing.usage import as_csv, credits_table, parse_time, usage_document, usage_report
from engy_node.gateway.store.deposits import CreditRecord
from engy_node.models import PriceCard
from tests.engy_node.gateway.store.support import entry, verdict

PRICE = PriceCard(input_per_m=200_000, cached_input_per_m=50_000, output_per_m=800_000)


@given(st.integers(min_value=0, max_value=10**15))
def test_a_cost_read_back_from_its_json_is_the_charge_to_the_micro_dollar(micro):
    assert Decimal(cost_usd(micro)) * 1_000_000 == micro
    for text in (orjson.dumps(cost_number(micro)), json.dumps(cost_number(micro)).encode()):
        assert Decimal(repr(json.loads(text))) * 1_000_000 == micro


def test_dollars_are_written_with_every_micro_dollar():
    assert [cost_usd(m) for m in (0, 1, 1_234, 25_000_000)] == ["0.000000", "0.000001", "0.001234", "25.000000"]
    with pytest.raises(ValueError):
        cost_usd(-1)


@given(
    prompt=st.integers(0, 10**6),
    cached_share=st.integers(0, 100),
    completion=st.integers(0, 10**6),
    reasoning_share=st.integers(0, 100),
)
def test_the_parts_rounded_up_once_are_the_charge(prompt, cached_share, completion, reasoning_share):
    usage = Usage(prompt, completion, prompt * cached_share // 100, completion * reasoning_share // 100)
    parts = cost_details(PRICE, usage)
    exact = sum(Decimal(repr(parts[k])) for k in ("prompt_cost", "cached_prompt_cost", "completion_cost"))
    charge = billing.charge(price=PRICE, usage=usage)
    assert charge - 1 < exact * 1_000_000 <= charge
    assert Decimal(repr(parts["reasoning_cost"])) <= Decimal(repr(parts["completion_cost"]))
    assert usage_cost(PRICE, usage, charged=charge)["cost"] == cost_number(charge)


@pytest.mark.parametrize(
    ("raw", "asked"), [(None, False), ({"include": True}, True), ({"include": False}, False), ({}, False)]
)
def test_the_cost_is_asked_for_openrouters_way(raw, asked):
    assert cost_fields.asked_in_body(raw) is asked


@pytest.mark.parametrize("raw", [True, {"include": "yes"}, {"include": True, "other": 1}, []])
def test_a_usage_field_that_is_not_openrouters_is_a_400(raw):
    with pytest.raises(GatewayError) as caught:
        cost_fields.asked_in_body(raw)
    assert (caught.value.status, caught.value.param) == (400, "usage")


def test_the_cost_is_asked_for_by_header():
    assert cost_fields.asked_in_headers({"x-engy-include-cost": "1"})
    assert cost_fields.asked_in_headers({"x-engy-include-cost": "True"})
    assert not cost_fields.asked_in_headers({"x-engy-include-cost": "0"})
    assert not cost_fields.asked_in_headers({})


def test_a_generation_id_is_the_request_id_in_any_of_its_forms():
    rid = "0190a1b2c3d4" + "e" * 20
    assert request_id_of(rid) == request_id_of(f"chatcmpl-{rid}") == request_id_of(f"msg_{rid}") == rid
    assert request_id_of("../../etc") is None and request_id_of("") is None


def test_a_generation_sums_its_attempts_and_reads_as_its_last():
    failed = entry(
        request_id="r", status=502, prompt_tokens=0, completion_tokens=0, cached_tokens=0, cost_micro=0, ttft_ms=None
    )
    served = entry(
        request_id="r", cost_micro=1_234, reasoning_tokens=2, finish_reason="stop", total_ms=300.0, audited=True
    )
    data = generation_body([failed, served], None)["data"]
    assert (data["status"], data["attempts"], data["finish_reason"]) == (200, 2, "stop")
    assert (data["cost_micro_usd"], data["cost_usd"], data["total_cost"]) == (1_234, "0.001234", 0.001234)
    assert (data["ttft_ms"], data["total_ms"], data["tokens_reasoning"]) == (120.0, 300.0, 2)
    assert data["verification"] == {"status": "pending"}
    assert verification([failed], None) == {"status": "not audited"}
    judged = verification([served], verdict(request_id="r", verdict="cheat", reason="usage-padding"))
    assert (judged["status"], judged["reason"]) == ("cheat", "usage-padding")


DAY = 86_400.0


def test_usage_counts_requests_once_in_their_first_rows_day_and_key():
    rows = [
        entry(
            request_id="a",
            key_id=1,
            created_at=DAY - 1,
            status=502,
            prompt_tokens=0,
            completion_tokens=0,
            cached_tokens=0,
            cost_micro=0,
            ttft_ms=None,
        ),
        entry(request_id="a", key_id=1, created_at=DAY + 1, cost_micro=10, ttft_ms=100.0),
        entry(request_id="b", key_id=1, created_at=DAY - 2, cost_micro=20, ttft_ms=300.0),
        entry(request_id="c", key_id=2, created_at=DAY - 3, status=499, cost_micro=5, ttft_ms=50.0),
        entry(request_id="d", key_id=1, created_at=DAY - 4, model="glm-5.2", cost_micro=7, ttft_ms=200.0),
    ]
    lines = usage_report(rows)
    assert [(line.day, line.key_id, line.model, line.requests, line.errors, line.cost_micro) for line in lines] == [
        ("1970-01-01", 1, "glm-5.2", 1, 0, 7),
        ("1970-01-01", 1, "smollm2-135m", 2, 0, 30),
        ("1970-01-01", 2, "smollm2-135m", 1, 1, 5),
    ]
    both = lines[1]
    assert (both.ttft_p50_ms, both.ttft_p95_ms, both.prompt_tokens, both.cached_tokens) == (100.0, 300.0, 20, 4)
    assert lines[2].error_rate == 1.0
    total = usage_report(rows, group_by="total")
    assert [line.day for line in total] == [None, None, None] and sum(line.cost_micro for line in total) == 42
    document = usage_document(
        total, account_id=1, since=0.0, until=DAY * 2, group_by="total", key_id=None, ledger_charged=42
    )
    assert document["total"]["cost_micro_usd"] == document["ledger"]["charged_micro_usd"] == 42
    csv_lines = as_csv(lines).splitlines()
    assert csv_lines[0].startswith("kind,day,key_id,model,requests,errors,error_rate")
    assert csv_lines[0].endswith(
        ",cost_micro_usd,cost_usd,ttft_p50_ms,ttft_p95_ms,credit_micro_usd,credit_usd,reference"
    )
    assert csv_lines[1].split(",")[:6] == ["requests", "1970-01-01", "1", "glm-5.2", "1", "0"]
    with pytest.raises(ValueError, match="group_by"):
        usage_report(rows, group_by="week")


CREDITS = [
    CreditRecord("credit", 25_000_000, DAY - 10, 1, "welcome"),
    CreditRecord("deposit", 400_000_001, DAY + 10, 9, "deposit 1003-0001 from 5Buyer", "1003-0001", "5Buyer", 10**9),
]


def test_a_usage_report_shows_the_windows_credits_and_deposits_beside_its_charges():
    lines = usage_report([entry(request_id="a", key_id=1, created_at=DAY - 1, cost_micro=42)])
    document = usage_document(
        lines, account_id=1, since=0.0, until=DAY * 2, group_by="day", key_id=None, ledger_charged=42, credits=CREDITS
    )
    assert document["ledger"] == {
        "charged_micro_usd": 42,
        "charged_usd": "0.000042",
        "credited_micro_usd": 425_000_001,
        "credited_usd": "425.000001",
        "deposited_micro_usd": 400_000_001,
        "deposited_usd": "400.000001",
    }
    credit, chain = document["credits"]
    assert credit == {
        "kind": "credit",
        "day": "1970-01-01",
        "created_at": DAY - 10,
        "micro_usd": 25_000_000,
        "usd": "25.000000",
        "ledger_id": 1,
        "memo": "welcome",
    }
    assert (chain["kind"], chain["day"], chain["extrinsic_id"], chain["coldkey"], chain["amount_rao"]) == (
        "deposit",
        "1970-01-02",
        "1003-0001",
        "5Buyer",
        10**9,
    )
    rows = list(csv.DictReader(io.StringIO(as_csv(lines, CREDITS))))
    assert [(row["kind"], row["day"], row["cost_micro_usd"], row["credit_micro_usd"]) for row in rows] == [
        ("requests", "1970-01-01", "42", ""),
        ("credit", "1970-01-01", "", "25000000"),
        ("deposit", "1970-01-02", "", "400000001"),
    ]
    assert rows[2]["reference"] == "deposit 1003-0001 from 5Buyer" and rows[2]["credit_usd"] == "400.000001"
    assert credits_table(CREDITS).splitlines() == [
        "credited $425.000001 in the window: 1 deposit(s) $400.000001, 1 credit(s) $25.000000",
        "  1970-01-01  credit   $25.000000  welcome",
        "  1970-01-02  deposit  $400.000001  deposit 1003-0001 from 5Buyer",
    ]
    assert credits_table([]) == "credited $0.000000 in the window: 0 deposit(s) $0.000000, 0 credit(s) $0.000000"


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3), st.integers(0, 10_000), st.booleans()), max_size=40))
def test_a_usage_reports_cost_is_the_sum_of_its_rows_however_grouped(specs):
    rows = [
        entry(
            request_id=f"r{rid}",
            key_id=key + 1,
            cost_micro=cost,
            status=200 if ok else 502,
            created_at=1_000.0 + i * 7_000,
        )
        for i, (rid, key, cost, ok) in enumerate(specs)
    ]
    for group_by in ("day", "total"):
        lines = usage_report(rows, group_by=group_by)
        assert sum(line.cost_micro for line in lines) == sum(row.cost_micro for row in rows)
        assert sum(line.requests for line in lines) == len({row.request_id for row in rows})


def test_a_window_bound_is_unix_seconds_a_date_or_an_iso_time():
    assert parse_time("1700000000", param="since") == 1_700_000_000.0
    assert parse_time("1970-01-02", param="since") == DAY
    assert parse_time("1970-01-02T01:00:00Z", param="since") == DAY + 3_600
    assert parse_time("1970-01-02T01:00:00+01:00", param="since") == DAY
    for bad in ("yesterday", "nan", "inf"):
        with pytest.raises(ValueError, match="since must be"):
            parse_time(bad, param="since")
