"""The validator and chain panels: every line as plain functions over the hub's states as
`engy_node.snapshots` decodes them (with Hypothesis throwing arbitrary JSON at the decoder and
them), both widgets under Pilot in a tiny host app, and SVG snapshots of realistic states.

The states are written in their wire form, with the exact keys their producers publish:
`engy_node.validator.light` and `role` for "validator", `engy_node.local.up._chain_snapshot` for
"chain", `_node_info`'s `hotkeys` for the names; `validator_of` and `chain_of` decode them
strictly, which also checks them against the schema. Pilot tests are plain functions driving the app with `asyncio.run`, as in
`test_app.py` (pytest-trio claims `async def` tests). Clock times are shown in local time, so
the tests that look at them run with TZ=UTC.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hashlib
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from textual.app import App, ComposeResult
from textual.widgets import Static

from engy_node.protocol.gates import GateTerms, explain_rows
from engy_node.snapshots import ChainState, ValidatorState, decode_states
from engy_tui.widgets.cells import Cell, format_age, format_duration, short_hotkey
from engy_tui.widgets.validator import ChainPanel, ValidatorPanel
from engy_tui.widgets.validator.chain import (
    NEURON_COLUMNS,
    chain_summary_line,
    chain_view,
    chain_weight_lines,
    miner_lines,
    neuron_rows,
)
from engy_tui.widgets.validator.common import BAR_WIDTH, lines_content, share_bar
from engy_tui.widgets.validator.findings import Finding, refusal_fix, validator_warnings, warning_lines
from engy_tui.widgets.validator.next_action import next_action_lines
from engy_tui.widgets.validator.submissions import submission_lines
from engy_tui.widgets.validator.view import validator_view
from engy_tui.widgets.validator.weights import weights_lines, weights_rows

NOW = 1_780_000_000.0
ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def ss58(seed: str) -> str:
    """A deterministic ss58-shaped address (48 base58 characters starting with 5)."""
    digest = hashlib.sha256(seed.encode()).digest() * 2
    return "5" + "".join(ALPHABET[byte % len(ALPHABET)] for byte in digest[:47])


NAMES = {name: ss58(name) for name in ("owner", "master", "validator", "verifier", "miner-1", "miner-2")}
STRANGER = ss58("deregistered")
MINERS = [ss58(f"finney-miner-{i}") for i in range(14)]
FINNEY_WEIGHTS = [21_804, 19_112, 6_211, 4_950, 3_802, 2_770, 2_101, 1_650, 1_203, 870, 544, 312, 120, 41]
DIGEST = "9f2c" + "0123456789abcdef" * 3 + "7a5d40e1"


def validator_of(wire: Any, *, strict: bool = True) -> ValidatorState | None:
    """A "validator" state as the panels get it: decoded (strictly: it must match the schema)."""
    return None if wire is None else decode_states({"validator": wire}, strict=strict).validator


def chain_of(wire: Any, *, strict: bool = True) -> ChainState | None:
    """A "chain" state as the panels get it: decoded (strictly: it must match the schema)."""
    return None if wire is None else decode_states({"chain": wire}, strict=strict).chain


def finney_validator() -> dict[str, Any]:
    """A finney validator 83 blocks after a landed resubmit, 41 s after its last tick."""
    return {
        # role.py
        "hotkey": ss58("finney-validator"),
        "network": "finney",
        "provider": "https://provider.engy.ai",
        "netuid": 53,
        "resubmit_blocks": 120,
        # light._observe
        "block": 4_812_330,
        "block_time_s": 12.0,
        "uid": 3,
        "permit": True,
        "last_update": 4_812_247,
        "weights_rate_limit": 100,
        "activity_cutoff": 5_000,
        "tempo": 360,
        "commit_reveal": False,
        # light._publish_weights
        "submitted_epoch": 210,
        "submitted_block": 4_812_247,
        "digest": DIGEST,
        "dropped": [STRANGER],
        "dropped_share": 0.004,
        "weights": [
            {"uid": uid, "hotkey": hotkey, "weight": weight}
            for uid, hotkey, weight in zip(
                (17, 22, 5, 31, 40, 8, 12, 51, 60, 9, 77, 80, 91, 102), MINERS, FINNEY_WEIGHTS
            )
        ],
        # light._record_submission
        "submissions": [
            {
                "ts": NOW - 996,
                "block": 4_812_247,
                "epoch": 210,
                "kind": "resubmitted",
                "landed": True,
                "detail": "included as 4812248-3",
            },
            {
                "ts": NOW - 2_436,
                "block": 4_812_127,
                "epoch": 210,
                "kind": "resubmit",
                "landed": False,
                "detail": "chain refusal: NotEnoughStakeToSetWeights [not_authorized] the hotkey's stake is below the minimum",
            },
            {
                "ts": NOW - 3_876,
                "block": 4_812_007,
                "epoch": 210,
                "kind": "applied",
                "landed": True,
                "detail": "included as 4812008-2",
            },
        ],
        # light._stamp
        "last_tick": NOW - 41,
        "last_outcome": "skipped:too-soon",
        "last_applied": 210,
        "last_submit_block": 4_812_247,
        "last_submit_ts": NOW - 996,
        "blocks_since_submit": 83,
        "next_resubmit_in_blocks": 37,
    }


def local_chain() -> dict[str, Any]:
    """`_chain_snapshot` of a local network's dev chain after 51 epochs."""

    def neuron(uid, name, stake, permit, last_update, incentive, dividends, emission, active=True):
        return {
            "uid": uid,
            "hotkey": NAMES[name],
            "stake": stake,
            "permit": permit,
            "active": active,
            "last_update": last_update,
            "incentive": incentive,
            "dividends": dividends,
            "emission": emission,
        }

    return {
        "network": "dev chain",
        "netuid": 53,
        "block": 1_540,
        "block_time_s": 1.0,
        "tempo": 30,
        "epochs_run": 51,
        "neurons": [
            neuron(0, "owner", 0.0, True, 0, 0.0, 0.0, 0.0, active=False),
            neuron(1, "validator", 1000.0, True, 1_532, 0.0, 1.0, 15.0),
            neuron(2, "miner-1", 0.0, False, 3, 0.6123, 0.0, 9.1845),
            neuron(3, "miner-2", 0.0, False, 3, 0.3877, 0.0, 5.8155),
        ],
        "weights": {"1": {"2": 65_535, "3": 41_496}},
    }


