"""The Anthropic Messages wire format: request parsing, message bodies, named SSE events, errors.

What it decides: how a buyer's `POST /v1/messages` (and `/v1/messages/count_tokens`) body becomes
the gateway's OpenAI-style `ChatRequest`, and how `OutputEvent`s, `Usage` and `GatewayError`s are
written back so that the official `anthropic` SDK and agents built on it, Claude Code first, read
them as they read Anthropic's own answers (Anthropic's Messages API reference, streaming included;
gateways that translate it loosely break tool use and streaming in those clients, which this
module exists to avoid). Pure: no IO, no clock reads; ids come in as
arguments.

Trust: the body is buyer input and untrusted. Every field the gateway relies on is type-checked
(by `validation`'s checks, shared with `openai_api`), and a bad one is a 400 `invalid_request`
whose message starts with the field's path in Anthropic's own style (`messages.2.content.0.type:
...`; `param` carries the same path). Nothing is silently ignored: `MESSAGES_FIELDS` and
`COUNT_TOKENS_FIELDS` say, for every top-level field of each endpoint (as the official SDK
declares them, with the sampling fields older SDKs send), whether the parser implements it,
accepts and drops it because that cannot change what the buyer gets (`metadata`,
`cache_control`, which Claude Code sends on every request), or refuses it with a message naming
it and what to send instead (`top_k`, `output_config`, server-side features); a field Anthropic
does not define is refused as Anthropic refuses it ("Extra inputs are not permitted"). Inside
the messages, what cannot be honoured is refused too: images and documents (the models are
text-only), server tools (`web_search_…`), a `tool_choice` naming an unknown tool or forbidding
parallel tool use.

`thinking` is accepted as sent, because Claude Code sends it on every request: the served
models reason or not as their chat template makes them, and whatever reasoning there is comes
back as thinking blocks, never hidden; `budget_tokens` is a target Anthropic does not promise to
meet either, while `max_tokens`, which bounds it, is enforced.

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
* A body sent with a `Content-Type` other than `application/json` is a 400
  `invalid_request_error` (`unsupported_content_type`): Anthropic's documented statuses have no
  415, and its SDK raises `BadRequestError` on a 400.
* Overloaded (no miner capacity) is HTTP 529 `overloaded_error`, Anthropic's status, which the
  SDK retries; `status_for` gives the Anthropic status for every kind. `error_headers` is
  `validation`'s: both APIs send the same retry headers.

Why this size: it is the whole Messages wire format, its table of every field, the request's
parsing, the bodies, the named stream events and the errors, which change together whenever the
reference does; what it shares with the OpenAI format is in `chat.py` and `validation.py` already.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from typing import Any

import orjson

from engy_node.gateway.api.chat import ChatRequest, FinishReason, GatewayError, Usage
from engy_node.gateway.api.fallback_models import requested_models
from engy_node.gateway.api.validation import (
    USED,
    FieldChecks,
    FieldRule,
    Harmless,
    Refused,
    error_headers,
    is_int,
    one_of,
)
from engy_node.model_output import OutputEvent, TextDelta, ToolCall
from engy_node.protocol.miner import Sampling

__all__ = [
    "COUNT_TOKENS_FIELDS",
    "ERROR_TYPE_BY_KIND",
    "EventEncoder",
    "MAX_STOP_SEQUENCES",
    "MAX_TEMPERATURE",
    "MESSAGES_FIELDS",
    "OVERLOADED_STATUS",
    "THINKING_SIGNATURE",
    "count_tokens_body",
    "error_body",
    "error_headers",
    "message_body",
    "parse_count_tokens_request",
    "parse_messages_request",
    "status_for",
    "stop_reason",
    "unsupported_content_type",
]

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
    "request_timeout": "invalid_request_error",
    "method_not_allowed": "invalid_request_error",
    "unsupported_media_type": "invalid_request_error",
}
"""Anthropic `error.type` per `GatewayError.kind`."""

_UNSUPPORTED_BLOCKS = {"image": "images", "document": "documents"}
_STOP_REASON_BY_FINISH = {"length": "max_tokens", "tool_calls": "tool_use"}

_CHECK = FieldChecks(
    separator=": ",
    item_path="{param}.{index}",
    unknown_model="model: {model}",
    unknown_field="{field}: Extra inputs are not permitted",
)
"""Anthropic's wording: the field's path first, then what is wrong (`messages.2.content: must be ...`)."""

_NO_JSON_FORMAT = (
    "the miners cannot guarantee JSON output; ask for JSON in the messages and validate what comes back, or omit it"
)

_CONVERSATION_FIELDS: dict[str, FieldRule] = {
    # Read by `_conversation` (and the model by `_model`).
    **dict.fromkeys(("model", "messages", "system", "tools", "tool_choice", "thinking", "output_config"), USED),
    # Accepted and dropped: none of them asks anything of the answer, its price or its handling.
    "cache_control": Harmless(
        "prompt caching is automatic on the miners and never billed as a cache write here, "
        "so the marker changes neither the answer nor its price",
        Mapping,
    ),
    "user_profile_id": Harmless("attributes the request to a party; accounts here are per API key", str),
    "workspace_id": Harmless("selects a credential's workspace; an API key here belongs to one account", str),
    # Refused unless they ask for what the gateway does anyway.
    "speed": Refused(
        "'fast' is not supported: this gateway has one speed; omit it or send 'standard'", allows=one_of("standard")
    ),
    "mcp_servers": Refused(
        "is not supported: this gateway connects to no MCP servers; run the tools yourself and send them as tools"
    ),
    "context_management": Refused(
        "is not supported: this gateway does not edit the context; send the messages you want the model to see"
    ),
}

MESSAGES_FIELDS: dict[str, FieldRule] = {
    **_CONVERSATION_FIELDS,
    # Read by `parse_messages_request`.
    **dict.fromkeys(("max_tokens", "stream", "stop_sequences", "temperature", "top_p"), USED),
    "metadata": Harmless("the end user's id, for the provider's abuse monitoring", Mapping),
    "service_tier": Refused(
        "must be 'auto' or 'standard_only' (this gateway has the standard tier only)",
        allows=one_of("auto", "standard_only"),
    ),
    "top_k": Refused(
        "is not supported: the miners sample from the whole distribution, narrowed by top_p only; omit "
        "it, or send top_p"
    ),
    "container": Refused("is not supported: this gateway runs no code-execution containers; omit it"),
    "diagnostics": Refused("is not supported: answers here carry no cache diagnostics; omit it"),
    "inference_geo": Refused("is not supported: this gateway cannot choose where the miners run; omit it"),
}
"""Every top-level Messages field the official SDK declares (and its beta MCP and context
fields), with `temperature`, `top_p` and `top_k`, which older SDKs send, and what the gateway
does with each (`validation` says what each kind means). A field not listed (nor in
`MESSAGES_EXTENSION_FIELDS`) is refused as Anthropic refuses it."""

MESSAGES_EXTENSION_FIELDS: dict[str, FieldRule] = {"models": USED}
"""Beyond the SDK's, sent through `extra_body`: OpenRouter's fallback `models`, as on the OpenAI
route (`fallback_models`)."""
_MESSAGES_ACCEPTED = {**MESSAGES_FIELDS, **MESSAGES_EXTENSION_FIELDS}

COUNT_TOKENS_FIELDS: dict[str, FieldRule] = {
    **_CONVERSATION_FIELDS,
    "output_format": Refused(f"is not supported: {_NO_JSON_FORMAT}"),
}
"""The same for `count_tokens`, whose body is a Messages body without the generation fields (so
`max_tokens` there is refused, as Anthropic refuses it); `output_format` is its older name for
`output_config.format`."""


# ---- request ------------------------------------------------------------------------------


def _text_blocks(content: Any, param: str) -> str:
    """A string, or a list of text blocks joined with "\\n" (system prompts, tool results)."""
    if isinstance(content, str):
        return content
    texts = []
    for block_param, block in _CHECK.items(content, param=param, complaint="must be a string or a list of text blocks"):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if isinstance(kind, str) and kind in _UNSUPPORTED_BLOCKS:
            raise _CHECK.invalid(
                param=f"{block_param}.type",
                complaint=f"{_UNSUPPORTED_BLOCKS[kind]} are not supported; "
                "the models served here take text only, so send text blocks",
            )
        if kind != "text" or not isinstance(block.get("text"), str):
            raise _CHECK.invalid(param=block_param, complaint='must be a text block ({"type": "text", "text": ...})')
        texts.append(block["text"])
    return "\n".join(texts)


def _user_messages(content: Any, param: str) -> list[dict[str, Any]]:
    """A user turn as chat messages: text runs as user messages, each tool result as a tool message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    blocks = _CHECK.items(content, param=param, complaint="must be a string or a list of content blocks")
    messages: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            messages.append({"role": "user", "content": "\n".join(texts)})
            texts.clear()

    for block_param, block in blocks:
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(_CHECK.string(block.get("text"), param=f"{block_param}.text"))
        elif kind == "tool_result":
            flush()
            tool_use_id = _CHECK.string(block.get("tool_use_id"), param=f"{block_param}.tool_use_id")
            result = block.get("content")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": tool_use_id,
                    "content": "" if result is None else _text_blocks(result, f"{block_param}.content"),
                }
            )
        else:
            _reject_block(kind, block_param, allowed="text or tool_result")
    flush()
    return messages


