"""The Logs view: every component's log lines in one place, the view support staff start from.

The node's hub keeps a ring of log events (`engy_node/hub.py`); the app reads them in batches at
its render rate (2–5 Hz) and hands each batch to `LogsView.append`, never one call per event.
The view keeps its own bounded buffer (`DEFAULT_CAPACITY` lines, oldest dropped and counted),
so a session can scroll back further than the node's ring and a flood of events costs bounded
memory.

Shape, and why:

* What a line says and whether it is shown are plain data and plain functions: `LogLine`,
  `hidden_by`, `compile_search`, `context_window`, `status_text`, and `LogBuffer`, which keeps
  the filtered index and the search matches up to date. None of it needs a terminal, and the
  tests check the buffer against a brute-force recomputation.
* Work per frame is proportional to the batch, not the buffer. Line numbers count every line
  ever appended, so dropping the oldest lines never renumbers the rest: the filtered index
  (`visible`) and the match list hold line numbers, and only the new lines are filtered and
  searched. Changing a filter or the search rescans the buffer once, on a key press.
* Rendering uses Textual's line API (`ScrollView.render_line`): only the rows on screen are
  drawn, whatever the buffer holds. `RichLog` and `Log` keep rendered lines and cannot
  re-filter them, which is why this is a `ScrollView` over the filtered index.
* A line is one row: newlines and control characters in a message are shown as visible marks
  rather than breaking the row grid that scrolling and the cursor rely on.

Cost, measured by hand on one CI core with 100,000 lines buffered at 160×45 (the issue's
target is ≤ 50 ms a frame at 1,000 events/s): appending 1,000 events takes about 3 ms (4 ms
with a search active), drawing the view's rows about 5 ms, and the rest of the frame about
2 ms. A filter change or a new search rescans the buffer in 40–80 ms, once per key press.

Ambiguity resolves toward showing a line: a level this view does not know (not one of
`LEVELS`) passes every level threshold, and a component first seen after its group's filter was
set is shown until someone hides it. A surprise line costs a glance; a hidden one can cost an
incident.

Colour is never the only signal: every row carries its level word. Colours live in this
module's `DEFAULT_CSS`, keyed on component classes, so `app.tcss` can restyle them.
"""

from __future__ import annotations

import bisect
import datetime
import functools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NamedTuple, Protocol

from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.cache import LRUCache
from textual.containers import Vertical
from textual.geometry import Size
from textual.message import Message
from textual.reactive import var
from textual.screen import ModalScreen
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Input, SelectionList, Static, TextArea

__all__ = [
    "CONTEXT_LINES",
    "DEFAULT_CAPACITY",
    "LEVELS",
    "Appended",
    "ComponentPicker",
    "LogBuffer",
    "LogContextScreen",
    "LogEvent",
    "LogFilter",
    "LogLine",
    "LogLines",
    "LogsView",
    "Search",
    "SearchError",
    "compile_search",
    "component_group",
    "context_window",
    "format_clock",
    "hidden_by",
    "log_line",
    "next_level",
    "status_text",
]

# 100 s of the 1,000 events/s benchmark, or days of a quiet node. A line costs a few
# hundred bytes (the event's strings plus the formatted row), so a full buffer is tens of MB.
DEFAULT_CAPACITY = 100_000
# The wireframe's "the 50 lines around it".
CONTEXT_LINES = 50

LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")
"""Known levels, lowest first: the names Python's logging gives, which the hub passes on."""
_RANK = {level: rank for rank, level in enumerate(LEVELS)}
# `l` steps through these; "critical" is left out because a threshold that shows only the
# lines nobody could miss anyway is not worth a key press.
LEVEL_THRESHOLDS: tuple[str, ...] = ("debug", "info", "warning", "error")

# "HH:MM:SS.mmm": the clock is fixed width, so the level words line up.
CLOCK_WIDTH = 12
# Wide enough for "CRITICAL", so the component column stays aligned on the rows that matter
# most (the node's log file pads to 7 and lets CRITICAL push its line over by one).
LEVEL_WIDTH = 8
_NO_CLOCK = "--:--:--.---"

# One row per line: a newline becomes a visible mark, a tab four spaces, other control
# characters the replacement character (they would move the terminal's cursor).
_ONE_ROW = str.maketrans(
    {code: "\ufffd" for code in (*range(32), 127)} | {ord("\n"): " ⏎ ", ord("\t"): "    ", ord("\r"): ""}
)
_REGEX_PREFIX = "re:"