def local_validator() -> dict[str, Any]:
    """The local network's validator, healthy: it resubmitted 8 blocks ago."""
    return {
        "hotkey": NAMES["validator"],
        "network": "dev chain",
        "provider": "http://127.0.0.1:8090",
        "netuid": 53,
        "resubmit_blocks": 12,
        "block": 1_532,
        "block_time_s": 1.0,
        "uid": 1,
        "permit": True,
        "last_update": 1_520,
        "weights_rate_limit": 10,
        "activity_cutoff": 416,
        "tempo": 30,
        "commit_reveal": False,
        "submitted_epoch": 12,
        "submitted_block": 1_532,
        "digest": "ab" * 32,
        "dropped": [],
        "dropped_share": 0.0,
        "weights": [
            {"uid": 2, "hotkey": NAMES["miner-1"], "weight": 65_535},
            {"uid": 3, "hotkey": NAMES["miner-2"], "weight": 41_496},
        ],
        "submissions": [
            {
                "ts": NOW - 8,
                "block": 1_532,
                "epoch": 12,
                "kind": "resubmitted",
                "landed": True,
                "detail": "included as 1533-1",
            }
        ],
        "last_tick": NOW - 3,
        "last_outcome": "skipped:too-soon",
        "last_applied": 12,
        "last_submit_block": 1_532,
        "last_submit_ts": NOW - 8,
        "blocks_since_submit": 3,
        "next_resubmit_in_blocks": 9,
    }


def troubled() -> tuple[dict[str, Any], dict[str, Any]]:
    """(validator, chain) of a local validator that lost its permit, is past the activity cutoff,
    has its last submission refused, an interval equal to the rate limit, and a stalled loop."""
    chain = local_chain()
    chain["neurons"][1].update(permit=False, last_update=1_100, active=False)
    validator = local_validator()
    validator.update(
        permit=False,
        last_update=1_100,
        resubmit_blocks=10,
        last_tick=NOW - 60,
        last_outcome="submit-failed",
        next_resubmit_in_blocks=0,
        blocks_since_submit=432,
        last_submit_block=1_100,
        submissions=[
            {
                "ts": NOW - 65,
                "block": 1_535,
                "epoch": 12,
                "kind": "resubmit",
                "landed": False,
                "detail": "chain refusal: NeuronNoValidatorPermit [not_authorized] the neuron has no validator permit",
            },
            {
                "ts": NOW - 440,
                "block": 1_100,
                "epoch": 12,
                "kind": "resubmitted",
                "landed": True,
                "detail": "included as 1101-1",
            },
        ],
    )
    return validator, chain


def text(line: tuple[Cell, ...]) -> str:
    return "".join(cell.text for cell in line).rstrip()


def texts(lines) -> list[str]:
    return [text(line) for line in lines]


def styles_of(lines) -> set[str]:
    return {cell.style for line in lines for cell in line}


# ---- small formatters -------------------------------------------------------------------------


def test_short_hotkey_prefers_the_local_name_then_shortens():
    names = {NAMES["miner-1"]: "miner-1"}
    assert short_hotkey(NAMES["miner-1"], names) == "miner-1"
    assert short_hotkey(STRANGER) == f"{STRANGER[:4]}…{STRANGER[-4:]}"
    assert short_hotkey("5short") == "5short"
    assert short_hotkey(None) == short_hotkey(17) == short_hotkey("") == "n/a"


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (None, "n/a"),
        (float("nan"), "n/a"),
        (float("inf"), "n/a"),
        (-5, "0 s"),
        (41, "41 s"),
        (119.9, "119 s"),
        (420, "7 min"),
        (3 * 3600 + 300, "3 h 5 min"),
        (2 * 86400 + 4 * 3600, "2 d 4 h"),
    ],
)
def test_format_duration(seconds, shown):
    assert format_duration(seconds) == shown


def test_format_age_is_none_for_what_is_not_a_time():
    assert format_age(NOW, NOW - 41) == "41 s"
    assert format_age(NOW, None) is format_age(NOW, "x") is format_age(NOW, True) is format_age(NOW, 10**400) is None
    assert format_age(float("nan"), NOW) is None


