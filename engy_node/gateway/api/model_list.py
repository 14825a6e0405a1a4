"""`GET /v1/models` and `GET /v1/models/{id}`: the served models, with what a buyer compares them by.

What it decides: the body of each model object. Pure: the catalog entry, `created` and which
proofs verify the model's answers come in as arguments.

Shape, and why. OpenAI's model object (`id`, `object: "model"`, `created`, `owned_by`) so the
official SDK's `client.models.list()` and `retrieve()` read it (its `Model` keeps fields it does
not declare), plus OpenRouter's fields, which buyers and routers comparing providers read:
`name`, `context_length`, and `pricing` as decimal strings of USD per token (`prompt`,
`completion`, `input_cache_read`). The strings are exact (µUSD per million tokens is USD × 10⁻¹²
per token, written out in full, never through a float), and our own integer card rides beside
them (`price_micro_usd_per_million`), so a buyer reconciling charges need not parse decimals.
`max_input_tokens` and `max_output_tokens` are the limits the gateway enforces (a model's
context is shared between the two). `verification` lists the proofs that check the model's
answers: "toploc" always (every answer carries a TOPLOC commitment the gateway checks against
the prompt and the verifiers audit), and "gemm" while a connected miner of the model takes GEMM
audits (`routing.fallbacks.announces_gemm`).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from engy_node.models import ModelSpec

__all__ = ["OWNED_BY", "model_body", "models_body", "usd_per_token", "verification"]

OWNED_BY = "engy"


def usd_per_token(micro_usd_per_million: int) -> str:
    """The exact decimal string of USD per token for a price in µUSD per million tokens."""
    return format(Decimal(micro_usd_per_million).scaleb(-12).normalize(), "f")


def verification(*, gemm: bool) -> list[str]:
    """The proofs that verify a model's answers, in the order they were introduced."""
    return ["toploc", "gemm"] if gemm else ["toploc"]


def model_body(spec: ModelSpec, *, created: int, verified_by: list[str]) -> dict[str, Any]:
    """One model object (module docstring)."""
    price = spec.price
    return {
        "id": spec.id,
        "object": "model",
        "created": created,
        "owned_by": OWNED_BY,
        "name": spec.display_name,
        "context_length": spec.context_length,
        "max_input_tokens": spec.max_input_tokens,
        "max_output_tokens": spec.max_output_tokens,
        "pricing": {
            "prompt": usd_per_token(price.input_per_m),
            "completion": usd_per_token(price.output_per_m),
            "input_cache_read": usd_per_token(price.cached_input_per_m),
        },
        "price_micro_usd_per_million": {
            "input": price.input_per_m,
            "cached_input": price.cached_input_per_m,
            "output": price.output_per_m,
        },
        "verification": verified_by,
    }


def models_body(models: list[dict[str, Any]]) -> dict[str, Any]:
    """The list, as OpenAI's `GET /v1/models` returns it."""
    return {"object": "list", "data": models}
