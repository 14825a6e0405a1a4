"""What a request cost, as the buyer reads it: exact decimal dollars from the ledger's integer µUSD.

The ledger charges integer micro-USD (`billing.charge`); buyers' tools (OpenRouter's
`usage.cost`, LiteLLM's `x-litellm-response-cost`) read dollars. Dollars here are made from the
integer by string formatting, never by float arithmetic, so `usage.cost` is exactly the charge:
`cost_usd(1_234)` is `"0.001234"`. A JSON number is a float to every SDK, so `cost_number`
turns that decimal into the double nearest to it; the shortest text of that double, which is
what `orjson` and Python's `json` write, is the same decimal, and reading it back gives the
charge to the µUSD (a property test checks it up to a billion dollars).

The breakdown (`cost_details`) is the charge's parts before its one rounding: prompt tokens not
cached at the input rate, cached ones at the cached rate, completion tokens at the output rate,
and, of those, the reasoning tokens (billed as output, like every API bills them). A part is an
exact rational number of µUSD with at most six decimals (rates are µUSD per million tokens), so
in dollars it has at most twelve; the charge is their sum (reasoning excluded, being part of
the completion) rounded up to the µUSD once, as `billing.charge` does.

Pure: no IO, no clock.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from engy_node.gateway.api.chat import Usage
from engy_node.gateway.billing.billing import TOKENS_PER_PRICE_UNIT
from engy_node.models import PriceCard

MICRO_USD_PER_USD = 1_000_000
USD_DECIMALS = 6


def cost_usd(micro: int) -> str:
    """`micro` µUSD as exact dollars: `1_234` → `"0.001234"`, `25_000_000` → `"25.000000"`."""
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 0:
        raise ValueError(f"a cost must be an integer number of µUSD >= 0, got {micro!r}")
    dollars, micros = divmod(micro, MICRO_USD_PER_USD)
    return f"{dollars}.{micros:0{USD_DECIMALS}d}"


def cost_number(micro: int) -> float:
    """`micro` µUSD as a JSON number of dollars whose text is the exact decimal (module docstring)."""
    return float(cost_usd(micro))


def _part(tokens: int, rate: int) -> float:
    # Exact in decimal: the divisor is a power of ten and the quotient has far fewer digits than
    # the default context's 28.
    return float(Decimal(tokens * rate) / (TOKENS_PER_PRICE_UNIT * MICRO_USD_PER_USD))


def cost_details(price: PriceCard, usage: Usage) -> dict[str, float]:
    """The charge's parts in dollars, before its rounding (module docstring)."""
    return {
        "prompt_cost": _part(usage.prompt_tokens - usage.cached_tokens, price.input_per_m),
        "cached_prompt_cost": _part(usage.cached_tokens, price.cached_input_per_m),
        "completion_cost": _part(usage.completion_tokens, price.output_per_m),
        "reasoning_cost": _part(usage.reasoning_tokens, price.output_per_m),
    }


def usage_cost(price: PriceCard, usage: Usage, *, charged: int) -> dict[str, Any]:
    """The fields a response's `usage` gains when the buyer asks for the cost: `cost`, the
    dollars the ledger charged (`charged` µUSD), and `cost_details`, its parts."""
    return {"cost": cost_number(charged), "cost_details": cost_details(price, usage)}