def _assistant_message(content: Any, param: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block_param, block in _CHECK.items(
        content, param=param, complaint="must be a string or a list of content blocks"
    ):
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text":
            texts.append(_CHECK.string(block.get("text"), param=f"{block_param}.text"))
        elif kind == "tool_use":
            call_id = _CHECK.string(block.get("id"), param=f"{block_param}.id")
            name = _CHECK.string(block.get("name"), param=f"{block_param}.name")
            arguments = _CHECK.json_object(block.get("input"), param=f"{block_param}.input")
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
                }
            )
        elif kind not in ("thinking", "redacted_thinking"):
            _reject_block(kind, block_param, allowed="text, tool_use or thinking")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _reject_block(kind: Any, param: str, *, allowed: str) -> None:
    if isinstance(kind, str) and kind in _UNSUPPORTED_BLOCKS:
        raise _CHECK.invalid(
            param=f"{param}.type",
            complaint=f"{_UNSUPPORTED_BLOCKS[kind]} are not supported; the models served here take text only",
        )
    raise _CHECK.invalid(param=f"{param}.type", complaint=f"block type {kind!r} is not supported here; use {allowed}")


def _messages(body: Mapping[str, Any]) -> tuple[dict[str, Any], ...]:
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        system_text = _text_blocks(system, "system")
        if system_text:
            messages.append({"role": "system", "content": system_text})
    for param, message in _CHECK.items(body.get("messages"), param="messages", non_empty=True):
        message = _CHECK.json_object(message, param=param)
        role = message.get("role")
        if role == "user":
            messages.extend(_user_messages(message.get("content"), f"{param}.content"))
        elif role == "assistant":
            messages.append(_assistant_message(message.get("content"), f"{param}.content"))
        else:
            raise _CHECK.invalid(
                param=f"{param}.role",
                complaint="must be 'user' or 'assistant' (the system prompt "
                f"goes in the top-level system field), got {role!r}",
            )
    return tuple(messages)


