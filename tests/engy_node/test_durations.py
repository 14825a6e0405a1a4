"""The one duration wording: its examples at each unit's edge, and on any span hypothesis draws,
a text that never reads longer than the span nor shorter by a whole unit of its last part, in
units that only grow with the span."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.durations import DAY_S, HOUR_S, MINUTE_S, duration_text

UNIT_S = {"s": 1, "min": MINUTE_S, "h": HOUR_S, "d": DAY_S}
SHAPES = {("s",), ("min",), ("h", "min"), ("d", "h")}
SPANS = st.floats(min_value=-1e9, max_value=1e10, allow_nan=False)


def parts(text: str) -> list[tuple[int, str]]:
    found = re.fullmatch(r"(\d+) (s|min|h|d)(?: (\d+) (min|h))?", text)
    assert found is not None, text
    values = [(int(found[1]), found[2])]
    if found[3] is not None:
        values.append((int(found[3]), found[4]))
    return values


def read_back(text: str) -> int:
    return sum(value * UNIT_S[unit] for value, unit in parts(text))


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-5, "0 s"),
        (0, "0 s"),
        (41.9, "41 s"),
        (119, "119 s"),
        (120, "2 min"),
        (7199, "119 min"),
        (7200, "2 h 0 min"),
        (3 * HOUR_S + 5 * MINUTE_S + 59, "3 h 5 min"),
        (2 * DAY_S - 1, "47 h 59 min"),
        (2 * DAY_S + 4 * HOUR_S + 59, "2 d 4 h"),
    ],
)
def test_durations_read_at_a_glance(seconds, text):
    assert duration_text(seconds) == text


@pytest.mark.parametrize("seconds", [math.nan, math.inf, -math.inf])
def test_a_span_that_is_not_a_number_is_refused(seconds):
    with pytest.raises(ValueError, match="finite number of seconds"):
        duration_text(seconds)


@given(SPANS)
def test_the_text_floors_the_span_in_at_most_two_units(seconds):
    shown = parts(duration_text(seconds))
    assert tuple(unit for _, unit in shown) in SHAPES
    if len(shown) == 2:
        (_, big), (small_value, small) = shown
        assert small_value < UNIT_S[big] // UNIT_S[small]  # `2 h 60 min` would be `3 h 0 min`
    last_unit = UNIT_S[shown[-1][1]]
    whole = max(0, int(seconds))
    assert read_back(duration_text(seconds)) <= whole < read_back(duration_text(seconds)) + last_unit


@given(SPANS, SPANS)
def test_a_longer_span_never_reads_shorter(a, b):
    shorter, longer = sorted((a, b))
    assert read_back(duration_text(shorter)) <= read_back(duration_text(longer))
    assert UNIT_S[parts(duration_text(shorter))[0][1]] <= UNIT_S[parts(duration_text(longer))[0][1]]
