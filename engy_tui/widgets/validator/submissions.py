"""The "Submissions" block: did the validator's submissions land?

The newest first: local time and age, block, epoch, kind, and how each ended (✔ included, or
✘ the chain's refusal and that nothing was recorded). Clock times are local time.
"""

from __future__ import annotations

import time

from engy_node.snapshots import ValidatorState
from engy_tui.widgets.cells import NA, Cell, format_age
from engy_tui.widgets.cells import as_number as _num
from engy_tui.widgets.cells import as_text as _text
from engy_tui.widgets.validator.common import ERROR, NA_CELL, OK, Line, pad_columns

__all__ = [
    "MAX_SUBMISSIONS",
    "submission_lines",
]

MAX_SUBMISSIONS = 8
"""Rows shown before the rest is counted in one line."""


def _clock(ts: float | None) -> str:
    seconds = _num(ts)
    if seconds is None:
        return "--:--:--"
    try:
        return time.strftime("%H:%M:%S", time.localtime(seconds))
    except (OverflowError, OSError, ValueError):
        return "--:--:--"


def submission_lines(validator: ValidatorState | None, now: float, *, max_rows: int = MAX_SUBMISSIONS) -> list[Line]:
    """The newest submissions first: local time and age, block, epoch, kind, and how it ended
    (✔ included, or ✘ the chain's refusal and that nothing was recorded)."""
    submissions = validator.submissions if validator is not None else ()
    if not submissions:
        return [(Cell("no submissions from this process yet", "na"),)]
    rows: list[Line] = []
    for submission in submissions[: max(0, max_rows)]:
        age = format_age(now, submission.ts)
        block = submission.block
        epoch = submission.epoch
        kind = _text(submission.kind)
        detail = _text(submission.detail)
        if submission.landed:
            end = Cell(f"{OK} {detail or 'landed'}", "ok")
        else:
            end = Cell(f"{ERROR} {detail or 'refused'} (not recorded; retried next interval)", "error")
        rows.append(
            (
                Cell(_clock(submission.ts), "" if age is not None else "na"),
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
