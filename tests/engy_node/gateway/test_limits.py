"""gateway.limits: the pure decisions behind per-key limits (windows, admission, give-back,
headers), exhaustively with hypothesis."""

from __future__ import annotations

import datetime

from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway import limits
from engy_node.gateway.limits import Admission, Counters, Limits, Refusal, admit, settle, windows

NOW = st.floats(min_value=0, max_value=4_000_000_000, allow_nan=False)
OPTIONAL = st.one_of(st.none(), st.integers(0, 50))
LIMITS = st.builds(Limits, OPTIONAL, st.one_of(st.none(), st.integers(0, 5_000)), OPTIONAL, OPTIONAL, OPTIONAL)


@given(NOW)
def test_each_window_holds_the_moment_and_ends_within_its_length(now):
    w = windows(now)
    assert 0 < w.minute_reset_s <= 60 and 0 < w.day_reset_s <= 86_400 and 0 < w.month_reset_s <= 31 * 86_400
    at = datetime.datetime.fromtimestamp(now, datetime.UTC)
    assert w.month == at.year * 12 + at.month - 1
    end = datetime.datetime.fromtimestamp(now + w.month_reset_s, datetime.UTC)
    assert end.day == 1 and end.time() == datetime.time(0) and w.month_reset_s >= w.day_reset_s


@given(NOW, st.floats(min_value=0, max_value=10_000_000))
def test_later_moments_are_in_the_same_or_later_windows(now, later):
    a, b = windows(now), windows(now + later)
    assert (a.minute, a.day, a.month) <= (b.minute, b.day, b.month)


@given(LIMITS, NOW, st.lists(st.tuples(st.booleans(), st.integers(0, 400), st.integers(0, 30)), max_size=60))
def test_no_sequence_of_requests_and_closures_at_one_moment_passes_a_limit(lim, now, steps):
    """Requests (True) and closures of the oldest open one (False), each with tokens and µUSD."""
    counters = Counters()
    open_holds: list[tuple[int, int]] = []
    held_at = windows(now)
    for is_request, tokens, micro in steps:
        if is_request:
            decision = admit(lim, counters, now, tokens=tokens, micro=micro)
            if isinstance(decision, Admission):
                counters = decision.counters
                open_holds.append((tokens, micro))
            else:
                assert decision.retry_after_s >= 1
        elif open_holds:
            tokens_held, micro_held = open_holds.pop(0)
            counters = settle(counters, held_at, unused_tokens=tokens_held // 2, unused_micro=micro_held // 3)
        c = counters
        assert lim.concurrent is None or c.in_flight <= lim.concurrent
        assert lim.rpm is None or c.minute_requests <= lim.rpm
        assert lim.tpm is None or c.minute_tokens <= lim.tpm
        assert lim.daily_micro is None or c.day_micro <= lim.daily_micro
        assert lim.monthly_micro is None or c.month_micro <= lim.monthly_micro
        assert c.in_flight == len(open_holds)


@given(LIMITS, NOW, st.integers(0, 400), st.integers(0, 30))
def test_a_request_is_admitted_exactly_when_it_fits_every_limit(lim, now, tokens, micro):
    decision = admit(lim, Counters(), now, tokens=tokens, micro=micro)
    fits = (
        (lim.concurrent is None or lim.concurrent >= 1)
        and (lim.rpm is None or lim.rpm >= 1)
        and (lim.tpm is None or tokens <= lim.tpm)
        and (lim.daily_micro is None or micro <= lim.daily_micro)
        and (lim.monthly_micro is None or micro <= lim.monthly_micro)
    )
    assert isinstance(decision, Admission) == fits
    if isinstance(decision, Refusal):
        assert "set-limits" in decision.message


@given(NOW, st.integers(1, 10))
def test_a_new_minute_forgets_the_last_ones_requests_but_not_the_days_spend(now, rpm):
    lim = Limits(rpm=rpm, daily_micro=10**9)
    counters = Counters()
    for _ in range(rpm):
        decision = admit(lim, counters, now, tokens=0, micro=5)
        assert isinstance(decision, Admission)
        counters = decision.counters
    refused = admit(lim, counters, now, tokens=0, micro=5)
    assert isinstance(refused, Refusal) and refused.limit == "rpm"
    assert refused.retry_after_s == max(1, -(-windows(now).minute_reset_s // 1))
    next_minute = (windows(now).minute + 1) * 60
    later = admit(lim, counters, next_minute, tokens=0, micro=5)
    assert isinstance(later, Admission)
    if windows(next_minute).day == windows(now).day:
        assert later.counters.day_micro == 5 * (rpm + 1)


def test_a_hold_settled_in_a_later_minute_gives_back_only_to_the_windows_it_was_counted_in():
    lim = Limits(tpm=100, daily_micro=100)
    first = admit(lim, Counters(), 59.0, tokens=50, micro=50)
    assert isinstance(first, Admission)
    second = admit(lim, first.counters, 61.0, tokens=30, micro=10)
    assert isinstance(second, Admission) and second.counters.minute_tokens == 30
    after = settle(second.counters, windows(59.0), unused_tokens=50, unused_micro=20)
    assert after.in_flight == 1 and after.minute_tokens == 30 and after.day_micro == 40


def test_a_key_limited_in_account_defaults_only_takes_them():
    assert Limits(rpm=5).over(Limits(rpm=9, tpm=100)) == Limits(rpm=5, tpm=100)
    assert not Limits().any and Limits(monthly_micro=0).any


def test_the_headers_speak_each_apis_names():
    view = limits.RateView(
        at=0.0,
        limit_requests=10,
        remaining_requests=3,
        reset_requests_s=12.5,
        limit_tokens=1000,
        remaining_tokens=900,
        reset_tokens_s=12.5,
    )
    assert dict(limits.response_headers(view, "openai")) == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "3",
        "x-ratelimit-reset-requests": "13s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "900",
        "x-ratelimit-reset-tokens": "13s",
    }
    assert dict(limits.response_headers(view, "anthropic")) == {
        "anthropic-ratelimit-requests-limit": "10",
        "anthropic-ratelimit-requests-remaining": "3",
        "anthropic-ratelimit-requests-reset": "1970-01-01T00:00:13Z",
        "anthropic-ratelimit-tokens-limit": "1000",
        "anthropic-ratelimit-tokens-remaining": "900",
        "anthropic-ratelimit-tokens-reset": "1970-01-01T00:00:13Z",
    }
    no_tokens = limits.RateView(0.0, 2, 1, 0.0, None, None, 0.0)
    assert [name for name, _ in limits.response_headers(no_tokens, "openai")] == [
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    ]