def test_share_bar_uses_eighth_blocks_and_never_hides_a_small_share():
    assert share_bar(1.0) == "█" * BAR_WIDTH
    assert share_bar(0.5) == "█" * (BAR_WIDTH // 2)
    assert share_bar(1 / 160) == "▏"
    assert share_bar(0.0001) == "▏"
    assert share_bar(0.333) == "██████▋"
    assert share_bar(7.0) == "█" * BAR_WIDTH
    assert share_bar(0) == share_bar(None) == share_bar(-1) == share_bar(float("nan")) == ""


# ---- weights on chain -------------------------------------------------------------------------


def test_weights_rows_are_heaviest_first_with_shares_of_the_row():
    validator = local_validator()
    validator["weights"].reverse()
    rows = weights_rows(validator_of(validator), NAMES)
    assert [[cell.text for cell in row[:4]] for row in rows] == [
        ["2", "miner-1", "65,535", "61.2%"],
        ["3", "miner-2", "41,496", "38.8%"],
    ]
    assert rows[0][4].text == share_bar(65_535 / 107_031) and rows[0][4].style == "bar"


def test_weights_rows_say_na_for_missing_parts():
    # Decoding drops the entries that are not objects, and a missing weight takes the schema's
    # default, 0 (the loop always publishes one).
    validator = validator_of({"weights": [{"uid": 4}, {"hotkey": STRANGER, "weight": "x"}, "junk", None]}, strict=False)
    rows = weights_rows(validator)
    assert [[cell.text for cell in row[:4]] for row in rows] == [
        ["4", "n/a", "0", "n/a"],
        ["n/a", short_hotkey(STRANGER), "0", "n/a"],
    ]
    assert all(row[4].text == "" for row in rows)
    assert weights_rows(validator_of({})) == weights_rows(None) == []
    assert weights_rows(validator_of({"weights": "many"}, strict=False)) == []


def test_weights_lines_for_a_finney_validator():
    lines = texts(weights_lines(validator_of(finney_validator())))
    hotkey = ss58("finney-validator")
    assert lines[0] == f"{hotkey[:4]}…{hotkey[-4:]} · uid 3 · permit ✔ · netuid 53 on finney"
    assert lines[1] == "epoch 210 · digest 9f2c01…40e1 · signed by master ✔"
    # No current head without a chain state: the validator's own count at its last tick.
    assert lines[2] == "last submit block 4,812,247 (83 ago) ✔ landed"
    assert lines[3].split() == ["uid", "hotkey", "weight", "share"]
    assert lines[4].startswith("17   " + short_hotkey(MINERS[0]))
    assert lines[4].endswith("21,804  33.3%  ██████▋")
    assert len(lines) == 4 + 12 + 2
    assert lines[-2] == "… 2 more uids (0.2%)"
    assert lines[-1] == "dropped: 1 unregistered hotkey (0.4% of the weight) ⚠"


def test_weights_lines_name_the_local_validator_and_count_blocks_on_the_current_chain():
    lines = texts(weights_lines(validator_of(local_validator()), NAMES, chain=chain_of(local_chain())))
    short = short_hotkey(NAMES["validator"])
    assert lines[0] == f"validator ({short}) · uid 1 · permit ✔ · netuid 53 on dev chain"
    assert lines[2] == "last submit block 1,532 (8 ago) ✔ landed"  # chain head 1,540
    assert lines[-1] == "dropped: none"


def gated_findings() -> list[dict[str, Any]]:
    """The validator's `gated`, as `LightValidator._publish_gated` publishes it for two rows."""
    slow = {"hotkey": ss58("slow-miner"), "model": "smollm2-135m", "gate_reason": "ttft_p99", "ttft_p99_ms": 45_000}
    flaky = {"hotkey": NAMES["miner-2"], "model": "smollm2-135m", "gate_reason": "acceptance"}
    flaky |= {"requests": 200, "ok_2xx": 190, "status_502": 10}
    terms = {"smollm2-135m": GateTerms(30_000, 2_000)}
    return [dataclasses.asdict(f) for f in explain_rows([slow, flaky], terms, epoch=12)]


def test_a_miner_a_gate_zeroed_is_said_where_dropped_none_was():
    validator = {**local_validator(), "gated": gated_findings()}
    lines = texts(weights_lines(validator_of(validator), NAMES, chain=chain_of(local_chain())))
    slow = short_hotkey(ss58("slow-miner"))
    assert lines[-2:] == [
        f"dropped: none · gated to 0 in epoch 12: {slow} smollm2-135m: ttft_p99 45,000 ms > 30,000 ms ⚠",
        "  miner-2 smollm2-135m: acceptance 95.0 % < 99 % ⚠",
    ]
    dropped = {**validator, "dropped": [ss58("gone")], "dropped_share": 0.01}
    lines = texts(weights_lines(validator_of(dropped), NAMES, chain=chain_of(local_chain())))
    assert lines[-3].startswith("dropped: 1 unregistered hotkey")
    assert lines[-2].startswith("gated to 0 in epoch 12: ") and lines[-1].startswith("  miner-2")


def test_weights_lines_say_where_a_vector_came_from():
    validator = local_validator()
    validator["submissions"][0]["kind"] = "standby:burn"
    assert "burn to the subnet owner ⚠ (standby)" in texts(weights_lines(validator_of(validator)))[1]
    validator["submissions"][0]["kind"] = "resubmitted:cached"
    assert "cached vector ⚠ (provider unavailable)" in texts(weights_lines(validator_of(validator)))[1]


def test_weights_lines_before_anything_was_submitted():
    validator = {"hotkey": NAMES["validator"], "block": 10, "uid": None, "permit": None, "netuid": 53}
    lines = weights_lines(validator_of(validator), NAMES)
    assert texts(lines)[0].endswith("· not registered ✘ · permit n/a · netuid 53 on n/a")
    assert texts(lines)[1] == "nothing on chain from this validator yet"
    assert "error" in styles_of(lines)


def test_weights_lines_after_a_restart_know_the_epoch_but_not_the_table():
    validator = {"last_applied": 7, "last_submit_block": 900}
    assert texts(weights_lines(validator_of(validator)))[1:] == [
        "epoch 7 · digest n/a · n/a",
        "last submit block 900 ✔ landed",
        "the weights table appears after this process's first submit",
    ]


# ---- next action ------------------------------------------------------------------------------


def test_next_action_for_a_finney_validator_estimates_the_countdown_from_the_clock():
    lines = texts(next_action_lines(validator_of(finney_validator()), NOW))
    # 37 blocks left at the last tick, 41 s ago at 12 s blocks: 3 blocks since.
    assert lines == [
        "resubmit in ~34 blocks (~6 min) · interval 120 > rate limit 100 ✔",
        "activity cutoff 5,000 blocks: 4,917 to spare ✔",
        "last tick 41 s ago: skipped:too-soon ✔",
        "commit-reveal: off · tempo 360 · 12 s blocks",
        "provider https://provider.engy.ai",
    ]


def test_next_action_counts_exactly_on_the_current_chain():
    lines = texts(next_action_lines(validator_of(local_validator()), NOW, chain=chain_of(local_chain())))
    assert lines[0] == "resubmit in 4 blocks (~4 s) · interval 12 > rate limit 10 ✔"  # 1,532 + 12 - 1,540
    assert lines[1] == "activity cutoff 416 blocks: 408 to spare ✔"  # the chain's last_update 1,532


def test_next_action_when_due_overdue_or_not_yet_started():
    validator = local_validator()
    chain = local_chain()
    chain["block"] = 1_544
    assert texts(next_action_lines(validator_of(validator), NOW, chain=chain_of(chain)))[0].startswith(
        "resubmit due: the next tick submits · "
    )
    chain["block"] = 1_550
    assert texts(next_action_lines(validator_of(validator), NOW, chain=chain_of(chain)))[0].startswith(
        "resubmit due 6 blocks ago · "
    )
    first = texts(next_action_lines(validator_of({"resubmit_blocks": 12}), NOW))
    assert first[0] == "first submit when the provider publishes an epoch · interval 12 · rate limit n/a"
    assert first[1:] == ["activity cutoff n/a", "last tick n/a", "commit-reveal: n/a · tempo n/a", "provider n/a"]


def test_next_action_flags_the_cutoff_and_the_rate_limit_in_words():
    validator, chain = troubled()
    lines = next_action_lines(validator_of(validator), NOW, chain=chain_of(chain))
    shown = texts(lines)
    assert shown[0] == "resubmit due 430 blocks ago · interval 10 ≤ rate limit 10 ⚠"
    assert shown[1] == "activity cutoff 416 blocks: passed 24 blocks ago ✘ inactive"
    assert shown[2] == "last tick 60 s ago: submit-failed ✘"
    chain["neurons"][1]["last_update"] = 1_300  # 240 idle of 416
    assert (
        texts(next_action_lines(validator_of(validator), NOW, chain=chain_of(chain)))[1]
        == "activity cutoff 416 blocks: only 176 to spare ⚠"
    )


def test_next_action_shows_commit_reveal_on():
    assert texts(next_action_lines(validator_of({"commit_reveal": True}), NOW))[3].startswith(
        "commit-reveal: on (weights count after"
    )


# ---- warnings ---------------------------------------------------------------------------------


def test_a_healthy_validator_has_no_warnings():
    assert validator_warnings(validator_of(local_validator()), chain_of(local_chain()), NOW) == []
    assert texts(warning_lines([])) == ["none ✔"]
    assert validator_warnings(validator_of({}), None, NOW) == validator_warnings(None, None, NOW) == []


def test_the_finney_validator_is_warned_about_its_dropped_hotkey():
    (finding,) = validator_warnings(validator_of(finney_validator()), None, NOW)
    assert finding.level == "warning"
    assert finding.text == "1 payload hotkey not registered on chain, 0.4% of the weight, dropped"
    assert "tell the provider" in finding.fix


def test_a_troubled_validator_gets_every_warning_worst_first_each_with_its_fix():
    validator, chain = troubled()
    findings = validator_warnings(validator_of(validator), chain_of(chain), NOW, names=NAMES, poll_s=5)
    assert [f.level for f in findings] == ["error", "error", "error", "warning", "warning"]
    shown = [f.text for f in findings]
    assert shown[0] == "uid 1 has no validator permit: the chain refuses its weights"
    assert shown[1].startswith("440 blocks since this validator's last update, past the activity cutoff of 416")
    assert shown[2].startswith("last submission refused at block 1,535: chain refusal: NeuronNoValidatorPermit")
    assert findings[2].fix == refusal_fix("NeuronNoValidatorPermit")
    assert shown[3] == "resubmit interval 10 blocks does not clear the weights rate limit of 10"
    assert "set validator.resubmit_blocks above 10" in findings[3].fix
    assert shown[4] == "no tick for 60 s (polls every 5 s)"
    assert all(f.fix for f in findings)
    # The refused submission is the tick's failure: not warned about twice.
    assert not any(f.text == "the last tick could not submit" for f in findings)
    lines = texts(warning_lines(findings))
    assert len(lines) == 10
    assert lines[0] == "✘ uid 1 has no validator permit: the chain refuses its weights"
    assert lines[1].startswith("  → stake more on this hotkey")
    assert lines[6].startswith("⚠ resubmit interval")


def test_an_old_tick_counts_in_polls_from_the_argument_the_state_or_the_default():
    validator = {"last_tick": NOW - 600}
    assert validator_warnings(validator_of(validator), None, NOW) == []  # 3 x 300 s default
    assert len(validator_warnings(validator_of(validator), None, NOW, poll_s=60)) == 1
    assert len(validator_warnings(validator_of({**validator, "poll_s": 60}), None, NOW)) == 1


def test_an_unregistered_hotkey_is_found_on_the_chain_or_from_the_validators_read():
    chain = local_chain()
    validator = {"hotkey": STRANGER, "netuid": 53}
    (finding,) = validator_warnings(validator_of(validator), chain_of(chain), NOW)
    assert (
        finding.level == "error" and finding.text == f"hotkey {short_hotkey(STRANGER)} is not registered on netuid 53"
    )
    assert "btcli subnets register --netuid 53" in finding.fix
    (finding,) = validator_warnings(validator_of({"hotkey": STRANGER, "block": 5, "uid": None}), None, NOW)
    assert "not registered" in finding.text
    # Before any chain read nothing is known: no warning.
    assert validator_warnings(validator_of({"hotkey": STRANGER}), None, NOW) == []


def test_the_cutoff_warns_past_half_and_errs_past_it():
    validator = {"activity_cutoff": 5_000, "block": 10_000, "uid": 3, "last_update": 7_400}
    (finding,) = validator_warnings(validator_of(validator), None, NOW)
    assert finding.level == "warning" and "2,400 left before the activity cutoff" in finding.text
    (finding,) = validator_warnings(validator_of({**validator, "last_update": 4_000}), None, NOW)
    assert finding.level == "error"
    # Without last_update the validator's own count since its last submit stands in.
    (finding,) = validator_warnings(validator_of({"activity_cutoff": 5_000, "blocks_since_submit": 3_000}), None, NOW)
    assert finding.level == "warning"


@pytest.mark.parametrize(
    ("outcome", "level", "words"),
    [
        ("fetch-failed", "error", "no cached vector exists"),
        ("rejected:bad-signature", "warning", "rejected (bad-signature)"),
        ("standby:burn", "warning", "burned to the subnet owner"),
        ("chain-failed", "error", "chain read failed"),
        ("error", "error", "raised an error"),
        ("submit-failed", "error", "could not submit"),
    ],
)
def test_a_tick_that_did_not_go_to_plan_is_a_warning(outcome, level, words):
    (finding,) = validator_warnings(validator_of({"last_outcome": outcome}), None, NOW)
    assert finding.level == level and words in finding.text and finding.fix


@pytest.mark.parametrize(
    ("detail", "words"),
    [
        ("chain refusal: NeuronNoValidatorPermit [not_authorized] x", "validator permit"),
        ("chain refusal: NotEnoughStakeToSetWeights", "stake more"),
        ("chain refusal: SettingWeightsTooFast [rate_limited]", "resubmit_blocks"),
        ("transport refusal: Invalid Transaction Custom error: 6", "resubmit_blocks"),
        ("chain refusal: HotKeyNotRegisteredInSubNet", "register"),
        ("transport refusal: RpcConnectionError: closed", "chain endpoint"),
        ("something new", "next interval retries"),
        (None, "next interval retries"),
    ],
)
def test_refusal_fix_names_what_to_do(detail, words):
    assert words in refusal_fix(detail)


# ---- submissions ------------------------------------------------------------------------------


def test_submission_lines_newest_first_with_clock_age_and_outcome(utc):
    lines = submission_lines(validator_of(finney_validator()), NOW)
    shown = texts(lines)
    assert shown[0].split() == [
        "20:10:04",
        "16",
        "min",
        "ago",
        "block",
        "4,812,247",
        "epoch",
        "210",
        "resubmitted",
        "✔",
        "included",
        "as",
        "4812248-3",
    ]
    assert shown[1].endswith(
        "✘ chain refusal: NotEnoughStakeToSetWeights [not_authorized] the hotkey's stake is "
        "below the minimum (not recorded; retried next interval)"
    )
    assert lines[1][-1].style == "error" and lines[0][-1].style == "ok"
    assert len({line.index("block") for line in shown}) == 1  # aligned columns


def test_submission_lines_cap_the_rows_and_say_nothing_was_submitted():
    validator = {"submissions": [{"block": b, "landed": True} for b in range(10)]}
    shown = texts(submission_lines(validator_of(validator), NOW, max_rows=3))
    assert len(shown) == 4 and shown[-1] == "… 7 older"
    assert shown[0].split()[:5] == ["--:--:--", "n/a", "block", "0", "epoch"]
    assert texts(submission_lines(validator_of({}), NOW)) == ["no submissions from this process yet"]


# ---- the chain --------------------------------------------------------------------------------


def test_neuron_rows_name_local_hotkeys_and_show_every_column():
    rows = neuron_rows(chain_of(local_chain()), NAMES)
    assert len(rows[0]) == len(NEURON_COLUMNS)
    assert [cell.text for cell in rows[1]] == [
        "1",
        "validator",
        "1,000.00",
        "✔",
        "1,532 (8 ago)",
        "0.0000",
        "1.0000",
        "15.0000",
    ]
    assert [cell.text for cell in rows[2]][:5] == ["2", "miner-1", "0.00", "—", "3 (1,537 ago)"]
    assert rows[0][4].text == "0 (1,540 ago) ⚠ inactive" and rows[0][4].style == "warning"
    assert neuron_rows(chain_of(local_chain()))[1][1].text == short_hotkey(NAMES["validator"])


def test_neuron_rows_say_na_for_what_is_missing():
    # An ill-typed value decodes as the field's default: None (n/a) for the numbers, False for
    # the permit (the chain state always publishes it).
    chain = chain_of(
        {"neurons": [{"uid": 7, "stake": "lots", "permit": None, "incentive": float("nan")}]}, strict=False
    )
    (row,) = neuron_rows(chain)
    assert [cell.text for cell in row] == ["7", "n/a", "n/a", "—"] + ["n/a"] * 4
    chain = chain_of({"neurons": [{"last_update": 4, "active": True}]})
    assert neuron_rows(chain)[0][4].text == "4"  # no head: no "ago"


def test_chain_weight_lines_show_each_validators_row():
    shown = texts(chain_weight_lines(chain_of(local_chain()), NAMES))
    assert shown[0].split() == ["set", "by", "on", "weight", "share"]
    assert shown[1].split()[:8] == ["uid", "1", "validator", "→", "uid", "2", "miner-1", "65,535"]
    assert "61.2%" in shown[1] and "38.8%" in shown[2]
    assert shown[2].startswith(" ") and "uid 3 miner-2" in shown[2]


def test_chain_weight_lines_sum_up_long_rows_and_empty_ones():
    chain = {"weights": {"10": {str(uid): 100 for uid in range(12)}, "2": {}}}
    shown = texts(chain_weight_lines(chain_of(chain), max_targets=3))
    assert shown[1].split()[:3] == ["uid", "2", "→"] and shown[1].endswith("none")
    assert shown[2].split()[:3] == ["uid", "10", "→"]
    assert shown[5].strip() == "… 9 more uids (75.0%)"
    assert texts(chain_weight_lines(chain_of({"weights": {}}))) == ["no weights on chain yet"]
    assert texts(chain_weight_lines(None)) == ["weights n/a"]


def test_chain_summary_and_view():
    assert text(chain_summary_line(chain_of(local_chain()))) == "block 1,540 · 1 s blocks · tempo 30 · epochs run 51"
    assert (
        text(chain_summary_line(chain_of({})))
        == text(chain_summary_line(None))
        == "block n/a · n/a blocks · tempo n/a · epochs run n/a"
    )
    view = chain_view(chain_of(local_chain()), now=NOW, names=NAMES)
    assert view.title == "Chain · dev chain · netuid 53"
    assert texts(view.neurons)[0].split() == [
        "uid",
        "name",
        "stake",
        "τ",
        "permit",
        "last",
        "update",
        "incentive",
        "dividends",
        "emission",
        "α",
    ]
    assert texts(chain_view(None).neurons) == texts(chain_view(chain_of({})).neurons) == []
    assert texts(chain_view(chain_of({"block": 3})).neurons) == ["no neurons"]


def test_miner_lines_for_the_miner_dashboard():
    shown = texts(miner_lines(chain_of(local_chain()), NAMES["miner-1"]))
    assert shown == [
        "uid 2 · incentive 0.6123 · emission 9.1845 α/epoch",
        "weights from 1/2 validators, newest 8 blocks ago ✔",
    ]
    assert texts(miner_lines(chain_of(local_chain()), STRANGER)) == ["not registered on netuid 53 ✘"]
    assert texts(miner_lines(chain_of({}), STRANGER)) == ["chain state n/a"]
    assert texts(miner_lines(None, STRANGER)) == ["chain state n/a"]


# ---- whole views ------------------------------------------------------------------------------


def test_validator_view_titles_and_worst_level():
    view = validator_view(validator_of(finney_validator()), now=NOW)
    assert view.weights_title == "Weights on chain · epoch 210"
    assert view.warnings_title == "Warnings (1)" and view.worst == "warning"
    assert view.submissions_title == "Submissions (newest first) · 3 kept, 1 refused"
    validator, chain = troubled()
    assert validator_view(validator_of(validator), now=NOW, chain=chain_of(chain), poll_s=5).worst == "error"
    assert validator_view(validator_of(local_validator()), now=NOW, chain=chain_of(local_chain())).worst == "none"
    waiting = validator_view(None, now=NOW)
    assert texts(waiting.weights) == ["waiting for the validator's first report"]
    assert validator_view(validator_of({}), now=NOW) == waiting


def test_nothing_reported_is_never_shown_as_zero():
    validator = {
        "hotkey": NAMES["validator"],
        "submitted_epoch": 3,
        "weights": [{"uid": 2, "hotkey": NAMES["miner-1"], "weight": 2}, {"uid": 3, "weight": 1}],
        "submissions": [{"landed": True}],
    }
    view = validator_view(validator_of(validator), now=NOW, names=NAMES)
    every = " ".join(texts(view.weights) + texts(view.next_action) + texts(view.submissions))
    assert " 0 " not in f" {every} " and "0.0" not in every and "0%" not in every
    assert "n/a" in every


# ---- never raising on arbitrary documents -----------------------------------------------------


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**400), max_value=10**400)
    | st.floats()
    | st.text(max_size=12)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)