class LogEvent(Protocol):
    """What the view reads from an event: `engy_node.hub.Event` has these attributes, and the
    control API's `/v1/events` sends the same names as dict keys (both are accepted)."""

    ts: float
    level: str
    component: str
    message: str


class LogLine(NamedTuple):
    """One log event as the view shows it.

    `LogBuffer` stores each line as a plain tuple of these fields and wraps one on demand. The
    garbage collector stops tracking a plain tuple of strings and floats (it does this for
    exact tuples only, not for subclasses or dataclasses), so a full buffer adds nothing to
    its full collections, which otherwise walked 100,000 lines and stalled a frame by 50–70 ms.
    """

    ts: float
    level: str
    """Lower case, as the hub sends it ("warning"); may be one this view does not know."""
    component: str
    """The logger's name below `engy.` ("gateway.pool")."""
    group: str
    """What the component filter acts on: the component's first part ("gateway")."""
    message: str
    text: str
    """The row as shown and searched: `HH:MM:SS.mmm LEVEL component: message`, the level
    word padded to `LEVEL_WIDTH`."""


@dataclass(frozen=True, slots=True)
class LogFilter:
    """Which lines the view shows. Components are listed by what is hidden, not what is
    shown, so a component that appears later is visible without anyone opting in."""

    min_level: str = "debug"
    hidden_components: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.min_level not in _RANK:
            raise ValueError(f"unknown log level {self.min_level!r}; use one of {', '.join(LEVELS)}")


class SearchError(ValueError):
    """The search text is not a valid regular expression; the message says where."""


@dataclass(frozen=True, slots=True)
class Search:
    query: str
    """As typed, for the status line."""
    pattern: re.Pattern[str]


class Appended(NamedTuple):
    """What one `LogBuffer.append` did to the filtered rows."""

    added: int
    """Rows added at the end."""
    removed: int
    """Rows removed from the start (their lines fell out of the buffer)."""


# ---- plain functions ----------------------------------------------------------------------------


def component_group(component: str) -> str:
    """The part of a component name the filter acts on: "gateway.pool" -> "gateway"."""
    return component.partition(".")[0]


def format_clock(ts: float, tz: datetime.tzinfo | None = None) -> str:
    """`ts` (Unix seconds) as HH:MM:SS.mmm in `tz` (None: this machine's local time).

    A timestamp that is not a real time shows as dashes rather than failing the whole batch.
    """
    try:
        seconds, ms = divmod(math.floor(ts * 1000), 1000)
        return f"{_clock_of_second(seconds, tz)}.{ms:03d}"
    except (ValueError, OverflowError, OSError):
        return _NO_CLOCK


# A busy node logs hundreds of lines per second, and converting a time is most of the cost of
# a row; the converted second is shared by all of them.
@functools.lru_cache(maxsize=1024)
def _clock_of_second(seconds: int, tz: datetime.tzinfo | None) -> str:
    return f"{datetime.datetime.fromtimestamp(seconds, tz):%H:%M:%S}"


def _one_row(text: str) -> str:
    # isprintable() is a fast C scan; almost every message passes it and skips the translate.
    return text if text.isprintable() else text.translate(_ONE_ROW)


def log_line(event: LogEvent | dict[str, Any], tz: datetime.tzinfo | None = None) -> LogLine:
    """The row for one hub event (or one `/v1/events` dict). Missing fields show as empty
    rather than dropping the line: a malformed event is still evidence."""
    return LogLine._make(_row(event, tz))


# `LogLine`'s fields, as the plain tuple the buffer stores (see `LogLine` for why).
_Row = tuple[float, str, str, str, str, str]
# Literal positions, so that a row's field keeps its type (str) where the buffer reads it.
_LEVEL: Final = 1
_GROUP: Final = 3
_TEXT: Final = 5
assert (_LEVEL, _GROUP, _TEXT) == tuple(LogLine._fields.index(name) for name in ("level", "group", "text"))


def _row(event: LogEvent | dict[str, Any], tz: datetime.tzinfo | None) -> _Row:
    # `dict`, not `Mapping`: JSON decodes to dicts, and an ABC isinstance check costs
    # microseconds per event at 1,000 events a second.
    if isinstance(event, dict):
        raw_ts, level = event.get("ts"), event.get("level", "")
        component, message = event.get("component", ""), event.get("message", "")
    else:
        raw_ts, level = getattr(event, "ts", None), getattr(event, "level", "")
        component, message = getattr(event, "component", ""), getattr(event, "message", "")
    ts = float(raw_ts) if isinstance(raw_ts, (int, float)) else math.nan
    level, component, message = str(level).lower(), _one_row(str(component)), _one_row(str(message))
    text = f"{format_clock(ts, tz)} {level.upper():<{LEVEL_WIDTH}} {component}: {message}"
    return (ts, level, component, component_group(component), message, text)


