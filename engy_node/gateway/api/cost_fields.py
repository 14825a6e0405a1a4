"""How a buyer asks for a request's cost, and where the gateway puts it (docs/billing.md, "Costs,
generations and usage").

* Always: the `x-engy-cost-usd` response header on a non-streamed answer of either API, the
  exact dollars the ledger charged (`costs.cost_usd`). A stream's headers leave before its cost
  is known; HTTP/1.1 trailers would carry it, but browsers' and most SDKs' SSE readers never
  read them, so a stream's cost is in its final usage chunk (OpenAI, when asked) and always in
  `GET /v1/generation`.
* When asked, OpenAI answers only: `usage.cost` and `usage.cost_details` (`costs.usage_cost`),
  in the body or in a stream's final usage chunk (sent when the cost is asked for even without
  `stream_options.include_usage`, as OpenRouter always sends it). Asked as OpenRouter does, with
  `"usage": {"include": true}` in the body, or with the `x-engy-include-cost: 1` header, for
  clients that cannot add a body field (the Anthropic SDK's `extra_headers`, a proxy).

Why only when asked: an SDK that validates `usage` strictly would see fields it does not know.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engy_node.gateway.api.chat import GatewayError

COST_HEADER = b"x-engy-cost-usd"
"""The response header with a non-streamed answer's cost in exact dollars."""

INCLUDE_COST_HEADER = "x-engy-include-cost"
"""The request header that asks for `usage.cost`: `1` or `true`."""


def asked_in_body(raw: Any) -> bool:
    """OpenRouter's `usage` request field: `{"include": true}` asks for the cost."""
    if raw is None:
        return False
    include = raw.get("include") if isinstance(raw, Mapping) else None
    if not isinstance(raw, Mapping) or set(raw) - {"include"} or not isinstance(include, bool | None):
        raise GatewayError(
            "invalid_request",
            f'usage must be {{"include": true}} to ask for the cost in the answer\'s usage, got {raw!r}',
            param="usage",
        )
    return bool(include)


def asked_in_headers(headers: Mapping[str, str]) -> bool:
    """Whether `x-engy-include-cost` asks for the cost (`1` or `true`, any case)."""
    return headers.get(INCLUDE_COST_HEADER, "").strip().lower() in ("1", "true")
