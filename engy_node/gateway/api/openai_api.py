"""The OpenAI Chat Completions wire format: request parsing, response bodies, SSE chunks, errors.

What it decides: how a buyer's `POST /v1/chat/completions` body becomes a `ChatRequest`, and how
the gateway's `OutputEvent`s, `Usage` and `GatewayError`s are written back so that the official
`openai` SDK and hand-rolled OpenAI clients read them exactly as they read OpenAI's own answers
(OpenAI's Chat Completions API reference, streaming included). Pure: no IO, no clock reads; ids and `created`
come in as arguments.

Trust: the request body is buyer input and untrusted. Every field the gateway relies on is
type-checked, and a bad one is a 400 `invalid_request` whose message and `param` name the field
(`messages[2].content[0].type`), so the buyer can fix the request without guessing; the checks
are `validation`'s, shared with `anthropic_api` and worded here in OpenAI's style. Nothing is
silently ignored: `FIELDS` says, for every top-level field of the Chat Completions API (as the
official SDK declares them), whether the parser implements it, accepts and drops it because
that cannot change what the buyer gets (`user`, `metadata`, cache hints…), or refuses it with a
400 that names it and says what to send instead (`logprobs`, penalties, JSON response formats,
`n > 1`…); a field OpenAI does not define is refused as OpenAI refuses it ("Unrecognized request
argument supplied"). The official SDK sends only the fields its caller passes, so its requests
pass. Dropped fields are never forwarded, so a miner's engine cannot trip over them. Inside the
messages, what cannot be honoured is refused too: images (the models are text-only), and a tool
choice naming a tool that was not sent.

Failure posture: once a stream's 200 has been sent, errors can only travel in-band, so
`ChunkEncoder.error` writes OpenAI's `data: {"error": ...}` event (the SDK raises `APIError` on
it) and then `data: [DONE]`, so a client that reads to the terminator still finds one; every
other stream ends with a `finish_reason` chunk and `data: [DONE]`, because strict clients treat
a stream without them as broken and retry.

Decisions the OpenAI reference leaves open, and why:
* `developer` messages become `system` messages: chat templates know only `system`.
* Text parts of one message are joined with "\\n" (vLLM's convention for templates that take a
  string), and an assistant's `reasoning_content` in history is dropped, as chat templates drop
  past reasoning.
* When both `max_completion_tokens` and the deprecated `max_tokens` are sent, the former wins;
  when neither is, the model's maximum output is used (and reserved by billing).
* `stream_options` on a non-streaming request is ignored rather than rejected.
* `top_p` must be in (0, 1] (`validation.FieldChecks.top_p` says why).
* A body sent with a `Content-Type` other than `application/json` is a 415 with OpenAI's
  "Unsupported content type" message (`unsupported_content_type`), whatever it holds.
* `finish_reason` is `tool_calls` only when the model stopped by itself after calling tools; a
  cut-off response stays `length` so the client knows the output is incomplete.
* Billing exhaustion is HTTP 402 with type `insufficient_quota` (OpenRouter's status; the SDK
  raises `APIStatusError` and, unlike for OpenAI's 429 `insufficient_quota`, does not retry).
  `error_headers` is `validation`'s: both APIs send the same retry headers.

Why this size: it is the whole Chat Completions wire format, its table of every field, the
request's parsing, the bodies, the stream chunks and the errors, which change together whenever
the reference does; what it shares with the Anthropic format is in `chat.py` and `validation.py`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

import orjson

from engy_node.chat_template import RESERVED_VARIABLES
from engy_node.gateway.api import cost_fields
from engy_node.gateway.api.chat import ChatRequest, FinishReason, GatewayError, Usage
from engy_node.gateway.api.fallback_models import requested_models
from engy_node.gateway.api.validation import (
    USED,
    FieldChecks,
    FieldRule,
    Harmless,
    Refused,
    equals,
    error_headers,
    invalid,
    is_int,
    is_zero,
    one_of,
)
from engy_node.model_output import OutputEvent, ReasoningDelta, TextDelta, ToolCall
from engy_node.protocol.miner import Sampling

__all__ = [
    "ChunkEncoder",
    "DONE",
    "ERROR_CODE_BY_KIND",
    "ERROR_TYPE_BY_KIND",
    "FIELDS",
    "KEEPALIVE",
    "MAX_STOP_SEQUENCES",
    "MAX_TEMPERATURE",
    "completion_body",
    "error_body",
    "error_headers",
    "parse_chat_request",
    "unsupported_content_type",
    "usage_body",
]

# OpenAI's own limits, kept so that a request valid here is valid against OpenAI and vice versa.
MAX_STOP_SEQUENCES = 4
MAX_TEMPERATURE = 2.0
# OpenAI's function-name rule; chat templates splice the name into the prompt verbatim.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

_ROLES = ("system", "developer", "user", "assistant", "tool")
_UNSUPPORTED_PARTS = {"image_url": "images", "input_audio": "audio", "file": "files"}

ERROR_TYPE_BY_KIND: dict[str, str] = {
    "invalid_request": "invalid_request_error",
    "authentication": "authentication_error",
    "billing": "insufficient_quota",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "request_too_large": "invalid_request_error",
    "rate_limit": "rate_limit_error",
    "api_error": "api_error",
    "upstream": "server_error",
    "overloaded": "service_unavailable_error",
    "timeout": "timeout",
    "request_timeout": "invalid_request_error",
    "method_not_allowed": "invalid_request_error",
    "unsupported_media_type": "invalid_request_error",
}
"""OpenAI `error.type` per `GatewayError.kind`."""

ERROR_CODE_BY_KIND: dict[str, str] = {
    "authentication": "invalid_api_key",
    "billing": "insufficient_quota",
    "request_too_large": "request_too_large",
    "rate_limit": "rate_limit_exceeded",
    "upstream": "upstream_error",
    "overloaded": "server_is_overloaded",
    "timeout": "timeout",
    "unsupported_media_type": "unsupported_content_type",
}
"""`error.code` per kind: OpenAI's documented code where one fits (`invalid_api_key`,
`insufficient_quota`, `rate_limit_exceeded`, `server_is_overloaded`), a descriptive one of ours
for the rest, null for kinds whose type already says everything."""

_CHECK = FieldChecks(
    separator=" ",
    item_path="{param}[{index}]",
    unknown_model="The model `{model}` does not exist or you do not have access to it.",
    unknown_field="Unrecognized request argument supplied: {field}",
)
"""OpenAI's wording: a sentence that starts with the field's path (`messages[2].content must be ...`)."""

_NO_LOGPROBS = "the miners' answers carry no log probabilities"
_NO_JSON_MODE = (
    "the miners cannot guarantee JSON output; ask for JSON in the messages and validate what comes "
    'back, or send {"type": "text"}'
)

FIELDS: dict[str, FieldRule] = {
    # Read by `parse_chat_request`, which implements them or refuses what it cannot honour.
    **dict.fromkeys(
        (
            "model",
            "messages",
            "max_completion_tokens",
            "max_tokens",
            "stream",
            "stream_options",
            "n",
            "temperature",
            "top_p",
            "seed",
            "stop",
            "tools",
            "tool_choice",
            "response_format",
        ),
        USED,
    ),
    # Accepted and dropped: none of them asks anything of the answer, its price or its handling.
    "user": Harmless("an end-user id for the provider's abuse monitoring", str),
    "safety_identifier": Harmless("an end-user id for the provider's abuse monitoring", str),
    "metadata": Harmless("tags for stored completions, and nothing is stored here (store: true is refused)", Mapping),
    "prompt_cache_key": Harmless(
        "a hint for routing to a warm cache; miners reuse prompt prefixes by themselves, "
        "and the answer and its price are the same",
        str,
    ),
    "prompt_cache_retention": Harmless(
        "how long a cache entry lives; it changes neither the answer nor its price here", str
    ),
    "prompt_cache_options": Harmless(
        "where cache breakpoints go; it changes neither the answer nor its price here", Mapping
    ),
    "prediction": Harmless(
        "predicted output only lets a server skip ahead where it matches; the answer is the same", Mapping
    ),
    # Refused unless they ask for what the gateway does anyway.
    "parallel_tool_calls": Refused(
        "false is not supported: the model may call several tools in one turn; omit it or send true",
        allows=equals(True),
    ),
    "store": Refused(
        "true is not supported: this gateway never stores completions; omit it or send false", allows=equals(False)
    ),
    "logprobs": Refused(f"is not supported: {_NO_LOGPROBS}; omit it or send false", allows=equals(False)),
    "top_logprobs": Refused(f"is not supported: {_NO_LOGPROBS}; omit it"),
    "frequency_penalty": Refused("is not supported: the miners apply no penalties; omit it or send 0", allows=is_zero),
    "presence_penalty": Refused("is not supported: the miners apply no penalties; omit it or send 0", allows=is_zero),
    "logit_bias": Refused("is not supported: the miners apply no logit bias; omit it", allows=equals({})),
    "service_tier": Refused(
        "is not supported beyond 'auto' and 'default': this gateway has one tier; omit it",
        allows=one_of("auto", "default"),
    ),
    "modalities": Refused(
        'is not supported beyond ["text"]: the models served here write text only; omit it', allows=equals(["text"])
    ),
    "audio": Refused("is not supported: the models served here write text only; omit it"),
    "verbosity": Refused(
        "is not supported: the served models cannot be told how much to write; bound the answer "
        "with max_completion_tokens, or ask in the messages"
    ),
    "reasoning_effort": Refused(
        "is not supported: the served models reason as their chat template makes them; omit it"
    ),
    "functions": Refused("is deprecated and not supported; send the functions as tools"),
    "function_call": Refused("is deprecated and not supported; send tools and tool_choice"),
    "web_search_options": Refused("is not supported: this gateway does no web search; omit it"),
    "moderation": Refused("is not supported: this gateway runs no moderation model; omit it"),
}
"""Every top-level Chat Completions field the official SDK declares, and what the gateway does
with it (`validation` says what each kind means). A field not listed is refused as OpenAI
refuses it."""

EXTENSION_FIELDS: dict[str, FieldRule] = {"chat_template_kwargs": USED, "models": USED, "usage": USED}
"""Fields beyond the SDK's that open-model servers take (sglang, vLLM) and buyers send through
`extra_body`: variables for the model's chat template (`{"enable_thinking": false}`); and
OpenRouter's fallback `models` (`fallback_models`) and `usage: {"include": true}` (`cost_fields`)."""

