"""Which of a buyer's models serves a request that names several (OpenRouter's `models: [...]`),
and what the pool can say about each model's miners (room now, GEMM audits).

What it decides. `choose_model` is the pure decision: given the models in the buyer's order and
each one's capacity as the pool sees it, the first model one of whose eligible miners has a free
slot now; when none has, the first one with an eligible miner connected (its queue is where the
request waits, `admission`: it will have room before a model with no miner will); when no model
has a miner at all, the first one, so the buyer's 503 names the model they asked for.

When it decides, and why then. Once per request, after the body is parsed and before the prompt
is tokenised and the hold taken (`pick_model`, called from the chat route): the prompt's tokens
depend on the model's chat template, and the hold is the chosen model's worst case at its price,
so the charge is exactly the used model's, and no hold is ever moved between prices. After that
the request is the chosen model's, as if the buyer had named only it: its retries before the
first byte go to that model's other miners and its wait is that model's queue. A model whose
miners fill up between the choice and the dispatch (a few milliseconds) therefore queues the
request rather than falling back; the buyer still gets the first model that had room when asked.

The shell (`capacity`, `announces_gemm`) reads the pool's legs as they are; it trusts what the
miners announced (their capacity, their features), as routing does, and asks `eligible` (the
traffic control plane's view) about every miner, so a miner that may not take paid traffic
counts for nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from engy_node.gateway.api.chat import ChatRequest
from engy_node.gateway.routing.pool import MinerPool
from engy_node.protocol.gemm import FEATURE_GEMM

__all__ = ["ModelCapacity", "announces_gemm", "capacity", "choose_model", "permitted", "pick_model"]

Eligible = Callable[[str, str], bool]
"""(miner identity, model) -> may it serve paid traffic (`Gateway.eligible`)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelCapacity:
    """One model's miners as the pool sees them for one decision."""

    room: bool
    """An eligible miner of the model can take one more request now."""
    connected: bool
    """An eligible miner of the model is connected, with room or not (implied by `room`)."""


NO_MINERS = ModelCapacity(room=False, connected=False)


def choose_model(models: Sequence[str], capacity: Mapping[str, ModelCapacity]) -> str:
    """The model to serve a request with: the first in `models` with room, else the first with a
    miner connected, else the first. A model missing from `capacity` has no miners."""
    if not models:
        raise ValueError("choose_model needs at least one model")
    for model in models:
        if capacity.get(model, NO_MINERS).room:
            return model
    for model in models:
        if capacity.get(model, NO_MINERS).connected:
            return model
    return models[0]


def capacity(pool: MinerPool, model: str, eligible: Eligible) -> ModelCapacity:
    """`model`'s capacity now: room is what routing would find (`MinerPool.route`, any prompt
    size, no affinity), connected is any open leg of an eligible miner of the model."""
    room = pool.route(model, prefix=None, rr_counter=0, eligible=lambda miner: eligible(miner, model)) is not None
    connected = room or any(
        not leg.closed and leg.hello.model == model and eligible(leg.identity.miner, model)
        for leg in pool.legs.values()
    )
    return ModelCapacity(room=room, connected=connected)


def permitted(models: Sequence[str], allowed: Sequence[str] | None) -> tuple[str, ...]:
    """The buyer's models that its key may use, in order; all of them when the key may use any
    or none of them (then the hold refuses the first, naming the key's models)."""
    usable = tuple(model for model in models if allowed is None or model in allowed)
    return usable or tuple(models)


def pick_model(
    chat: ChatRequest, pool: MinerPool, eligible: Eligible, allowed: Sequence[str] | None = None
) -> ChatRequest:
    """`chat` as served: for the model `choose_model` picks among `chat.model` and its
    fallbacks that the key may use (`allowed`; None: any). A request without fallbacks is
    returned as it is, at no cost."""
    if not chat.fallbacks:
        return chat
    models = permitted((chat.model, *chat.fallbacks), allowed)
    chosen = choose_model(models, {model: capacity(pool, model, eligible) for model in models})
    return dataclasses.replace(chat, model=chosen, fallbacks=())


def announces_gemm(pool: MinerPool, model: str, eligible: Eligible) -> bool:
    """Whether answers for `model` can be GEMM-audited now: the pool asks miners for activation
    commitments (`PoolSettings.gemm_audit`) and at least one open leg of an eligible miner of the
    model announced `FEATURE_GEMM`."""
    return pool.settings.gemm_audit and any(
        not leg.closed
        and leg.hello.model == model
        and FEATURE_GEMM in leg.hello.features
        and eligible(leg.identity.miner, model)
        for leg in pool.legs.values()
    )