def _function_spec(tool: Any, param: str) -> dict[str, Any]:
    """One custom tool as a function spec; server tools run on Anthropic's side and are refused."""
    tool = _CHECK.json_object(tool, param=param)
    if tool.get("type", "custom") != "custom":
        raise _CHECK.invalid(
            param=f"{param}.type",
            complaint=f"server tool {tool.get('type')!r} is not supported; "
            "only custom tools (name, description, input_schema) are",
        )
    spec: dict[str, Any] = {"name": _CHECK.string(tool.get("name"), param=f"{param}.name", non_empty=True)}
    parameters = _CHECK.json_schema(tool.get("input_schema"), param=f"{param}.input_schema")
    if tool.get("description") is not None:
        spec["description"] = _CHECK.string(tool["description"], param=f"{param}.description")
    spec["parameters"] = parameters
    return spec


def _tool_choice(raw: Any, tools: tuple[dict[str, Any], ...] | None) -> Any:
    """The OpenAI-style choice: None, "none", "auto", "required" or a named function."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    if kind == "none":
        return "none"
    if kind is not None and _CHECK.optional_bool(
        raw.get("disable_parallel_tool_use"), param="tool_choice.disable_parallel_tool_use"
    ):
        raise _CHECK.invalid(
            param="tool_choice.disable_parallel_tool_use",
            complaint="true is not supported: the model may call several tools in one turn; omit it",
        )
    if kind == "auto":
        return "auto" if tools else None
    if kind == "any":
        if not tools:
            raise _CHECK.invalid(param="tool_choice", complaint="type 'any' needs at least one tool in tools")
        return "required"
    if kind == "tool":
        name = raw.get("name")
        if not isinstance(name, str) or name not in {tool["function"]["name"] for tool in tools or ()}:
            raise _CHECK.invalid(param="tool_choice.name", complaint=f"names the tool {name!r}, which is not in tools")
        return {"type": "function", "function": {"name": name}}
    raise _CHECK.invalid(
        param="tool_choice",
        complaint='must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}',
    )


def _check_thinking(thinking: Any) -> None:
    """Accepted as sent (the module docstring says why), but type-checked, so a typo is reported."""
    if thinking is None:
        return
    if not isinstance(thinking, Mapping) or thinking.get("type") not in (
        "enabled",
        "disabled",
        "adaptive",
        "between_tools",
    ):
        raise _CHECK.invalid(
            param="thinking",
            complaint='must be {"type": "enabled", "budget_tokens": N}, '
            '{"type": "adaptive"}, {"type": "between_tools"} or {"type": "disabled"}',
        )
    budget = thinking.get("budget_tokens")
    if budget is not None and (not is_int(budget) or budget < 0):
        raise _CHECK.invalid(
            param="thinking.budget_tokens", complaint=f"must be a non-negative integer, got {budget!r}"
        )


def _check_output_config(raw: Any) -> None:
    """Neither of its options can be honoured: an output format (JSON) or an effort level."""
    if raw is None:
        return
    for key, value in _CHECK.json_object(raw, param="output_config").items():
        if value is None:
            continue
        if key == "format":
            raise _CHECK.invalid(param="output_config.format", complaint=f"is not supported: {_NO_JSON_FORMAT}")
        if key == "effort":
            raise _CHECK.invalid(
                param="output_config.effort",
                complaint="is not supported: the served models reason as their chat template makes them; omit it",
            )
        raise _CHECK.invalid(param=f"output_config.{key}", complaint="Extra inputs are not permitted")


def _model(body: Any, known_models: Collection[str], fields: Mapping[str, FieldRule]) -> str:
    """The model, once the body is known to be an object holding only `fields`."""
    if not isinstance(body, Mapping):
        raise _CHECK.invalid(param="body", complaint="the request body must be a JSON object")
    _CHECK.known_fields(body, fields)
    return _CHECK.model(body.get("model"), known_models=known_models)


def _conversation(body: Mapping[str, Any]) -> tuple[tuple[dict[str, Any], ...], tuple[dict[str, Any], ...] | None, Any]:
    """Messages, tools and tool choice, shared by messages and count_tokens."""
    messages = _messages(body)
    tools = _CHECK.tools(body.get("tools"), function_spec=_function_spec)
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    if tool_choice == "none":
        tools, tool_choice = None, None
    _check_thinking(body.get("thinking"))
    _check_output_config(body.get("output_config"))
    return messages, tools, tool_choice


def parse_messages_request(
    body: Any, *, known_models: Collection[str], max_output_tokens_for: Callable[[str], int]
) -> ChatRequest:
    """A buyer's Messages body as a `ChatRequest`.

    Raises `GatewayError`: `invalid_request` (400) for a malformed, missing, unknown or
    unsupported field (`MESSAGES_FIELDS`), naming it; `not_found` (404) for a model this gateway
    does not serve.
    """
    model = _model(body, known_models, _MESSAGES_ACCEPTED)
    _, fallbacks = requested_models(model, body.get("models"), check=_CHECK, known_models=known_models)
    limit = min(map(max_output_tokens_for, (model, *fallbacks)))
    max_tokens = body.get("max_tokens")
    if not is_int(max_tokens) or max_tokens < 1:
        raise _CHECK.invalid(
            param="max_tokens", complaint=f"is required and must be a positive integer, got {max_tokens!r}"
        )
    if max_tokens > limit:
        raise _CHECK.invalid(
            param="max_tokens",
            complaint=f"{max_tokens} > {limit}, which is the maximum allowed number of output tokens for {model}",
        )
    messages, tools, tool_choice = _conversation(body)
    stream = _CHECK.optional_bool(body.get("stream"), param="stream")
    sampling = Sampling(
        temperature=_CHECK.temperature(body.get("temperature"), maximum=MAX_TEMPERATURE),
        top_p=_CHECK.top_p(body.get("top_p")),
        stop=_CHECK.stop_sequences(
            body.get("stop_sequences"), param="stop_sequences", max_count=MAX_STOP_SEQUENCES, accept_string=False
        ),
    )
    return ChatRequest(
        api="anthropic",
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        stream=bool(stream),
        sampling=sampling,
        tools=tools,
        tool_choice=tool_choice,
        chat_template_kwargs=_thinking_switch(body.get("thinking")),
        fallbacks=fallbacks,
    )


def _thinking_switch(thinking: Any) -> dict[str, Any] | None:
    """`thinking` on or off, as the chat templates that can switch reasoning take it
    (`enable_thinking`, Qwen3's); any other setting leaves the template's default."""
    kind = thinking.get("type") if isinstance(thinking, Mapping) else None
    return {"enable_thinking": kind == "enabled"} if kind in ("enabled", "disabled") else None


def parse_count_tokens_request(
    body: Any, *, known_models: Collection[str], max_output_tokens_for: Callable[[str], int]
) -> ChatRequest:
    """A `count_tokens` body (no `max_tokens`) as a `ChatRequest` to render and count.

    `max_tokens` is set to the model's maximum only to fill the field; nothing is generated.
    Fields are checked against `COUNT_TOKENS_FIELDS`.
    """
    model = _model(body, known_models, COUNT_TOKENS_FIELDS)
    messages, tools, tool_choice = _conversation(body)
    return ChatRequest(
        api="anthropic",
        model=model,
        messages=messages,
        max_tokens=max_output_tokens_for(model),
        stream=False,
        tools=tools,
        tool_choice=tool_choice,
    )


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
            blocks.append(
                {"type": "tool_use", "id": event.id, "name": event.name, "input": json.loads(event.arguments)}
            )
        elif event.text:
            kind, key = ("text", "text") if isinstance(event, TextDelta) else ("thinking", "thinking")
            if blocks and blocks[-1]["type"] == kind:
                blocks[-1][key] += event.text
            elif kind == "text":
                blocks.append({"type": "text", "text": event.text})
            else:
                blocks.append({"type": "thinking", "thinking": event.text, "signature": THINKING_SIGNATURE})
    return blocks


def message_body(
    *,
    message_id: str,
    model: str,
    events: list[OutputEvent],
    finish: FinishReason,
    stop_sequence: str | None,
    usage: Usage,
) -> dict[str, Any]:
    """A non-streaming `message`. `stop_sequence` is the buyer's stop sequence that ended the
    output, if one did."""
    called_tools = any(isinstance(event, ToolCall) for event in events)
    reason = stop_reason(finish, called_tools=called_tools, stop_sequence=stop_sequence)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _content_blocks(events),
        "stop_reason": reason,
        "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
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
        return [
            _sse(
                "message_start",
                {
                    "message": {
                        "id": self._message_id,
                        "type": "message",
                        "role": "assistant",
                        "model": self._model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": _usage(usage_so_far, output_tokens=max(1, usage_so_far.completion_tokens)),
                    }
                },
            )
        ]

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
                out.append(
                    _sse(
                        "content_block_start",
                        {
                            "index": index,
                            "content_block": {"type": "tool_use", "id": event.id, "name": event.name, "input": {}},
                        },
                    )
                )
                out.append(
                    _sse(
                        "content_block_delta",
                        {"index": index, "delta": {"type": "input_json_delta", "partial_json": event.arguments}},
                    )
                )
                out.append(_sse("content_block_stop", {"index": index}))
                self._blocks += 1
                continue
            if not event.text:
                continue
            kind = "text" if isinstance(event, TextDelta) else "thinking"
            if self._open != kind:
                out += self._close()
                block = (
                    {"type": "text", "text": ""}
                    if kind == "text"
                    else {"type": "thinking", "thinking": "", "signature": THINKING_SIGNATURE}
                )
                out.append(_sse("content_block_start", {"index": self._blocks, "content_block": block}))
                self._open = kind
            delta = (
                {"type": "text_delta", "text": event.text}
                if kind == "text"
                else {"type": "thinking_delta", "thinking": event.text}
            )
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
        return [
            *self._close(),
            _sse(
                "message_delta",
                {
                    "delta": {
                        "stop_reason": reason,
                        "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
                    },
                    "usage": _usage(usage, output_tokens=usage.completion_tokens),
                },
            ),
            _sse("message_stop", {}),
        ]

    def error(self, err: GatewayError) -> list[bytes]:
        """An in-band `error` event after the 200 was sent; the stream must close right after it."""
        return [_sse("error", {"error": {"type": ERROR_TYPE_BY_KIND[err.kind], "message": err.message}})]


# ---- errors -------------------------------------------------------------------------------


def unsupported_content_type(content_type: str | None) -> GatewayError:
    """The 400 for a body that is not declared JSON (the module docstring says why not a 415)."""
    sent = f"got {content_type!r}" if content_type else "got no content-type header"
    return GatewayError(
        "invalid_request",
        f"content-type: must be application/json, {sent}; send the body as JSON with content-type: application/json",
    )


def status_for(err: GatewayError) -> int:
    """The HTTP status Anthropic uses for `err`: as `err.status`, except 529 for overloaded."""
    return OVERLOADED_STATUS if err.kind == "overloaded" else err.status


def error_body(err: GatewayError, request_id: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {"type": ERROR_TYPE_BY_KIND[err.kind], "message": err.message},
        "request_id": request_id,
    }
