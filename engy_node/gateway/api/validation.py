"""The request checks both buyer APIs share, and the retry headers that come with every refusal.

What it decides: whether one field of a buyer's body has the JSON type and range the gateway
relies on (a string, an object, a list, a sampling number, stop sequences, a served model), and
whether a body holds only fields the gateway knows what to do with (`FieldChecks.known_fields`).
Which fields a request has, and what they mean, stays in `openai_api` and `anthropic_api`, each
as a table of every top-level field its API defines. Pure: no IO, no clock reads.

Trust: every value is buyer input. A check either returns the value as the gateway will use it
or raises a 400 `invalid_request` (a 404 `not_found` for a model not served) whose `param` is the
field's path, so the buyer can fix the request without guessing; nothing is coerced (`true` is
not an integer, `"1"` is not a number).

Why it is shaped so: the two APIs check the same kinds of field by the same rules, but each words
a bad field its own way, and that text is part of its observable behaviour (clients, logs and
tests match on it). So the rules live here once, and the wording is a value: each API module
builds one `FieldChecks` that says how its paths are written (`messages[2].content[0]` or
`messages.2.content.0`), what stands between a path and the complaint (OpenAI writes a sentence,
"stop must be ..."; Anthropic leads with the path, "stop_sequences: must be ..."), and its 404
text for a model the gateway does not serve. A message of another shape is written out in the
API's own module and raised with `invalid`.

Nothing a buyer sends is silently ignored. Every top-level field is one of three things, and each
API module says which for every field its API defines: `USED` (the parser reads it, and honours
it or refuses the values it cannot honour), `Harmless` (accepted and dropped, because ignoring it
cannot change what the buyer gets: the answer, its shape, its price, where and how it is served;
its type is still checked, so a typo is reported), or `Refused` (a 400 naming the field, saying
why and what to send instead; only a value that asks for what the gateway does anyway passes,
such as `logprobs: false`). A field in no table is refused as each real API refuses it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

from engy_node.gateway.api.chat import GatewayError

NO_RETRY_KINDS = frozenset(
    {
        "invalid_request",
        "authentication",
        "billing",
        "permission",
        "not_found",
        "method_not_allowed",
        "unsupported_media_type",
        "request_too_large",
    }
)
"""Kinds where the buyer must change something first: `x-should-retry: false` stops SDK retries."""


def error_headers(err: GatewayError) -> dict[str, str]:
    """`retry-after` when waiting helps; `x-should-retry: false` when only a changed request can.

    Both SDKs read these two headers the same way, so both APIs send the same ones."""
    headers = {}
    if err.retry_after_s is not None:
        headers["retry-after"] = str(err.retry_after_s)
    if err.kind in NO_RETRY_KINDS:
        headers["x-should-retry"] = "false"
    headers.update(err.headers)
    return headers


@dataclasses.dataclass(frozen=True, slots=True)
class Used:
    """A field the API module's parser reads: it implements the field, or refuses in its own
    words the values it cannot honour."""


USED = Used()


@dataclasses.dataclass(frozen=True, slots=True)
class Harmless:
    """A field accepted and dropped (never forwarded to a miner): ignoring it cannot change what
    the buyer gets. Its JSON type is still checked."""

    why: str
    """Why ignoring it changes nothing the buyer gets; the table's justification, kept with it."""
    shape: type
    """`str`, `bool` or `Mapping` (a JSON object)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Refused:
    """A field the gateway cannot honour: any value but those `allows` passes is a 400 whose
    message is the field's path, the API's separator, then `complaint` (why, and what to send
    instead). null always passes: it is the field left out."""

    complaint: str
    allows: Callable[[Any], bool] = lambda value: False
    """The values that ask for what the gateway does anyway (`logprobs: false`, a penalty of 0)."""


FieldRule = Used | Harmless | Refused

_SHAPE_NAMES = {str: "a string", bool: "a boolean", Mapping: "an object"}


def equals(expected: Any) -> Callable[[Any], bool]:
    """A `Refused.allows` that passes `expected` only, with JSON's types (`false` is not `0`)."""
    return lambda value: type(value) is type(expected) and value == expected


def is_zero(value: Any) -> bool:
    """A `Refused.allows` for a number whose default, 0, is what the gateway does."""
    return _is_number(value) and value == 0


def one_of(*allowed: str) -> Callable[[Any], bool]:
    """A `Refused.allows` that passes the listed strings."""
    return lambda value: isinstance(value, str) and value in allowed


def invalid(*, param: str, message: str) -> GatewayError:
    """A 400 `invalid_request` naming `param`, with `message` sent to the buyer as it is."""
    return GatewayError("invalid_request", message, param=param)


