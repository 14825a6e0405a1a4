"""The "Submissions" block: did the validator's submissions land?

The newest first: local time and age, block, epoch, kind, and how each ended (✔ included, or
✘ the chain's refusal and that nothing was recorded). Clock times are local time.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from engy_tui.widgets.cells import NA, Cell, format_age
from engy_tui.widgets.cells import as_int as _int
from engy_tui.widgets.cells import as_list as _list
from engy_tui.widgets.cells import as_map as _map
from engy_tui.widgets.cells import as_number as _num
from engy_tui.widgets.cells import as_text as _text
from engy_tui.widgets.validator.common import ERROR, NA_CELL, OK, Line, pad_columns

__all__ = [
    "MAX_SUBMISSIONS",
    "submission_lines",
]

MAX_SUBMISSIONS = 8
"""Rows shown before the rest is counted in one line."""


def _clock(ts: Any) -> str:
    seconds = _num(ts)
    if seconds is None:
        return "--:--:--"
    try:
        return time.strftime("%H:%M:%S", time.localtime(seconds))
    except (OverflowError, OSError, ValueError):
        return "--:--:--"


def submission_lines(validator: Mapping[str, Any] | None, now: float, *, max_rows: int = MAX_SUBMISSIONS) -> list[Line]:
    """The newest submissions first: local time and age, block, epoch, kind, and how it ended
    (✔ included, or ✘ the chain's refusal and that nothing was recorded)."""
    submissions = [_map(s) for s in _list(_map(validator).get("submissions"))]
    if not submissions:
        return [(Cell("no submissions from this process yet", "na"),)]
    rows: list[Line] = []
    for submission in submissions[: max(0, max_rows)]:
        age = format_age(now, submission.get("ts"))
        block = _int(submission.get("block"))
        epoch = _int(submission.get("epoch"))
        kind = _text(submission.get("kind"))
        landed = submission.get("landed")
        detail = _text(submission.get("detail"))
        if landed is True:
            end = Cell(f"{OK} {detail or 'landed'}", "ok")
        elif landed is False:
            end = Cell(f"{ERROR} {detail or 'refused'} (not recorded; retried next interval)", "error")
        else:
            end = Cell(f"{detail or NA}", "" if detail else "na")
        rows.append(
            (
                Cell(_clock(submission.get("ts")), "" if age is not None else "na"),
                Cell(f"{age} ago" if age is not None else NA, "" if age is not None else "na"),
                Cell(f"block {block:,}") if block is not None else Cell(f"block {NA}", "na"),
                Cell(f"epoch {epoch}") if epoch is not None else Cell(f"epoch {NA}", "na"),
                Cell(kind) if kind else NA_CELL,
                end,
            )
        )
    lines = list(pad_columns(rows, "lrrlll"))
    if len(submissions) > len(rows):
        older = len(submissions) - len(rows)
        lines.append((Cell(f"… {older} older", "na"),))
    return lines