def _entries(*keys: str) -> st.SearchStrategy:
    return st.lists(st.fixed_dictionaries({}, optional={key: SCALARS for key in keys}) | JSON, max_size=5) | JSON


VALIDATOR_KEYS = (
    "hotkey",
    "network",
    "provider",
    "netuid",
    "resubmit_blocks",
    "block",
    "block_time_s",
    "uid",
    "permit",
    "last_update",
    "weights_rate_limit",
    "activity_cutoff",
    "tempo",
    "commit_reveal",
    "submitted_epoch",
    "submitted_block",
    "digest",
    "dropped_share",
    "last_tick",
    "last_outcome",
    "last_applied",
    "last_submit_block",
    "last_submit_ts",
    "blocks_since_submit",
    "next_resubmit_in_blocks",
    "poll_s",
)
VALIDATORS = (
    st.fixed_dictionaries(
        {},
        optional={
            **{key: SCALARS | JSON for key in VALIDATOR_KEYS},
            "last_outcome": st.sampled_from(["applied", "submit-failed", "rejected:x", "standby:burn", "?"]) | SCALARS,
            "dropped": st.lists(SCALARS, max_size=3) | JSON,
            "weights": _entries("uid", "hotkey", "weight"),
            "submissions": _entries("ts", "block", "epoch", "kind", "landed", "detail"),
        },
    )
    | JSON
)
UID_KEYS = st.text(max_size=4) | st.integers(min_value=0, max_value=300).map(str)
CHAINS = (
    st.fixed_dictionaries(
        {},
        optional={
            **{key: SCALARS for key in ("network", "netuid", "block", "block_time_s", "tempo", "epochs_run")},
            "neurons": _entries(
                "uid", "hotkey", "stake", "permit", "active", "last_update", "incentive", "dividends", "emission"
            ),
            "weights": st.dictionaries(UID_KEYS, st.dictionaries(UID_KEYS, SCALARS, max_size=10) | JSON, max_size=4)
            | JSON,
        },
    )
    | JSON
    | st.none()
)
NAMES_MAPS = st.dictionaries(st.text(max_size=6), SCALARS, max_size=3) | JSON | st.none()
NOWS = st.floats() | st.just(NOW)


