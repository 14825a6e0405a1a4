"""Which lines are kept, which are shown, and which match: `LogBuffer` keeps the last
`DEFAULT_CAPACITY` lines (oldest dropped and counted), the filtered index and the search
matches, with no Textual in it; `status_text` is the line under the view that says so.

Work per frame is proportional to the batch, not the buffer. Line numbers count every line ever
appended, so dropping the oldest lines never renumbers the rest: the filtered index and the
match list hold line numbers, and only the new lines are filtered and searched. Changing a
filter or the search rescans the buffer once, on a key press. The tests check the buffer
against a brute-force recomputation.

Cost, measured by hand on one CI core with 100,000 lines buffered (the issue's target is
≤ 50 ms a frame at 1,000 events/s): appending 1,000 events takes about 3 ms (4 ms with a search
active); a filter change or a new search rescans the buffer in 40–80 ms, once per key press.
"""

from __future__ import annotations

import bisect
import datetime
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from engy_tui.widgets.logs.filters import LEVELS, SHOW_ALL, LogFilter, Search, compile_search, hidden_by
from engy_tui.widgets.logs.rows import GROUP_AT, LEVEL_AT, TEXT_AT, LogEvent, LogLine, Row, event_row

__all__ = [
    "Appended",
    "CONTEXT_LINES",
    "DEFAULT_CAPACITY",
    "LogBuffer",
    "context_window",
    "status_text",
]

# 100 s of the 1,000 events/s benchmark, or days of a quiet node. A line costs a few
# hundred bytes (the event's strings plus the formatted row), so a full buffer is tens of MB.
DEFAULT_CAPACITY = 100_000
# The wireframe's "the 50 lines around it".
CONTEXT_LINES = 50


class Appended(NamedTuple):
    """What one `LogBuffer.append` did to the filtered rows."""

    added: int
    """Rows added at the end."""
    removed: int
    """Rows removed from the start (their lines fell out of the buffer)."""


def context_window(total: int, index: int, size: int = CONTEXT_LINES) -> tuple[int, int]:
    """The `[start, stop)` range of `size` items around `index` among `total`: centred, and
    shifted rather than cut short at either end, so the window is `min(size, total)` long."""
    if not 0 <= index < total:
        raise IndexError(f"index {index} is outside 0..{total - 1}")
    size = min(size, total)
    start = min(max(0, index - size // 2), total - size)
    return start, start + size


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
        log_filter: LogFilter = SHOW_ALL,
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
        self._rows: list[Row] = []
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
        new = [event_row(event, self.tz) for event in events]
        if not new:
            return Appended(0, 0)
        next_number = self._first + len(self._rows)
        log_filter, search, hidden = self.filter, self.search, self.hidden
        added = 0
        for number, row in enumerate(new, next_number):
            self.components.add(row[GROUP_AT])
            reason = hidden_by(row[LEVEL_AT], row[GROUP_AT], log_filter)
            if reason is not None:
                hidden[reason] += 1
                continue
            added += 1
            self._visible.append(number)
            if search is not None and search.pattern.search(row[TEXT_AT]):
                self._matches.append(number)
        # No character takes more cells than its UTF-8 bytes, so the encoded length bounds a
        # row's width at C speed; cell_len is exact but slow on non-ASCII text. The cost of the
        # bound is scrolling a few cells past the end of a line with wide characters.
        self.widest = max(self.widest, max(len(row[TEXT_AT].encode()) for row in new))
        self._rows.extend(new)
        return Appended(added, self._drop_overflow())

    def _drop_overflow(self) -> int:
        overflow = len(self._rows) - self.capacity
        if overflow <= 0:
            return 0
        for row in self._rows[:overflow]:
            reason = hidden_by(row[LEVEL_AT], row[GROUP_AT], self.filter)
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
            reason = hidden_by(row[LEVEL_AT], row[GROUP_AT], log_filter)
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
        self._matches = [number for number in self._visible if found(rows[number - first][TEXT_AT])]

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
