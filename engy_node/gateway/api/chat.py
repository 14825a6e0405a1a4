"""The gateway's internal language, between the two buyer APIs and the miners.

OpenAI and Anthropic requests are both parsed into one `ChatRequest` (OpenAI-style chat messages
and tools, because that is what chat templates consume); miners stream raw model text, which
`engy_node.model_output` turns into `OutputEvent`s (text, reasoning, tool calls); each API's
encoder turns those events back into its own wire format. Nothing here does IO.

`GatewayError` is the one error type the buyer-facing handlers raise: it carries an HTTP status
and a kind, and each API renders it in its own error shape (OpenAI `{"error": {...}}`,
Anthropic `{"type": "error", "error": {...}}`), with `Retry-After` when retrying can help.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from engy_node.protocol.miner import Sampling

ErrorKind = Literal[
    "invalid_request",  # 400
    "authentication",  # 401
    "billing",  # 402: prepaid balance cannot cover the worst case
    "permission",  # 403
    "not_found",  # 404: unknown model or route
    "request_timeout",  # 408: the body did not arrive in time
    "request_too_large",  # 413
    "method_not_allowed",  # 405: a route sent the wrong HTTP method
    "unsupported_media_type",  # 415 (OpenAI): a body not sent as application/json
    "rate_limit",  # 429
    "api_error",  # 500
    "upstream",  # 502: the miner failed
    "overloaded",  # 503 (OpenAI) / 529 (Anthropic): no miner capacity
    "timeout",  # 504
]

STATUS_BY_KIND: dict[str, int] = {
    "invalid_request": 400,
    "authentication": 401,
    "billing": 402,
    "permission": 403,
    "not_found": 404,
    "request_timeout": 408,
    "request_too_large": 413,
    "rate_limit": 429,
    "api_error": 500,
    "upstream": 502,
    "overloaded": 503,
    "timeout": 504,
    "method_not_allowed": 405,
    "unsupported_media_type": 415,
}


@dataclasses.dataclass
class GatewayError(Exception):
    kind: ErrorKind
    message: str
    param: str | None = None
    retry_after_s: int | None = None
    status_from_miner: int | None = None
    """A miner's own 4xx for a request that was at fault, passed through as it is."""
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    """Headers of its own (a 429's rate-limit headers, `gateway.limits`)."""

    def __post_init__(self) -> None:
        super().__init__(self.message)

    @property
    def status(self) -> int:
        return self.status_from_miner or STATUS_BY_KIND[self.kind]


ApiName = Literal["openai", "anthropic"]
"""The buyer APIs."""


@dataclasses.dataclass(frozen=True, slots=True)
class ChatRequest:
    """One buyer request, whichever API it came through."""

    api: ApiName
    model: str
    messages: tuple[dict[str, Any], ...]
    """OpenAI-style chat messages: {role: system|user|assistant|tool, content: str,
    tool_calls?: [{id, type: "function", function: {name, arguments: str}}], tool_call_id?}."""
    max_tokens: int
    stream: bool
    sampling: Sampling = Sampling()
    tools: tuple[dict[str, Any], ...] | None = None
    """OpenAI function tools: {"type": "function", "function": {name, description, parameters}}."""
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables for the model's chat template (`enable_thinking`): the OpenAI API's
    `chat_template_kwargs`, as sglang and vLLM take it; Anthropic's `thinking` switch."""
    include_usage: bool = False
    """OpenAI `stream_options.include_usage`."""
    include_cost: bool = False
    """The buyer asked for `usage.cost` (`cost_fields`)."""
    fallbacks: tuple[str, ...] = ()
    """Models to serve it with instead, in order, when no miner of `model` has room (OpenRouter's
    `models`: `engy_node.gateway.routing.fallbacks` picks one before the hold)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    """Token counts as the gateway bills them. `prompt_tokens` includes `cached_tokens`."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    """Of the completion tokens, those of the answer's reasoning (billed as output, as every API
    bills them; reported apart as OpenAI's `completion_tokens_details.reasoning_tokens`)."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


FinishReason = Literal["stop", "length", "tool_calls"]
