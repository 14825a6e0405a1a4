"""retry.backoff_delay: monotone, capped, jitter bounded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.retry import JITTER_SPREAD, backoff_delay

failures = st.integers(min_value=0, max_value=10_000)
jitters = st.floats(min_value=0, max_value=1, exclude_max=True)
bases = st.floats(min_value=1e-3, max_value=10)


@given(n=failures, jitter=jitters, base=bases, extra=st.floats(min_value=0, max_value=1000))
def test_the_backoff_never_shrinks_as_failures_accumulate(n, jitter, base, extra):
    cap = base + extra
    assert backoff_delay(consecutive_failures=n, jitter=jitter, base_s=base, cap_s=cap) <= backoff_delay(
        consecutive_failures=n + 1, jitter=jitter, base_s=base, cap_s=cap
    )


@given(n=failures.filter(lambda n: n > 0), jitter=jitters, base=bases, extra=st.floats(min_value=0, max_value=1000))
def test_the_backoff_is_capped_and_jitter_removes_at_most_its_spread(n, jitter, base, extra):
    cap = base + extra
    delay = backoff_delay(consecutive_failures=n, jitter=jitter, base_s=base, cap_s=cap)
    undithered = min(cap, base * 2.0 ** min(n - 1, 62))
    assert undithered * (1 - JITTER_SPREAD) <= delay <= undithered <= cap


def test_the_default_backoff_doubles_to_a_minute_and_no_failure_waits_nothing():
    delays = [backoff_delay(consecutive_failures=n, jitter=0.0) for n in range(9)]
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"consecutive_failures": -1, "jitter": 0.0},
        {"consecutive_failures": 1, "jitter": 1.0},
        {"consecutive_failures": 1, "jitter": -0.1},
        {"consecutive_failures": 1, "jitter": 0.0, "base_s": 0.0},
        {"consecutive_failures": 1, "jitter": 0.0, "base_s": 5.0, "cap_s": 1.0},
    ],
)
def test_nonsense_backoff_inputs_are_refused(kwargs):
    with pytest.raises(ValueError):
        backoff_delay(**kwargs)
