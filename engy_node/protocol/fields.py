"""How a frame's fields are read (`engy_node.protocol.miner`, `engy_node.protocol.gemm`): coerce
what has one obvious meaning, refuse the rest with `ProtocolError` naming the field."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any


class ProtocolError(ValueError):
    """A frame this side cannot read: `field` is the dotted path to what is wrong
    (`hello.capacity.max_inflight`, or `frame` for the frame as a whole), `reason` says how."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


MISSING: Any = object()


def describe(value: Any) -> str:
    if value is None:
        return "null"
    kind = {bool: "a boolean", str: "a string", list: "a list", dict: "an object", float: "a number"}.get(type(value))
    return kind or type(value).__name__


MAX_COUNT = 2**64 - 1
"""The largest count a frame may carry: the largest integer orjson writes (and reads back) as one."""


def as_count(value: Any, field: str) -> int:
    """A non-negative whole number up to `MAX_COUNT`; an integral float counts (`1800.0`)."""
    if isinstance(value, bool):
        raise ProtocolError(field, "must be a number, not a boolean")
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    else:
        raise ProtocolError(
            field, f"must be a whole number, got {describe(value) if not isinstance(value, float) else value}"
        )
    if not 0 <= number <= MAX_COUNT:
        raise ProtocolError(field, f"must be between 0 and 2**64-1, got {value}")
    return number


def as_seconds(value: Any, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(field, f"must be a number of seconds, got {describe(value)}")
    if not math.isfinite(value) or value < 0:
        raise ProtocolError(field, f"must be a finite non-negative number, got {value}")
    return float(value)


def as_text(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(field, f"must be a string, got {describe(value)}")
    return value


def read_field(obj: Mapping[str, Any], key: str, where: str, read: Callable[[Any, str], Any], default: Any) -> Any:
    """`obj[key]` through `read`; absent or null gives `default`, or is refused without one."""
    value = obj.get(key)
    if value is None:
        if default is MISSING:
            raise ProtocolError(f"{where}.{key}", "missing")
        return default
    return read(value, f"{where}.{key}")


def count_field(obj: Mapping[str, Any], key: str, where: str, *, default: Any = MISSING) -> Any:
    return read_field(obj, key, where, as_count, default)


def text_field(obj: Mapping[str, Any], key: str, where: str, *, default: Any = MISSING) -> Any:
    return read_field(obj, key, where, as_text, default)


def as_object(value: Any, field: str) -> Mapping[str, Any]:
    # A frame's objects are dicts (JSON); `isinstance` against the `Mapping` ABC costs several
    # times the exact test, for every object of every frame.
    if type(value) is not dict and not isinstance(value, Mapping):
        raise ProtocolError(field, f"must be an object, got {describe(value)}")
    return value
