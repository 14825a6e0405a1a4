"""The Logs view: what a row says and whether it shows (plain functions and `LogBuffer`, no
terminal), then the widget under Pilot in a host app that holds only it, then one SVG snapshot.

Like `test_app.py`, Pilot tests are plain functions that drive the app with `asyncio.run`,
because pytest-trio's trio_mode claims every `async def` test. Rows are shown in UTC so the
clock text does not depend on the machine's time zone.
"""

from __future__ import annotations

import asyncio
import datetime
import gc
from collections.abc import Awaitable, Callable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st
from textual.app import App, ComposeResult
from textual.events import MouseScrollUp
from textual.message import Message
from textual.pilot import Pilot
from textual.widgets import SelectionList, TextArea

from engy_node.hub import Event, Hub
from engy_tui.widgets.logs import LogsView
from engy_tui.widgets.logs.buffer import CONTEXT_LINES, LogBuffer, context_window, status_text
from engy_tui.widgets.logs.filters import LEVELS, LogFilter, SearchError, compile_search, hidden_by, next_level
from engy_tui.widgets.logs.rows import LogLine, component_group, format_clock, log_line
from engy_tui.widgets.logs.screens import ComponentPicker, LogContextScreen
from engy_tui.widgets.logs.view import LogLines

UTC = datetime.UTC
# 2026-12-01 09:14:02 UTC: a fixed moment, so rows and the snapshot are reproducible.
T0 = 1_796_116_442.0
SIZE = (100, 24)
COMPONENTS = ("gateway.pool", "miner", "model_server", "validator.chain", "verifier")


def event(seq: int, *, level: str = "info", component: str = "gateway", message: str | None = None) -> Event:
    return Event(seq, T0 + seq / 1000, level, component, message if message is not None else f"line {seq}")


def events(start: int, count: int, **fields: str) -> list[Event]:
    return [event(seq, **fields) for seq in range(start, start + count)]


def line(level: str = "info", component: str = "gateway", message: str = "m") -> LogLine:
    return log_line(Event(0, T0, level, component, message), UTC)


# ---- rows (no terminal) -------------------------------------------------------------------------


def test_a_row_reads_clock_level_word_component_and_message():
    row = log_line(Event(7, T0 + 0.123, "warning", "gateway.pool", "worker 5F3s slow"), UTC)
    assert row.text == "09:14:02.123 WARNING  gateway.pool: worker 5F3s slow"
    assert (row.level, row.component, row.group) == ("warning", "gateway.pool", "gateway")
    assert log_line(Event(7, T0, "info", "miner", "ready"), UTC).text == "09:14:02.000 INFO     miner: ready"


def test_a_control_api_dict_makes_the_same_row_as_a_hub_event():
    hub_event = Event(3, T0 + 0.5, "error", "verifier", "audit failed")
    api_dict = {"seq": 3, "ts": T0 + 0.5, "level": "error", "component": "verifier", "message": "audit failed"}
    assert log_line(api_dict, UTC) == log_line(hub_event, UTC)


def test_a_malformed_event_still_makes_a_row():
    row = log_line({"message": "no other fields"}, UTC)
    assert row.text == "--:--:--.--- " + " " * 8 + " : no other fields"


def test_newlines_and_control_characters_never_break_the_one_row_per_line_grid():
    row = log_line(Event(0, T0, "error", "miner", "Traceback:\n  boom\t!\x1b[2J"), UTC)
    assert "\n" not in row.text and "\x1b" not in row.text
    assert row.message == "Traceback: ⏎   boom    !\ufffd[2J"


@pytest.mark.parametrize(
    ("ts", "text"),
    [
        (T0, "09:14:02.000"),
        (T0 + 0.9999, "09:14:02.999"),
        (T0 + 59.5, "09:15:01.500"),
        (float("nan"), "--:--:--.---"),
        (float("inf"), "--:--:--.---"),
        (1e300, "--:--:--.---"),
    ],
)
def test_format_clock_shows_milliseconds_truncated_never_rounded_into_the_next_second(ts, text):
    assert format_clock(ts, UTC) == text


