"""Fallback models and model metadata, as pure decisions: which model serves a request that names
several, how `model` and `models` are read by both APIs, and the price strings `/v1/models` shows."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway.api import model_list
from engy_node.gateway.api.anthropic_api import parse_messages_request
from engy_node.gateway.api.chat import GatewayError
from engy_node.gateway.api.fallback_models import MAX_MODELS
from engy_node.gateway.api.openai_api import parse_chat_request
from engy_node.gateway.routing.fallbacks import ModelCapacity, choose_model, permitted
from engy_node.models import CATALOG

ROOM = ModelCapacity(room=True, connected=True)
FULL = ModelCapacity(room=False, connected=True)
NONE = ModelCapacity(room=False, connected=False)

# ---- the decision -------------------------------------------------------------------------


def test_the_first_model_with_room_serves_and_a_full_one_beats_one_with_no_miner():
    assert choose_model(["a", "b"], {"a": ROOM, "b": ROOM}) == "a"
    assert choose_model(["a", "b"], {"a": FULL, "b": ROOM}) == "b"
    assert choose_model(["a", "b", "c"], {"a": NONE, "b": FULL, "c": NONE}) == "b"
    assert choose_model(["a", "b"], {"a": NONE, "b": NONE}) == "a"
    # A model the pool knows nothing about has no miners.
    assert choose_model(["a", "b"], {"b": FULL}) == "b"
    with pytest.raises(ValueError):
        choose_model([], {})


capacities = st.sampled_from([ROOM, FULL, NONE])


@given(
    st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=8, unique=True).flatmap(
        lambda models: st.tuples(st.just(models), st.fixed_dictionaries({m: capacities for m in models}))
    )
)
def test_any_capacities_give_the_buyers_first_model_that_can_serve_soonest(case):
    models, capacity = case
    chosen = choose_model(models, capacity)
    assert chosen in models
    before = models[: models.index(chosen)]
    if any(c.room for c in capacity.values()):
        # The first with room, and no earlier one had any.
        assert capacity[chosen].room and not any(capacity[m].room for m in before)
    elif any(c.connected for c in capacity.values()):
        assert capacity[chosen].connected and not any(capacity[m].connected for m in before)
    else:
        assert chosen == models[0]
    # Giving the chosen model's predecessors no capacity never changes the choice.
    assert choose_model(models, {**capacity, **dict.fromkeys(before, NONE)}) == chosen


# ---- the request fields ---------------------------------------------------------------------

SERVED = {
    "known_models": {"small", "big"},
    "max_output_tokens_for": lambda model: {"small": 2048, "big": 32768}[model],
}
MESSAGES = [{"role": "user", "content": "hi"}]


def openai(**fields):
    return parse_chat_request({"messages": MESSAGES, **fields}, **SERVED)


def anthropic(**fields):
    return parse_messages_request({"messages": MESSAGES, "max_tokens": 16, **fields}, **SERVED)


def refused(parse, **fields) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        parse(**fields)
    return caught.value


def test_models_alone_or_with_model_give_the_order_to_try():
    chat = openai(models=["big", "small"])
    assert (chat.model, chat.fallbacks) == ("big", ("small",))
    # What the SDKs send: model, and models in extra_body, repeating it first or not.
    for fields in ({"model": "big", "models": ["big", "small"]}, {"model": "big", "models": ["small"]}):
        chat = openai(**fields)
        assert (chat.model, chat.fallbacks) == ("big", ("small",))
    assert openai(model="small").fallbacks == ()
    chat = anthropic(model="big", models=["small"])
    assert (chat.model, chat.fallbacks) == ("big", ("small",))


def test_max_tokens_must_suit_every_model_named_and_defaults_to_the_smallest_limit():
    assert openai(models=["big", "small"]).max_tokens == 2048
    assert openai(models=["big"]).max_tokens == 32768
    err = refused(openai, models=["big", "small"], max_tokens=4096)
    assert err.param == "max_tokens" and "2048" in err.message
    assert refused(anthropic, model="small", models=["big"], max_tokens=4096).param == "max_tokens"


@pytest.mark.parametrize(
    ("fields", "param", "fix"),
    [
        ({"models": []}, "models", "non-empty list"),
        ({"models": "big"}, "models", "list"),
        ({"models": ["big", 3]}, "models[1]", "model id"),
        ({"models": ["big", "big"]}, "models[1]", "name each model once"),
        ({"model": "small", "models": ["big", "small"]}, "model", "put it first in models"),
        ({"models": ["big"] * (MAX_MODELS + 1)}, "models", f"at most {MAX_MODELS}"),
        ({"models": ["big", "gpt-9"]}, "models[1]", "name only served models (big, small)"),
    ],
)
def test_a_bad_models_field_is_refused_naming_the_entry_and_the_fix(fields, param, fix):
    err = refused(openai, **fields)
    assert (err.param, err.status) == (param, 404 if "served" in fix else 400)
    assert fix in err.message


def test_the_anthropic_route_names_entries_in_its_own_notation():
    err = refused(anthropic, model="big", models=["small", 3])
    assert err.param == "models.1" and err.message.startswith("models.1: ")


# ---- model metadata -----------------------------------------------------------------------


@given(st.integers(min_value=0, max_value=10**15))
def test_a_price_string_is_the_exact_usd_per_token(micro_usd_per_million):
    text = model_list.usd_per_token(micro_usd_per_million)
    assert Decimal(text) * 10**12 == micro_usd_per_million
    assert "e" not in text.lower() and not text.startswith("-")


def test_a_model_object_carries_context_prices_and_proofs():
    spec = CATALOG["qwen3.6-35b-a3b"]
    body = model_list.model_body(spec, created=7, verified_by=model_list.verification(gemm=True))
    assert body["context_length"] == 262_144
    assert body["pricing"] == {"prompt": "0.0000002", "completion": "0.0000008", "input_cache_read": "0.00000005"}
    assert body["price_micro_usd_per_million"] == {"input": 200_000, "cached_input": 50_000, "output": 800_000}
    assert body["verification"] == ["toploc", "gemm"]
    assert model_list.verification(gemm=False) == ["toploc"]


@given(
    models=st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=4, unique=True),
    allowed=st.none() | st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=4, unique=True),
)
def test_fallbacks_keep_the_buyers_order_among_the_models_its_key_may_use(models, allowed):
    chosen = permitted(models, allowed)
    usable = [model for model in models if allowed is None or model in allowed]
    # None usable: all stay, and the hold refuses the first naming the key's models.
    assert list(chosen) == (usable or models)