def is_int(value: Any) -> bool:
    """A JSON integer: an `int` that is not a `bool` (Python's `True` is an int, JSON's is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True, slots=True)
class FieldChecks:
    """The shared checks, worded as one API words them.

    Every check takes the buyer's value first and the rest by keyword (`param`, the field's path,
    where the field is not always at the same place), returns the value as the gateway uses it,
    and refuses a bad one with `invalid`: the path, the separator, then what is wrong.
    """

    separator: str
    """Between a field's path and what is wrong with it: " " reads as a sentence
    ("stop must be ..."), ": " leads with the path ("stop_sequences: must be ...")."""
    item_path: str
    """A list item's path, from `{param}` (the list's) and `{index}`: "{param}[{index}]" or "{param}.{index}"."""
    unknown_model: str
    """The 404 message for a model this gateway does not serve; `{model}` stands for the name sent."""
    unknown_field: str
    """The 400 message for a top-level field the API does not define; `{field}` stands for its name."""

    def invalid(self, *, param: str, complaint: str) -> GatewayError:
        """A 400 naming `param`, whose message is the path, the separator, then `complaint`."""
        return invalid(param=param, message=f"{param}{self.separator}{complaint}")

    def known_fields(self, body: Mapping[str, Any], rules: Mapping[str, FieldRule]) -> None:
        """Refuse the first field of `body` (in the buyer's order) that `rules` does not know, or
        whose rule refuses its value; check the type of each `Harmless` one. `USED` fields are
        left to the parser."""
        for name, value in body.items():
            rule = rules.get(name)
            if rule is None:
                raise invalid(param=name, message=self.unknown_field.format(field=name))
            if value is None or isinstance(rule, Used):
                continue
            if isinstance(rule, Harmless):
                if not isinstance(value, rule.shape):
                    raise self.invalid(param=name, complaint=f"must be {_SHAPE_NAMES[rule.shape]}")
            elif not rule.allows(value):
                raise self.invalid(param=name, complaint=rule.complaint)

    def model(self, value: Any, *, known_models: Collection[str]) -> str:
        """The requested model: a non-empty string (else 400) that this gateway serves (else a 404
        `not_found` with param "model", which the SDKs raise as `NotFoundError`)."""
        if not isinstance(value, str) or not value:
            raise self.invalid(param="model", complaint="must be a non-empty string")
        if value not in known_models:
            raise GatewayError("not_found", self.unknown_model.format(model=value), param="model")
        return value

    def items(
        self, value: Any, *, param: str, non_empty: bool = False, complaint: str | None = None
    ) -> list[tuple[str, Any]]:
        """`(path, item)` for each item of the list at `param`, the paths in this API's notation.

        A value that is not a list (or, with `non_empty`, an empty list) is refused with
        `complaint`, by default "must be a list" (or "must be a non-empty list"); a field that
        also takes another form (a string) names both in its own complaint."""
        if not isinstance(value, list) or (non_empty and not value):
            raise self.invalid(param=param, complaint=complaint or f"must be a {'non-empty ' if non_empty else ''}list")
        return [(self.item_path.format(param=param, index=index), item) for index, item in enumerate(value)]

    def tools(
        self, value: Any, *, function_spec: Callable[[Any, str], dict[str, Any]]
    ) -> tuple[dict[str, Any], ...] | None:
        """The buyer's tools as OpenAI function tools (what chat templates render), None for none.

        `function_spec(tool, path)` checks one tool in the API's own shape and returns its
        function spec (`name`, optional `description`, `parameters`). An empty list is no tools."""
        if value is None:
            return None
        return (
            tuple(
                {"type": "function", "function": function_spec(tool, path)}
                for path, tool in self.items(value, param="tools")
            )
            or None
        )

    def json_object(self, value: Any, *, param: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.invalid(param=param, complaint="must be an object")
        return value

    def json_schema(self, value: Any, *, param: str) -> dict[str, Any]:
        """A tool's parameter schema, as a plain dict. Only its being an object is checked: the
        schema is the buyer's contract with the model, and the chat template renders it as sent."""
        if not isinstance(value, Mapping):
            raise self.invalid(param=param, complaint="must be a JSON Schema object")
        return dict(value)

    def string(self, value: Any, *, param: str, non_empty: bool = False, complaint: str | None = None) -> str:
        """A string (a non-empty one with `non_empty`); `complaint` replaces "must be a (non-empty) string"."""
        if not isinstance(value, str) or (non_empty and not value):
            raise self.invalid(
                param=param, complaint=complaint or f"must be a {'non-empty ' if non_empty else ''}string"
            )
        return value

    def optional_bool(self, value: Any, *, param: str) -> bool | None:
        if value is not None and not isinstance(value, bool):
            raise self.invalid(param=param, complaint="must be a boolean")
        return value

    def _number(self, value: Any, *, param: str, low: float, high: float, low_open: bool = False) -> float | None:
        if value is None:
            return None
        if not (_is_number(value) and (low < value if low_open else low <= value) and value <= high):
            bound = "greater than" if low_open else "at least"
            raise self.invalid(
                param=param, complaint=f"must be a number {bound} {low:g} and at most {high:g}, got {value!r}"
            )
        return float(value)

    def temperature(self, value: Any, *, maximum: float) -> float | None:
        """`temperature` in [0, `maximum`]; each API has its own maximum (OpenAI 2, Anthropic 1)."""
        return self._number(value, param="temperature", low=0.0, high=maximum)

    def top_p(self, value: Any) -> float | None:
        """`top_p` in (0, 1]: miners' engines reject 0, and a 400 naming the field is better than an
        upstream failure."""
        return self._number(value, param="top_p", low=0.0, high=1.0, low_open=True)

    def stop_sequences(self, value: Any, *, param: str, max_count: int, accept_string: bool) -> tuple[str, ...]:
        """Non-empty stop strings, at most `max_count` of them; with `accept_string`, one bare
        string stands for a list of one (OpenAI's `stop` takes both, Anthropic's `stop_sequences`
        only a list)."""
        if value is None:
            return ()
        stops = [value] if accept_string and isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(stop, str) and stop for stop in stops):
            shape = (
                "a non-empty string or a list of non-empty strings" if accept_string else "a list of non-empty strings"
            )
            raise self.invalid(param=param, complaint=f"must be {shape}")
        if len(stops) > max_count:
            raise self.invalid(param=param, complaint=f"takes at most {max_count} sequences, got {len(stops)}")
        return tuple(stops)
