"""What the validator tab's blocks and the chain tab share: the style names and symbols, counts
that read n/a when unknown, shares of a weight row and their bars, columns padded into a table,
and the node's names by ss58.

Plain functions over plain values, like `engy_tui.widgets.cells`; only
`lines_content` touches Textual, to turn the blocks' cells into content with this tab's
`STYLES`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

from rich.cells import cell_len
from textual.content import Content

from engy_tui.widgets.cells import NA, Cell, cells_content

__all__ = [
    "BAR_WIDTH",
    "ERROR",
    "Line",
    "NA_CELL",
    "OK",
    "STYLES",
    "WARN",
    "count_or_na",
    "header_line",
    "lines_content",
    "names_by_ss58",
    "pad_columns",
    "percent_text",
    "share_bar",
    "share_of",
]

OK = "✔"
WARN = "⚠"
ERROR = "✘"

BAR_WIDTH = 20
"""Cells of a 100% share bar; eighth blocks make the bar exact to 1/160."""


STYLES: dict[str, str] = {
    "": "",
    "header": "bold $text-muted",
    "na": "$text-muted",
    "ok": "$text-success",
    "warning": "$text-warning",
    "error": "bold $text-error",
    "bar": "$text-accent",
}
"""Cell style names -> Textual styles (theme variables, so every theme works)."""


Line = tuple[Cell, ...]
NA_CELL = Cell(NA, "na")


def count_or_na(value: int | None) -> str:
    return NA if value is None else f"{value:,}"


def names_by_ss58(names: Mapping[str, str] | None) -> dict[str, str]:
    """{name: ss58} (the node's `hotkeys`) -> {ss58: name}."""
    return {ss58: name for name, ss58 in (names or {}).items()}


def share_of(part: int | None, whole: int) -> float | None:
    """part/whole for a share of a weight row; None when unknown, negative (not a weight) or
    not a float."""
    if part is None or part < 0 or whole <= 0:
        return None
    try:
        return part / whole
    except OverflowError:
        return None


def percent_text(share: float | None) -> str:
    return NA if share is None else f"{share * 100:.1f}%"


def share_bar(share: float | None, width: int = BAR_WIDTH) -> str:
    """`share` (0..1) of `width` cells in eighth blocks; any share above 0 shows at least a sliver,
    so a small weight never looks like none."""
    if share is None or not math.isfinite(share) or share <= 0 or width <= 0:
        return ""
    eighths = max(1, round(min(share, 1.0) * width * 8))
    full, rest = divmod(eighths, 8)
    return "█" * full + (" ▏▎▍▌▋▊▉"[rest] if rest else "")


def pad_columns(rows: Sequence[Line], align: str, gap: str = "  ") -> tuple[Line, ...]:
    """Pad every cell to its column's widest text ("l"/"r" per column in `align`), with `gap`
    between columns; the last column is not padded on the right."""
    if not rows:
        return ()
    columns = max(len(row) for row in rows)
    widths = [max((cell_len(row[c].text) for row in rows if c < len(row)), default=0) for c in range(columns)]
    padded = []
    for row in rows:
        cells = []
        for c, cell in enumerate(row):
            right = c < len(align) and align[c] == "r"
            room = " " * (widths[c] - cell_len(cell.text))
            if c == len(row) - 1 and not right:
                cells.append(cell)
                continue
            text = room + cell.text if right else cell.text + room
            cells.append(cell._replace(text=text + ("" if c == len(row) - 1 else gap)))
        padded.append(tuple(cells))
    return tuple(padded)


def header_line(*names: str) -> Line:
    return tuple(Cell(name, "header") for name in names)


def lines_content(lines: Iterable[Sequence[Cell]]) -> Content:
    """Cells as Textual content, one line each (styles from `STYLES`; text never parsed as markup)."""
    return cells_content(lines, STYLES)
