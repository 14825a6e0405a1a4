"""admin: dollars parsed exactly, keys shown once, printable results that add up."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway import admin
from engy_node.gateway.admin import MICRO_USD_PER_USD, USD_DECIMALS, AdminError, format_usd, parse_usd
from engy_node.gateway.store import RequestLogEntry, Store


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "gateway.sqlite3", clock=lambda: 1_700_000_000.0) as opened:
        yield opened


def test_the_ledger_counts_six_decimal_places():
    assert USD_DECIMALS == 6 and 10**USD_DECIMALS == MICRO_USD_PER_USD


@pytest.mark.parametrize(
    ("text", "micro"),
    [
        ("25", 25_000_000),
        ("0.50", 500_000),
        ("0.1", 100_000),
        ("$3", 3_000_000),
        (" 7.000001 ", 7_000_001),
        ("0.000001", 1),
        ("123456789012345678901234567890.123456", 123456789012345678901234567890_123456),
    ],
)
def test_dollar_text_becomes_exact_micro_dollars(text, micro):
    assert parse_usd(text) == micro


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("0", "not more than"),
        ("0.000000", "not more than"),
        ("-1", "not a dollar amount"),
        ("1.0000001", "decimal places"),
        ("abc", "not a dollar amount"),
        ("1e3", "not a dollar amount"),
        ("NaN", "not a dollar amount"),
        ("1,000", "not a dollar amount"),
        ("", "not a dollar amount"),
        (".5", "not a dollar amount"),
    ],
)
def test_amounts_the_ledger_cannot_hold_exactly_are_refused_not_rounded(text, reason):
    with pytest.raises(AdminError, match=reason):
        parse_usd(text)


@given(micro=st.integers(min_value=1, max_value=10**15))
def test_formatted_amounts_parse_back_to_the_same_micro_dollars(micro):
    text = format_usd(micro)
    assert re.fullmatch(r"\$\d+\.\d{6}", text)
    assert parse_usd(text) == micro


def test_format_usd_shows_every_micro_dollar():
    assert format_usd(12_345_678) == "$12.345678"
    assert format_usd(0) == "$0.000000"
    assert format_usd(-1) == "-$0.000001"


def test_a_new_buyers_key_is_printed_once_and_works(store):
    text = admin.create_buyer(store, name="acme")
    api_key = re.search(r"API key: (engy-sk-\S+)", text)[1]
    assert "shown once" in text
    assert store.authenticate(api_key).name == "acme"


def test_a_key_is_rotated_by_issuing_another_and_revoking_the_old_one_shown_masked(store):
    account_id, old_key = store.create_buyer("acme")
    issued = admin.issue_key(store, account_id=account_id)
    new_key = re.search(r"(engy-sk-\S+)", issued)[1]
    assert "shown once" in issued and store.authenticate(new_key).account_id == account_id
    revoked = admin.revoke_key(store, api_key=f" {old_key}\n")  # as pasted, or read from standard input
    assert old_key not in revoked and f"engy-sk-…{old_key[-4:]}" in revoked and "next request" in revoked
    assert store.authenticate(old_key) is None and store.authenticate(new_key) is not None
    with pytest.raises(AdminError, match="revoked already, or it is not a key of this gateway") as again:
        admin.revoke_key(store, api_key=old_key)
    assert old_key not in str(again.value)
    with pytest.raises(AdminError, match="buyer keys start with engy-sk-"):
        admin.revoke_key(store, api_key="sk-somewhere-else")


@pytest.mark.parametrize(
    ("key", "masked"),
    [("engy-sk-abcdefghijklmnop", "engy-sk-…mnop"), ("engy-sk-short", "engy-sk-…"), ("x", "…"), ("", "…")],
)
def test_a_masked_key_shows_at_most_its_prefix_and_last_four_characters(key, masked):
    assert admin.mask_key(key) == masked


def test_credit_and_balance_print_exact_amounts(store):
    account_id, _ = store.create_buyer("acme")
    assert admin.credit(store, account_id=account_id, dollars="25") == (
        f"credited $25.000000 to account {account_id}; available $25.000000"
    )
    admin.credit(store, account_id=account_id, dollars="0.50", memo="top-up")
    store.settle(store.hold(account_id, amount=2_000_000, request_id="r1"), cost=1_234_567)
    balance = admin.show_balance(store, account_id=account_id)
    assert "available $24.265433" in balance and "charged   $1.234567" in balance and "credited  $25.500000" in balance


def test_a_bad_credit_changes_nothing(store):
    account_id, _ = store.create_buyer("acme")
    with pytest.raises(AdminError):
        admin.credit(store, account_id=account_id, dollars="0.0000001")
    assert store.balance(account_id).credited == 0


def test_usage_prints_tokens_and_cost(store):
    account_id, _ = store.create_buyer("acme")
    store.log_request(
        RequestLogEntry(
            request_id="r1",
            account_id=account_id,
            miner="key:1",
            model="glm-5.2",
            api="anthropic",
            kind="paid",
            status=200,
            prompt_tokens=1_000,
            completion_tokens=200,
            cached_tokens=400,
            cost_micro=801,
            ttft_ms=None,
            tpot_ms=None,
            created_at=1_700_000_000.0,
        )
    )
    text = admin.show_usage(store, account_id=account_id)
    assert "requests          1" in text and "1000 (400 cached)" in text and "$0.000801" in text
    assert "all retained history" in text
    assert "since 2023-11-14 22:13:20Z" in admin.show_usage(store, account_id=account_id, since=1_700_000_000.0)


def test_a_registered_miners_key_is_printed_once_and_never_listed(store):
    text = admin.register_miner(store, name="rig-1", hotkey="5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY")
    miner_key = re.search(r"miner key: (engy-mk-\S+)", text)[1]
    assert store.authenticate_miner(miner_key).name == "rig-1"
    listing = admin.list_miners(store)
    assert "rig-1" in listing and "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY" in listing
    assert miner_key not in listing and "engy-mk-" not in listing


def test_an_empty_miner_list_says_so(store):
    assert admin.list_miners(store) == "no miners registered"


def test_trust_shows_each_miners_state_reason_and_verdicts(store):
    from engy_node.gateway.store import EligibilityRow, VerdictRecord

    assert admin.show_trust(store, now=1_700_000_100.0) == "no miner has been probed or audited yet"
    store.save_eligibility(
        [
            EligibilityRow(
                miner="key:1",
                model="smollm2-135m",
                state="pulled",
                reason="pulled: cheat verdict on probe p1",
                since=1_700_000_000.0,
                updated_at=1_700_000_000.0,
            )
        ]
    )
    for index, verdict in enumerate(("pass", "cheat")):
        store.record_verdict(
            VerdictRecord(
                request_id=f"p{index}",
                miner="key:1",
                model="smollm2-135m",
                kind="probe",
                verdict=verdict,
                reason="ok",
                verifier="local",
                request_created_at=1_700_000_000.0,
                judged_at=1_700_000_001.0,
            )
        )
    for request_id, reason in (("q", "ok"), ("r", "defect:held-back"), ("s", "recompute:defect:whitespace")):
        store.record_verdict(
            VerdictRecord(
                request_id=request_id,
                miner="key:2",
                model="smollm2-135m",
                kind="paid",
                verdict="pass",
                reason=reason,
                verifier="local",
                request_created_at=1_700_000_000.0,
                judged_at=1_700_000_001.0,
            )
        )
    text = admin.show_trust(store, now=1_700_000_100.0)
    first, second, note = text.splitlines()[1:]
    assert first.startswith("key:1") and " pulled " in first
    assert first.endswith("    1     1     0     0  pulled: cheat verdict on probe p1")
    assert "key:2" in second and "not connected" in second and "    3     0     0     2  " in second
    assert note.startswith("def.: answers that passed but whose text differed")


def test_epochs_lists_what_was_published(store, alice):
    from engy_node.protocol.epoch import build_result_json, encode_payload, sign_epoch

    assert "no epoch published yet" in admin.list_epochs(store)
    result = build_result_json(
        netuid=53, epoch_index=4, settlement_json={"weights": [[alice.ss58_address, 65535]], "rows": []}
    )
    payload = encode_payload(sign_epoch(alice, netuid=53, epoch_index=4, result_json=result))
    store.save_epoch(4, payload, json.loads(payload)["digest"], closed_at=1_700_000_000.0)
    line = admin.list_epochs(store)
    assert line.startswith("epoch 4  closed ") and f"weights {alice.ss58_address}=65535" in line
