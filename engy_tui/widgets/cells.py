"""What every dashboard panel is made of: cells of text with a style name, the readers that take
values out of untrusted JSON (a hub state from another process, a control API answer), and the
step that turns lines of cells into Textual content.

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

from textual.content import Content

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


def cells_content(lines: Iterable[Sequence[Cell]], styles: Mapping[str, str]) -> Content:
    """Lines of cells as Textual content, one line each, styled from `styles`."""
    return Content("\n").join(
        Content.assemble(*((cell.text, styles.get(cell.style, "")) for cell in line)) for line in lines
    )
