"""Jittered exponential backoff: the one schedule every restarting or re-dialling loop uses.

Pure: the random draw comes in as `jitter` in [0, 1), so tests pin it and a loop's schedule is
reproducible from its RNG.
"""

from __future__ import annotations

import math

# "Equal jitter": at least half of the exponential delay is kept, so the backoff still grows
# with every failure, and up to half is random, so servers that failed together (a shared power
# or driver event) do not all restart, and read their weights from the same disk, in lockstep.
JITTER_SPREAD = 0.5

# 2**62 times any sensible base is far above any cap; bounding the exponent keeps the float
# arithmetic finite for any failure count.
_MAX_DOUBLINGS = 62


def backoff_delay(*, consecutive_failures: int, jitter: float, base_s: float = 1.0, cap_s: float = 60.0) -> float:
    """Seconds to wait before restarting after `consecutive_failures` failures in a row.

    The delay doubles per failure from `base_s` up to `cap_s`, then loses a random share of up
    to `JITTER_SPREAD`: `min(cap_s, base_s * 2**(n-1)) * (1 - JITTER_SPREAD * jitter)`, with
    `jitter` in [0, 1) drawn by the caller. For a fixed `jitter` it never decreases with the
    failure count and never exceeds `cap_s`. No failure (n = 0) waits 0.
    """
    if isinstance(consecutive_failures, bool) or not isinstance(consecutive_failures, int) or consecutive_failures < 0:
        raise ValueError(f"consecutive_failures must be an integer >= 0, got {consecutive_failures!r}")
    if not 0 <= jitter < 1:
        raise ValueError(f"jitter must be in [0, 1), got {jitter!r}")
    if not 0 < base_s <= cap_s < math.inf:
        raise ValueError(f"need 0 < base_s <= cap_s < inf, got base_s={base_s!r}, cap_s={cap_s!r}")
    if consecutive_failures == 0:
        return 0.0
    exponential = base_s * 2.0 ** min(consecutive_failures - 1, _MAX_DOUBLINGS)
    return min(cap_s, exponential) * (1 - JITTER_SPREAD * jitter)
