"""The orphan sweep's decision: by how long it has seen a hold open, never by the hold's timestamp."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway.billing.orphans import sweep


def test_a_hold_is_released_only_after_being_seen_open_past_the_limit():
    release, seen = sweep({}, [1, 2], now=100.0, max_age_s=50.0)
    assert release == [] and seen == {1: 100.0, 2: 100.0}
    release, seen = sweep(seen, [1, 2, 3], now=150.0, max_age_s=50.0)
    assert release == [] and seen == {1: 100.0, 2: 100.0, 3: 150.0}
    release, seen = sweep(seen, [2, 3], now=150.5, max_age_s=50.0)
    assert release == [2] and seen == {3: 150.0}, "hold 1 closed meanwhile: forgotten, never released"


@given(st.lists(st.tuples(st.floats(0, 1000), st.sets(st.integers(0, 20), max_size=8)), max_size=30))
def test_nothing_is_released_before_it_was_seen_open_for_the_whole_limit(rounds):
    seen: dict[int, float] = {}
    opened_at: dict[int, float] = {}
    now = 0.0
    for step, open_now in rounds:
        now += step
        opened_at = {hold: opened_at.get(hold, now) for hold in open_now}
        release, seen = sweep(seen, open_now, now=now, max_age_s=300.0)
        for hold in release:
            assert now - opened_at[hold] > 300.0
            del opened_at[hold]
        assert set(seen) == set(open_now) - set(release)
