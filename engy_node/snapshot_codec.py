"""The snapshot types' codec: JSON-ready data to a snapshot dataclass and back (`engy_node.snapshots`).

Split from the types so that file stays the schema. Decoding follows a dataclass's type hints
(unions, literals, nested dataclasses, tuples, dicts, bool/int/float/str): liberal by default, so
a TUI reads a node of another version (an unknown key is ignored, a missing or ill-typed field
takes its default), strict on request (`strict=True` raises `SchemaError` naming the field).
Fields whose wire key is not a Python name carry it in `field(metadata={"key": ...})`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Hashable, Mapping
from typing import Any, Literal, TypeVar

T = TypeVar("T")

MAX_KEY_DIGITS = 4000
"""Longer digit strings are not read as numbers: Python refuses to parse past 4,300 digits."""
_INTEGER = re.compile(r"-?[0-9]+")
"""ASCII digits only: `str.isdigit` also takes "²", which `int` refuses."""


class SchemaError(ValueError):
    """A state that does not match its snapshot type (raised only when decoding strictly, and by
    `Hub.set_state` for an undeclared field)."""


def wire_key(field: dataclasses.Field[Any]) -> str:
    return str(field.metadata.get("key", field.name))


@functools.cache
def wire_keys(kind: type) -> frozenset[str]:
    """The JSON keys a snapshot type declares."""
    return frozenset(wire_key(field) for field in dataclasses.fields(kind))


@functools.cache
def _hints(kind: Hashable) -> dict[str, Any]:
    return typing.get_type_hints(kind)


_MISSING = object()


def decode(kind: type[T], value: Any, *, strict: bool = False, where: str = "") -> T:
    """`value` (JSON-ready data) as an instance of snapshot dataclass `kind`."""
    if not isinstance(value, Mapping):
        raise SchemaError(f"{where or kind.__name__}: expected an object, got {type(value).__name__}")
    hints = _hints(typing.cast(Hashable, kind))
    known = {wire_key(field): field for field in dataclasses.fields(kind)}  # type: ignore[arg-type]
    if strict:
        unknown = sorted(str(key) for key in value if key not in known)
        if unknown:
            raise SchemaError(f"{where or kind.__name__}: {', '.join(unknown)} not declared by {kind.__name__}")
    values = {}
    for key, field in known.items():
        if key not in value:
            continue
        place = f"{where}.{key}" if where else key
        converted = _convert(hints[field.name], value[key], strict=strict, where=place)
        if converted is not _MISSING:
            values[field.name] = converted
    try:
        return kind(**values)
    except TypeError as error:  # a required field is missing
        raise SchemaError(f"{where or kind.__name__}: {error}") from None


def _convert(hint: Any, value: Any, *, strict: bool, where: str) -> Any:
    """`value` as type `hint`, or `_MISSING` (liberal) / SchemaError (strict) if it is not one."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (arg for arg in args if arg is not type(None)):
            converted = _convert(arg, value, strict=False, where=where)
            if converted is not _MISSING:
                return converted
        return _refuse(hint, value, strict=strict, where=where)
    if origin is Literal:
        return value if value in args else _refuse(hint, value, strict=strict, where=where)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        try:
            return decode(hint, value, strict=strict, where=where)
        except SchemaError:
            if strict:
                raise
            return _MISSING
    if origin is tuple:
        if not isinstance(value, list | tuple):
            return _refuse(hint, value, strict=strict, where=where)
        if len(args) == 2 and args[1] is Ellipsis:
            items = [_convert(args[0], item, strict=strict, where=f"{where}[{i}]") for i, item in enumerate(value)]
            return tuple(item for item in items if item is not _MISSING)
        if len(args) != len(value):
            return _refuse(hint, value, strict=strict, where=where)
        items = [_convert(arg, item, strict=strict, where=where) for arg, item in zip(args, value, strict=True)]
        return _MISSING if _MISSING in items else tuple(items)
    if origin is dict:
        if not isinstance(value, Mapping):
            return _refuse(hint, value, strict=strict, where=where)
        result = {}
        for key, item in value.items():
            k = _convert(args[0], key, strict=strict, where=where)
            v = _convert(args[1], item, strict=strict, where=f"{where}[{key}]")
            if k is not _MISSING and v is not _MISSING:
                result[k] = v
        return result
    if hint is Any:
        return value
    if hint is bool:
        return value if isinstance(value, bool) else _refuse(hint, value, strict=strict, where=where)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and _INTEGER.fullmatch(value) and len(value) <= MAX_KEY_DIGITS:
            return int(value)  # JSON object keys are strings
        return _refuse(hint, value, strict=strict, where=where)
    if hint is float:
        if isinstance(value, float):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:  # an integer past a float's range
                return _refuse(hint, value, strict=strict, where=where)
        return _refuse(hint, value, strict=strict, where=where)
    if hint is str:
        return value if isinstance(value, str) else _refuse(hint, value, strict=strict, where=where)
    raise TypeError(f"{where}: snapshot types use no {hint!r}")


def _refuse(hint: Any, value: Any, *, strict: bool, where: str) -> Any:
    if strict:
        raise SchemaError(f"{where}: {value!r} is not a {getattr(hint, '__name__', hint)}")
    return _MISSING


def encode(snapshot: Any) -> Any:
    """A snapshot (or any value inside one) as JSON-ready data, with wire keys."""
    if dataclasses.is_dataclass(snapshot) and not isinstance(snapshot, type):
        return {wire_key(field): encode(getattr(snapshot, field.name)) for field in dataclasses.fields(snapshot)}
    if isinstance(snapshot, tuple | list):
        return [encode(item) for item in snapshot]
    if isinstance(snapshot, Mapping):
        return {key: encode(item) for key, item in snapshot.items()}
    return snapshot