@given(st.floats(min_value=0, max_value=4e9))
def test_format_clock_is_always_twelve_characters(ts):
    assert len(format_clock(ts, UTC)) == 12


def test_component_group_is_the_first_part_of_the_name():
    assert [component_group(name) for name in ("gateway.pool", "miner", "", "a.b.c")] == ["gateway", "miner", "", "a"]


# ---- filters ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("level", "min_level", "shown"),
    [
        ("debug", "debug", True),
        ("debug", "info", False),
        ("info", "info", True),
        ("warning", "error", False),
        ("error", "error", True),
        ("critical", "error", True),
        ("trace", "error", True),
        ("", "error", True),
    ],
)
def test_level_threshold_hides_lower_levels_and_never_an_unknown_one(level, min_level, shown):
    assert (hidden_by(level, "gateway", LogFilter(min_level)) is None) is shown


def test_a_hidden_component_hides_its_whole_group_at_every_level():
    log_filter = LogFilter("debug", frozenset({"gateway"}))
    for level, component in (("critical", "gateway.pool"), ("info", "gateway")):
        each = line(level, component)
        assert hidden_by(each.level, each.group, log_filter) == "component"
    assert hidden_by("info", component_group("gateways"), log_filter) is None


def test_a_line_both_filters_hide_counts_under_component():
    assert hidden_by("debug", "miner", LogFilter("info", frozenset({"miner"}))) == "component"


@given(
    level=st.sampled_from((*LEVELS, "trace", "notice")),
    component=st.sampled_from(COMPONENTS),
    min_level=st.sampled_from(LEVELS),
    hidden=st.frozensets(st.sampled_from(("gateway", "miner", "model_server", "validator", "verifier"))),
)
def test_hidden_by_agrees_with_the_rule_written_out(level, component, min_level, hidden):
    known = level in LEVELS
    expected = (
        "component"
        if component.split(".")[0] in hidden
        else "level"
        if known and LEVELS.index(level) < LEVELS.index(min_level)
        else None
    )
    each = line(level, component)
    assert hidden_by(each.level, each.group, LogFilter(min_level, hidden)) == expected


def test_a_filter_names_the_allowed_levels_when_given_an_unknown_one():
    with pytest.raises(ValueError, match="debug, info, warning, error, critical"):
        LogFilter("verbose")


def test_the_level_key_cycles_debug_info_warning_error_and_back():
    seen = ["debug"]
    for _ in range(4):
        seen.append(next_level(seen[-1]))
    assert seen == ["debug", "info", "warning", "error", "debug"]
    assert next_level("critical") == "debug"


# ---- search -------------------------------------------------------------------------------------


def test_search_is_a_case_insensitive_substring_with_no_regex_meaning():
    search, dot = compile_search("Abort (code"), compile_search("a.c")
    assert search is not None and search.pattern.search("request ABORT (CODE 3)")
    assert dot is not None and not dot.pattern.search("abc")


def test_re_prefix_makes_a_case_insensitive_regex():
    search = compile_search("re:abort|cancel+ed")
    assert search is not None and search.query == "re:abort|cancel+ed"
    assert search.pattern.search("request CANCELLED") and search.pattern.search("abort")


def test_an_invalid_regex_names_the_way_out():
    with pytest.raises(SearchError, match="drop the re: prefix"):
        compile_search("re:(unclosed")


def test_an_empty_query_is_no_search():
    assert compile_search("") is None


@given(
    query=st.text(alphabet="abcXYZ .*+?()[]|\\^$", min_size=1, max_size=5),
    text=st.text(alphabet="abcXYZ .*+?()[]|\\^$", max_size=30),
)
def test_a_plain_search_matches_exactly_when_the_text_contains_the_query_ignoring_case(query, text):
    search = compile_search(query)
    assert search is not None
    assert (search.pattern.search(text) is not None) == (query.lower() in text.lower())