def hidden_by(level: str, group: str, log_filter: LogFilter) -> Literal["component", "level"] | None:
    """Why `log_filter` hides a line of this level and component group, or None when it shows
    it. A line both filters hide counts under "component", the coarser switch, so each hidden
    line is counted exactly once."""
    if group in log_filter.hidden_components:
        return "component"
    rank = _RANK.get(level)
    if rank is not None and rank < _RANK[log_filter.min_level]:
        return "level"
    return None


def next_level(level: str) -> str:
    """The threshold after `level` in `LEVEL_THRESHOLDS`, wrapping from the last to the first."""
    if level not in LEVEL_THRESHOLDS:
        return LEVEL_THRESHOLDS[0]
    return LEVEL_THRESHOLDS[(LEVEL_THRESHOLDS.index(level) + 1) % len(LEVEL_THRESHOLDS)]


def compile_search(query: str) -> Search | None:
    """A search for `query`, case-insensitive: a plain substring, or a regular expression when
    it starts with `re:`. None for an empty query (no search).

    Raises:
        SearchError: the regular expression does not compile; the message quotes the error.
    """
    if not query:
        return None
    if query.startswith(_REGEX_PREFIX):
        try:
            pattern = re.compile(query[len(_REGEX_PREFIX) :], re.IGNORECASE)
        except re.error as err:
            raise SearchError(
                f"{query!r} is not a valid regular expression ({err}); fix it, or drop the re: prefix to search for the text"
            ) from None
    else:
        pattern = re.compile(re.escape(query), re.IGNORECASE)
    return Search(query, pattern)


