"""billing: holds cover charges, charges round up exactly once, billed usage never exceeds a bound."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway.api.chat import Usage
from engy_node.gateway.billing.billing import TOKENS_PER_PRICE_UNIT, billable_usage, charge, worst_case_hold
from engy_node.models import CATALOG, PriceCard

rates = st.integers(min_value=0, max_value=100_000_000)
tokens = st.integers(min_value=0, max_value=2_000_000)


@st.composite
def price_cards(draw) -> PriceCard:
    input_per_m = draw(rates)
    return PriceCard(
        input_per_m=input_per_m,
        cached_input_per_m=draw(st.integers(min_value=0, max_value=input_per_m)),
        output_per_m=draw(rates),
    )


@st.composite
def usages(draw, *, max_prompt: int = 2_000_000, max_completion: int = 2_000_000) -> Usage:
    prompt = draw(st.integers(min_value=0, max_value=max_prompt))
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=draw(st.integers(min_value=0, max_value=max_completion)),
        cached_tokens=draw(st.integers(min_value=0, max_value=prompt)),
    )


def exact_cost(price: PriceCard, usage: Usage) -> Fraction:
    return Fraction(
        (usage.prompt_tokens - usage.cached_tokens) * price.input_per_m
        + usage.cached_tokens * price.cached_input_per_m
        + usage.completion_tokens * price.output_per_m,
        TOKENS_PER_PRICE_UNIT,
    )


@given(price=price_cards(), held_prompt=tokens, max_tokens=tokens, data=st.data())
def test_a_charge_never_exceeds_the_hold_made_for_it(price, held_prompt, max_tokens, data):
    usage = data.draw(usages(max_prompt=held_prompt, max_completion=max_tokens))
    assert charge(price=price, usage=usage) <= worst_case_hold(
        price=price, prompt_tokens=held_prompt, max_tokens=max_tokens
    )


@given(price=price_cards(), usage=usages())
def test_a_charge_is_the_exact_cost_rounded_up_to_the_micro_dollar(price, usage):
    cost = charge(price=price, usage=usage)
    exact = exact_cost(price, usage)
    assert cost - 1 < exact <= cost


@given(price=price_cards(), prompt=tokens, max_tokens=tokens)
def test_the_hold_is_every_token_at_the_dearest_rate_rounded_up(price, prompt, max_tokens):
    hold = worst_case_hold(price=price, prompt_tokens=prompt, max_tokens=max_tokens)
    exact = Fraction(prompt * price.input_per_m + max_tokens * price.output_per_m, TOKENS_PER_PRICE_UNIT)
    assert hold - 1 < exact <= hold


@pytest.mark.parametrize("spec", CATALOG.values(), ids=lambda spec: spec.id)
def test_one_billable_token_is_never_free_at_catalog_prices(spec):
    # At SmolLM2's $0.01 per 1M input tokens, a single token costs 1e-8 dollars: rounding
    # down would make tiny requests free, so it must cost at least one micro-dollar.
    for usage in (
        Usage(prompt_tokens=1, completion_tokens=0),
        Usage(prompt_tokens=0, completion_tokens=1),
        Usage(prompt_tokens=1, completion_tokens=0, cached_tokens=1),
    ):
        assert charge(price=spec.price, usage=usage) >= 1
    assert charge(price=CATALOG["smollm2-135m"].price, usage=Usage(prompt_tokens=1, completion_tokens=0)) == 1


def test_cached_tokens_are_billed_at_the_cached_rate():
    price = PriceCard(input_per_m=200_000, cached_input_per_m=50_000, output_per_m=800_000)
    usage = Usage(prompt_tokens=1_000_000, completion_tokens=1_000_000, cached_tokens=400_000)
    assert charge(price=price, usage=usage) == 600_000 * 200_000 // 1_000_000 + 20_000 + 800_000
    assert worst_case_hold(price=price, prompt_tokens=1_000_000, max_tokens=1_000_000) == 1_000_000


def test_no_usage_costs_nothing():
    assert charge(price=CATALOG["glm-5.2"].price, usage=Usage(prompt_tokens=0, completion_tokens=0)) == 0


@pytest.mark.parametrize(
    "usage",
    [
        Usage(prompt_tokens=-1, completion_tokens=0),
        Usage(prompt_tokens=1, completion_tokens=-1),
        Usage(prompt_tokens=1, completion_tokens=0, cached_tokens=2),
        Usage(prompt_tokens=True, completion_tokens=0),
        Usage(prompt_tokens=1.5, completion_tokens=0),
    ],
)
def test_impossible_usage_is_refused_rather_than_billed(usage):
    with pytest.raises(ValueError):
        charge(price=CATALOG["glm-5.2"].price, usage=usage)


def test_a_price_card_that_charges_more_for_cached_input_is_refused():
    dearer_cache = PriceCard(input_per_m=1, cached_input_per_m=2, output_per_m=1)
    with pytest.raises(ValueError, match="cached input"):
        worst_case_hold(price=dearer_cache, prompt_tokens=1, max_tokens=1)
    with pytest.raises(ValueError, match="cached input"):
        charge(price=dearer_cache, usage=Usage(prompt_tokens=1, completion_tokens=1))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt_tokens": -1, "max_tokens": 1},
        {"prompt_tokens": 1, "max_tokens": -1},
        {"prompt_tokens": 1, "max_tokens": 2.0},
    ],
)
def test_a_nonsense_hold_request_is_refused(kwargs):
    with pytest.raises(ValueError):
        worst_case_hold(price=CATALOG["glm-5.2"].price, **kwargs)


claims = st.integers(min_value=-1_000, max_value=10_000_000)


@given(
    claimed_prompt=claims,
    claimed_completion=claims,
    claimed_cached=claims,
    committed_prompt=tokens,
    committed_completion=tokens,
    relayed=tokens,
)
def test_billed_usage_never_exceeds_any_bound_and_is_never_negative(
    claimed_prompt, claimed_completion, claimed_cached, committed_prompt, committed_completion, relayed
):
    claimed = Usage(prompt_tokens=claimed_prompt, completion_tokens=claimed_completion, cached_tokens=claimed_cached)
    billed = billable_usage(
        claimed=claimed,
        committed_prompt=committed_prompt,
        committed_completion=committed_completion,
        relayed_completion=relayed,
    )
    assert billed.prompt_tokens == committed_prompt
    assert 0 <= billed.completion_tokens <= min(committed_completion, relayed, max(claimed_completion, 0))
    assert 0 <= billed.cached_tokens <= billed.prompt_tokens
    assert billed.cached_tokens <= max(claimed_cached, 0)
    # Whatever the miner claimed, the result is something `charge` accepts.
    charge(price=CATALOG["qwen3.6-35b-a3b"].price, usage=billed)


def test_a_miner_claiming_more_than_it_relayed_is_billed_for_what_the_buyer_got():
    # The opencode #43379 shape: 859 completion tokens claimed, 8 delivered.
    claimed = Usage(prompt_tokens=5, completion_tokens=859)
    billed = billable_usage(claimed=claimed, committed_prompt=120, committed_completion=859, relayed_completion=8)
    assert billed == Usage(prompt_tokens=120, completion_tokens=8, cached_tokens=0)


def test_the_miners_prompt_count_is_ignored_for_the_gateways_own():
    claimed = Usage(prompt_tokens=10_000, completion_tokens=3, cached_tokens=9_000)
    billed = billable_usage(claimed=claimed, committed_prompt=50, committed_completion=3, relayed_completion=3)
    assert billed == Usage(prompt_tokens=50, completion_tokens=3, cached_tokens=50)


def test_a_malformed_claim_counts_as_nothing():
    claimed = Usage(prompt_tokens=5, completion_tokens="859", cached_tokens=None)  # type: ignore[arg-type]
    billed = billable_usage(claimed=claimed, committed_prompt=5, committed_completion=9, relayed_completion=9)
    assert billed == Usage(prompt_tokens=5, completion_tokens=0, cached_tokens=0)


def test_negative_gateway_counts_are_a_bug_not_a_discount():
    with pytest.raises(ValueError, match="relayed_completion"):
        billable_usage(
            claimed=Usage(prompt_tokens=1, completion_tokens=1),
            committed_prompt=1,
            committed_completion=1,
            relayed_completion=-1,
        )