_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})
_ALL_FIELDS = {**FIELDS, **EXTENSION_FIELDS}


# ---- request ------------------------------------------------------------------------------


def _text_content(content: Any, param: str, *, allow_null: bool) -> str:
    """A message's content as one string: a string, or a list of text parts joined with "\\n"."""
    if content is None and allow_null:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part_param, part in _CHECK.items(content, param=param, complaint="must be a string or a list of content parts"):
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise invalid(param=f"{part_param}.type", message=f"{part_param} must be an object with a string type")
        kind = part["type"]
        if kind in _UNSUPPORTED_PARTS:
            raise invalid(
                param=f"{part_param}.type",
                message=f"{part_param}: {_UNSUPPORTED_PARTS[kind]} are not "
                "supported; the models served here take text only, so send text parts",
            )
        if kind not in ("text", "refusal"):
            raise _CHECK.invalid(param=f"{part_param}.type", complaint=f"{kind!r} is not supported; use 'text'")
        texts.append(_CHECK.string(part.get(kind), param=f"{part_param}.{kind}"))
    return "\n".join(texts)


def _assistant_tool_calls(raw: Any, param: str) -> list[dict[str, Any]]:
    calls = []
    for call_param, call in _CHECK.items(raw, param=param):
        call = _CHECK.json_object(call, param=call_param)
        call_id = _CHECK.string(call.get("id"), param=f"{call_param}.id")
        if call.get("type", "function") != "function":
            raise _CHECK.invalid(param=f"{call_param}.type", complaint="must be 'function'")
        function = _CHECK.json_object(call.get("function"), param=f"{call_param}.function")
        name = _CHECK.string(function.get("name"), param=f"{call_param}.function.name")
        arguments = _CHECK.string(
            function.get("arguments"), param=f"{call_param}.function.arguments", complaint="must be a JSON string"
        )
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


