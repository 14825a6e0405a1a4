"""The Anthropic Messages wire format: request parsing, message bodies, named SSE events, errors.

What it decides: how a buyer's `POST /v1/messages` (and `/v1/messages/count_tokens`) body becomes
the gateway's OpenAI-style `ChatRequest`, and how `OutputEvent`s, `Usage` and `GatewayError`s are
written back so that the official `anthropic` SDK and agents built on it, Claude Code first, read
them as they read Anthropic's own answers (reference/llm-gateways-and-wire-formats.md §5, and the
complaints in §6.1 that this module exists to avoid). Pure: no IO, no clock reads; ids come in as
arguments.

Trust: the body is buyer input and untrusted. Every field the gateway relies on is type-checked,
and a bad one is a 400 `invalid_request` whose message starts with the field's path in
Anthropic's own style (`messages.2.content.0.type: ...`; `param` carries the same path). Fields
the gateway does not use (`metadata`, `cache_control`, `service_tier`, `top_k`, `thinking`,
`disable_parallel_tool_use`…) are accepted and ignored, because Claude Code sends them on every
request; what cannot be honoured is refused with a message naming it: images and documents (the
models are text-only), server tools (`web_search_…`), and a `tool_choice` naming an unknown tool.

Translation (§5.7): top-level `system` becomes a leading system message; `tool_use` blocks become
the assistant's `tool_calls` (arguments as a JSON string); each `tool_result` block becomes a
`tool` message with `tool_call_id`, in block order; `thinking` blocks in history are dropped, as
chat templates drop past reasoning; text blocks of one message are joined with "\\n".

Failure posture: the stream is the fragile part. Exactly one `message_start`, whose usage has
the input tokens and a non-zero `output_tokens` (Claude Code rejects zeros); a block is opened
only when it has content, so no empty text block precedes a `tool_use`; a delta always matches
its block's type; every started block is stopped before `message_delta`, whose usage is
cumulative; the turn ends with `message_stop`, or, after an error, with one `event: error` that
the SDK raises. Usage follows Anthropic's semantics: `input_tokens` EXCLUDES cache reads, which
are reported separately in `cache_read_input_tokens` (the gateway writes no cache entries the
buyer pays extra for, so `cache_creation_input_tokens` is always 0).

Decisions the references leave open, and why:
* `thinking` blocks carry `signature: ""`. Anthropic signs its own reasoning so that it can be
  sent back verified; our reasoning is never trusted back (history drops it), so there is
  nothing to sign, and an empty string is an honest "unsigned" that the SDK types accept.
* Content blocks keep the order the model produced them in (thinking, then text, then tool
  calls, in practice), each run of one kind in one block, the same in the body as in the stream.
* `stop_reason` is `tool_use` whenever the model stopped by itself after calling tools, even if a
  stop sequence also matched, because an agent loop must run the tools; a cut-off response is
  `max_tokens` so the client knows it is incomplete.
* Overloaded (no miner capacity) is HTTP 529 `overloaded_error`, Anthropic's status, which the
  SDK retries; `status_for` gives the Anthropic status for every kind.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import orjson

from engy_node.gateway.chat import ChatRequest, FinishReason, GatewayError, OutputEvent, TextDelta, ToolCall, Usage
from engy_node.protocol.miner import Sampling

# Engines check every stop string at every decoding step; Anthropic documents no limit, and 16
# is well above what clients send (OpenAI allows 4), so a larger list is a mistake or an abuse.
MAX_STOP_SEQUENCES = 16
MAX_TEMPERATURE = 1.0

THINKING_SIGNATURE = ""
"""The `signature` of every thinking block: empty, because the gateway's reasoning is unsigned."""

OVERLOADED_STATUS = 529

ERROR_TYPE_BY_KIND: dict[str, str] = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "billing": "billing_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "request_too_large": "request_too_large",
    "rate_limit": "rate_limit_error",
    "api_error": "api_error",
    "upstream": "api_error",
    "overloaded": "overloaded_error",
    "timeout": "timeout_error",
}
"""Anthropic `error.type` per `GatewayError.kind`."""