# ---- context window -----------------------------------------------------------------------------


@given(
    st.integers(1, 500).flatmap(lambda total: st.tuples(st.just(total), st.integers(0, total - 1), st.integers(1, 80)))
)
def test_context_window_is_full_size_in_bounds_and_holds_the_line(case):
    total, index, size = case
    start, stop = context_window(total, index, size)
    assert 0 <= start <= index < stop <= total
    assert stop - start == min(size, total)
    if size // 2 <= index and index - size // 2 + size <= total:
        assert start == index - size // 2  # centred when neither end is near


def test_context_window_refuses_an_index_outside_the_items():
    with pytest.raises(IndexError):
        context_window(10, 10)


# ---- the buffer against a brute-force model -------------------------------------------------------

appends = st.lists(
    st.tuples(
        st.sampled_from((*LEVELS, "trace")),
        st.sampled_from(COMPONENTS),
        st.sampled_from(("abort", "ok", "Abort!", "x")),
    ),
    max_size=12,
).map(lambda rows: ("append", rows))
filters = st.tuples(st.sampled_from(LEVELS[:4]), st.frozensets(st.sampled_from(("gateway", "miner", "verifier")))).map(
    lambda f: ("filter", LogFilter(*f))
)
searches = st.sampled_from(("", "abort", "re:^x$", "re:ab|ok", "9")).map(lambda q: ("search", q))


@given(capacity=st.integers(1, 20), operations=st.lists(st.one_of(appends, filters, searches), max_size=25))
def test_the_buffer_keeps_the_same_rows_matches_and_counts_as_recomputing_from_scratch(capacity, operations):
    buffer = LogBuffer(capacity=capacity, tz=UTC)
    everything: list[LogLine] = []  # every line ever appended, numbered by position
    batches = 0
    for kind, value in operations:
        if kind == "append":
            batch = [Event(len(everything) + i, T0 + len(everything) + i, *row) for i, row in enumerate(value)]
            buffer.append(batch, missed=1)
            batches += 1
            everything.extend(log_line(each, UTC) for each in batch)
        elif kind == "filter":
            buffer.set_filter(value)
        else:
            buffer.set_search(value)

        first = max(0, len(everything) - capacity)
        kept = list(enumerate(everything))[first:]
        shown = [number for number, each in kept if hidden_by(each.level, each.group, buffer.filter) is None]
        search = compile_search(buffer.search.query) if buffer.search else None
        assert len(buffer) == len(kept) <= capacity
        assert buffer.first_number == first and buffer.dropped == first
        assert list(buffer.visible_numbers()) == shown
        assert list(buffer.match_numbers()) == [
            number for number in shown if search is not None and search.pattern.search(everything[number].text)
        ]
        for reason in ("level", "component"):
            assert buffer.hidden[reason] == sum(
                1 for _, each in kept if hidden_by(each.level, each.group, buffer.filter) == reason
            )
        assert [buffer.line(number) for number, _ in kept] == [each for _, each in kept]
        assert buffer.missed == batches


def test_buffered_lines_are_invisible_to_the_garbage_collector():
    # A tripwire with no timing in it: when a full buffer's lines were GC-tracked objects,
    # every full collection walked all of them and stalled a frame by 50-70 ms.
    buffer = LogBuffer(tz=UTC)
    buffer.append(events(0, 100))
    gc.collect()
    assert not any(gc.is_tracked(row) for row in buffer._rows)


def test_the_append_result_says_how_many_rows_came_and_went():
    buffer = LogBuffer(capacity=5, log_filter=LogFilter("info"), tz=UTC)
    assert buffer.append(events(0, 3)) == (3, 0)
    assert buffer.append([event(3, level="debug"), event(4), event(5), event(6)]) == (3, 2)
    assert list(buffer.visible_numbers()) == [2, 4, 5, 6]
    assert buffer.dropped == 2 and buffer.hidden == {"level": 1, "component": 0}