def _shown_anywhere(lines) -> None:
    lines_content(lines)  # builds the Textual content: must not raise either
    for line in lines:
        assert all(isinstance(cell, Cell) and isinstance(cell.text, str) and "\n" not in cell.text for cell in line)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    validator=VALIDATORS,
    chain=CHAINS,
    names=NAMES_MAPS,
    now=NOWS,
    poll_s=st.none() | st.floats(allow_nan=False, allow_infinity=False),
)
def test_the_validator_functions_never_raise(validator, chain, names, now, poll_s):
    original = copy.deepcopy(validator)
    states = decode_states({"validator": validator, "chain": chain, "node": {"hotkeys": names}})
    typed, hotkeys = states.validator, states.node.hotkeys
    view = validator_view(typed, now=now, chain=states.chain, names=hotkeys, poll_s=poll_s)
    for lines in (view.weights, view.next_action, view.warnings, view.submissions):
        _shown_anywhere(lines)
    findings = validator_warnings(typed, states.chain, now, names=hotkeys, poll_s=poll_s)
    assert all(isinstance(f, Finding) and f.fix for f in findings)
    _shown_anywhere(weights_rows(typed, hotkeys))
    _shown_anywhere(next_action_lines(typed, now))
    _shown_anywhere(submission_lines(typed, now, max_rows=2))
    assert validator == original or validator != validator  # never mutated (nan compares unequal)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chain=CHAINS, names=NAMES_MAPS, hotkey=st.none() | st.text(max_size=4) | st.sampled_from(list(NAMES.values())))
