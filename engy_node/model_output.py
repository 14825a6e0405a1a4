"""Turns raw model text, as a model server writes it, into reasoning, visible text and tool calls.

Qwen3-family models (and other Hermes-format models) write their reasoning between `<think>` and
`</think>` and their tool calls as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
blocks. `OutputParser` is fed the text in whatever pieces the miner sent and returns
`OutputEvent`s: `ReasoningDelta`, `TextDelta` and, once a block has closed, a complete `ToolCall`.
Pure: no IO, no clock, no randomness; tool-call ids come from a caller-supplied prefix.

It is shared core: the gateway reads buyers' answers (and a proof's text) with it, and the miner
sends its answers in these parts, so both read a model's output the same way.

What it decides:

* Reasoning. `<think>` opens reasoning only at the very start of the output (where Qwen3 puts it);
  later in the answer it is plain text, because a model explaining the tag to a user must not
  have the rest of its answer hidden. When the chat template already opened `<think>` in the
  prompt, the caller passes `starts_in_reasoning=True` (a redundant `<think>` at the start is
  still consumed). Inside reasoning only `</think>` is a tag, so reasoning that mentions
  `<tool_call>` stays reasoning. Output that never closes `</think>` (a length cut-off) is all
  reasoning.
* Newline conventions of the Qwen3 chat template, which renders history as
  `<think>\\nR\\n</think>\\n\\nT` and puts one `\\n` before each `<tool_call>`: one `\\n` after
  `<think>` (or at the start when the output starts inside reasoning) and one before `</think>`
  are dropped, as is one `\\n` before `<tool_call>`; after `</think>` and after a tool call all
  leading newlines are dropped, so an answer never starts with blank lines and the newlines
  between consecutive tool calls produce no text.
* Tool calls. A block whose body is a JSON object with a string `name` and an object `arguments`
  (absent means `{}`; a string holding a JSON object is accepted; the Hermes format) becomes a
  `ToolCall` with id `call_<prefix>_<n>`, `n` counting calls from 0, and `arguments`
  re-serialised with `json.dumps(ensure_ascii=False)` (the spacing chat templates use, so history
  round-trips). So does a body in the XML format of Qwen3-Coder and Qwen3.5+ templates (sglang's
  `qwen3_coder` tool parser): `<function=NAME>` holding `<parameter=KEY>VALUE</parameter>`
  blocks, each value less the newline the template puts on either side of it, converted by the
  type the request's tool schema declares for that parameter (integer, number, boolean, object,
  array; a value that does not convert stays a string, as does one of an undeclared parameter).
  Anything else, including invalid JSON, is passed through verbatim as text (with the `\\n`
  dropped before it restored): the buyer sees what the model wrote rather than losing it. A block
  still open at `finish()` becomes a call if its body is a valid call (the model stopped before
  the closing tag, as vLLM's Hermes parser also accepts) and text otherwise.

Streaming posture: text is released as soon as it cannot be part of a tag or of a dropped
newline, so only the shortest tail that could still start `<think>`, `</think>` or
`<tool_call>` (plus one newline) is held back. Tool calls are emitted whole, when their block
closes, because a half-parsed JSON object cannot be streamed as valid arguments. The parser's
decisions depend only on the concatenated text, never on where the chunks were cut, so any
chunking yields the same events once adjacent deltas of one kind are joined (property-tested).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """A complete tool call parsed from the model's output."""

    index: int
    id: str
    name: str
    arguments: str
    """JSON text of the arguments object."""


OutputEvent = TextDelta | ReasoningDelta | ToolCall

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


class _State(enum.Enum):
    TEXT = "text"
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"


def _partial_tag_length(buffer: str, tag: str) -> int:
    """Length of the longest suffix of `buffer` that is a proper prefix of `tag` (a tag that may
    still be arriving), counting one newline in front of it that the tag would swallow."""
    for length in range(min(len(buffer), len(tag) - 1), 0, -1):
        if buffer.endswith(tag[:length]):
            return length + (1 if buffer[:-length].endswith("\n") else 0)
    return 1 if buffer.endswith("\n") else 0


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def parameter_types(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, str]]:
    """Per function name, the JSON-schema type of each declared parameter, from OpenAI tools."""
    types: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            continue
        properties = (
            (function.get("parameters") or {}).get("properties")
            if isinstance(function.get("parameters"), Mapping)
            else None
        )
        types[function["name"]] = {
            key: spec["type"]
            for key, spec in (properties or {}).items()
            if isinstance(spec, Mapping) and isinstance(spec.get("type"), str)
        }
    return types


def _converted(value: str, kind: str | None) -> Any:
    """An XML parameter's text as the schema's type, or the text itself when it does not convert."""
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            try:
                return int(value)
            except ValueError:
                return float(value)
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if kind in ("object", "array"):
            parsed = json.loads(value)
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    except ValueError:
        pass
    return value


def _tool_call_from_xml(
    body: str, *, index: int, call_id_prefix: str, types: Mapping[str, Mapping[str, str]]
) -> ToolCall | None:
    function = _XML_FUNCTION.fullmatch(body)
    if function is None:
        return None
    name = function.group(1).strip()
    if not name:
        return None
    declared = types.get(name, {})
    arguments = {}
    for key, value in _XML_PARAMETER.findall(function.group(2)):
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[key.strip()] = _converted(value, declared.get(key.strip()))
    return ToolCall(
        index=index, id=f"call_{call_id_prefix}_{index}", name=name, arguments=json.dumps(arguments, ensure_ascii=False)
    )