def test_a_batch_bigger_than_the_buffer_keeps_its_newest_lines():
    buffer = LogBuffer(capacity=3, tz=UTC)
    buffer.append(events(0, 10))
    assert [buffer.line(n).message for n in buffer.visible_numbers()] == ["line 7", "line 8", "line 9"]
    assert buffer.dropped == 7


def test_next_match_steps_both_ways_and_wraps():
    buffer = LogBuffer(tz=UTC)
    buffer.append([event(i, message="abort" if i in (2, 5, 8) else "ok") for i in range(10)])
    buffer.set_search("abort")
    assert [buffer.next_match(n) for n in (None, 2, 5, 8, 3)] == [2, 5, 8, 2, 5]
    assert [buffer.next_match(n, forward=False) for n in (None, 8, 5, 2, 6)] == [8, 5, 2, 8, 5]
    buffer.set_search("nothing like it")
    assert buffer.next_match(3) is None


def test_a_failed_search_leaves_the_previous_one_in_place():
    buffer = LogBuffer(tz=UTC)
    buffer.append(events(0, 3))
    buffer.set_search("line 1")
    with pytest.raises(SearchError):
        buffer.set_search("re:[")
    assert buffer.search is not None and buffer.search.query == "line 1" and buffer.match_count == 1


def test_row_of_a_hidden_line_is_the_next_shown_row():
    buffer = LogBuffer(log_filter=LogFilter("info"), tz=UTC)
    buffer.append([event(0), event(1, level="debug"), event(2)])
    assert [buffer.row_of(n) for n in (0, 1, 2, 3)] == [0, 1, 1, 2]


def test_context_ignores_the_filters_and_centres_on_the_line():
    buffer = LogBuffer(log_filter=LogFilter("error"), tz=UTC)
    buffer.append(events(0, 200, level="debug"))
    around, index = buffer.context(100)
    assert len(around) == CONTEXT_LINES and around[index].message == "line 100"
    assert around[0].message == "line 75"
    around, index = buffer.context(1)
    assert (around[0].message, index) == ("line 0", 1)


def test_status_text_counts_filters_drops_follow_and_search():
    buffer = LogBuffer(capacity=12_345, log_filter=LogFilter("info", frozenset({"miner"})), tz=UTC)
    # The first five lines (three below info, two from miner) are the five dropped.
    buffer.append(events(0, 3, level="debug") + events(3, 2, component="miner") + events(5, 12_345), missed=40)
    buffer.set_search("line 12")  # line 12, 120-129, 1200-1299, 12000-12349
    assert status_text(buffer, following=True) == (
        "12,345 lines · 0 filtered out by level (below info) · 0 filtered out by component (miner) · "
        "5 oldest dropped (keeps 12,345) · 40 missed (the node's ring moved on) · following · "
        "search 'line 12' 461 matches"
    )
    buffer.set_filter(LogFilter("warning"))
    assert status_text(buffer, following=False) == (
        "12,345 lines (0 shown) · 12,345 filtered out by level (below warning) · 5 oldest dropped (keeps 12,345) · "
        "40 missed (the node's ring moved on) · paused: f or end follows · search 'line 12' 0 matches"
    )


def test_status_text_of_a_fresh_buffer_is_short():
    assert status_text(LogBuffer(), following=True) == "0 lines · following"


# ---- the widget under Pilot ---------------------------------------------------------------------


class LogsHost(App[None]):
    """Only the widget: what these tests exercise is the view, not the engy-tui app."""

    def __init__(self, **view_options: object) -> None:
        super().__init__()
        self.view_options = view_options
        self.messages: list[Message] = []

    def compose(self) -> ComposeResult:
        yield LogsView(tz=UTC, **self.view_options)  # type: ignore[arg-type]

    def on_logs_view_follow_changed(self, message: LogsView.FollowChanged) -> None:
        self.messages.append(message)

    def on_logs_view_filters_changed(self, message: LogsView.FiltersChanged) -> None:
        self.messages.append(message)


