"""The `models` field: a buyer's fallback models, OpenRouter's extension to both chat APIs.

What it decides: which models a request may be served with, in the buyer's order, from `model`
and `models` (`requested_models`); which one serves it is the gateway's choice at dispatch time
(`engy_node.gateway.routing.fallbacks`). Pure: no IO.

The rules, and why:
* `models` alone (no `model`): its first entry is the model asked for, the rest its fallbacks,
  as on OpenRouter.
* `model` and `models` (what the official SDKs send: `model` is a required argument, `models`
  rides in `extra_body`): `model` is tried first. It may also be `models[0]`, but nowhere else in
  the list, because then the two fields would say different orders and guessing which the buyer
  meant would serve some requests with the wrong model.
* Every entry is a model this gateway serves (else 404, naming the served ones), named once, and
  at most `MAX_MODELS` of them: each named model is looked at on every request that names it.
* `max_tokens` must suit every model named (the caller checks it against the smallest limit), so
  a request valid for the first model is never refused for the one that ends up serving it.

Trust: buyer input; every entry is type-checked and a bad one is a 400 whose `param` is its path
(`models[1]`), worded as the API's other checks are (`FieldChecks`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from engy_node.gateway.api.chat import GatewayError
from engy_node.gateway.api.validation import FieldChecks

__all__ = ["MAX_MODELS", "requested_models"]

MAX_MODELS = 8
"""Models one request may name, `model` included."""


def requested_models(
    model: Any, models: Any, *, check: FieldChecks, known_models: Collection[str]
) -> tuple[str, tuple[str, ...]]:
    """(the model asked for, its fallbacks in order) from a body's `model` and `models`."""
    if models is None:
        return check.model(model, known_models=known_models), ()
    items = check.items(models, param="models", non_empty=True)
    if len(items) > MAX_MODELS:
        raise check.invalid(
            param="models", complaint=f"names {len(items)} models; name at most {MAX_MODELS}, in the order to try them"
        )
    listed: list[str] = []
    for param, item in items:
        if not isinstance(item, str) or not item:
            raise check.invalid(param=param, complaint="must be a non-empty string: a model id")
        if item not in known_models:
            raise GatewayError(
                "not_found",
                f"{param}: the model `{item}` is not served here; name only served models "
                f"({', '.join(sorted(known_models))})",
                param=param,
            )
        if item in listed:
            raise check.invalid(param=param, complaint=f"repeats `{item}`; name each model once")
        listed.append(item)
    if model is None:
        first, rest = listed[0], listed[1:]
    else:
        first = check.model(model, known_models=known_models)
        if first in listed[1:]:
            raise check.invalid(
                param="model",
                complaint=f"`{first}` is also {check.item_path.format(param='models', index=listed.index(first))}, "
                "which orders it differently; "
                "put it first in models, or leave it out of one of them",
            )
        rest = [item for item in listed if item != first]
    if 1 + len(rest) > MAX_MODELS:
        raise check.invalid(
            param="models",
            complaint=f"and model name {1 + len(rest)} models; name at most {MAX_MODELS}, in the order to try them",
        )
    return first, tuple(rest)
