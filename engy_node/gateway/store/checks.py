"""Checks on the values callers hand the store: identifiers, short codes, digests, catalog
model ids, integer amounts, durations and timestamps.

They refuse rather than coerce. A wrong type or a negative amount reaching the store is a
gateway bug, so it raises `ValueError` naming the parameter before anything is written; an
identifier is checked against a pattern that no sentence fits, so free text (a prompt, a
completion) cannot reach the disk in a field meant for an id.
"""

from __future__ import annotations

import math
import re

from engy_node.models import CATALOG

IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
"""What a request id or miner id in the request log may look like. ss58 hotkeys (48 chars),
uuids (36) and `key:<id>` fit with room to spare; spaces and punctuation do not, so no sentence of
prompt or completion text can pass for one."""

CODE = re.compile(r"[A-Za-z0-9_.:+-]{1,128}")
"""What a short code may look like: a verdict's reason (`chunk:exp-mismatch`, `past-eos`) or a
software version (`0.4.1+local`). Like an identifier it has no room for a space, so no sentence
fits; unlike one it may start with any of its characters."""

VERSION = re.compile(r"[A-Za-z0-9_.:+-]{1,64}(?: [A-Za-z0-9_.:+-]{1,63})?")
"""A peer's software version as it reports it: a `CODE`, or a name and a `CODE` separated by one
space, as the public light validator sends (`engy-lv 0.4.4`). One space and no more, so a
sentence still does not fit."""

DIGEST = re.compile(r"[0-9a-f]{64}")
"""A sha256 as the epoch protocol writes it: lowercase hex, nothing else (`keys.epoch_digest`)."""


def identifier(name: str, value: object) -> str:
    if not isinstance(value, str) or IDENTIFIER.fullmatch(value) is None:
        raise ValueError(f"{name} must be an identifier matching {IDENTIFIER.pattern}, got {value!r}")
    return value


def short_code(name: str, value: object) -> str:
    if not isinstance(value, str) or CODE.fullmatch(value) is None:
        raise ValueError(f"{name} must be a short code matching {CODE.pattern}, got {value!r}")
    return value


def version_text(name: str, value: object) -> str:
    if not isinstance(value, str) or VERSION.fullmatch(value) is None:
        raise ValueError(f"{name} must be a version such as 0.4.1 or engy-lv 0.4.4, got {value!r}")
    return value


def hex_digest(name: str, value: object) -> str:
    if not isinstance(value, str) or DIGEST.fullmatch(value) is None:
        raise ValueError(f"{name} must be a sha256 digest (64 lowercase hex characters), got {value!r}")
    return value


def catalog_id(name: str, value: object) -> str:
    if not isinstance(value, str) or value not in CATALOG:
        raise ValueError(f"{name} must be a catalog id ({', '.join(sorted(CATALOG))}), got {value!r}")
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


def timestamp(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be unix seconds, got {value!r}")
    return float(value)