def run_host(scenario: Callable[[LogsHost, LogsView, Pilot], Awaitable[None]], **view_options: object) -> None:
    async def main() -> None:
        app = LogsHost(**view_options)
        async with app.run_test(size=SIZE) as pilot:
            await scenario(app, app.query_one(LogsView), pilot)

    asyncio.run(main())


def rows_on_screen(view: LogsView) -> list[str]:
    """The messages of the rows currently in the viewport, top to bottom."""
    lines = view.query_one(LogLines)
    top, height = lines.scroll_offset.y, lines.scrollable_content_region.height
    stop = min(top + height, view.buffer.visible_count)
    return [view.buffer.line(view.buffer.number_at_row(row)).message for row in range(top, stop)]


def rendered(view: LogsView, y: int) -> str:
    return view.query_one(LogLines).render_line(y).text


def status(view: LogsView) -> str:
    return str(view.query_one("#logs-status").render())


def selected(view: LogsView) -> str | None:
    return view.cursor_line.message if view.cursor_line is not None else None


def test_an_empty_view_says_no_lines_yet():
    async def scenario(app: LogsHost, view: LogsView, pilot: Pilot) -> None:
        await pilot.pause()
        assert rendered(view, 0).startswith("no log lines yet")
        assert status(view) == "0 lines · following"

    run_host(scenario)


def test_appended_batches_show_in_order_and_follow_keeps_the_newest_line_in_view():
    async def scenario(app: LogsHost, view: LogsView, pilot: Pilot) -> None:
        view.append(events(0, 5))
        await pilot.pause()
        assert rows_on_screen(view) == [f"line {i}" for i in range(5)]
        assert rendered(view, 0).startswith("09:14:02.000 INFO     gateway: line 0")
        for start in range(5, 300, 60):
            view.append(events(start, 60))
            await pilot.pause()
            assert rows_on_screen(view)[-1] == selected(view) == f"line {start + 59}"
        assert view.follow and status(view) == "305 lines · following"

    run_host(scenario)


def test_scrolling_up_stops_follow_and_end_or_G_resumes_it():
    async def scenario(app: LogsHost, view: LogsView, pilot: Pilot) -> None:
        lines = view.query_one(LogLines)
        view.append(events(0, 100))
        await pilot.pause()
        # Pilot has no wheel: post what the driver posts for one notch up.
        lines.post_message(MouseScrollUp(lines, 1, 1, 0, -1, 0, False, False, False))
        await pilot.pause()
        assert not view.follow
        frozen = rows_on_screen(view)
        view.append(events(100, 50))
        await pilot.pause()
        assert rows_on_screen(view) == frozen  # new lines do not move a paused view
        assert "paused: f or end follows" in status(view)
        await pilot.press("end")
        assert view.follow and rows_on_screen(view)[-1] == "line 149"
        await pilot.press("up", "up")
        assert not view.follow and selected(view) == "line 147"
        await pilot.press("G")
        assert view.follow and selected(view) == "line 149"
        await pilot.press("f")
        assert not view.follow
        await pilot.press("f")
        assert view.follow
        assert [m.following for m in app.messages if isinstance(m, LogsView.FollowChanged)] == [
            False,
            True,
            False,
            True,
            False,
            True,
        ]

    run_host(scenario)


def test_the_level_key_raises_the_threshold_and_the_status_counts_what_it_hides():
    async def scenario(app: LogsHost, view: LogsView, pilot: Pilot) -> None:
        view.append([event(i, level=LEVELS[i % 4]) for i in range(40)])
        await pilot.pause()
        assert view.buffer.visible_count == 40
        await pilot.press("l")
        assert view.buffer.filter.min_level == "info"
        assert "debug" not in {view.buffer.line(n).level for n in view.buffer.visible_numbers()}
        assert "10 filtered out by level (below info)" in status(view)
        await pilot.press("l", "l")
        assert {view.buffer.line(n).level for n in view.buffer.visible_numbers()} == {"error"}
        assert "ERROR" in rendered(view, 0)
        await pilot.press("l")
        assert view.buffer.visible_count == 40
        changes = [m.log_filter.min_level for m in app.messages if isinstance(m, LogsView.FiltersChanged)]
        assert changes == ["info", "warning", "error", "debug"]

    run_host(scenario)


