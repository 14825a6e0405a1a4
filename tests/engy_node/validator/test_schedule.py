"""When the light loop submits (engy_node.validator.schedule): new epochs at once, the applied
epoch every interval, old epochs never, and every ambiguous case toward submitting."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.config import ValidatorSection
from engy_node.validator.schedule import (
    BLOCK_S,
    MIN_STALL_S,
    PREGATE_FRACTION,
    REASONS,
    RESUBMIT_BLOCKS,
    Decision,
    check_interval,
    decide,
    pregate_skip,
    stall_limit,
)

SN53_WEIGHTS_RATE_LIMIT = 100
"""SN53's on-chain weights_rate_limit; the default interval must clear it."""
SN53_ACTIVITY_CUTOFF = 5000
"""Blocks after which the chain counts a silent validator inactive."""

T0 = 1_700_000_000.0
INTERVAL_S = RESUBMIT_BLOCKS * BLOCK_S


def same_epoch(**overrides: object) -> Decision:
    """`decide` for epoch 7 already applied at block 1000, time T0, unless overridden."""
    arguments: dict = dict(
        epoch_index=7, last_applied=7, current_block=1000, last_submit_block=1000, now=T0, last_submit_ts=T0
    )
    arguments.update(overrides)
    return decide(**arguments)


# ---- the constants and their margins ---------------------------------------------------------


def test_the_default_interval_clears_sn53s_rate_limit_with_room_for_inclusion_lag() -> None:
    assert RESUBMIT_BLOCKS - SN53_WEIGHTS_RATE_LIMIT >= 20
    assert check_interval(RESUBMIT_BLOCKS, SN53_WEIGHTS_RATE_LIMIT) is None


def test_the_default_interval_stays_far_inside_the_activity_cutoff() -> None:
    assert RESUBMIT_BLOCKS * 40 <= SN53_ACTIVITY_CUTOFF


def test_the_pregate_window_ends_before_the_interval_does() -> None:
    assert 0 < PREGATE_FRACTION < 1


def test_the_reason_codes_are_the_documented_stable_set() -> None:
    assert set(REASONS) == {"new-epoch", "replay", "due", "not-due", "chain-behind", "clock-due", "clock-not-due"}


# ---- new epochs and the replay guard ---------------------------------------------------------


def test_a_validator_that_never_applied_an_epoch_submits_at_once() -> None:
    decision = decide(
        epoch_index=0, last_applied=None, current_block=None, last_submit_block=None, now=T0, last_submit_ts=None
    )
    assert decision == Decision(True, "new-epoch", None)


def test_a_newer_epoch_submits_at_once_even_right_after_a_submission() -> None:
    assert same_epoch(epoch_index=8) == Decision(True, "new-epoch", None)


def test_an_older_epoch_is_never_submitted_even_when_a_resubmission_is_due() -> None:
    for current_block in (1000, 1000 + RESUBMIT_BLOCKS, 5, None):
        decision = same_epoch(epoch_index=6, current_block=current_block, now=T0 + 10 * INTERVAL_S)
        assert decision == Decision(False, "replay", None)


@given(
    last_applied=st.integers(min_value=1, max_value=10**9),
    behind=st.integers(min_value=1, max_value=10**9),
    current_block=st.none() | st.integers(min_value=0, max_value=10**9),
    last_submit_block=st.none() | st.integers(min_value=0, max_value=10**9),
    now=st.floats(allow_nan=True, allow_infinity=True),
    last_submit_ts=st.none() | st.floats(allow_nan=True, allow_infinity=True),
)
def test_the_replay_guard_holds_whatever_the_blocks_and_clocks_say(
    last_applied: int,
    behind: int,
    current_block: int | None,
    last_submit_block: int | None,
    now: float,
    last_submit_ts: float | None,
) -> None:
    decision = decide(
        epoch_index=last_applied - behind,
        last_applied=last_applied,
        current_block=current_block,
        last_submit_block=last_submit_block,
        now=now,
        last_submit_ts=last_submit_ts,
    )
    assert decision == Decision(False, "replay", None)


# ---- the block interval ----------------------------------------------------------------------


def test_the_applied_epoch_is_resubmitted_once_the_interval_has_passed() -> None:
    assert same_epoch(current_block=1000 + RESUBMIT_BLOCKS) == Decision(True, "due", None)
    assert same_epoch(current_block=1000 + 10 * RESUBMIT_BLOCKS) == Decision(True, "due", None)


def test_one_block_short_of_the_interval_waits_and_says_how_long() -> None:
    assert same_epoch(current_block=1000 + RESUBMIT_BLOCKS - 1) == Decision(False, "not-due", 1)
    assert same_epoch(current_block=1000) == Decision(False, "not-due", RESUBMIT_BLOCKS)


