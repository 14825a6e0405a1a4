"""The light loop's heartbeat (engy_node.validator.liveness): written every tick without ever
raising, read defensively, and judged against the watchdog's stall limit."""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.validator.liveness import health, read_heartbeat, stalled, write_heartbeat
from engy_node.validator.schedule import stall_limit

T0 = 1_700_000_000.0
POLL_S = 300
"""The default poll: the stall limit is then the 900 s floor."""


# ---- writing ---------------------------------------------------------------------------------


def test_a_heartbeat_carries_the_tick_time_and_its_outcome(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    assert write_heartbeat(path, now=T0, detail={"outcome": "applied", "epoch": 7, "block": 1234}) is None
    assert json.loads(path.read_text()) == {"ts": T0, "outcome": "applied", "epoch": 7, "block": 1234}
    assert read_heartbeat(path) == {"ts": T0, "outcome": "applied", "epoch": 7, "block": 1234}


def test_a_heartbeat_without_detail_is_just_the_time(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    assert write_heartbeat(path, now=T0) is None
    assert json.loads(path.read_text()) == {"ts": T0}


def test_a_ts_in_the_detail_cannot_override_the_tick_time(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    assert write_heartbeat(path, now=T0, detail={"ts": 1.0, "outcome": "skipped:too-soon"}) is None
    assert read_heartbeat(path) == {"ts": T0, "outcome": "skipped:too-soon"}


def test_each_tick_replaces_the_last_one_atomically(tmp_path: Path) -> None:
    path = tmp_path / "run" / "heartbeat.json"
    assert write_heartbeat(path, now=T0, detail={"outcome": "applied"}) is None
    assert write_heartbeat(path, now=T0 + 300) is None
    assert read_heartbeat(path) == {"ts": T0 + 300}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["heartbeat.json"]


def test_a_write_that_cannot_reach_the_disk_returns_the_error_instead_of_raising(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    error = write_heartbeat(blocker / "heartbeat.json", now=T0)
    assert error is not None and "heartbeat not written" in error and "Error" in error


def test_an_unserialisable_detail_returns_the_error_and_keeps_the_last_heartbeat(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    write_heartbeat(path, now=T0)
    error = write_heartbeat(path, now=T0 + 1, detail={"outcome": object()})
    assert error is not None and "TypeError" in error
    error = write_heartbeat(path, now=T0 + 1, detail={"ratio": math.nan})
    assert error is not None and "ValueError" in error
    assert read_heartbeat(path) == {"ts": T0}
    assert [p.name for p in tmp_path.iterdir()] == ["heartbeat.json"]


@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf, True, "1700000000"])
def test_a_tick_time_that_is_not_a_finite_number_is_not_written(tmp_path: Path, now: object) -> None:
    path = tmp_path / "heartbeat.json"
    error = write_heartbeat(path, now=now, detail=None)  # type: ignore[arg-type]
    assert error is not None and "not a finite number" in error
    assert not path.exists()


def test_an_integer_tick_time_is_stored_as_a_float(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    write_heartbeat(path, now=1_700_000_000)
    assert read_heartbeat(path) == {"ts": 1_700_000_000.0}
    assert isinstance(json.loads(path.read_text())["ts"], float)


# ---- reading ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        "",
        "{",
        "[]",
        '"ts"',
        "{}",
        '{"ts": null}',
        '{"ts": true}',
        '{"ts": "1700000000"}',
        '{"ts": [1]}',
        '{"ts": NaN}',
        '{"ts": Infinity}',
        '{"ts": -Infinity}',
    ],
)
def test_anything_but_an_object_with_a_finite_numeric_ts_is_no_heartbeat(tmp_path: Path, content: str) -> None:
    path = tmp_path / "heartbeat.json"
    path.write_text(content)
    assert read_heartbeat(path) is None


def test_a_missing_or_unreadable_heartbeat_is_none(tmp_path: Path) -> None:
    assert read_heartbeat(tmp_path / "absent.json") is None
    assert read_heartbeat(tmp_path) is None
    bad_utf8 = tmp_path / "bad.json"
    bad_utf8.write_bytes(b'{"ts": 1, "x": "\xff"}')
    assert read_heartbeat(bad_utf8) is None


def test_an_integer_ts_written_by_another_tool_reads_as_a_float(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    path.write_text('{"ts": 1700000000}')
    heartbeat = read_heartbeat(path)
    assert heartbeat == {"ts": 1_700_000_000.0} and isinstance(heartbeat["ts"], float)


# ---- the stall decision ----------------------------------------------------------------------


def test_a_stall_is_strictly_past_the_limit() -> None:
    assert not stalled(900, POLL_S)
    assert stalled(900.001, POLL_S)
    assert not stalled(0, POLL_S)


def test_a_longer_poll_allows_a_longer_silence() -> None:
    assert not stalled(1800, 600)
    assert stalled(1801, 600)


@given(age_s=st.floats(min_value=0, max_value=1e7), poll_s=st.floats(min_value=1, max_value=1e5))
def test_the_watchdog_and_health_share_one_limit(age_s: float, poll_s: float) -> None:
    assert stalled(age_s, poll_s) == (age_s > stall_limit(poll_s))


# ---- health ----------------------------------------------------------------------------------


def test_a_recent_tick_is_healthy_and_says_what_it_did(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    write_heartbeat(path, now=T0, detail={"outcome": "applied", "epoch": 7, "block": 1234})
    expected = "ok: last tick 12 s ago (outcome=applied epoch=7 block=1234)"
    assert health(path, now=T0 + 12, poll_s=POLL_S) == (True, expected)


def test_a_bare_heartbeat_reports_only_its_age(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    write_heartbeat(path, now=T0)
    assert health(path, now=T0 + 900, poll_s=POLL_S) == (True, "ok: last tick 900 s ago")


def test_detail_values_that_are_null_are_left_out(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    write_heartbeat(path, now=T0, detail={"outcome": "fetch-failed", "epoch": None, "block": None})
    assert health(path, now=T0 + 5, poll_s=POLL_S) == (True, "ok: last tick 5 s ago (outcome=fetch-failed)")


def test_a_tick_older_than_the_limit_is_stale(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    write_heartbeat(path, now=T0)
    assert health(path, now=T0 + 1234, poll_s=POLL_S) == (False, "stale: last tick 1234 s ago, limit 900 s")
    write_heartbeat(path, now=T0, detail={"outcome": "chain-failed"})
    assert health(path, now=T0 + 1234, poll_s=POLL_S) == (
        False,
        "stale: last tick 1234 s ago, limit 900 s (outcome=chain-failed)",
    )


def test_no_heartbeat_yet_is_unhealthy_and_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    assert health(path, now=T0, poll_s=POLL_S) == (False, f"no heartbeat yet at {path}")


def test_an_unusable_heartbeat_is_unhealthy_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    path.write_text('{"ts": "yesterday"}')
    ok, message = health(path, now=T0, poll_s=POLL_S)
    assert not ok and message.startswith(f"unusable heartbeat at {path}")


def test_a_heartbeat_from_the_future_reads_as_fresh_not_stale(tmp_path: Path) -> None:
    # The clock jumped back after the last tick; the next tick stamps the corrected time.
    path = tmp_path / "heartbeat.json"
    write_heartbeat(path, now=T0 + 3600)
    assert health(path, now=T0, poll_s=POLL_S) == (True, "ok: last tick 0 s ago")


def test_detail_that_is_not_plain_text_is_shown_on_one_line(tmp_path: Path) -> None:
    path = tmp_path / "heartbeat.json"
    write_heartbeat(path, now=T0, detail={"error": "line one\nline two", "dropped": ["a", "b"], "ok": None})
    ok, message = health(path, now=T0, poll_s=POLL_S)
    assert ok
    assert message == 'ok: last tick 0 s ago (error="line one\\nline two" dropped=["a", "b"])'


@given(
    detail=st.dictionaries(
        st.text(max_size=5),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
            max_leaves=6,
        ),
        max_size=4,
    ),
    age_s=st.floats(min_value=0, max_value=1e6),
)
def test_health_is_always_one_line(tmp_path_factory: pytest.TempPathFactory, detail: dict, age_s: float) -> None:
    path = tmp_path_factory.mktemp("hb") / "heartbeat.json"
    assert write_heartbeat(path, now=T0, detail=detail) is None
    ok, message = health(path, now=T0 + age_s, poll_s=POLL_S)
    assert message.splitlines() == [message]
    assert ok == (not stalled((T0 + age_s) - T0, POLL_S))