NO_RETRY_KINDS = frozenset({"invalid_request", "authentication", "billing", "permission", "not_found", "request_too_large"})
"""Kinds where the buyer must change something first: `x-should-retry: false` stops SDK retries."""

_UNSUPPORTED_BLOCKS = {"image": "images", "document": "documents"}
_STOP_REASON_BY_FINISH = {"length": "max_tokens", "tool_calls": "tool_use"}


# ---- request ------------------------------------------------------------------------------


def _invalid(param: str, message: str) -> GatewayError:
    return GatewayError("invalid_request", f"{param}: {message}", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_number(body: Mapping[str, Any], key: str, *, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    in_range = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and (low < value if low_open else low <= value) and value <= high)
    if not in_range:
        bound = "greater than" if low_open else "at least"
        raise _invalid(key, f"must be a number {bound} {low:g} and at most {high:g}, got {value!r}")
    return float(value)


def _text_blocks(content: Any, param: str) -> str:
    """A string, or a list of text blocks joined with "\\n" (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(param, "must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        block_param = f"{param}.{j}"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind in _UNSUPPORTED_BLOCKS:
            raise _invalid(f"{block_param}.type", f"{_UNSUPPORTED_BLOCKS[kind]} are not supported; the models "
                           "served here take text only, so send text blocks")
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _invalid(block_param, "must be a text block ({\"type\": \"text\", \"text\": ...})")
        texts.append(block["text"])
    return "\n".join(texts)


def _user_messages(content: Any, param: str) -> list[dict[str, Any]]:
    """A user turn as chat messages: text runs as user messages, each tool result as a tool message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise _invalid(param, "must be a string or a list of content blocks")
    messages: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            messages.append({"role": "user", "content": "\n".join(texts)})
            texts.clear()

    for j, block in enumerate(content):
        block_param = f"{param}.{j}"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(_block_text(block, block_param))
        elif kind == "tool_result":
            flush()
            tool_use_id = block.get("tool_use_id")
            if not isinstance(tool_use_id, str):
                raise _invalid(f"{block_param}.tool_use_id", "must be a string")
            result = block.get("content")
            messages.append({"role": "tool", "tool_call_id": tool_use_id,
                             "content": "" if result is None else _text_blocks(result, f"{block_param}.content")})
        else:
            _reject_block(kind, block_param, allowed="text or tool_result")
    flush()
    return messages


def _block_text(block: Mapping[str, Any], param: str) -> str:
    if not isinstance(block.get("text"), str):
        raise _invalid(f"{param}.text", "must be a string")
    return block["text"]


def _assistant_message(content: Any, param: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise _invalid(param, "must be a string or a list of content blocks")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        block_param = f"{param}.{j}"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(_block_text(block, block_param))
        elif kind == "tool_use":
            for key in ("id", "name"):
                if not isinstance(block.get(key), str):
                    raise _invalid(f"{block_param}.{key}", "must be a string")
            if not isinstance(block.get("input"), Mapping):
                raise _invalid(f"{block_param}.input", "must be an object")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}})
        elif kind not in ("thinking", "redacted_thinking"):
            _reject_block(kind, block_param, allowed="text, tool_use or thinking")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _reject_block(kind: Any, param: str, *, allowed: str) -> None:
    if kind in _UNSUPPORTED_BLOCKS:
        raise _invalid(f"{param}.type", f"{_UNSUPPORTED_BLOCKS[kind]} are not supported; the models served "
                       "here take text only")
    raise _invalid(f"{param}.type", f"block type {kind!r} is not supported here; use {allowed}")