def test_the_chain_functions_never_raise(chain, names, hotkey):
    states = decode_states({"chain": chain, "node": {"hotkeys": names}})
    typed, hotkeys = states.chain, states.node.hotkeys
    view = chain_view(typed, now=NOW, names=hotkeys)
    for lines in ((view.summary,), view.neurons, view.weights):
        _shown_anywhere(lines)
    _shown_anywhere([chain_summary_line(typed)])
    _shown_anywhere(neuron_rows(typed, hotkeys))
    _shown_anywhere(chain_weight_lines(typed, hotkeys, max_targets=2))
    _shown_anywhere(miner_lines(typed, hotkey))


# ---- the widgets under Pilot ------------------------------------------------------------------


def outage(*, cached: bool) -> dict[str, Any]:
    """A validator whose chain and provider are both down, as `light` publishes it: with no
    cached vector (a first start in the outage) or with one (epoch 12 landed before)."""
    state: dict[str, Any] = {
        "hotkey": NAMES["validator"],
        "network": "ws://10.0.0.7:9944",
        "provider": "https://provider.engy.ai",
        "netuid": 53,
        "resubmit_blocks": 120,
        "poll_s": 300.0,
        "chain_error": "RpcConnectionError: could not connect to any endpoint: [Errno 111] Connect call failed",
        "provider_error": "https://provider.engy.ai/api/subnet/v1/epoch/latest: ConnectError: [Errno -2] Name or "
        "service not known",
        "cached_vector": cached,
        "last_tick": NOW - 20,
        "last_outcome": "chain-failed" if cached else "fetch-failed",
    }
    return {**state, "last_applied": 12, "last_submit_block": 1_500} if cached else state


