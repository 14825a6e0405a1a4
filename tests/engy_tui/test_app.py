"""engy-tui: the panel's formatting as plain functions, the app under Pilot, and one SVG snapshot.

Textual runs on asyncio while pytest-trio's trio_mode claims every `async def` test, so the
Pilot tests are plain functions that drive the app with `asyncio.run`; the app then hosts its
own trio guest run exactly as it does for a user. Waits are bounded loops over
`pilot.pause()`, never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import pytest
import trio
from textual.pilot import Pilot
from textual.widgets import Static

from engy_tui.app import EngyTui, build_app, build_parser
from engy_tui.bridge import LatencySummary, ServerStatus
from engy_tui.widgets.server_panel import (
    ROWS,
    format_count,
    format_ms,
    format_percent,
    format_rate,
    latency_line,
    panel_values,
    shorten_root,
    state_of,
)

SIZE = (100, 30)
WAIT_S = 20.0
UNREACHABLE = ServerStatus(
    url="http://127.0.0.1:9",
    reachable=False,
    healthy=False,
    error="cannot reach http://127.0.0.1:9: GET /health: ConnectError: all attempts to connect to 127.0.0.1:9 failed",
)
SERVING = ServerStatus(
    url="http://127.0.0.1:30000",
    reachable=True,
    healthy=True,
    model_id="smollm2-135m",
    served_model_name="smollm2-135m",
    model_root="0123456789abcdef" * 4,
    device="cpu",
    dtype="bfloat16",
    running=1,
    queued=2,
    max_running_requests=4,
    gen_throughput=12.345,
    requests_total=1200,
    aborted_total=3,
    generation_tokens_total=45678,
    ttft=LatencySummary(count=1200, mean_s=0.2, p50_s=0.15, p95_s=0.4, p99_s=1.25),
)


# ---- formatting (no terminal) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "—"), (0.00042, "0.42 ms"), (0.0123, "12.3 ms"), (0.15, "150 ms"), (1.2345, "1,234 ms")],
)
def test_format_ms_keeps_about_three_significant_digits(seconds, text):
    assert format_ms(seconds) == text


def test_format_percent_is_a_dash_when_the_whole_is_unknown_or_zero():
    assert format_percent(1, 4) == "25.0%"
    assert format_percent(None, 4) == format_percent(1, None) == format_percent(0, 0) == "—"


def test_shorten_root_keeps_the_head_and_tail_of_a_digest():
    assert shorten_root("0123456789abcdef" * 4) == "01234567…cdef"
    assert shorten_root("short") == "short"
    assert shorten_root(None) == "—"


def test_counts_and_rates_show_a_dash_not_zero_when_unknown():
    assert (format_count(12345), format_count(0), format_count(None)) == ("12,345", "0", "—")
    assert (format_rate(12.345), format_rate(None)) == ("12.3 tok/s", "—")


def test_latency_line_shows_percentiles_in_ms_or_says_nothing_was_measured():
    assert latency_line(SERVING.ttft) == "p50 150 ms · p95 400 ms · p99 1,250 ms  (n=1,200)"
    assert latency_line(None) == "no requests measured yet"


def test_state_distinguishes_connecting_healthy_unhealthy_and_unreachable():
    assert state_of(None) == "connecting"
    assert state_of(UNREACHABLE) == "unreachable"
    assert state_of(SERVING) == "healthy"
    assert state_of(ServerStatus(url="u", reachable=True, healthy=False)) == "unhealthy"


def test_panel_values_fill_every_row():
    values = panel_values(SERVING)
    assert set(values) == {row for row, _ in ROWS} == set(panel_values(None)) == set(panel_values(UNREACHABLE))
    assert values["model"] == "smollm2-135m"
    assert values["device"] == "cpu · bfloat16"
    assert values["load"] == "1 running · 2 queued · max 4 (25.0% busy)"
    assert values["totals"] == "1,200 requests · 3 aborted (0.2%) · 45,678 tokens generated"
    assert values["itl"] == "no requests measured yet"


def test_model_row_prefers_our_catalog_id_and_mentions_a_different_served_name():
    sglang = ServerStatus(url="u", reachable=True, healthy=True, served_model_name="Qwen3.6", model_path="/models/Qwen")
    assert panel_values(sglang)["model"] == "Qwen3.6"
    ours = ServerStatus(url="u", reachable=True, healthy=True, model_id="qwen3.6", served_model_name="Qwen3.6")
    assert panel_values(ours)["model"] == "qwen3.6 (served as Qwen3.6)"


def test_cli_rejects_a_serve_url_without_a_scheme(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--serve-url", "127.0.0.1:30000"])
    assert "--serve-url http://127.0.0.1:30000" in capsys.readouterr().err


def test_help_names_the_three_ways_to_run(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "node manager" in text and "--local" in text and "--attach" in text and "monitors one sglang-compatible" in text
    )


# ---- the app under Pilot ----------------------------------------------------------------------


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


async def wait_until(pilot: Pilot, condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {WAIT_S} s waiting for {what}")
        await pilot.pause(0.05)


def shown(app: EngyTui, row: str) -> str:
    return str(app.query_one(f"#{row}", Static).content)


def test_app_shows_the_reference_servers_model_and_health(reference_server):
    async def scenario() -> None:
        app = build_app(["--serve-url", reference_server.url])
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: shown(app, "state") != "connecting", "the first poll to be rendered")
            assert shown(app, "state") == "healthy"
            assert app.query_one("#state").has_class("-healthy")
            assert shown(app, "model") == "smollm2-135m"
            assert shown(app, "device") == "cpu · bfloat16"
            assert shown(app, "problem") == "none"
            assert shown(app, "load").endswith("max 4 (0.0% busy)")

    asyncio.run(scenario())


def test_app_shows_an_unreachable_server_with_the_error():
    url = closed_port_url()

    async def scenario() -> None:
        app = build_app(["--serve-url", url])
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: shown(app, "state") != "connecting", "the first poll to be rendered")
            assert shown(app, "state") == "unreachable"
            assert app.query_one("#state").has_class("-unreachable")
            assert shown(app, "problem").startswith(f"cannot reach {url}: GET /health: ConnectError")

    asyncio.run(scenario())


def test_r_polls_at_once_instead_of_waiting_for_the_interval():
    async def scenario() -> None:
        # An hour between polls: a second poll within the test can only come from the key.
        app = EngyTui(closed_port_url(), poll_interval_s=3600)
        async with app.run_test(size=SIZE) as pilot:
            assert app.bridge is not None
            await wait_until(pilot, lambda: app.bridge.polls == 1, "the first poll")
            await pilot.press("r")
            await wait_until(pilot, lambda: app.bridge.polls == 2, "the poll that r asked for")

    asyncio.run(scenario())


def test_q_stops_the_trio_guest_run_before_the_app_exits():
    async def scenario() -> EngyTui:
        app = build_app(["--serve-url", closed_port_url()])
        async with app.run_test(size=SIZE) as pilot:
            assert app.bridge is not None
            await wait_until(pilot, lambda: app.bridge.polls >= 1, "the first poll")
            assert app.bridge.running and trio.lowlevel.in_trio_run()
            await pilot.press("q")
            await wait_until(pilot, lambda: not app.is_running, "the app to exit")
            # Finished before the app let go of the loop, not during teardown.
            assert not app.bridge.running
        return app

    app = asyncio.run(scenario())
    assert app.return_code == 0
    # The guest run is over: no trio run (and so no trio task) is left on this thread.
    assert not trio.lowlevel.in_trio_run()


def test_a_crashed_poller_ends_the_app_with_an_error_instead_of_a_stale_screen(monkeypatch):
    async def broken_fetch_status(*args: object, **kwargs: object) -> ServerStatus:
        raise RuntimeError("boom")

    monkeypatch.setattr("engy_tui.bridge.fetch_status", broken_fetch_status)

    async def scenario() -> EngyTui:
        app = build_app(["--serve-url", closed_port_url()])
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: not app.is_running, "the app to exit")
        return app

    app = asyncio.run(scenario())
    assert app.return_code == 1
    assert not trio.lowlevel.in_trio_run()


def test_unreachable_state_snapshot(snap_compare):
    def show_unreachable(pilot: Pilot) -> None:
        pilot.app.show_status(UNREACHABLE)

    app = build_app(["--serve-url", UNREACHABLE.url], poll=False)
    assert snap_compare(app, terminal_size=SIZE, run_before=show_unreachable)
