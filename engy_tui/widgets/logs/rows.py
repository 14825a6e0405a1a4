"""What a log line says as a row: `LogLine`, built from a hub event (or a `/v1/events` dict) by
`log_line`, and the plain tuple `LogBuffer` stores instead of it (`event_row`).

A line is one row: newlines and control characters in a message are shown as visible marks
rather than breaking the row grid that scrolling and the cursor rely on. A malformed event still
makes a row (missing fields show as empty): it is still evidence.
"""

from __future__ import annotations

import datetime
import functools
import math
from typing import Any, Final, NamedTuple, Protocol

__all__ = [
    "CLOCK_WIDTH",
    "GROUP_AT",
    "LEVEL_AT",
    "LEVEL_WIDTH",
    "LogEvent",
    "LogLine",
    "Row",
    "TEXT_AT",
    "component_group",
    "context_row",
    "event_row",
    "format_clock",
    "log_line",
]

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
    return LogLine._make(event_row(event, tz))


# `LogLine`'s fields, as the plain tuple the buffer stores (see `LogLine` for why).
Row = tuple[float, str, str, str, str, str]
# Literal positions, so that a row's field keeps its type (str) where the buffer reads it.
LEVEL_AT: Final = 1
GROUP_AT: Final = 3
TEXT_AT: Final = 5
assert (LEVEL_AT, GROUP_AT, TEXT_AT) == tuple(LogLine._fields.index(name) for name in ("level", "group", "text"))


def event_row(event: LogEvent | dict[str, Any], tz: datetime.tzinfo | None) -> Row:
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


def context_row(line: LogLine, tz: datetime.tzinfo | None) -> str:
    # A pasted excerpt needs the date the row's clock leaves out.
    try:
        date = datetime.datetime.fromtimestamp(math.floor(line.ts), tz).strftime("%Y-%m-%d ")
    except (ValueError, OverflowError, OSError):
        date = "---------- "
    return date + line.text