def test_an_outage_of_chain_and_provider_shows_both_and_says_no_cache_exists():
    findings = validator_warnings(validator_of(outage(cached=False)), None, NOW)
    assert [f.level for f in findings] == ["error", "error"]
    assert findings[0].text.startswith("chain unreachable: RpcConnectionError: could not connect")
    assert "validator.network" in findings[0].fix
    assert findings[1].text.startswith("the provider gave no usable payload: https://provider.engy.ai/api/")
    assert findings[1].text.endswith("no cached vector exists, so nothing is submitted")
    assert "validator.provider_url" in findings[1].fix
    shown = " ".join(f.text + f.fix for f in findings)
    assert "resubmitted" not in shown  # nothing is: no cache


def test_an_outage_with_a_cache_says_which_vector_stands_in_and_when():
    findings = validator_warnings(validator_of(outage(cached=True)), None, NOW)
    assert [f.level for f in findings] == ["error", "warning"]
    assert findings[0].text.startswith("chain unreachable:")
    assert findings[1].fix.endswith("the cached epoch 12 vector is resubmitted once the chain answers")
    # The tick's outcome is not warned about again.
    assert not any("last chain read failed" in f.text for f in findings)
    up = {**outage(cached=True), "chain_error": None, "last_outcome": "resubmitted:cached"}
    (finding,) = validator_warnings(validator_of(up), None, NOW)
    assert finding.fix.endswith("the cached epoch 12 vector is resubmitted every resubmit interval")
    # A provider with no epoch yet is a quiet wait, and a node that does not say shows no guess.
    assert validator_warnings(validator_of({**up, "last_outcome": "no-epoch-yet"}), None, NOW) == []
    (finding,) = validator_warnings(validator_of({**up, "cached_vector": None}), None, NOW)
    assert "cached" not in finding.fix


