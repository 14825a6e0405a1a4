"""What a request costs: the hold reserved before dispatch, the charge after, and the usage billed.

Pure integer arithmetic over micro-USD: no IO, no clock, no floats. The store moves the money
(`store/ledger.py`); this module only decides how much.

Trust. Prices come from the catalog (`models.PriceCard`, micro-USD per 1M tokens). Token
counts come from the gateway itself wherever it can count them (docs/billing.md): the prompt is the
gateway's own tokenisation, completion tokens are capped by what was relayed to the buyer and by
the proof commitment. A miner's claimed usage is an upper bound at best, never a floor.

Rounding. Every amount is rounded UP to the micro-dollar, once, at the end. Rounding down would
make every request cheaper than one micro-dollar free — at the embedded model's prices a
50-token request costs half a micro-dollar, so a buyer could send millions of them for nothing —
while rounding up costs an honest buyer at most one micro-dollar per request. The hold rounds
up for a second reason: an under-reserved hold could let a request spend money the buyer does
not have.

Failure posture: nonsense inputs (negative or non-integer counts, a price card whose cached
rate exceeds its input rate) raise `ValueError`; they are gateway bugs, and a wrong bill is
worse than a failed request.
"""

from __future__ import annotations

import dataclasses

from engy_node.gateway.api.chat import Usage
from engy_node.models import PriceCard

TOKENS_PER_PRICE_UNIT = 1_000_000
"""`PriceCard` rates are micro-USD per this many tokens."""


def _ceil_div(numerator: int, denominator: int) -> int:
    # Floor division of the negation rounds toward -inf, so negating back rounds toward +inf:
    # exact in integers, with no float detour.
    return -(-numerator // denominator)


def _count(name: str, value: object) -> int:
    # bool is an int subclass; True tokens is always a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _claim(value: object) -> int:
    # A miner's number: anything but a non-negative integer is worth nothing, which only ever
    # lowers the bill (its bound is a minimum).
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return max(0, value)


def _checked(price: PriceCard) -> PriceCard:
    for field in dataclasses.fields(price):
        _count(f"price.{field.name}", getattr(price, field.name))
    # The hold prices every prompt token at the input rate; that covers the charge only if
    # caching never makes a token dearer.
    if price.cached_input_per_m > price.input_per_m:
        raise ValueError(
            f"price card charges more for cached input ({price.cached_input_per_m}) than for input "
            f"({price.input_per_m}); fix the catalog entry"
        )
    return price


def worst_case_hold(*, price: PriceCard, prompt_tokens: int, max_tokens: int) -> int:
    """Micro-USD to reserve before dispatch: the most the request can cost.

    Every prompt token at the uncached input rate (the miner may have nothing cached) plus
    `max_tokens` completion tokens at the output rate, rounded up. `charge` of any usage with at
    most `prompt_tokens` prompt tokens and at most `max_tokens` completion tokens is never above
    this (tested with hypothesis).

    Raises:
        ValueError: a negative or non-integer count, or an invalid price card.
    """
    _checked(price)
    prompt = _count("prompt_tokens", prompt_tokens)
    completion = _count("max_tokens", max_tokens)
    return _ceil_div(prompt * price.input_per_m + completion * price.output_per_m, TOKENS_PER_PRICE_UNIT)


def charge(*, price: PriceCard, usage: Usage) -> int:
    """Micro-USD the request actually cost.

    Uncached prompt tokens (`prompt_tokens - cached_tokens`; OpenAI semantics, where the prompt
    count includes the cached part) at the input rate, cached tokens at the cached rate,
    completion tokens at the output rate; the exact sum in micro-USD·tokens is divided by 1M
    and rounded up once, so no request with any billable token is free.

    Why `charge <= worst_case_hold` when `usage.prompt_tokens <= P` and
    `usage.completion_tokens <= M`: before rounding, the charge's numerator is
    `(p - c)·in + c·cached + k·out <= p·in + k·out <= P·in + M·out` (since `cached <= in`,
    enforced by `_checked`), which is the hold's numerator; rounding up is monotone.

    Raises:
        ValueError: negative counts, `cached_tokens > prompt_tokens`, or an invalid price card.
    """
    _checked(price)
    prompt = _count("usage.prompt_tokens", usage.prompt_tokens)
    cached = _count("usage.cached_tokens", usage.cached_tokens)
    completion = _count("usage.completion_tokens", usage.completion_tokens)
    if cached > prompt:
        raise ValueError(f"usage.cached_tokens ({cached}) exceeds usage.prompt_tokens ({prompt})")
    exact = (prompt - cached) * price.input_per_m + cached * price.cached_input_per_m + completion * price.output_per_m
    return _ceil_div(exact, TOKENS_PER_PRICE_UNIT)


def billable_usage(
    *, claimed: Usage, committed_prompt: int, committed_completion: int, relayed_completion: int
) -> Usage:
    """The usage the buyer is billed for and the miner is scored on (docs/billing.md, "What is billed").

    Args:
        claimed: what the miner reported. Untrusted: it can only lower the bill (its completion
            count and its cached count, which makes tokens cheaper), never raise it. A negative
            or non-integer claim counts as 0.
        committed_prompt: the gateway's own prompt-token count — its rendering and tokenisation
            of the request, which the commitment's `prompt_ids` must equal. Billed as is; the
            miner's prompt count is ignored.
        committed_completion: `len(commitment.output_token_ids)`.
        relayed_completion: the gateway's recount, with the model's tokenizer, of the completion
            text actually relayed to the buyer (a stream cut by a dying miner relays less).

    Returns `Usage(prompt_tokens=committed_prompt, completion_tokens=min(claimed, committed,
    relayed), cached_tokens=clamped to [0, committed_prompt])`: no field exceeds any bound and
    none is negative. Taking the minimum errs toward under-billing: a miner that under-claims
    costs itself score, a gateway that over-bills costs a buyer money it never received value
    for.

    Raises:
        ValueError: a negative or non-integer gateway-side count (those are our own numbers).
    """
    prompt = _count("committed_prompt", committed_prompt)
    committed = _count("committed_completion", committed_completion)
    relayed = _count("relayed_completion", relayed_completion)
    completion = min(_claim(claimed.completion_tokens), committed, relayed)
    cached = min(_claim(claimed.cached_tokens), prompt)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)
