"""The Logs widget: `LogsView` holds a `LogBuffer`, the status line and the search box, and handles
the keys (follow, level, components, search, context, moving the selection); `LogLines` draws
the rows.

Rendering uses Textual's line API (`ScrollView.render_line`): only the rows on screen are drawn,
whatever the buffer holds. `RichLog` and `Log` keep rendered lines and cannot re-filter them,
which is why this is a `ScrollView` over the buffer's filtered index. The two classes share a
module because each calls the other (the view feeds the rows; the rows report scrolls and
clicks to the view). Drawing the rows of a 160×45 view takes about 5 ms with 100,000 lines
buffered, the rest of the frame about 2 ms.

Colour is never the only signal: every row carries its level word. Colours live in
`LogLines.DEFAULT_CSS`, keyed on component classes, so `app.tcss` can restyle them.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.cache import LRUCache
from textual.geometry import Size
from textual.message import Message
from textual.reactive import var
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Input, Static

from engy_tui.widgets.logs.buffer import DEFAULT_CAPACITY, LogBuffer, status_text
from engy_tui.widgets.logs.filters import LEVEL_RANK, LEVELS, LogFilter, SearchError, next_level
from engy_tui.widgets.logs.rows import CLOCK_WIDTH, LEVEL_WIDTH, LogEvent, LogLine, context_row
from engy_tui.widgets.logs.screens import ComponentPicker, LogContextScreen

__all__ = [
    "LogLines",
    "LogsView",
]


class LogLines(ScrollView, can_focus=True, inherit_bindings=False):
    """The scrolling rows of a `LogsView`. It draws and reports scrolls and clicks; the view
    owns the buffer and follow state and handles the keys (none are inherited from
    `ScrollView`, so the view's bindings see them all)."""

    # Rows are picked with a click, not text-selected; copying goes through the context screen.
    ALLOW_SELECT = False
    COMPONENT_CLASSES = {
        "log-lines--time",
        "log-lines--component",
        "log-lines--match",
        "log-lines--cursor",
        "log-lines--empty",
        *(f"log-lines--{level}" for level in LEVELS),
    }
    DEFAULT_CSS = """
    LogLines {
        overflow-y: scroll;
        overflow-x: auto;
        background: $surface;
        & > .log-lines--time { color: $text-muted; }
        & > .log-lines--component { color: $text-accent; }
        & > .log-lines--debug { color: $text-muted; }
        & > .log-lines--info { color: $text-success; }
        & > .log-lines--warning { color: $text-warning; text-style: bold; }
        & > .log-lines--error { color: $text-error; text-style: bold; }
        & > .log-lines--critical { color: $text-error; text-style: bold reverse; }
        & > .log-lines--match { background: $warning-muted; text-style: underline; }
        & > .log-lines--cursor { background: $block-cursor-blurred-background; }
        &:focus > .log-lines--cursor { background: $block-cursor-background; color: $block-cursor-foreground; }
        & > .log-lines--empty { color: $text-muted; text-style: italic; }
    }
    """

    def __init__(self, owner: LogsView) -> None:
        super().__init__()
        self._owner = owner
        self.cursor: int | None = None
        """The number of the selected line; None before any line is shown."""
        # Keyed by (line number, selected): numbers never repeat, so the cache survives drops.
        self._strips: LRUCache[tuple[int, bool], Strip] = LRUCache(1024)
        self._styles: dict[str, Style] = {}

    def forget_rendered(self) -> None:
        """Drop cached rows (the search or the styles changed) and redraw."""
        self._strips.clear()
        self.refresh()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles.clear()
        self._strips.clear()

    def _style(self, name: str) -> Style:
        style = self._styles.get(name)
        if style is None:
            style = self._styles[name] = self.get_component_rich_style(f"log-lines--{name}")
        return style

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        row = scroll_y + y
        width = self.size.width
        buffer = self._owner.buffer
        if row >= buffer.visible_count:
            if row == 0:
                hint = Text(self._empty_hint(buffer), style=self._style("empty"), end="")
                return Strip(hint.render(self.app.console)).crop_extend(0, width, self.rich_style)
            return Strip.blank(width, self.rich_style)
        number = buffer.number_at_row(row)
        selected = number == self.cursor
        strip = self._strips.get((number, selected))
        if strip is None:
            strip = self._strips[(number, selected)] = self._render_row(buffer.line(number), selected)
        return strip.crop_extend(scroll_x, scroll_x + width, self._style("cursor") if selected else self.rich_style)

    @staticmethod
    def _empty_hint(buffer: LogBuffer) -> str:
        if not len(buffer):
            return "no log lines yet"
        return f"the filters hide all {len(buffer):,} lines: l changes the level, c the components"

    def _render_row(self, line: LogLine, selected: bool) -> Strip:
        text = Text(line.text, style=self.rich_style, no_wrap=True, end="")
        text.stylize(self._style("time"), 0, CLOCK_WIDTH)
        level_start = CLOCK_WIDTH + 1
        level_end = level_start + len(line.level.upper())
        text.stylize(self._style(line.level if line.level in LEVEL_RANK else "info"), level_start, level_end)
        component_start = max(level_end, level_start + LEVEL_WIDTH) + 1
        text.stylize(self._style("component"), component_start, component_start + len(line.component))
        search = self._owner.buffer.search
        if search is not None:
            for match in search.pattern.finditer(line.text):
                if match.end() > match.start():
                    text.stylize(self._style("match"), match.start(), match.end())
        if selected:
            text.stylize(self._style("cursor"))
        return Strip(text.render(self.app.console), cell_len(line.text))

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        # Called synchronously (not via a message) so a later programmatic scroll to the end
        # cannot be overtaken by a stale "scrolled up".
        if new_value < old_value and round(new_value) < self.max_scroll_y:
            self._owner._scrolled_up()

    def on_resize(self, event: events.Resize) -> None:
        self._owner._resized()

    def on_click(self, event: events.Click) -> None:
        row = self.scroll_offset.y + event.y
        if row < self._owner.buffer.visible_count:
            self._owner._clicked(row, double=event.chain >= 2)


class LogsView(Widget):
    """Every component's log lines with level and component filters, search and follow mode.

    Feed it with `append(batch)` from the app's render timer. Keys (binding ids in brackets,
    for the keymap): f follow on/off [logs.follow], end or G newest and follow [logs.newest],
    l level threshold [logs.level], c components [logs.components], / search [logs.search],
    n/N next/previous match [logs.next_match, logs.previous_match], enter the lines around the
    selected one [logs.context], escape close or clear the search [logs.search_close],
    arrows/page keys/home move the selection or pan [logs.cursor_*, logs.pan_*].
    """

    BINDINGS = [
        Binding(
            "f", "toggle_follow", "Follow", id="logs.follow", tooltip="Keep the newest line in view, or stop scrolling."
        ),
        Binding(
            "end,G",
            "follow_newest",
            "Newest",
            id="logs.newest",
            show=False,
            tooltip="Jump to the newest line and follow.",
        ),
        Binding("l", "cycle_level", "Level", id="logs.level", tooltip="Show only lines at or above the next level."),
        Binding("c", "pick_components", "Components", id="logs.components", tooltip="Choose which components to show."),
        Binding(
            "slash", "open_search", "Search", id="logs.search", tooltip="Search the shown lines (re: for a regex)."
        ),
        Binding("n", "next_match", "Next", id="logs.next_match", tooltip="Select the next (newer) match."),
        Binding(
            "N", "previous_match", "Previous", id="logs.previous_match", tooltip="Select the previous (older) match."
        ),
        Binding(
            "enter",
            "open_context",
            "Context",
            id="logs.context",
            tooltip="Show the 50 lines around the selected line, to copy.",
        ),
        Binding(
            "escape",
            "close_search",
            "Close search",
            id="logs.search_close",
            show=False,
            tooltip="Close the search box, or clear the search.",
        ),
        Binding("up", "move_cursor(-1)", "Up", id="logs.cursor_up", show=False, tooltip="Select the line above."),
        Binding("down", "move_cursor(1)", "Down", id="logs.cursor_down", show=False, tooltip="Select the line below."),
        Binding(
            "pageup", "move_page(-1)", "Page up", id="logs.cursor_page_up", show=False, tooltip="Select a page up."
        ),
        Binding(
            "pagedown",
            "move_page(1)",
            "Page down",
            id="logs.cursor_page_down",
            show=False,
            tooltip="Select a page down.",
        ),
        Binding(
            "home", "oldest", "Oldest", id="logs.cursor_oldest", show=False, tooltip="Select the oldest shown line."
        ),
        Binding("left", "pan(-8)", "Left", id="logs.pan_left", show=False, tooltip="Scroll long lines left."),
        Binding("right", "pan(8)", "Right", id="logs.pan_right", show=False, tooltip="Scroll long lines right."),
    ]
    DEFAULT_CSS = """
    LogsView {
        layout: vertical;
        height: 1fr;
        & > LogLines { height: 1fr; }
        & > #logs-status { height: 1; background: $panel; color: $text-muted; }
        & > #logs-search { display: none; }
        & > #logs-search.-open { display: block; }
    }
    """

    follow: var[bool] = var(True, init=False)
    """Keep the newest line selected and in view. Scrolling or moving up turns it off."""

    class FollowChanged(Message):
        """Follow mode went on or off (a key, a scroll, or an assignment)."""

        def __init__(self, logs_view: LogsView, following: bool) -> None:
            super().__init__()
            self.logs_view = logs_view
            self.following = following

        @property
        def control(self) -> LogsView:
            return self.logs_view

    class FiltersChanged(Message):
        """The level threshold or the hidden components changed."""

        def __init__(self, logs_view: LogsView, log_filter: LogFilter) -> None:
            super().__init__()
            self.logs_view = logs_view
            self.log_filter = log_filter

        @property
        def control(self) -> LogsView:
            return self.logs_view

    def __init__(
        self,
        *,
        capacity: int = DEFAULT_CAPACITY,
        min_level: str = "debug",
        tz: datetime.tzinfo | None = None,
        name: str | None = None,
        id: str | None = None,
        classes: str | None = None,
    ) -> None:
        """
        Args:
            capacity: Lines kept; older ones are dropped and counted.
            min_level: The level threshold to start with (one of `LEVELS`).
            tz: The time zone rows are shown in; None is this machine's (tests pass UTC).
        """
        super().__init__(name=name, id=id, classes=classes)
        self.buffer = LogBuffer(capacity=capacity, log_filter=LogFilter(min_level=min_level), tz=tz)
        """The lines, filters and search; read it, change it through this view's methods."""
        self._lines = LogLines(self)
        self._status = Static("", id="logs-status", markup=False)
        self._search_box = Input(
            id="logs-search", placeholder="search (case-insensitive; re: for a regex) · enter searches · escape cancels"
        )

    def compose(self) -> ComposeResult:
        yield self._lines
        yield self._status
        yield self._search_box

    def on_mount(self) -> None:
        self._refresh_status()

    def take_focus(self) -> None:
        """Focus the lines, so this view's keys work at once (its parent shows it: a tab)."""
        self._lines.focus()

    # ---- feeding and state ----------------------------------------------------------------------

    @property
    def cursor_line(self) -> LogLine | None:
        """The selected line, if it is still buffered."""
        cursor = self._lines.cursor
        if cursor is None or cursor < self.buffer.first_number:
            return None
        return self.buffer.line(cursor)

    def append(self, events: Iterable[LogEvent | dict[str, Any]], *, missed: int = 0) -> None:
        """Add a batch of events, oldest first (hub `Event`s or `/v1/events` dicts); `missed`
        is how many the reader lost before it (`EventBatch.missed`). Call at the render rate."""
        appended = self.buffer.append(events, missed=missed)
        lines = self._lines
        lines.virtual_size = Size(self.buffer.widest, self.buffer.visible_count)
        if self.follow:
            self._select_newest()
        else:
            if appended.removed:
                # Keep the same lines on screen while the rows above them go.
                lines.scroll_to(y=lines.scroll_offset.y - appended.removed, animate=False, force=True)
            if lines.cursor is None or lines.cursor < self.buffer.first_number:
                # Nothing selected yet, or the selected line fell out: select the oldest shown.
                lines.cursor = self.buffer.number_at_row(0) if self.buffer.visible_count else None
        lines.refresh()
        self._refresh_status()

    def set_min_level(self, level: str) -> None:
        """Show lines at `level` or above (lines of unknown levels always show)."""
        self._set_filter(LogFilter(level, self.buffer.filter.hidden_components))

    def set_hidden_components(self, hidden: Iterable[str]) -> None:
        """Hide these component groups ("gateway" hides gateway.pool too); empty shows all."""
        self._set_filter(LogFilter(self.buffer.filter.min_level, frozenset(hidden)))

    def set_search(self, query: str) -> None:
        """Highlight and count matches of `query` (see `compile_search`; empty clears it).

        Raises:
            SearchError: an invalid `re:` expression; the previous search stays.
        """
        self.buffer.set_search(query)
        self._lines.forget_rendered()
        self._refresh_status()

    def _set_filter(self, log_filter: LogFilter) -> None:
        if log_filter == self.buffer.filter:
            return
        self.buffer.set_filter(log_filter)
        self._lines.virtual_size = Size(self.buffer.widest, self.buffer.visible_count)
        if self.follow:
            self._select_newest()
        else:
            cursor = self._lines.cursor
            row = self.buffer.row_of(cursor) if cursor is not None else 0
            self._select_row(min(row, self.buffer.visible_count - 1), center=True)
        self._lines.refresh()
        self._refresh_status()
        self.post_message(self.FiltersChanged(self, log_filter))

    def _refresh_status(self) -> None:
        self._status.update(status_text(self.buffer, following=self.follow))

    def _select_newest(self) -> None:
        lines = self._lines
        count = self.buffer.visible_count
        lines.cursor = self.buffer.number_at_row(count - 1) if count else None
        lines.scroll_to(y=lines.max_scroll_y, animate=False, force=True)
        lines.refresh()

    def _select_row(self, row: int, *, center: bool = False) -> None:
        """Select the line at `row` (clamped) and scroll it into view."""
        count = self.buffer.visible_count
        lines = self._lines
        if not count:
            lines.cursor = None
            return
        row = max(0, min(row, count - 1))
        lines.cursor = self.buffer.number_at_row(row)
        height = lines.scrollable_content_region.height
        top = lines.scroll_offset.y
        if center:
            top = row - height // 2
        elif row < top:
            top = row
        elif row >= top + height:
            top = row - height + 1
        lines.scroll_to(y=top, animate=False, force=True)
        lines.refresh()

    def _cursor_row(self) -> int:
        cursor = self._lines.cursor
        return self.buffer.row_of(cursor) if cursor is not None else self.buffer.visible_count - 1

    def watch_follow(self, following: bool) -> None:
        if following:
            self._select_newest()
        self._refresh_status()
        self.post_message(self.FollowChanged(self, following))

    # ---- called by LogLines -----------------------------------------------------------------------

    def _scrolled_up(self) -> None:
        self.follow = False

    def _resized(self) -> None:
        # A shorter view leaves the newest line below the bottom until the next batch.
        if self.follow:
            self._select_newest()

    def _clicked(self, row: int, *, double: bool) -> None:
        self.follow = False
        self._select_row(row)
        if double:
            self.action_open_context()

    # ---- actions ----------------------------------------------------------------------------------

    def action_toggle_follow(self) -> None:
        self.follow = not self.follow

    def action_follow_newest(self) -> None:
        if self.follow:
            self._select_newest()
        else:
            self.follow = True

    def action_cycle_level(self) -> None:
        self.set_min_level(next_level(self.buffer.filter.min_level))

    def action_pick_components(self) -> None:
        self.app.push_screen(
            ComponentPicker(sorted(self.buffer.components), self.buffer.filter.hidden_components),
            self._components_picked,
        )

    def _components_picked(self, hidden: frozenset[str] | None) -> None:
        # The picker always dismisses with a set; None (a dismiss without one) changes nothing.
        if hidden is not None:
            self.set_hidden_components(hidden)

    def action_open_search(self) -> None:
        box = self._search_box
        box.value = self.buffer.search.query if self.buffer.search is not None else ""
        box.add_class("-open")
        box.focus()

    def action_close_search(self) -> None:
        if self._search_box.has_class("-open"):
            self._close_search_box()
        elif self.buffer.search is not None:
            self.set_search("")

    def _close_search_box(self) -> None:
        self._search_box.remove_class("-open")
        self._lines.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input is not self._search_box:
            return
        event.stop()
        try:
            self.set_search(event.value)
        except SearchError as err:
            # The box stays open with the text, so the expression can be fixed in place.
            self.notify(str(err), title="search", severity="error")
            return
        self._close_search_box()
        # The newest match at or above the selection: while following, the latest occurrence,
        # which is what someone searching a live log usually wants first.
        cursor = self._lines.cursor
        self._jump_to_match(self.buffer.next_match(None if cursor is None else cursor + 1, forward=False))

    def action_next_match(self) -> None:
        self._jump_to_match(self.buffer.next_match(self._lines.cursor, forward=True))

    def action_previous_match(self) -> None:
        self._jump_to_match(self.buffer.next_match(self._lines.cursor, forward=False))

    def _jump_to_match(self, number: int | None) -> None:
        if number is None:
            if self.buffer.search is not None:
                self.notify(f"no shown line matches {self.buffer.search.query!r}", title="search")
            return
        self.follow = False
        self._select_row(self.buffer.row_of(number), center=True)

    def action_move_cursor(self, delta: int) -> None:
        if delta < 0:
            self.follow = False
        self._select_row(self._cursor_row() + delta)

    def action_move_page(self, pages: int) -> None:
        if pages < 0:
            self.follow = False
        self._select_row(self._cursor_row() + pages * max(1, self._lines.scrollable_content_region.height - 1))

    def action_oldest(self) -> None:
        self.follow = False
        self._select_row(0)

    def action_pan(self, cells: int) -> None:
        self._lines.scroll_relative(x=cells, animate=False)

    def action_open_context(self) -> None:
        line = self.cursor_line
        if line is None:
            return
        assert self._lines.cursor is not None  # cursor_line is set only with a cursor
        around, index = self.buffer.context(self._lines.cursor)
        rows = [context_row(each, self.buffer.tz) for each in around]
        self.app.push_screen(LogContextScreen(rows, index))
