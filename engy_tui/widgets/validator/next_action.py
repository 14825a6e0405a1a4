"""The "Next action" block: what does the validator do next, and when?

The resubmit countdown against the weights rate limit, the room left before the activity
cutoff, the last tick and how it went, commit-reveal and the tempo, and the provider it polls.
"""

from __future__ import annotations

from engy_node.snapshots import ChainState, ValidatorState
from engy_tui.widgets.cells import NA, Cell, format_age, format_duration
from engy_tui.widgets.cells import as_text as _text
from engy_tui.widgets.validator.common import ERROR, NA_CELL, OK, WARN, Line, count_or_na
from engy_tui.widgets.validator.standing import block_seconds, idle_blocks, resubmit_left

__all__ = [
    "OUTCOMES",
    "next_action_lines",
]


def _interval_cells(validator: ValidatorState) -> Line:
    interval = validator.resubmit_blocks
    limit = validator.weights_rate_limit
    if interval is None or limit is None:
        return (Cell(f"interval {count_or_na(interval)} · rate limit {count_or_na(limit)}", "na"),)
    if interval > limit:
        return (Cell(f"interval {interval:,} > rate limit {limit:,} "), Cell(OK, "ok"))
    return (Cell(f"interval {interval:,} ≤ rate limit {limit:,} {WARN}", "warning"),)


OUTCOMES: dict[str, tuple[str, str]] = {
    "applied": ("ok", OK),
    "resubmitted": ("ok", OK),
    "skipped:too-soon": ("ok", OK),
    "resubmitted:cached": ("warning", WARN),
    "standby:cached": ("warning", WARN),
    "standby:burn": ("warning", WARN),
    "skipped:replay": ("warning", WARN),
    "fetch-failed": ("error", ERROR),
    "chain-failed": ("error", ERROR),
    "submit-failed": ("error", ERROR),
    "error": ("error", ERROR),
}
"""`TickResult.outcome` -> (style, symbol); `rejected:<reason>` is a warning."""


def _outcome_cell(outcome: str | None) -> Cell:
    text = _text(outcome)
    if text is None:
        return NA_CELL
    style, symbol = OUTCOMES.get(text, ("warning", WARN) if text.startswith("rejected:") else ("", ""))
    return Cell(f"{text} {symbol}".rstrip(), style)


def next_action_lines(validator: ValidatorState | None, now: float, *, chain: ChainState | None = None) -> list[Line]:
    """The "Next action" box: the resubmit countdown against the rate limit, the room left
    before the activity cutoff, the last tick, commit-reveal, the provider."""
    validator = validator if validator is not None else ValidatorState()
    block_s = block_seconds(validator, chain)
    left, estimated = resubmit_left(validator, chain, now)
    approx = "~" if estimated else ""
    if left is None:
        if validator.last_submit_block is None and validator.last_applied is None:
            countdown: Line = (Cell("first submit when the provider publishes an epoch", "na"),)
        else:
            countdown = (Cell("resubmit in "), NA_CELL)
    elif left > 0:
        eta = f" (~{_eta(left, block_s)})" if block_s is not None else ""
        countdown = (Cell(f"resubmit in {approx}{left:,} blocks{eta}"),)
    elif left == 0:
        countdown = (Cell("resubmit due: the next tick submits"),)
    else:
        countdown = (Cell(f"resubmit due {approx}{-left:,} blocks ago"),)
    lines: list[Line] = [(*countdown, Cell(" · "), *_interval_cells(validator))]

    cutoff = validator.activity_cutoff
    idle = idle_blocks(validator, chain)
    if cutoff is None:
        lines.append((Cell("activity cutoff "), NA_CELL))
    elif idle is None:
        lines.append((Cell(f"activity cutoff {cutoff:,} blocks: spare "), NA_CELL))
    else:
        spare = cutoff - idle
        if spare < 0:
            lines.append(
                (Cell(f"activity cutoff {cutoff:,} blocks: passed {-spare:,} blocks ago {ERROR} inactive", "error"),)
            )
        elif 2 * idle > cutoff:
            lines.append((Cell(f"activity cutoff {cutoff:,} blocks: only {spare:,} to spare {WARN}", "warning"),))
        else:
            lines.append((Cell(f"activity cutoff {cutoff:,} blocks: {spare:,} to spare "), Cell(OK, "ok")))

    age = format_age(now, validator.last_tick)
    if age is None:
        lines.append((Cell("last tick "), NA_CELL))
    else:
        lines.append((Cell(f"last tick {age} ago: "), _outcome_cell(validator.last_outcome)))

    reveal = validator.commit_reveal
    tempo = validator.tempo
    lines.append(
        (
            Cell("commit-reveal: "),
            Cell("on (weights count after the reveal)") if reveal else Cell("off") if reveal is False else NA_CELL,
            Cell(f" · tempo {count_or_na(tempo)}" + (f" · {block_s:g} s blocks" if block_s is not None else "")),
        )
    )
    provider = _text(validator.provider)
    lines.append((Cell("provider "), Cell(provider) if provider else NA_CELL))
    return lines


def _eta(blocks: int, block_s: float) -> str:
    try:
        return format_duration(blocks * block_s)
    except OverflowError:  # an integer too large for a float
        return NA