def test_the_component_picker_hides_the_unticked_groups():
    async def scenario(app: LogsHost, view: LogsView, pilot: Pilot) -> None:
        view.append([event(i, component=COMPONENTS[i % 5]) for i in range(50)])
        await pilot.pause()
        await pilot.press("c")
        picker = app.screen
        assert isinstance(picker, ComponentPicker)
        options = picker.query_one(SelectionList)
        assert [options.get_option_at_index(i).value for i in range(options.option_count)] == [
            "gateway",
            "miner",
            "model_server",
            "validator",
            "verifier",
        ]
        await pilot.press("down", "space", "escape")  # untick "miner"
        assert not isinstance(app.screen, ComponentPicker)
        assert view.buffer.filter.hidden_components == {"miner"}
        assert {view.buffer.line(n).group for n in view.buffer.visible_numbers()} == {
            "gateway",
            "model_server",
            "validator",
            "verifier",
        }
        assert "10 filtered out by component (miner)" in status(view)
        await pilot.press("c", "a", "escape")
        assert view.buffer.filter.hidden_components == frozenset() and view.buffer.visible_count == 50

    run_host(scenario)


def test_search_selects_the_newest_match_and_n_and_N_step_through_matches():
    async def scenario(app: LogsHost, view: LogsView, pilot: Pilot) -> None:
        view.append(
            [event(i, message=f"request {i} aborted" if i % 25 == 0 else f"request {i} ok") for i in range(200)]
        )
        await pilot.pause()
        await pilot.press("slash")
        await pilot.press(*"ABORTED")
        await pilot.press("enter")
        assert selected(view) == "request 175 aborted" and not view.follow
        assert "search 'ABORTED' 8 matches" in status(view)
        assert selected(view) in rows_on_screen(view)
        await pilot.press("n")
        assert selected(view) == "request 0 aborted"  # wraps from the newest to the oldest
        assert selected(view) in rows_on_screen(view)
        await pilot.press("n", "n")
        assert selected(view) == "request 50 aborted"
        await pilot.press("N", "N")
        assert selected(view) == "request 0 aborted"
        await pilot.press("N")
        assert selected(view) == "request 175 aborted"  # wraps from the oldest to the newest
        await pilot.press("escape")
        assert view.buffer.search is None and "search" not in status(view)

    run_host(scenario)


def test_an_invalid_regex_keeps_the_search_box_open_with_the_text():
    async def scenario(app: LogsHost, view: LogsView, pilot: Pilot) -> None:
        view.append(events(0, 10))
        await pilot.pause()
        await pilot.press("slash", *"re:(", "enter")
        box = view.query_one("#logs-search")
        assert box.has_class("-open") and box.has_focus and view.buffer.search is None
        assert any("not a valid regular expression" in str(n.message) for n in app._notifications)
        await pilot.press("escape")
        assert not box.has_class("-open") and view.query_one(LogLines).has_focus

    run_host(scenario)


def test_enter_shows_the_fifty_lines_around_the_selected_one_and_y_copies_them():
    async def scenario(app: LogsHost, view: LogsView, pilot: Pilot) -> None:
        view.append(events(0, 300, component="miner"))
        await pilot.pause()
        await pilot.press(*["pageup"] * 5)
        target = view.cursor_line
        assert target is not None
        await pilot.press("enter")
        screen = app.screen
        assert isinstance(screen, LogContextScreen)
        assert len(screen.rows) == CONTEXT_LINES
        assert screen.rows[screen.selected] == "2026-12-01 " + target.text
        text_area = screen.query_one(TextArea)
        assert text_area.read_only and text_area.cursor_location == (screen.selected, 0)
        await pilot.press("y")
        assert app.clipboard == screen.text and app.clipboard.count("\n") == CONTEXT_LINES - 1
        await pilot.press("escape")
        assert app.screen is not screen and isinstance(app.focused, LogLines)

    run_host(scenario)