def _messages(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        system_text = _text_blocks(system, "system")
        if system_text:
            messages.append({"role": "system", "content": system_text})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise _invalid("messages", "must be a non-empty list")
    for i, message in enumerate(raw):
        param = f"messages.{i}"
        if not isinstance(message, Mapping):
            raise _invalid(param, "must be an object")
        role = message.get("role")
        if role == "user":
            messages.extend(_user_messages(message.get("content"), f"{param}.content"))
        elif role == "assistant":
            messages.append(_assistant_message(message.get("content"), f"{param}.content"))
        else:
            raise _invalid(f"{param}.role", f"must be 'user' or 'assistant' (the system prompt goes in the "
                           f"top-level system field), got {role!r}")
    return tuple(messages)


def _tools(raw: Any) -> tuple[dict[str, Any], ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _invalid("tools", "must be a list")
    tools = []
    for i, tool in enumerate(raw):
        param = f"tools.{i}"
        if not isinstance(tool, Mapping):
            raise _invalid(param, "must be an object")
        if tool.get("type", "custom") != "custom":
            raise _invalid(f"{param}.type", f"server tool {tool.get('type')!r} is not supported; only custom tools "
                           "(name, description, input_schema) are")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _invalid(f"{param}.name", "must be a non-empty string")
        if not isinstance(tool.get("input_schema"), Mapping):
            raise _invalid(f"{param}.input_schema", "must be a JSON Schema object")
        function: dict[str, Any] = {"name": tool["name"]}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise _invalid(f"{param}.description", "must be a string")
            function["description"] = tool["description"]
        function["parameters"] = dict(tool["input_schema"])
        tools.append({"type": "function", "function": function})
    return tuple(tools) or None


def _tool_choice(raw: Any, tools: tuple[dict[str, Any], ...] | None) -> Any:
    """The OpenAI-style choice: None, "none", "auto", "required" or a named function."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    if kind == "none":
        return "none"
    if kind == "auto":
        return "auto" if tools else None
    if kind == "any":
        if not tools:
            raise _invalid("tool_choice", "type 'any' needs at least one tool in tools")
        return "required"
    if kind == "tool":
        name = raw.get("name")
        if not isinstance(name, str) or name not in {tool["function"]["name"] for tool in tools or ()}:
            raise _invalid("tool_choice.name", f"names the tool {name!r}, which is not in tools")
        return {"type": "function", "function": {"name": name}}
    raise _invalid("tool_choice", "must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"tool\", "
                   "\"name\": ...} or {\"type\": \"none\"}")


def _check_ignored_fields(body: Mapping[str, Any]) -> None:
    """Fields accepted for compatibility but not used; still type-checked, so a typo is reported."""
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or top_k < 0):
        raise _invalid("top_k", f"must be a non-negative integer, got {top_k!r}")
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, Mapping) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise _invalid("thinking", "must be {\"type\": \"enabled\", \"budget_tokens\": N}, "
                           "{\"type\": \"adaptive\"} or {\"type\": \"disabled\"}")
        budget = thinking.get("budget_tokens")
        if budget is not None and (not _is_int(budget) or budget < 0):
            raise _invalid("thinking.budget_tokens", f"must be a non-negative integer, got {budget!r}")


def _model(body: Any, known_models: Collection[str]) -> str:
    if not isinstance(body, Mapping):
        raise _invalid("body", "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _invalid("model", "must be a non-empty string")
    if model not in known_models:
        raise GatewayError("not_found", f"model: {model}", param="model")
    return model


def _stop_sequences(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(s, str) and s for s in raw):
        raise _invalid("stop_sequences", "must be a list of non-empty strings")
    if len(raw) > MAX_STOP_SEQUENCES:
        raise _invalid("stop_sequences", f"takes at most {MAX_STOP_SEQUENCES} sequences, got {len(raw)}")
    return tuple(raw)


def _conversation(body: Mapping[str, Any]) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...] | None, Any]:
    """Messages, tools and tool choice, shared by messages and count_tokens."""
    messages = _messages(body)
    tools = _tools(body.get("tools"))
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    if tool_choice == "none":
        tools, tool_choice = None, None
    _check_ignored_fields(body)
    return messages, tools, tool_choice


def parse_messages_request(body: Any, *, known_models: Collection[str],
                           max_output_tokens_for: Callable[[str], int]) -> ChatRequest:
    """A buyer's Messages body as a `ChatRequest`.

    Raises `GatewayError`: `invalid_request` (400) for a malformed or missing field, naming it;
    `not_found` (404) for a model this gateway does not serve.
    """
    model = _model(body, known_models)
    limit = max_output_tokens_for(model)
    max_tokens = body.get("max_tokens")
    if not _is_int(max_tokens) or max_tokens < 1:
        raise _invalid("max_tokens", f"is required and must be a positive integer, got {max_tokens!r}")
    if max_tokens > limit:
        raise _invalid("max_tokens", f"{max_tokens} > {limit}, which is the maximum allowed number of output "
                       f"tokens for {model}")
    messages, tools, tool_choice = _conversation(body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _invalid("stream", "must be a boolean")
    sampling = Sampling(
        temperature=_optional_number(body, "temperature", low=0.0, high=MAX_TEMPERATURE),
        top_p=_optional_number(body, "top_p", low=0.0, high=1.0, low_open=True),
        stop=_stop_sequences(body.get("stop_sequences")),
    )
    return ChatRequest(api="anthropic", model=model, messages=messages, max_tokens=max_tokens, stream=bool(stream),
                       sampling=sampling, tools=tools, tool_choice=tool_choice)


def parse_count_tokens_request(body: Any, *, known_models: Collection[str],
                               max_output_tokens_for: Callable[[str], int]) -> ChatRequest:
    """A `count_tokens` body (no `max_tokens`) as a `ChatRequest` to render and count.

    `max_tokens` is set to the model's maximum only to fill the field; nothing is generated.
    """
    model = _model(body, known_models)
    messages, tools, tool_choice = _conversation(body)
    return ChatRequest(api="anthropic", model=model, messages=messages, max_tokens=max_output_tokens_for(model),
                       stream=False, tools=tools, tool_choice=tool_choice)


def count_tokens_body(input_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens}


# ---- responses ----------------------------------------------------------------------------


def _usage(usage: Usage, *, output_tokens: int) -> dict[str, Any]:
    """Anthropic usage: `input_tokens` excludes the cache reads reported beside it."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": output_tokens,
    }


def stop_reason(finish: FinishReason, *, called_tools: bool, stop_sequence: str | None) -> str:
    """Anthropic's `stop_reason` for how generation ended (see the module docstring for precedence)."""
    if finish in _STOP_REASON_BY_FINISH:
        return _STOP_REASON_BY_FINISH[finish]
    if called_tools:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def _content_blocks(events: list[OutputEvent]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for event in events:
        if isinstance(event, ToolCall):
            blocks.append({"type": "tool_use", "id": event.id, "name": event.name, "input": json.loads(event.arguments)})
        elif event.text:
            kind, key = ("text", "text") if isinstance(event, TextDelta) else ("thinking", "thinking")
            if blocks and blocks[-1]["type"] == kind:
                blocks[-1][key] += event.text
            elif kind == "text":
                blocks.append({"type": "text", "text": event.text})
            else:
                blocks.append({"type": "thinking", "thinking": event.text, "signature": THINKING_SIGNATURE})
    return blocks


def message_body(*, message_id: str, model: str, events: list[OutputEvent], finish: FinishReason,
                 stop_sequence: str | None, usage: Usage) -> dict[str, Any]:
    """A non-streaming `message`. `stop_sequence` is the buyer's stop sequence that ended the
    output, if one did."""
    called_tools = any(isinstance(event, ToolCall) for event in events)
    reason = stop_reason(finish, called_tools=called_tools, stop_sequence=stop_sequence)
    return {
        "id": message_id, "type": "message", "role": "assistant", "model": model,
        "content": _content_blocks(events),
        "stop_reason": reason, "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
        "usage": _usage(usage, output_tokens=usage.completion_tokens),
    }


def _sse(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **payload}) + b"\n\n"


class EventEncoder:
    """Writes one streaming response as Anthropic's named SSE events.

    Call `start()` once, then `events()` any number of times, `ping()` whenever the stream has
    been idle, and end with exactly one of `finish()` or `error()`. Every method returns the
    bytes to send, in order.
    """

    def __init__(self, message_id: str, model: str) -> None:
        self._message_id = message_id
        self._model = model
        self._blocks = 0
        self._open: str | None = None
        """Type of the open content block ("text" or "thinking"); tool_use blocks never stay open."""
        self._called_tools = False

    def start(self, usage_so_far: Usage) -> list[bytes]:
        """The one `message_start`: empty content, no stop reason, the input usage, and
        `output_tokens` at least 1, because Claude Code treats a zero there as a broken stream."""
        return [_sse("message_start", {"message": {
            "id": self._message_id, "type": "message", "role": "assistant", "model": self._model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": _usage(usage_so_far, output_tokens=max(1, usage_so_far.completion_tokens)),
        }})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        self._blocks += 1
        return [_sse("content_block_stop", {"index": self._blocks - 1})]

    def events(self, events: list[OutputEvent]) -> list[bytes]:
        """Content blocks for `events`: a run of text or reasoning shares one open block, a new
        kind closes it and opens the next, and each tool call is a whole `tool_use` block."""
        out: list[bytes] = []
        for event in events:
            if isinstance(event, ToolCall):
                out += self._close()
                self._called_tools = True
                index = self._blocks
                out.append(_sse("content_block_start", {"index": index, "content_block": {
                    "type": "tool_use", "id": event.id, "name": event.name, "input": {}}}))
                out.append(_sse("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": event.arguments}}))
                out.append(_sse("content_block_stop", {"index": index}))
                self._blocks += 1
                continue
            if not event.text:
                continue
            kind = "text" if isinstance(event, TextDelta) else "thinking"
            if self._open != kind:
                out += self._close()
                block = {"type": "text", "text": ""} if kind == "text" else {
                    "type": "thinking", "thinking": "", "signature": THINKING_SIGNATURE}
                out.append(_sse("content_block_start", {"index": self._blocks, "content_block": block}))
                self._open = kind
            delta = {"type": "text_delta", "text": event.text} if kind == "text" else {
                "type": "thinking_delta", "thinking": event.text}
            out.append(_sse("content_block_delta", {"index": self._blocks, "delta": delta}))
        return out

    def ping(self) -> list[bytes]:
        return [_sse("ping", {})]

    def finish(self, finish: FinishReason, *, stop_sequence: str | None, usage: Usage) -> list[bytes]:
        """Close the open block, then `message_delta` with the stop reason and the cumulative
        usage (final counts, not increments over `message_start`), then `message_stop`.

        `stop_sequence` (the buyer's stop sequence that ended the output, or None) and `usage`
        are keyword-only: both are optional-looking values of different types that a positional
        call could swap without any error until a buyer saw the wrong usage."""
        reason = stop_reason(finish, called_tools=self._called_tools, stop_sequence=stop_sequence)
        return [*self._close(),
                _sse("message_delta", {
                    "delta": {"stop_reason": reason,
                              "stop_sequence": stop_sequence if reason == "stop_sequence" else None},
                    "usage": _usage(usage, output_tokens=usage.completion_tokens),
                }),
                _sse("message_stop", {})]

    def error(self, err: GatewayError) -> list[bytes]:
        """An in-band `error` event after the 200 was sent; the stream must close right after it."""
        return [_sse("error", {"error": {"type": ERROR_TYPE_BY_KIND[err.kind], "message": err.message}})]


# ---- errors -------------------------------------------------------------------------------


def status_for(err: GatewayError) -> int:
    """The HTTP status Anthropic uses for `err`: as `err.status`, except 529 for overloaded."""
    return OVERLOADED_STATUS if err.kind == "overloaded" else err.status


def error_body(err: GatewayError, request_id: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPE_BY_KIND[err.kind], "message": err.message},
            "request_id": request_id}


def error_headers(err: GatewayError) -> dict[str, str]:
    """`retry-after` when waiting helps; `x-should-retry: false` when only a changed request can."""
    headers = {}
    if err.retry_after_s is not None:
        headers["retry-after"] = str(err.retry_after_s)
    if err.kind in NO_RETRY_KINDS:
        headers["x-should-retry"] = "false"
    return headers