def test_the_block_number_outranks_the_wall_clock() -> None:
    # The clock says an hour passed, the chain says 10 blocks: not due.
    assert same_epoch(current_block=1010, now=T0 + 3600) == Decision(False, "not-due", RESUBMIT_BLOCKS - 10)
    # The clock says nothing passed, the chain says the interval did: due.
    assert same_epoch(current_block=1000 + RESUBMIT_BLOCKS, now=T0) == Decision(True, "due", None)


def test_a_custom_interval_is_honoured() -> None:
    assert same_epoch(current_block=1010, interval_blocks=10) == Decision(True, "due", None)
    assert same_epoch(current_block=1009, interval_blocks=10) == Decision(False, "not-due", 1)


def test_a_chain_behind_the_recorded_anchor_submits_instead_of_waiting_to_catch_up() -> None:
    # A wiped local chain restarts near block 0: waiting for block 1000 + interval would keep this
    # validator silent for as long as the old chain had run.
    assert same_epoch(current_block=3) == Decision(True, "chain-behind", None)
    assert same_epoch(current_block=999) == Decision(True, "chain-behind", None)


# ---- the wall-clock fallback -----------------------------------------------------------------


@pytest.mark.parametrize("missing", ["current_block", "last_submit_block"])
def test_without_a_block_number_the_clock_decides(missing: str) -> None:
    assert same_epoch(**{missing: None}, now=T0 + INTERVAL_S) == Decision(True, "clock-due", None)
    assert same_epoch(**{missing: None}, now=T0 + INTERVAL_S - 1) == Decision(False, "clock-not-due", None)
    assert same_epoch(**{missing: None}, now=T0) == Decision(False, "clock-not-due", None)


def test_a_backward_clock_jump_submits_rather_than_stalling() -> None:
    assert same_epoch(current_block=None, now=T0 - 1) == Decision(True, "clock-due", None)
    assert same_epoch(current_block=None, now=T0 - 86400) == Decision(True, "clock-due", None)


def test_with_neither_a_block_nor_a_timestamp_to_measure_from_it_submits() -> None:
    assert same_epoch(current_block=None, last_submit_ts=None) == Decision(True, "clock-due", None)
    assert same_epoch(last_submit_block=None, last_submit_ts=None) == Decision(True, "clock-due", None)


def test_a_clock_reading_that_is_not_a_number_resolves_toward_submitting() -> None:
    assert same_epoch(current_block=None, now=math.nan) == Decision(True, "clock-due", None)
    assert same_epoch(current_block=None, last_submit_ts=math.inf) == Decision(True, "clock-due", None)


def test_the_clock_fallback_uses_the_given_block_time() -> None:
    assert same_epoch(current_block=None, now=T0 + 10, interval_blocks=5, block_s=2.0).reason == "clock-due"
    assert same_epoch(current_block=None, now=T0 + 9.9, interval_blocks=5, block_s=2.0).reason == "clock-not-due"


# ---- invariants ------------------------------------------------------------------------------

SUBMITTING = {"new-epoch", "due", "chain-behind", "clock-due"}

block_numbers = st.none() | st.integers(min_value=0, max_value=10**9)
epoch_indices = st.integers(min_value=0, max_value=10**6)


@given(
    epoch_index=epoch_indices,
    last_applied=st.none() | epoch_indices,
    current_block=block_numbers,
    last_submit_block=block_numbers,
    now=st.floats(allow_nan=True, allow_infinity=True),
    last_submit_ts=st.none() | st.floats(allow_nan=True, allow_infinity=True),
    interval_blocks=st.integers(min_value=1, max_value=10_000),
    block_s=st.floats(min_value=0.001, max_value=600),
)
def test_every_decision_is_consistent_with_its_reason(
    epoch_index: int,
    last_applied: int | None,
    current_block: int | None,
    last_submit_block: int | None,
    now: float,
    last_submit_ts: float | None,
    interval_blocks: int,
    block_s: float,
) -> None:
    decision = decide(
        epoch_index=epoch_index,
        last_applied=last_applied,
        current_block=current_block,
        last_submit_block=last_submit_block,
        now=now,
        last_submit_ts=last_submit_ts,
        interval_blocks=interval_blocks,
        block_s=block_s,
    )
    assert decision.reason in REASONS
    assert decision.submit == (decision.reason in SUBMITTING)
    if decision.reason == "not-due":
        assert decision.blocks_left is not None and 1 <= decision.blocks_left <= interval_blocks
    else:
        assert decision.blocks_left is None


@pytest.mark.parametrize("interval_blocks", [0, -1])
def test_an_interval_below_one_block_is_refused(interval_blocks: int) -> None:
    with pytest.raises(ValueError, match="interval_blocks"):
        same_epoch(interval_blocks=interval_blocks)
    with pytest.raises(ValueError, match="interval_blocks"):
        pregate_skip(now=T0, last_submit_ts=T0, interval_blocks=interval_blocks, block_s=BLOCK_S)


