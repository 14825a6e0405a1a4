"""What the official SDKs' usage objects say, as the gateway bills it (`chat.Usage`), so a test
can price a buyer's answers with `billing.charge` and compare with the ledger."""

from __future__ import annotations

from engy_node.gateway.api.chat import Usage


def openai_usage(usage) -> Usage:
    details = usage.prompt_tokens_details
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=(details.cached_tokens or 0) if details else 0,
    )


def anthropic_usage(usage) -> Usage:
    cached = usage.cache_read_input_tokens or 0
    return Usage(prompt_tokens=usage.input_tokens + cached, completion_tokens=usage.output_tokens, cached_tokens=cached)
