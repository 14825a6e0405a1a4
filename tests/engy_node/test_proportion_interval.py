"""The 95 % intervals docs/verification.md publishes (`calibration.proportion_interval`, exact
Clopper-Pearson): known values, and the properties any such interval must have."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.calibration import proportion_interval


@pytest.mark.parametrize(
    ("successes", "trials", "low", "high"),
    [
        (0, 1000, 0.0, 1 - 0.025 ** (1 / 1000)),  # closed form at 0 of n
        (1000, 1000, 0.025 ** (1 / 1000), 1.0),
        (46, 99, 0.3638, 0.5677),  # the figure for the old rank rule
        (5, 15, 0.1182, 0.6162),
        (1, 1, 0.025, 1.0),
    ],
)
def test_known_intervals(successes, trials, low, high):
    got = proportion_interval(successes, trials)
    assert got == pytest.approx((low, high), abs=1e-4)


@given(trials=st.integers(1, 400), data=st.data())
def test_the_interval_holds_the_observed_rate_and_widens_with_confidence(trials, data):
    successes = data.draw(st.integers(0, trials))
    low, high = proportion_interval(successes, trials)
    assert 0.0 <= low <= successes / trials <= high <= 1.0
    wide_low, wide_high = proportion_interval(successes, trials, confidence=0.99)
    assert wide_low <= low + 1e-12 and high <= wide_high + 1e-12


@given(trials=st.integers(2, 400), data=st.data())
def test_more_successes_move_the_interval_up(trials, data):
    successes = data.draw(st.integers(0, trials - 1))
    lower, upper = proportion_interval(successes, trials), proportion_interval(successes + 1, trials)
    assert lower[0] <= upper[0] and lower[1] <= upper[1]
    assert not math.isclose(lower[1], upper[1])


@pytest.mark.parametrize(("successes", "trials"), [(-1, 10), (11, 10), (0, 0)])
def test_impossible_counts_are_refused(successes, trials):
    with pytest.raises(ValueError):
        proportion_interval(successes, trials)
