"""Jittered exponential backoff, the one schedule every reconnecting or restarting loop uses.

Pure: the random draw comes in as `jitter` in [0, 1), so tests pin it and a loop's schedule is
reproducible from its RNG. Full jitter on the top half of the window keeps a fleet of miners that
lost the same gateway from re-dialling in lockstep, while never retrying sooner than half the
nominal delay.
"""

from __future__ import annotations


def backoff_delay(*, attempt: int, base_s: float, cap_s: float, jitter: float) -> float:
    """Seconds to wait before retry number `attempt` (1 = the first retry)."""
    if attempt < 1:
        raise ValueError("attempt counts from 1")
    if not 0.0 <= jitter < 1.0:
        raise ValueError("jitter must be in [0, 1)")
    nominal = min(cap_s, base_s * 2.0 ** min(attempt - 1, 62))
    return nominal * (0.5 + 0.5 * jitter)
