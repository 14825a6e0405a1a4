"""Checks on the values callers hand the store: identifiers, integer amounts, durations.

They refuse rather than coerce. A wrong type or a negative amount reaching the store is a
gateway bug, so it raises `ValueError` naming the parameter before anything is written; an
identifier is checked against a pattern that no sentence fits, so free text (a prompt, a
completion) cannot reach the disk in a field meant for an id.
"""

from __future__ import annotations

import math
import re

IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""What a request id or miner id in the request log may look like. ss58 hotkeys (48 chars),
uuids (36) and `key:<id>` fit with room to spare; spaces and punctuation do not, so no sentence of
prompt or completion text can pass for one."""


def identifier(name: str, value: object) -> str:
    if not isinstance(value, str) or IDENTIFIER.fullmatch(value) is None:
        raise ValueError(f"{name} must be an identifier matching {IDENTIFIER.pattern}, got {value!r}")
    return value


def integer(name: str, value: object, *, minimum: int = 0) -> int:
    # bool is an int subclass; True micro-dollars is always a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def duration(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < math.inf):
        raise ValueError(f"{name} must be a finite number of ms >= 0 or None, got {value!r}")
    return float(value)
