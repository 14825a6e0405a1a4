"""What the miner tab's blocks share: the style names and symbols, the level a box is framed by,
and counts and milliseconds that read n/a when unknown (None).

Plain values and functions, like `engy_tui.widgets.cells` (whose readers they use); only
`lines_content` touches Textual, to turn the blocks' cells into content with this tab's
`STYLES`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from textual.content import Content

from engy_tui.widgets.cells import NA, Cell, cells_content
from engy_tui.widgets.cells import as_number as _num

__all__ = [
    "BAD",
    "Level",
    "Line",
    "NA_CELL",
    "OK",
    "SEP",
    "STYLES",
    "WARN",
    "count_text",
    "lines_content",
    "ms_text",
    "plural",
]

OK = "✔"
WARN = "⚠"
BAD = "✘"
SEP = " · "


STYLES: dict[str, str] = {
    "": "",
    "header": "bold $foreground-muted",
    "na": "$foreground-muted",
    "ok": "$text-success",
    "info": "$text-primary",
    "warning": "$text-warning",
    "error": "bold $text-error",
    "bar": "$text-accent",
}
"""Cell style names -> Textual styles (theme variables, so every theme works). `$foreground-muted`
rather than `$text-muted`, which renders white inside Content styles in this Textual version."""

Line = tuple[Cell, ...]
Level = Literal["", "ok", "warning", "error", "na"]
NA_CELL = Cell(NA, "na")


def count_text(value: int | None) -> str:
    return NA if value is None else f"{value:,}"


def plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def ms_text(value: float | None) -> str:
    ms = _num(value)  # a float from the wire may be nan or inf
    if ms is None:
        return NA
    return f"{ms:.1f}" if abs(ms) < 10 else f"{ms:,.0f}"


def lines_content(lines: Iterable[Sequence[Cell]]) -> Content:
    # Content.assemble never parses markup: log lines, reasons and commands come from outside.
    return cells_content(lines, STYLES)
