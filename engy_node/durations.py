"""How long something took or has left, in the one wording every reader of a node shares.

The TUI, `engy-node status`, the alerts' webhooks, the gate explanations and the validator's log
and health messages all say durations to an operator. Each used to format them its own way, so
one span read `3 h 5 min` in the TUI, `3 h 05 min` in a gate's next chance, `185 min` in the
validator's log and `3.1 h` in its health message. They now all say it as `duration_text` does.

The wording: whole seconds up to two minutes (a heartbeat 61 s old reads as late, `1 min` would
hide it), then whole minutes up to two hours, then hours and minutes up to two days, then days and
hours. Two units at most, the larger first; each unit floors, so a span never reads longer than
it is. Pure: the caller computes the span (from its own `now`).
"""

from __future__ import annotations

import math

MINUTE_S = 60
HOUR_S = 3600
DAY_S = 86400


def duration_text(seconds: float) -> str:
    """`41 s`, `12 min`, `3 h 5 min`, `2 d 4 h`; a negative span (a clock stepped back, a time
    from another host) reads `0 s`. Raises ValueError for a span that is not a finite number."""
    if not math.isfinite(seconds):
        raise ValueError(f"a duration must be a finite number of seconds, got {seconds!r}")
    whole = max(0, int(seconds))
    if whole < 2 * MINUTE_S:
        return f"{whole} s"
    if whole < 2 * HOUR_S:
        return f"{whole // MINUTE_S} min"
    if whole < 2 * DAY_S:
        return f"{whole // HOUR_S} h {whole % HOUR_S // MINUTE_S} min"
    return f"{whole // DAY_S} d {whole % DAY_S // HOUR_S} h"