def _messages(raw: Any) -> tuple[dict[str, Any], ...]:
    messages = []
    for param, message in _CHECK.items(raw, param="messages", non_empty=True):
        message = _CHECK.json_object(message, param=param)
        role = message.get("role")
        if role not in _ROLES:
            raise _CHECK.invalid(param=f"{param}.role", complaint=f"must be one of {', '.join(_ROLES)}; got {role!r}")
        tool_calls = None
        if role == "assistant" and message.get("tool_calls") is not None:
            tool_calls = _assistant_tool_calls(message["tool_calls"], f"{param}.tool_calls")
        out: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": _text_content(message.get("content"), f"{param}.content", allow_null=role == "assistant"),
        }
        if tool_calls:
            out["tool_calls"] = tool_calls
        if role == "tool":
            out["tool_call_id"] = _CHECK.string(message.get("tool_call_id"), param=f"{param}.tool_call_id")
        messages.append(out)
    return tuple(messages)


def _function_spec(tool: Any, param: str) -> dict[str, Any]:
    """One tool's `function`, checked: function tools are the only kind supported."""
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        raise invalid(
            param=f"{param}.type",
            message=f"{param} must be an object with type 'function' (the only tool type supported)",
        )
    function = _CHECK.json_object(tool.get("function"), param=f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise _CHECK.invalid(param=f"{param}.function.name", complaint="must be 1-64 letters, digits, '_' or '-'")
    spec: dict[str, Any] = {"name": name}
    if function.get("description") is not None:
        spec["description"] = _CHECK.string(function["description"], param=f"{param}.function.description")
    if function.get("parameters") is not None:
        spec["parameters"] = _CHECK.json_schema(function["parameters"], param=f"{param}.function.parameters")
    return spec


def _tool_choice(raw: Any, tools: tuple[dict[str, Any], ...] | None) -> Any:
    """The normalised tool choice: None, "none" (the caller then drops the tools), "auto", "required"
    or {"type": "function", "function": {"name": ...}}; "auto" without tools is None."""
    if raw is None or raw == "none":
        return raw
    if raw == "auto":
        return raw if tools else None
    names = {tool["function"]["name"] for tool in tools or ()}
    if raw == "required":
        if not tools:
            raise _CHECK.invalid(param="tool_choice", complaint="'required' needs at least one tool in tools")
        return raw
    if isinstance(raw, Mapping) and raw.get("type") == "function" and isinstance(raw.get("function"), Mapping):
        name = raw["function"].get("name")
        if not isinstance(name, str) or name not in names:
            raise invalid(
                param="tool_choice.function.name",
                message=f"tool_choice names the function {name!r}, which is not in tools",
            )
        return {"type": "function", "function": {"name": name}}
    raise _CHECK.invalid(
        param="tool_choice",
        complaint='must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
    )


def _max_tokens(body: Mapping[str, Any], limit: int) -> int:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(key)
    if value is None:
        return limit
    if not is_int(value) or value < 1:
        raise _CHECK.invalid(param=key, complaint=f"must be a positive integer, got {value!r}")
    if value > limit:
        raise _CHECK.invalid(
            param=key,
            complaint=f"is too large: {value}. This model supports at most {limit} "
            f"completion tokens, whereas you provided {value}.",
        )
    return value


def _seed(raw: Any) -> int | None:
    if raw is None:
        return None
    # Engines keep the seed in a 64-bit integer.
    if not is_int(raw) or not -(2**63) <= raw < 2**64:
        raise _CHECK.invalid(param="seed", complaint=f"must be a 64-bit integer, got {raw!r}")
    return raw


def _include_usage(raw: Any) -> bool | None:
    """`stream_options.include_usage`; the other option, obfuscation padding, is not done here."""
    if raw is None:
        return None
    options = _CHECK.json_object(raw, param="stream_options")
    for key in options:
        if key not in _STREAM_OPTIONS:
            raise _CHECK.invalid(
                param=f"stream_options.{key}",
                complaint="is not a stream option; the options are include_usage and include_obfuscation",
            )
    if _CHECK.optional_bool(options.get("include_obfuscation"), param="stream_options.include_obfuscation"):
        raise _CHECK.invalid(
            param="stream_options.include_obfuscation",
            complaint="true is not supported: this gateway pads no stream events; omit it or send false",
        )
    return _CHECK.optional_bool(options.get("include_usage"), param="stream_options.include_usage")


def _check_response_format(raw: Any) -> None:
    """Only plain text: the miners cannot constrain their output to JSON."""
    if raw is None:
        return
    kind = _CHECK.json_object(raw, param="response_format").get("type")
    if kind in ("json_object", "json_schema"):
        raise _CHECK.invalid(param="response_format", complaint=f"type {kind!r} is not supported: {_NO_JSON_MODE}")
    if kind != "text":
        raise _CHECK.invalid(
            param="response_format.type", complaint=f"must be 'text', 'json_object' or 'json_schema', got {kind!r}"
        )


def parse_chat_request(
    body: Any, *, known_models: Collection[str], max_output_tokens_for: Callable[[str], int]
) -> ChatRequest:
    """A buyer's chat-completions body as a `ChatRequest`.

    Raises `GatewayError`: `invalid_request` (400, with `param`) for a malformed, unknown or
    unsupported field (`FIELDS`), `not_found` (404, param "model") for a model this gateway does
    not serve.
    """
    if not isinstance(body, Mapping):
        raise invalid(param="body", message="the request body must be a JSON object")
    _CHECK.known_fields(body, _ALL_FIELDS)
    model, fallbacks = requested_models(body.get("model"), body.get("models"), check=_CHECK, known_models=known_models)
    messages = _messages(body.get("messages"))
    max_tokens = _max_tokens(body, min(map(max_output_tokens_for, (model, *fallbacks))))
    stream = _CHECK.optional_bool(body.get("stream"), param="stream")
    include_usage = _include_usage(body.get("stream_options"))
    _check_response_format(body.get("response_format"))
    n = body.get("n")
    if n is not None and (not is_int(n) or n != 1):
        raise _CHECK.invalid(param="n", complaint=f"must be 1: this gateway returns one choice per request, got {n!r}")
    tools = _CHECK.tools(body.get("tools"), function_spec=_function_spec)
    tool_choice = _tool_choice(body.get("tool_choice"), tools)
    if tool_choice == "none":
        tools, tool_choice = None, None
    sampling = Sampling(
        temperature=_CHECK.temperature(body.get("temperature"), maximum=MAX_TEMPERATURE),
        top_p=_CHECK.top_p(body.get("top_p")),
        seed=_seed(body.get("seed")),
        stop=_CHECK.stop_sequences(body.get("stop"), param="stop", max_count=MAX_STOP_SEQUENCES, accept_string=True),
    )
    return ChatRequest(
        api="openai",
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        stream=bool(stream),
        sampling=sampling,
        tools=tools,
        tool_choice=tool_choice,
        include_usage=bool(stream and include_usage),
        include_cost=cost_fields.asked_in_body(body.get("usage")),
        chat_template_kwargs=_chat_template_kwargs(body.get("chat_template_kwargs")),
        fallbacks=fallbacks,
    )


def _chat_template_kwargs(raw: Any) -> dict[str, Any] | None:
    """sglang's and vLLM's extension: variables for the chat template (`{"enable_thinking":
    false}`). An object of JSON values; names the renderer sets itself are refused."""
    if raw is None:
        return None
    kwargs = _CHECK.json_object(raw, param="chat_template_kwargs")
    for key in kwargs:
        if key in RESERVED_VARIABLES:
            raise _CHECK.invalid(
                param=f"chat_template_kwargs.{key}",
                complaint="is set by the gateway from the request itself; send it in its own field",
            )
    return dict(kwargs) or None


# ---- responses ----------------------------------------------------------------------------


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI usage: `prompt_tokens` includes the cached tokens, which are a breakdown, not extra."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def _tool_call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _finish_reason(finish: FinishReason, *, called_tools: bool) -> FinishReason:
    return "tool_calls" if finish == "stop" and called_tools else finish


def completion_body(
    *, request_id: str, created: int, model: str, events: list[OutputEvent], finish: FinishReason, usage: Usage
) -> dict[str, Any]:
    """A non-streaming `chat.completion` object. `request_id` is used as the completion id as is."""
    text = "".join(event.text for event in events if isinstance(event, TextDelta))
    reasoning = "".join(event.text for event in events if isinstance(event, ReasoningDelta))
    calls = [_tool_call_body(event) for event in events if isinstance(event, ToolCall)]
    message: dict[str, Any] = {"role": "assistant", "content": None if calls and not text else text, "refusal": None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": _finish_reason(finish, called_tools=bool(calls)),
            }
        ],
        "usage": usage_body(usage),
    }