@pytest.mark.parametrize("block_s", [0.0, -12.0, math.nan, math.inf])
def test_a_block_time_that_is_not_a_positive_number_is_refused(block_s: float) -> None:
    with pytest.raises(ValueError, match="block_s"):
        same_epoch(block_s=block_s)
    with pytest.raises(ValueError, match="block_s"):
        pregate_skip(now=T0, last_submit_ts=T0, interval_blocks=RESUBMIT_BLOCKS, block_s=block_s)


# ---- the pre-gate ----------------------------------------------------------------------------


def test_the_pregate_skips_right_after_a_submission_and_says_how_long_until_due() -> None:
    assert pregate_skip(now=T0, last_submit_ts=T0) == INTERVAL_S
    assert pregate_skip(now=T0 + 60, last_submit_ts=T0) == INTERVAL_S - 60


def test_the_pregate_opens_the_chain_from_its_fraction_of_the_interval_on() -> None:
    window_end = INTERVAL_S * PREGATE_FRACTION
    assert pregate_skip(now=T0 + window_end - 0.5, last_submit_ts=T0) == pytest.approx(INTERVAL_S - window_end + 0.5)
    assert pregate_skip(now=T0 + window_end, last_submit_ts=T0) is None
    assert pregate_skip(now=T0 + INTERVAL_S, last_submit_ts=T0) is None


def test_the_pregate_never_skips_without_a_timestamp_or_after_a_backward_clock_jump() -> None:
    assert pregate_skip(now=T0, last_submit_ts=None) is None
    assert pregate_skip(now=T0 - 1, last_submit_ts=T0) is None
    assert pregate_skip(now=math.nan, last_submit_ts=T0) is None


def test_the_pregate_uses_the_given_interval_and_block_time() -> None:
    assert pregate_skip(now=T0 + 7, last_submit_ts=T0, interval_blocks=5, block_s=2.0) == 3
    assert pregate_skip(now=T0 + 8, last_submit_ts=T0, interval_blocks=5, block_s=2.0) is None


@given(
    data=st.data(),
    interval_blocks=st.integers(min_value=1, max_value=10_000),
    block_s=st.floats(min_value=0.01, max_value=120),
    last_submit_ts=st.floats(min_value=0, max_value=4e9),
    elapsed=st.floats(min_value=-1e6, max_value=1e7),
    last_submit_block=block_numbers,
    block_known=st.booleans(),
)
def test_the_pregate_never_skips_a_tick_decide_would_submit_on(
    data: st.DataObject,
    interval_blocks: int,
    block_s: float,
    last_submit_ts: float,
    elapsed: float,
    last_submit_block: int | None,
    block_known: bool,
) -> None:
    now = last_submit_ts + elapsed
    current_block = None
    if block_known and last_submit_block is not None:
        # Blocks advance no faster than block_s, and never backwards.
        most = max(0, math.floor((now - last_submit_ts) / block_s))
        current_block = last_submit_block + data.draw(st.integers(min_value=0, max_value=most))
    skip = pregate_skip(now=now, last_submit_ts=last_submit_ts, interval_blocks=interval_blocks, block_s=block_s)
    decision = decide(
        epoch_index=3,
        last_applied=3,
        current_block=current_block,
        last_submit_block=last_submit_block,
        now=now,
        last_submit_ts=last_submit_ts,
        interval_blocks=interval_blocks,
        block_s=block_s,
    )
    if skip is not None:
        assert not decision.submit
        assert 0 < skip <= interval_blocks * block_s


# ---- the watchdog limit and the interval check -----------------------------------------------


def test_the_stall_limit_is_three_polls_but_never_under_fifteen_minutes() -> None:
    assert MIN_STALL_S == 900
    assert stall_limit(300) == 900.0
    assert stall_limit(60) == 900.0
    assert stall_limit(301) == 903.0
    assert stall_limit(1200) == 3600.0
    assert isinstance(stall_limit(300), float)


@pytest.mark.parametrize(("interval_blocks", "rate_limit"), [(100, 100), (99, 100), (1, 360)])
def test_an_interval_that_does_not_clear_the_rate_limit_is_warned_about(interval_blocks: int, rate_limit: int) -> None:
    warning = check_interval(interval_blocks, rate_limit)
    assert warning is not None
    assert f"{interval_blocks} blocks" in warning and f"{rate_limit} blocks" in warning
    assert "\n" not in warning


@pytest.mark.parametrize(("interval_blocks", "rate_limit"), [(101, 100), (120, 100), (1, 0)])
def test_an_interval_above_the_rate_limit_passes(interval_blocks: int, rate_limit: int) -> None:
    assert check_interval(interval_blocks, rate_limit) is None


def test_the_configs_default_interval_is_the_schedules():
    # The TUI explains the default from the config (it never imports the validator role).
    assert ValidatorSection().resubmit_blocks == RESUBMIT_BLOCKS
