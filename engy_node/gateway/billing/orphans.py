"""Which open holds no live request can own, judged by how long this process has seen them open.

A gateway worker that dies leaves its requests' holds open; the first process sweeps them back
to the buyers. A hold's `created_at` is wall-clock time, and the wall clock steps (NTP, a VM
resumed, an operator's `date`): aging holds by it would release, after a step forward, the hold
of a request still streaming, whose settle then finds it closed and never charges the answer.
So the sweep ages holds by its own monotonic clock instead: a hold becomes an orphan once the
sweep has seen it open, continuously, for longer than any request can hold money. A hold the
sweep has not seen before starts its count now, whatever its timestamp says; the first process
releases every hold left from before it started (`Store.recover_open_holds`), so none is older
than the sweep's first look.

Pure: open hold ids and a monotonic time in, the holds to release and what to remember out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def sweep(
    first_seen: Mapping[int, float], open_now: Iterable[int], *, now: float, max_age_s: float
) -> tuple[list[int], dict[int, float]]:
    """(hold ids to release, in order; when each still-open hold was first seen open). A hold
    that closed since the last sweep is forgotten; one seen open for more than `max_age_s` is
    released and forgotten."""
    seen = {hold_id: first_seen.get(hold_id, now) for hold_id in open_now}
    release = sorted(hold_id for hold_id, since in seen.items() if now - since > max_age_s)
    for hold_id in release:
        del seen[hold_id]
    return release, seen