def test_a_double_click_opens_the_context_of_the_clicked_line():
    async def scenario(app: LogsHost, view: LogsView, pilot: Pilot) -> None:
        view.append(events(0, 10))
        await pilot.pause()
        await pilot.double_click(LogLines, offset=(5, 3))
        assert isinstance(app.screen, LogContextScreen)
        assert not view.follow and selected(view) == "line 3"

    run_host(scenario)


def test_the_buffer_bound_drops_the_oldest_lines_and_says_so():
    async def scenario(app: LogsHost, view: LogsView, pilot: Pilot) -> None:
        for start in range(0, 250, 50):
            view.append(events(start, 50))
        await pilot.pause()
        assert len(view.buffer) == 100 and view.buffer.line(view.buffer.first_number).message == "line 150"
        assert status(view) == "100 lines · 150 oldest dropped (keeps 100) · following"

    run_host(scenario, capacity=100)


def test_a_paused_view_keeps_its_lines_on_screen_while_the_oldest_are_dropped():
    async def scenario(app: LogsHost, view: LogsView, pilot: Pilot) -> None:
        view.append(events(0, 100))
        await pilot.pause()
        await pilot.press(*["up"] * 40)
        frozen, chosen = rows_on_screen(view), selected(view)
        view.append(events(100, 30))
        await pilot.pause()
        assert rows_on_screen(view) == frozen and selected(view) == chosen

    run_host(scenario, capacity=100)


def test_lines_from_the_control_api_and_the_missed_count_reach_the_status():
    async def scenario(app: LogsHost, view: LogsView, pilot: Pilot) -> None:
        hub = Hub(ring_size=10)
        for i in range(15):
            hub.emit("info", "gateway", f"hub line {i}", ts=T0 + i)
        batch = hub.events_since(0)
        view.append(batch.events, missed=batch.missed)
        view.append([{"seq": 15, "ts": T0 + 15, "level": "warning", "component": "chain", "message": "from the API"}])
        await pilot.pause()
        assert rows_on_screen(view)[-2:] == ["hub line 14", "from the API"]
        assert "5 missed (the node's ring moved on)" in status(view)

    run_host(scenario)


# ---- snapshot -----------------------------------------------------------------------------------


def snapshot_events() -> list[Event]:
    plan: Sequence[tuple[str, str, str]] = [
        ("info", "node", "engy-node 0.4.0 starting: roles miner, gateway"),
        ("debug", "miner.nvml", "GPU 0 RTX 4090 64°C 301/450 W"),
        ("info", "model_server", "sglang ready in 41.2 s (tp 2, mem-fraction 0.86)"),
        ("info", "gateway.pool", "worker 5F3s…k9Qa/rig-a admitted"),
        ("warning", "gateway.pool", "worker 5Cz0…/x breaker open: cheat (3 proofs failed)"),
        ("info", "validator", "epoch 210 weights submitted at block 4,812,247"),
        ("error", "validator.chain", "set_weights failed: NotEnoughStakeToSetWeights (retry next interval)"),
        ("info", "verifier", "audit 61 passed"),
        ("critical", "miner", "model server exited (code 137): out of memory; restarting in 5 s"),
        ("info", "gateway", "request 9f2c aborted by the buyer after 2.1 s"),
        ("info", "gateway", "request 9f2d ok 182 ms"),
    ]
    return [Event(i, T0 + i * 1.25, level, component, message) for i, (level, component, message) in enumerate(plan)]


def test_logs_view_snapshot(snap_compare):
    async def fill(pilot: Pilot) -> None:
        view = pilot.app.query_one(LogsView)
        view.append(snapshot_events())
        view.set_search("aborted")
        await pilot.pause()

    assert snap_compare(LogsHost(), terminal_size=(110, 16), run_before=fill)