def context_window(total: int, index: int, size: int = CONTEXT_LINES) -> tuple[int, int]:
    """The `[start, stop)` range of `size` items around `index` among `total`: centred, and
    shifted rather than cut short at either end, so the window is `min(size, total)` long."""
    if not 0 <= index < total:
        raise IndexError(f"index {index} is outside 0..{total - 1}")
    size = min(size, total)
    start = min(max(0, index - size // 2), total - size)
    return start, start + size


# ---- the buffer ---------------------------------------------------------------------------------


class LogBuffer:
    """The last `capacity` log lines, the rows the filter shows, and the rows the search matches.

    Lines are numbered from 0 in the order appended, across drops: `line(n)` is the line
    numbered n while it is still buffered. Rows are positions among the shown lines:
    `number_at_row(row)` and `row_of(number)` translate. No Textual here; the view reads it.
    """

    def __init__(
        self,
        *,
        capacity: int = DEFAULT_CAPACITY,
        log_filter: LogFilter = LogFilter(),
        tz: datetime.tzinfo | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1 line, not {capacity}")
        self.capacity = capacity
        self.tz = tz
        self.filter = log_filter
        self.search: Search | None = None
        self.dropped = 0
        """Lines pushed out of this buffer by newer ones."""
        self.missed = 0
        """Events the reader never got (the node's ring moved past them), as reported to append."""
        self.components: set[str] = set()
        """Every component group seen, for the component picker."""
        self.widest = 0
        """At least the cells in the widest row seen: how far the view can scroll sideways."""
        self.hidden = {"level": 0, "component": 0}
        """Buffered lines the filter hides, by the reason `hidden_by` gives."""
        self._rows: list[_Row] = []
        self._first = 0  # the number of self._rows[0]
        self._visible: list[int] = []  # numbers of shown lines, ascending
        self._matches: list[int] = []  # numbers of shown lines the search matches, ascending

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def visible_count(self) -> int:
        return len(self._visible)

    @property
    def match_count(self) -> int:
        return len(self._matches)

    @property
    def first_number(self) -> int:
        """The number of the oldest buffered line (the next line's number when empty)."""
        return self._first

    def line(self, number: int) -> LogLine:
        index = number - self._first
        if not 0 <= index < len(self._rows):
            raise IndexError(
                f"line {number} is not buffered (lines {self._first}..{self._first + len(self._rows) - 1} are)"
            )
        return LogLine._make(self._rows[index])

    def number_at_row(self, row: int) -> int:
        return self._visible[row]

    def row_of(self, number: int) -> int:
        """The row showing line `number`, or, when the filter hides it, the row of the next
        shown line after it (`visible_count` when there is none)."""
        return bisect.bisect_left(self._visible, number)

    def visible_numbers(self) -> Sequence[int]:
        return self._visible

    def match_numbers(self) -> Sequence[int]:
        return self._matches

    def append(self, events: Iterable[LogEvent | dict[str, Any]], *, missed: int = 0) -> Appended:
        """Add a batch, oldest first; `missed` counts events the reader lost before this batch."""
        self.missed += missed
        new = [_row(event, self.tz) for event in events]
        if not new:
            return Appended(0, 0)
        next_number = self._first + len(self._rows)
        log_filter, search, hidden = self.filter, self.search, self.hidden
        added = 0
        for number, row in enumerate(new, next_number):
            self.components.add(row[_GROUP])
            reason = hidden_by(row[_LEVEL], row[_GROUP], log_filter)
            if reason is not None:
                hidden[reason] += 1
                continue
            added += 1
            self._visible.append(number)
            if search is not None and search.pattern.search(row[_TEXT]):
                self._matches.append(number)
        # No character takes more cells than its UTF-8 bytes, so the encoded length bounds a
        # row's width at C speed; cell_len is exact but slow on non-ASCII text. The cost of the
        # bound is scrolling a few cells past the end of a line with wide characters.
        self.widest = max(self.widest, max(len(row[_TEXT].encode()) for row in new))
        self._rows.extend(new)
        return Appended(added, self._drop_overflow())

    def _drop_overflow(self) -> int:
        overflow = len(self._rows) - self.capacity
        if overflow <= 0:
            return 0
        for row in self._rows[:overflow]:
            reason = hidden_by(row[_LEVEL], row[_GROUP], self.filter)
            if reason is not None:
                self.hidden[reason] -= 1
        del self._rows[:overflow]
        self._first += overflow
        self.dropped += overflow
        removed = bisect.bisect_left(self._visible, self._first)
        del self._visible[:removed]
        del self._matches[: bisect.bisect_left(self._matches, self._first)]
        return removed

    def set_filter(self, log_filter: LogFilter) -> None:
        """Show what `log_filter` lets through (rescans the buffer)."""
        self.filter = log_filter
        self.hidden = {"level": 0, "component": 0}
        self._visible = []
        for number, row in enumerate(self._rows, self._first):
            reason = hidden_by(row[_LEVEL], row[_GROUP], log_filter)
            if reason is None:
                self._visible.append(number)
            else:
                self.hidden[reason] += 1
        self._rematch()

    def set_search(self, query: str) -> None:
        """Search for `query` (see `compile_search`; empty clears the search).

        Raises:
            SearchError: an invalid `re:` expression; the previous search stays in place.
        """
        self.search = compile_search(query)
        self._rematch()

    def _rematch(self) -> None:
        if self.search is None:
            self._matches = []
            return
        found, rows, first = self.search.pattern.search, self._rows, self._first
        self._matches = [number for number in self._visible if found(rows[number - first][_TEXT])]

    def next_match(self, number: int | None, *, forward: bool = True) -> int | None:
        """The number of the first match after line `number` (before it, with forward=False),
        wrapping around; from None, the oldest (newest) match. None when nothing matches."""
        matches = self._matches
        if not matches:
            return None
        if number is None:
            return matches[0] if forward else matches[-1]
        if forward:
            index = bisect.bisect_right(matches, number)
            return matches[index] if index < len(matches) else matches[0]
        index = bisect.bisect_left(matches, number)
        return matches[index - 1] if index > 0 else matches[-1]

    def context(self, number: int, size: int = CONTEXT_LINES) -> tuple[list[LogLine], int]:
        """Up to `size` buffered lines around line `number`, whatever the filter, and the
        index of that line among them. Unfiltered on purpose: the line that explains an error
        is often from a component or level the filter hides."""
        index = number - self._first
        start, stop = context_window(len(self._rows), index, size)
        return [LogLine._make(row) for row in self._rows[start:stop]], index - start


def status_text(buffer: LogBuffer, *, following: bool) -> str:
    """The one-line summary under the log: counts, active filters, follow state and search."""
    parts = [f"{len(buffer):,} lines"]
    if buffer.visible_count != len(buffer):
        parts[0] += f" ({buffer.visible_count:,} shown)"
    # An active filter is named even while it hides nothing, so nobody wonders where lines went.
    if buffer.filter.min_level != LEVELS[0]:
        parts.append(f"{buffer.hidden['level']:,} filtered out by level (below {buffer.filter.min_level})")
    if buffer.filter.hidden_components:
        hidden = ", ".join(sorted(buffer.filter.hidden_components))
        parts.append(f"{buffer.hidden['component']:,} filtered out by component ({hidden})")
    if buffer.dropped:
        parts.append(f"{buffer.dropped:,} oldest dropped (keeps {buffer.capacity:,})")
    if buffer.missed:
        parts.append(f"{buffer.missed:,} missed (the node's ring moved on)")
    parts.append("following" if following else "paused: f or end follows")
    if buffer.search is not None:
        count = buffer.match_count
        parts.append(f"search {buffer.search.query!r} {count:,} match{'' if count == 1 else 'es'}")
    return " · ".join(parts)


def _context_row(line: LogLine, tz: datetime.tzinfo | None) -> str:
    # A pasted excerpt needs the date the row's clock leaves out.
    try:
        date = datetime.datetime.fromtimestamp(math.floor(line.ts), tz).strftime("%Y-%m-%d ")
    except (ValueError, OverflowError, OSError):
        date = "---------- "
    return date + line.text


# ---- widgets ------------------------------------------------------------------------------------


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
        text.stylize(self._style(line.level if line.level in _RANK else "info"), level_start, level_end)
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
        rows = [_context_row(each, self.buffer.tz) for each in around]
        self.app.push_screen(LogContextScreen(rows, index))


class LogContextScreen(ModalScreen[None]):
    """The lines around a selected one, as plain text to read, select and copy."""

    BINDINGS = [
        Binding("y", "copy", "Copy all", id="logs.context.copy", tooltip="Copy these lines to the clipboard."),
        Binding("escape", "close", "Close", id="logs.context.close", tooltip="Back to the log."),
    ]
    DEFAULT_CSS = """
    LogContextScreen {
        align: center middle;
        & > Vertical { width: 95%; height: 90%; border: round $primary; background: $surface; }
        & TextArea, & TextArea:focus { height: 1fr; border: none; }
        & #context-hint { height: 1; color: $text-muted; }
    }
    """

    def __init__(self, rows: Sequence[str], selected: int) -> None:
        """`rows` are the lines as text, `selected` the index of the one asked about."""
        super().__init__()
        self.rows = list(rows)
        self.selected = selected
        self.text = "\n".join(self.rows)
        """What y copies."""

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = f"{len(self.rows)} lines around the selected one (all components and levels)"
            yield TextArea(self.text, read_only=True, soft_wrap=False, id="context-text")
            yield Static(
                "y copies all · select with the mouse or shift+arrows, ctrl+c copies that · escape closes",
                id="context-hint",
            )

    def on_mount(self) -> None:
        text_area = self.query_one(TextArea)
        text_area.move_cursor((self.selected, 0), center=True)
        text_area.focus()

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.notify(f"copied {len(self.rows)} lines", title="logs")

    def action_close(self) -> None:
        self.dismiss(None)


class ComponentPicker(ModalScreen[frozenset[str]]):
    """Tick the component groups to show; the screen returns the ones left unticked (hidden)."""

    BINDINGS = [
        Binding("escape", "done", "Done", id="logs.components.done", tooltip="Apply and go back to the log."),
        Binding("a", "show_all", "Show all", id="logs.components.all", tooltip="Tick every component."),
    ]
    DEFAULT_CSS = """
    ComponentPicker {
        align: center middle;
        & > Vertical { width: 50; height: auto; max-height: 80%; border: round $primary; background: $surface; }
        & SelectionList, & SelectionList:focus { height: auto; max-height: 20; border: none; }
        & #components-hint { height: 1; color: $text-muted; }
    }
    """

    def __init__(self, components: Sequence[str], hidden: frozenset[str]) -> None:
        super().__init__()
        self.components = list(components)
        self.hidden = hidden

    def compose(self) -> ComposeResult:
        with Vertical() as box:
            box.border_title = "components shown"
            if self.components:
                yield SelectionList[str](*((name, name, name not in self.hidden) for name in self.components))
            else:
                yield Static("no components seen yet", id="components-none")
            yield Static("space toggles · a shows all · escape applies", id="components-hint")

    def action_show_all(self) -> None:
        for selection_list in self.query(SelectionList):
            selection_list.select_all()

    def action_done(self) -> None:
        shown: set[str] = set()
        for selection_list in self.query(SelectionList):
            shown.update(selection_list.selected)
        # Hidden components nobody could untick here (none seen yet) stay hidden.
        self.dismiss(
            frozenset(name for name in self.components if name not in shown) | (self.hidden - set(self.components))
        )