def _tool_call_from_json(body: str, *, index: int, call_id_prefix: str) -> ToolCall | None:
    """The call a `<tool_call>` block's JSON body describes, or None when it does not describe one."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    name = parsed.get("name")
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, str):
        # Some models double-encode the arguments object as a JSON string.
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(
        index=index,
        id=f"call_{call_id_prefix}_{index}",
        name=name,
        arguments=json.dumps(arguments, ensure_ascii=False),
    )


class OutputParser:
    """Incremental parser for one response's raw text; feed chunks in order, then `finish()`.

    Not reusable: after `finish()` the parser is spent.
    """

    def __init__(
        self,
        *,
        call_id_prefix: str,
        starts_in_reasoning: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self._call_id_prefix = call_id_prefix
        self._types = parameter_types(tools)
        self._state = _State.REASONING if starts_in_reasoning else _State.TEXT
        self._buffer = ""
        # Only the very start of the output may open reasoning; cleared once anything else is seen.
        self._may_open_think = True
        # One newline right after `<think>` (or at a start inside reasoning) is template convention.
        self._drop_one_newline = starts_in_reasoning
        # After `</think>` and after a tool call, leading newlines are convention, not content.
        self._drop_leading_newlines = False
        # Whether the `\n` before the open `<tool_call>` was dropped, to restore it if the block is text.
        self._newline_before_call = False
        self._calls = 0
        self._finished = False

    def feed(self, text: str) -> list[OutputEvent]:
        """Events that `text`, appended to what came before, makes certain."""
        if self._finished:
            raise RuntimeError("OutputParser.feed after finish()")
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> list[OutputEvent]:
        """Everything still held back: the output has ended, so no tag can complete any more."""
        if self._finished:
            raise RuntimeError("OutputParser.finish called twice")
        events = self._drain(final=True)
        self._finished = True
        return events

    def _drain(self, *, final: bool) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        # At the end, an open tool-call block is resolved even when its body is still empty.
        while self._buffer or (final and self._state is _State.TOOL_CALL):
            if self._may_open_think:
                if self._buffer.startswith(THINK_OPEN):
                    self._buffer = self._buffer[len(THINK_OPEN) :]
                    self._state = _State.REASONING
                    self._drop_one_newline = True
                    self._may_open_think = False
                    continue
                if THINK_OPEN.startswith(self._buffer) and not final:
                    break
                self._may_open_think = False
            if self._state is _State.TEXT:
                progressed = self._drain_text(events, final=final)
            elif self._state is _State.REASONING:
                progressed = self._drain_reasoning(events, final=final)
            else:
                progressed = self._drain_tool_call(events, final=final)
            if not progressed:
                break
        return events

    def _drain_text(self, events: list[OutputEvent], *, final: bool) -> bool:
        if self._drop_leading_newlines:
            self._buffer = self._buffer.lstrip("\n")
            if not self._buffer:
                return False
            self._drop_leading_newlines = False
        start = self._buffer.find(TOOL_OPEN)
        if start >= 0:
            text = self._buffer[:start]
            self._newline_before_call = text.endswith("\n")
            if self._newline_before_call:
                text = text[:-1]
            if text:
                events.append(TextDelta(text))
            self._buffer = self._buffer[start + len(TOOL_OPEN) :]
            self._state = _State.TOOL_CALL
            return True
        held = 0 if final else _partial_tag_length(self._buffer, TOOL_OPEN)
        ready = self._buffer[: len(self._buffer) - held]
        if ready:
            events.append(TextDelta(ready))
        self._buffer = self._buffer[len(ready) :]
        return False

    def _drain_reasoning(self, events: list[OutputEvent], *, final: bool) -> bool:
        if self._drop_one_newline:
            if self._buffer.startswith("\n"):
                self._buffer = self._buffer[1:]
            self._drop_one_newline = False
            return True
        end = self._buffer.find(THINK_CLOSE)
        if end >= 0:
            reasoning = self._buffer[:end]
            if reasoning.endswith("\n"):
                reasoning = reasoning[:-1]
            if reasoning:
                events.append(ReasoningDelta(reasoning))
            self._buffer = self._buffer[end + len(THINK_CLOSE) :]
            self._state = _State.TEXT
            self._drop_leading_newlines = True
            return True
        held = 0 if final else _partial_tag_length(self._buffer, THINK_CLOSE)
        ready = self._buffer[: len(self._buffer) - held]
        if ready:
            events.append(ReasoningDelta(ready))
        self._buffer = self._buffer[len(ready) :]
        return False

    def _drain_tool_call(self, events: list[OutputEvent], *, final: bool) -> bool:
        end = self._buffer.find(TOOL_CLOSE)
        if end < 0 and not final:
            return False
        body = self._buffer[:end] if end >= 0 else self._buffer
        self._buffer = self._buffer[end + len(TOOL_CLOSE) :] if end >= 0 else ""
        self._state = _State.TEXT
        call = _tool_call_from_json(
            body, index=self._calls, call_id_prefix=self._call_id_prefix
        ) or _tool_call_from_xml(body, index=self._calls, call_id_prefix=self._call_id_prefix, types=self._types)
        if call is not None:
            self._calls += 1
            events.append(call)
            self._drop_leading_newlines = True
        else:
            raw = ("\n" if self._newline_before_call else "") + TOOL_OPEN + body + (TOOL_CLOSE if end >= 0 else "")
            events.append(TextDelta(raw))
        return True


def parse_output(
    text: str,
    *,
    call_id_prefix: str,
    starts_in_reasoning: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[OutputEvent]:
    """All events of a complete output (the non-streaming path), adjacent deltas not yet joined."""
    parser = OutputParser(call_id_prefix=call_id_prefix, starts_in_reasoning=starts_in_reasoning, tools=tools)
    return parser.feed(text) + parser.finish()
