"""The one percentile definition every part of the node uses: nearest rank.

Dashboards (`metrics.py`), epoch settlement's latency gates and the traffic control plane's
breaker all compare the same figure, so they compute it the same way: the value at 1-based rank
ceil(q/100 · n) of the sorted observations. It is always one of the observations, never an
interpolation, so integer milliseconds stay integers and an epoch's result is exact on every
platform. The rank is computed in exact rational arithmetic from the percentile as written
(`99.9`, not the binary float nearest to it): in floating point, 7/100 · 100 rounds up to rank 8
and 99.9 % of 1,000 to rank 1,000.

Pure: no IO.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import TypeVar

T = TypeVar("T")


def checked(q: float) -> float:
    """`q` if it is a percentile (0 < q <= 100); ValueError otherwise, NaN included."""
    if not (0 < q <= 100):
        raise ValueError(f"percentile must be in (0, 100], got {q!r}")
    return q


def nearest_rank(sorted_values: Sequence[T], q: float) -> T:
    """The q-th percentile (0 < q <= 100) of ascending `sorted_values` by nearest rank.

    Raises ValueError for an empty sequence or q outside (0, 100] (NaN included)."""
    checked(q)
    if not sorted_values:
        raise ValueError("the percentile of no values (an empty sequence) is undefined")
    rank = math.ceil(Fraction(str(q)) * len(sorted_values) / 100)
    return sorted_values[rank - 1]
