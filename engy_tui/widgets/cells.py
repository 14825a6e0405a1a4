"""What every dashboard panel is made of: cells of text with a style name, the readers that take
values out of untrusted JSON (a hub state from another process, a control API answer), the
formats more than one panel writes (durations, ages, short hotkeys), the step that turns
lines of cells into Textual content, and `fit_columns`, which keeps a table's key columns whole
on a narrow terminal by leaving out its low-value ones rather than cutting every row at the edge.

Why cells. A panel's text is decided by plain functions tested without a terminal; they return
`Cell(text, style)`, and only the widget maps style names to the theme (each panel has its
`STYLES`). Content is assembled, never parsed, so a `[` in a reason or a URL from the network is
shown as text, not read as markup.

The readers never raise and never guess: a value of the wrong type is None, and the panel shows
"n/a" for it rather than a 0 that would claim something.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from rich.cells import cell_len
from textual.content import Content

from engy_node.durations import duration_text

NA = "n/a"
DASH = "—"


class Cell(NamedTuple):
    text: str
    style: str = ""
    """A key of the panel's `STYLES`."""


def as_map(value: Any) -> Mapping[Any, Any]:
    return value if isinstance(value, Mapping) else {}


def as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else []


def as_int(value: Any) -> int | None:
    # bool is an int subclass; True is never a count.
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def as_number(value: Any) -> float | None:
    """A finite number as a float, or None (bools, strings, nan, inf and too-large ints)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def as_text(value: Any) -> str | None:
    """A non-empty string on one line (control characters would break a panel's rows), or None."""
    if not isinstance(value, str) or not value.strip():
        return None
    if value.isprintable():
        return value
    return "".join(ch if ch.isprintable() else " " for ch in value)


def format_duration(seconds: float | None) -> str:
    """ "41 s", "12 min", "3 h 5 min", "2 d 4 h" (`engy_node.durations.duration_text`, as the
    node's text and alerts say it); n/a for an unknown or non-finite time."""
    if seconds is None or not math.isfinite(seconds):
        return NA
    return duration_text(seconds)


def format_age(now: float, then: Any) -> str | None:
    """How long ago `then` (a unix time) was, or None when it is not a usable time."""
    then_s = as_number(then)
    if then_s is None or not math.isfinite(now):
        return None
    return format_duration(now - then_s)


def short_hotkey(ss58: Any, names: Mapping[str, str] | None = None) -> str:
    """The local name of `ss58` if `names` ({ss58: name}) has one, else "5F3s…k9Qa"; n/a for a
    missing hotkey."""
    text = as_text(ss58)
    if text is None:
        return NA
    if names and text in names:
        return names[text]
    return text if len(text) <= 10 else f"{text[:4]}…{text[-4:]}"


def cells_content(lines: Iterable[Sequence[Cell]], styles: Mapping[str, str]) -> Content:
    """Lines of cells as Textual content, one line each, styled from `styles`."""
    return Content("\n").join(
        Content.assemble(*((cell.text, styles.get(cell.style, "")) for cell in line)) for line in lines
    )


def fit_columns(
    rows: Sequence[Sequence[Cell]], width: int | None, *, drop: Sequence[str], gap: int = 2
) -> list[tuple[Cell, ...]]:
    """`rows` (the header row first) without the columns whose headers are in `drop`, left out
    in that order only until the table fits in `width` cells with `gap` cells between columns.
    The other columns always stay, even when they alone are too wide; `width` None keeps all."""
    if not rows:
        return []
    keep = list(range(len(rows[0])))

    def wide() -> bool:
        widths = [max(cell_len(row[c].text) for row in rows if c < len(row)) for c in keep]
        return width is not None and sum(widths) + gap * (len(keep) - 1) > width

    headers = [cell.text.strip() for cell in rows[0]]
    for name in drop:
        if not wide():
            break
        if name in headers and headers.index(name) in keep:
            keep.remove(headers.index(name))
    return [tuple(row[c] for c in keep if c < len(row)) for row in rows]


def room(widget: Any) -> int:
    """Cells a panel's lines have inside its border and padding: from its own width once laid
    out, else from the screen's (a tab drawn as it becomes visible is not laid out yet)."""
    if widget.size.width:
        return int(widget.size.width)
    return max(0, widget.app.size.width - widget.styles.gutter.width - widget.styles.margin.width)