def _sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


KEEPALIVE = b": keep-alive\n\n"
"""An SSE comment: the SDK's decoder skips it, and proxies see bytes and keep the stream open."""

DONE = b"data: [DONE]\n\n"


class ChunkEncoder:
    """Writes one streaming response as `chat.completion.chunk` SSE events.

    Call `start()` once, then `events()` any number of times, `keepalive()` whenever the stream
    has been idle, and end with exactly one of `finish()` or `error()`. Every method returns the
    bytes to send, in order; every chunk carries the same id, `created` and model, and
    `"usage": null` except the final usage chunk.
    """

    def __init__(self, request_id: str, created: int, model: str, include_usage: bool) -> None:
        self._request_id = request_id
        self._created = created
        self._model = model
        self._include_usage = include_usage
        self._called_tools = False

    def _chunk(self, *, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return _sse(
            {
                "id": self._request_id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": self._model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
                "usage": None,
            }
        )

    def start(self) -> list[bytes]:
        """The first chunk: the assistant role, announced once, with empty content."""
        return [self._chunk(delta={"role": "assistant", "content": ""})]

    def events(self, events: list[OutputEvent]) -> list[bytes]:
        """Content, `reasoning_content` and tool-call deltas; adjacent text of one kind is merged.

        A tool call is sent as OpenAI sends one: a first fragment with index, id, type, name and
        empty arguments, then a fragment with the arguments (clients concatenate fragments by index).
        """
        chunks: list[bytes] = []
        pending_kind: type | None = None
        pending: list[str] = []

        def flush() -> None:
            if pending:
                key = "content" if pending_kind is TextDelta else "reasoning_content"
                chunks.append(self._chunk(delta={key: "".join(pending)}))
                pending.clear()

        for event in events:
            if isinstance(event, ToolCall):
                flush()
                self._called_tools = True
                chunks.append(
                    self._chunk(
                        delta={
                            "tool_calls": [
                                {
                                    "index": event.index,
                                    "id": event.id,
                                    "type": "function",
                                    "function": {"name": event.name, "arguments": ""},
                                }
                            ]
                        }
                    )
                )
                chunks.append(
                    self._chunk(
                        delta={
                            "tool_calls": [
                                {
                                    "index": event.index,
                                    "function": {"arguments": event.arguments},
                                }
                            ]
                        }
                    )
                )
            elif event.text:
                if type(event) is not pending_kind:
                    flush()
                    pending_kind = type(event)
                pending.append(event.text)
        flush()
        return chunks

    def finish(self, finish_reason: FinishReason, usage: Usage, cost: Mapping[str, Any] | None = None) -> list[bytes]:
        """The `finish_reason` chunk (`stop` becomes `tool_calls` when tools were called), the usage
        chunk with `choices: []` when the buyer asked for it or for the `cost` (`cost_fields`),
        then `[DONE]`."""
        chunks = [self._chunk(delta={}, finish_reason=_finish_reason(finish_reason, called_tools=self._called_tools))]
        if self._include_usage or cost is not None:
            chunks.append(
                _sse(
                    {
                        "id": self._request_id,
                        "object": "chat.completion.chunk",
                        "created": self._created,
                        "model": self._model,
                        "choices": [],
                        "usage": {**usage_body(usage), **(cost or {})},
                    }
                )
            )
        chunks.append(DONE)
        return chunks

    def error(self, err: GatewayError) -> list[bytes]:
        """An in-band error after the 200 was sent, and the terminator; the stream closes after."""
        return [_sse(error_body(err, self._request_id)), DONE]

    def keepalive(self) -> list[bytes]:
        return [KEEPALIVE]


# ---- errors -------------------------------------------------------------------------------


def error_body(err: GatewayError, request_id: str) -> dict[str, Any]:
    """OpenAI's error object; `request_id` rides at the top level, where the SDK ignores it and a
    buyer pasting the body into a support request still has it."""
    code = "model_not_found" if err.kind == "not_found" and err.param == "model" else ERROR_CODE_BY_KIND.get(err.kind)
    return {
        "error": {"message": err.message, "type": ERROR_TYPE_BY_KIND[err.kind], "param": err.param, "code": code},
        "request_id": request_id,
    }


def unsupported_content_type(content_type: str | None) -> GatewayError:
    """The 415 for a body that is not declared JSON, worded as OpenAI words it."""
    sent = (
        f"you specified the header 'Content-Type: {content_type}'"
        if content_type
        else "you sent no Content-Type header"
    )
    return GatewayError(
        "unsupported_media_type",
        f"Unsupported content type: {content_type or 'none'!r}. This API method "
        f"only accepts 'application/json' requests, but {sent}. Please try again with a supported content type.",
    )
