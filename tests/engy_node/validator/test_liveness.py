"""The light loop's heartbeat (engy_node.validator.liveness): written every tick without ever
raising, read defensively, and judged against the watchdog's stall limit; then `engy-node health`'s
other question, whether weights land within the activity cutoff, with an exit code for each answer."""

from __future__ import annotations

import json
import math
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.config import Config, resolve_paths
from engy_node.validator.liveness import health, read_heartbeat, stalled, weights_problem, write_heartbeat
from engy_node.validator.role import (
    HEALTH_NO_WEIGHTS,
    HEALTH_OK,
    HEALTH_STALLED,
    health_report,
    heartbeat_path,
    state_path,
)
from engy_node.validator.schedule import stall_limit
from engy_node.validator.state import ValidatorState, write_state

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


# ---- doing its job: weights within the activity cutoff ------------------------------------------

CUTOFF_S = 5000 * 12.0


def beat(*, started: float = T0, outcome: str = "skipped:too-soon", cutoff_s: float | None = CUTOFF_S) -> dict:
    return {"ts": T0, "outcome": outcome, "started": started, "activity_cutoff_s": cutoff_s}


def test_a_loop_that_never_set_weights_is_failing_once_it_has_run_past_the_cutoff() -> None:
    # Within the grace (the cutoff) a new validator may still be waiting for its first epoch.
    assert weights_problem(beat(outcome="fetch-failed"), now=T0 + CUTOFF_S, last_submit_ts=None, poll_s=POLL_S) is None
    problem = weights_problem(beat(outcome="fetch-failed"), now=T0 + CUTOFF_S + 60, last_submit_ts=None, poll_s=POLL_S)
    assert problem is not None
    assert problem.startswith(
        "no weights set: the loop has run 16 h 41 min, longer than the activity cutoff (16 h 40 min)"
    )
    assert "last tick: fetch-failed" in problem and "check validator.provider_url" in problem


@pytest.mark.parametrize(
    ("outcome", "fix"),
    [
        ("chain-failed", "validator.network"),
        ("submit-failed", "the chain refuses the weights"),
        ("no-epoch-yet", "published no epoch yet"),
        ("rejected:bad-signature", "validator.master_hotkey"),
        ("skipped:too-soon", "the validator log"),
    ],
)
def test_weights_not_landing_within_the_cutoff_name_why_and_the_fix(outcome: str, fix: str) -> None:
    now = T0 + 2 * CUTOFF_S
    problem = weights_problem(beat(outcome=outcome), now=now, last_submit_ts=now - CUTOFF_S - 1, poll_s=POLL_S)
    assert problem is not None and problem.startswith("no weights landed for 16 h 40 min, past the activity cutoff")
    assert fix in problem
    assert weights_problem(beat(outcome=outcome), now=now, last_submit_ts=now - 600, poll_s=POLL_S) is None


def test_a_restarted_loop_gets_the_stall_limit_to_land_weights_and_the_default_cutoff_stands_in() -> None:
    old = T0 - 2 * CUTOFF_S
    assert weights_problem(beat(), now=T0 + 600, last_submit_ts=old, poll_s=POLL_S) is None
    assert weights_problem(beat(), now=T0 + 901, last_submit_ts=old, poll_s=POLL_S) is not None
    # A loop that has not read the chain's cutoff is judged against 5000 blocks of 12 s.
    assert weights_problem(beat(cutoff_s=None), now=T0 + CUTOFF_S + 1, last_submit_ts=None, poll_s=POLL_S)
    assert weights_problem(beat(cutoff_s=600.0), now=T0 + 601, last_submit_ts=None, poll_s=POLL_S)


def health_home(tmp_path: Path, *, heartbeat: dict | None, last_submit_ts: float | None):
    config = Config(paths=resolve_paths(tmp_path, {}))
    if heartbeat is not None:
        write_heartbeat(heartbeat_path(config), now=heartbeat["ts"], detail=heartbeat)
    if last_submit_ts is not None:
        write_state(
            state_path(config), ValidatorState(last_applied=3, last_submit_block=100, last_submit_ts=last_submit_ts)
        )
    return config


def test_health_report_exit_codes(tmp_path: Path) -> None:
    config = health_home(tmp_path / "none", heartbeat=None, last_submit_ts=None)
    assert health_report(config, now=T0) == (HEALTH_STALLED, f"no heartbeat yet at {heartbeat_path(config)}")
    config = health_home(tmp_path / "stale", heartbeat=beat(), last_submit_ts=T0)
    code, message = health_report(config, now=T0 + 1000)
    assert code == HEALTH_STALLED and message.startswith("stale:")
    config = health_home(tmp_path / "ok", heartbeat=beat(), last_submit_ts=T0 - 600)
    assert health_report(config, now=T0 + 12) == (
        HEALTH_OK,
        "ok: last tick 12 s ago (outcome=skipped:too-soon); weights landed 10 min ago",
    )
    config = health_home(tmp_path / "new", heartbeat=beat(outcome="fetch-failed"), last_submit_ts=None)
    assert health_report(config, now=T0 + 12)[0] == HEALTH_OK
    assert health_report(config, now=T0 + 12)[1].endswith("; no weights set yet")
    config = health_home(tmp_path / "never", heartbeat=beat(started=T0 - CUTOFF_S - 60), last_submit_ts=None)
    code, message = health_report(config, now=T0 + 12)
    assert code == HEALTH_NO_WEIGHTS and message.startswith("no weights set:")
    config = health_home(tmp_path / "lapsed", heartbeat=beat(started=T0 - CUTOFF_S), last_submit_ts=T0 - CUTOFF_S - 60)
    code, message = health_report(config, now=T0 + 12)
    assert code == HEALTH_NO_WEIGHTS and message.startswith("no weights landed for 16 h 41 min")