class Host(App[None]):
    """One widget on a screen, fed one state after mounting (as the render timer would)."""

    def __init__(self, widget, state, **kwargs) -> None:
        super().__init__()
        self.widget, self.state, self.kwargs = widget, state, kwargs

    def compose(self) -> ComposeResult:
        yield self.widget

    def feed(self) -> None:
        self.widget.update_state(self.state, now=NOW, **self.kwargs)


def static_text(app: App, widget_id: str) -> str:
    return str(app.query_one(f"#{widget_id}", Static).content)


def test_validator_panel_shows_the_state_it_is_given(utc):
    async def scenario() -> None:
        validator, chain = troubled()
        app = Host(ValidatorPanel(poll_s=5), validator_of(validator), names=NAMES, chain=chain_of(chain))
        async with app.run_test(size=(160, 40)) as pilot:
            assert static_text(app, "validator-weights") == "waiting for the validator's first report"
            app.feed()
            await pilot.pause()
            weights = app.query_one("#validator-weights", Static)
            assert weights.border_title == "Weights on chain · epoch 12"
            assert "validator (" in static_text(app, "validator-weights")
            assert "no permit ✘" in static_text(app, "validator-weights")
            assert "passed 24 blocks ago ✘ inactive" in static_text(app, "validator-next")
            warnings = app.query_one("#validator-warnings", Static)
            assert warnings.border_title == "Warnings (5)" and warnings.has_class("-error")
            assert "NeuronNoValidatorPermit" in static_text(app, "validator-submissions")
            # Healthy again: the warnings box says so, in words and without the error border.
            app.state, app.kwargs["chain"] = validator_of(local_validator()), chain_of(local_chain())
            app.feed()
            await pilot.pause()
            assert static_text(app, "validator-warnings") == "none ✔"
            assert not warnings.has_class("-error") and not warnings.has_class("-warning")

    asyncio.run(scenario())


def test_validator_panel_shows_an_outage_of_chain_and_provider():
    async def scenario() -> None:
        app = Host(ValidatorPanel(), validator_of(outage(cached=False)), names=NAMES)
        async with app.run_test(size=(160, 40)) as pilot:
            app.feed()
            await pilot.pause()
            warnings = app.query_one("#validator-warnings", Static)
            assert warnings.border_title == "Warnings (2)" and warnings.has_class("-error")
            shown = static_text(app, "validator-warnings")
            assert "✘ chain unreachable: RpcConnectionError" in shown
            assert "no cached vector exists, so nothing is submitted" in shown
            assert "resubmitted" not in shown

    asyncio.run(scenario())


def test_validator_panel_skips_the_repaint_when_nothing_changed():
    async def scenario() -> None:
        app = Host(ValidatorPanel(), validator_of(local_validator()), chain=chain_of(local_chain()))
        async with app.run_test(size=(160, 40)) as pilot:
            app.feed()
            await pilot.pause()
            box = app.query_one("#validator-next", Static)
            calls = []
            original = box.update
            box.update = lambda content: (calls.append(content), original(content))  # type: ignore[method-assign]
            app.feed()
            assert calls == []
            app.widget.update_state(app.state, now=NOW + 5, chain=chain_of(local_chain()))
            assert len(calls) == 1  # the tick is older: "last tick 8 s ago"

    asyncio.run(scenario())


def test_chain_panel_shows_neurons_and_weights():
    async def scenario() -> None:
        app = Host(ChainPanel(), chain_of(local_chain()), names=NAMES)
        async with app.run_test(size=(120, 20)) as pilot:
            assert static_text(app, "chain-summary") == "waiting for the chain's first report"
            app.feed()
            await pilot.pause()
            assert app.widget.border_title == "Chain · dev chain · netuid 53"
            neurons = static_text(app, "chain-neurons")
            assert "miner-2" in neurons and "1,000.00" in neurons and "⚠ inactive" in neurons
            assert "uid 1 validator" in static_text(app, "chain-weights")

    asyncio.run(scenario())


# ---- snapshots --------------------------------------------------------------------------------


def test_validator_panel_snapshot(snap_compare, utc):
    app = Host(ValidatorPanel(), validator_of(finney_validator()))
    assert snap_compare(app, terminal_size=(160, 34), run_before=lambda pilot: app.feed())


def test_troubled_validator_panel_snapshot(snap_compare, utc):
    validator, chain = troubled()
    app = Host(ValidatorPanel(poll_s=5), validator_of(validator), names=NAMES, chain=chain_of(chain))
    assert snap_compare(app, terminal_size=(160, 30), run_before=lambda pilot: app.feed())


def test_outage_validator_panel_snapshot(snap_compare, utc):
    app = Host(ValidatorPanel(), validator_of(outage(cached=False)), names=NAMES)
    assert snap_compare(app, terminal_size=(160, 30), run_before=lambda pilot: app.feed())


def test_chain_panel_snapshot(snap_compare):
    app = Host(ChainPanel(), chain_of(local_chain()), names=NAMES)
    assert snap_compare(app, terminal_size=(110, 14), run_before=lambda pilot: app.feed())
