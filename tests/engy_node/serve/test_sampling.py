"""Tests for engy_node.serve.sampling: sglang-compatible parameter parsing, stop matching and
hold-back, and token choice on small logits tensors (no model is loaded)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.serve.sampling import (
    FIELDS,
    GREEDY_TEMPERATURE,
    MAX_STOP_STRINGS,
    REPLACEMENT_CHARACTER,
    SamplingError,
    SamplingParams,
    StopMatch,
    choose_token,
    find_stop,
    parse_sampling_params,
    stop_holdback,
    stream_holdback,
)

GREEDY = SamplingParams(temperature=0.0)


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draws(logits: torch.Tensor, params: SamplingParams, count: int = 300, *, seed: int = 0, history=()) -> list[int]:
    generator = seeded(seed)
    return [choose_token(logits, params, list(history), generator, position=0)[0] for _ in range(count)]


def random_logits(size: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randn(size, generator=seeded(seed)) * 3


# --- parse_sampling_params: defaults ----------------------------------------------------------


@pytest.mark.parametrize("raw", [None, {}])
def test_missing_or_empty_sampling_params_give_the_sglang_defaults(raw):
    params = parse_sampling_params(raw)
    assert params == SamplingParams()
    assert params.max_new_tokens == 128
    assert params.temperature == 1.0
    assert params.top_p == 1.0
    assert params.top_k == -1
    assert params.min_p == 0.0
    assert params.repetition_penalty == 1.0
    assert params.stop == ()
    assert params.sampling_seed is None
    assert params.greedy is False


def test_a_key_given_as_null_keeps_its_default():
    params = parse_sampling_params(
        {"max_new_tokens": None, "temperature": None, "stop": None, "json_schema": None, "n": None}
    )
    assert params == SamplingParams()


def test_valid_values_are_carried_into_the_params():
    params = parse_sampling_params(
        {
            "max_new_tokens": 7,
            "min_new_tokens": 2,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "frequency_penalty": 0.5,
            "presence_penalty": -0.5,
            "repetition_penalty": 1.1,
            "stop": ["\n\n", "END"],
            "stop_token_ids": [2, 3],
            "ignore_eos": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,
            "n": 1,
            "sampling_seed": 42,
            "stream_interval": 4,
            "logit_bias": {"5": 2.5, "1": -1},
        }
    )
    assert params == SamplingParams(
        max_new_tokens=7,
        min_new_tokens=2,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.1,
        stop=("\n\n", "END"),
        stop_token_ids=(2, 3),
        ignore_eos=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        no_stop_trim=True,
        sampling_seed=42,
        stream_interval=4,
        logit_bias=((1, -1.0), (5, 2.5)),
    )


@given(
    max_new_tokens=st.integers(min_value=0, max_value=10**6),
    temperature=st.floats(min_value=0, max_value=100, allow_nan=False),
    top_p=st.floats(min_value=0, max_value=1, exclude_min=True),
    top_k=st.one_of(st.just(-1), st.integers(min_value=1, max_value=10**6)),
    penalty=st.floats(min_value=-2, max_value=2),
)
@settings(max_examples=150)
def test_any_value_inside_the_documented_ranges_is_accepted_as_given(
    max_new_tokens, temperature, top_p, top_k, penalty
):
    params = parse_sampling_params(
        {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "frequency_penalty": penalty,
            "presence_penalty": penalty,
        }
    )
    assert (params.max_new_tokens, params.temperature, params.top_p, params.top_k) == (
        max_new_tokens,
        temperature,
        top_p,
        top_k,
    )
    assert params.frequency_penalty == params.presence_penalty == penalty
    assert params.greedy == (temperature < 1e-6)


# --- parse_sampling_params: unknown and unsupported keys --------------------------------------


def test_an_unknown_key_is_rejected_naming_it_and_every_expected_field():
    with pytest.raises(SamplingError) as caught:
        parse_sampling_params({"max_new_tokens": 4, "foo": 1})
    message = str(caught.value)
    assert message.startswith("unknown field `foo`, expected one of `max_new_tokens`, `min_new_tokens`, ")
    for field in FIELDS:
        assert f"`{field}`" in message


def test_openai_style_names_are_unknown_fields():
    for key in ("max_tokens", "seed", "stop_sequences"):
        with pytest.raises(SamplingError, match=f"unknown field `{key}`"):
            parse_sampling_params({key: 1})


def test_sampling_errors_are_value_errors():
    assert issubclass(SamplingError, ValueError)


@pytest.mark.parametrize("raw", ["temperature=0", [("temperature", 0)], 5])
def test_sampling_params_that_are_not_an_object_are_rejected(raw):
    with pytest.raises(SamplingError, match="sampling_params must be an object"):
        parse_sampling_params(raw)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("json_schema", '{"type": "object"}'),
        ("regex", "[a-z]+"),
        ("ebnf", "root ::= 'a'"),
        ("structural_tag", "{}"),
        ("stop_regex", "\\d"),
        ("custom_params", {"x": 1}),
    ],
)
def test_constrained_decoding_fields_are_rejected_with_a_clear_message(key, value):
    with pytest.raises(SamplingError) as caught:
        parse_sampling_params({key: value})
    message = str(caught.value)
    assert f"`{key}`" in message
    assert "not supported" in message
    assert "sglang" in message


@pytest.mark.parametrize("n", [2, 8])
def test_more_than_one_choice_per_request_is_rejected(n):
    with pytest.raises(SamplingError, match="n > 1 is not supported"):
        parse_sampling_params({"n": n})


def test_n_of_one_is_accepted_and_n_must_be_a_positive_integer():
    assert parse_sampling_params({"n": 1}) == SamplingParams()
    with pytest.raises(SamplingError, match="n must be at least 1"):
        parse_sampling_params({"n": 0})
    with pytest.raises(SamplingError, match="invalid type: n must be an integer"):
        parse_sampling_params({"n": 2.0})


# --- parse_sampling_params: types -------------------------------------------------------------


@pytest.mark.parametrize("value", [3.0, "3", True, False, [3]])
def test_max_new_tokens_must_be_an_integer_and_not_a_float_string_or_bool(value):
    with pytest.raises(SamplingError, match="invalid type: max_new_tokens must be an integer"):
        parse_sampling_params({"max_new_tokens": value})


@pytest.mark.parametrize("name", ["min_new_tokens", "top_k", "stream_interval", "sampling_seed"])
def test_every_integer_field_refuses_a_bool(name):
    with pytest.raises(SamplingError, match=f"invalid type: {name} must be an integer"):
        parse_sampling_params({name: True})


@pytest.mark.parametrize(
    ("seed", "ok"), [(0, True), (-1, True), (2**63 - 1, True), (-(2**63), True), (2**63, False), (-(2**63) - 1, False)]
)
def test_sampling_seed_must_fit_in_a_signed_64_bit_integer_as_in_sglang(seed, ok):
    if ok:
        assert parse_sampling_params({"sampling_seed": seed}).sampling_seed == seed
    else:
        with pytest.raises(SamplingError, match=r"sampling_seed must be in \[-2\*\*63, 2\*\*63 - 1\]"):
            parse_sampling_params({"sampling_seed": seed})


def test_temperature_accepts_an_integer_and_stores_a_float():
    params = parse_sampling_params({"temperature": 0})
    assert params.temperature == 0.0
    assert isinstance(params.temperature, float)
    assert params.greedy
    assert parse_sampling_params({"temperature": 2}).temperature == 2.0


@pytest.mark.parametrize(
    "name", ["temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"]
)
@pytest.mark.parametrize("value", ["0.5", True, {"v": 0.5}, [0.5]])
def test_every_number_field_refuses_strings_bools_and_other_types(name, value):
    with pytest.raises(SamplingError, match=f"invalid type: {name} must be a number"):
        parse_sampling_params({name: value})


@pytest.mark.parametrize("name", ["ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"])
@pytest.mark.parametrize("value", [1, 0, "true"])
def test_boolean_fields_accept_only_booleans(name, value):
    with pytest.raises(SamplingError, match=f"invalid type: {name} must be a boolean"):
        parse_sampling_params({name: value})


# --- parse_sampling_params: ranges ------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, -0.001])
def test_a_negative_temperature_is_rejected(value):
    with pytest.raises(SamplingError, match="temperature must be non-negative"):
        parse_sampling_params({"temperature": value})


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.0001, 2])
def test_top_p_outside_zero_exclusive_to_one_is_rejected(value):
    with pytest.raises(SamplingError, match=r"top_p must be in \(0, 1\]"):
        parse_sampling_params({"top_p": value})


@pytest.mark.parametrize("value", [1e-9, 0.5, 1, 1.0])
def test_top_p_inside_zero_exclusive_to_one_is_accepted(value):
    assert parse_sampling_params({"top_p": value}).top_p == value


@pytest.mark.parametrize("value", [0, -2, -100])
def test_top_k_must_be_minus_one_or_at_least_one(value):
    with pytest.raises(SamplingError, match="top_k must be -1 \\(all\\) or at least 1"):
        parse_sampling_params({"top_k": value})


@pytest.mark.parametrize("value", [-1, 1, 50])
def test_top_k_of_minus_one_or_a_positive_count_is_accepted(value):
    assert parse_sampling_params({"top_k": value}).top_k == value


@pytest.mark.parametrize(("value", "ok"), [(0, True), (1, True), (0.3, True), (-0.01, False), (1.01, False)])
def test_min_p_must_be_between_zero_and_one(value, ok):
    if ok:
        assert parse_sampling_params({"min_p": value}).min_p == value
    else:
        with pytest.raises(SamplingError, match=r"min_p must be in \[0, 1\]"):
            parse_sampling_params({"min_p": value})


@pytest.mark.parametrize("name", ["frequency_penalty", "presence_penalty"])
@pytest.mark.parametrize(("value", "ok"), [(-2, True), (2, True), (0, True), (-2.01, False), (2.5, False)])
def test_frequency_and_presence_penalties_must_be_within_minus_two_and_two(name, value, ok):
    if ok:
        assert getattr(parse_sampling_params({name: value}), name) == value
    else:
        with pytest.raises(SamplingError, match=rf"{name} must be in \[-2, 2\]"):
            parse_sampling_params({name: value})


@pytest.mark.parametrize(("value", "ok"), [(0.01, True), (1, True), (2, True), (0, False), (-1, False), (2.1, False)])
def test_repetition_penalty_must_be_in_zero_exclusive_to_two(value, ok):
    if ok:
        assert parse_sampling_params({"repetition_penalty": value}).repetition_penalty == value
    else:
        with pytest.raises(SamplingError, match=r"repetition_penalty must be in \(0, 2\]"):
            parse_sampling_params({"repetition_penalty": value})


@pytest.mark.parametrize(("name", "minimum"), [("max_new_tokens", 0), ("min_new_tokens", 0), ("stream_interval", 1)])
def test_counts_below_their_minimum_are_rejected(name, minimum):
    assert getattr(parse_sampling_params({name: minimum}), name) == minimum
    with pytest.raises(SamplingError, match=f"{name} must be at least {minimum}"):
        parse_sampling_params({name: minimum - 1})


# --- parse_sampling_params: stop, stop_token_ids, logit_bias ----------------------------------


def test_a_single_stop_string_becomes_a_one_item_tuple():
    assert parse_sampling_params({"stop": "END"}).stop == ("END",)


def test_a_list_of_stop_strings_is_kept_in_order_without_empty_strings():
    assert parse_sampling_params({"stop": ["b", "", "a"]}).stop == ("b", "a")
    assert parse_sampling_params({"stop": ""}).stop == ()
    assert parse_sampling_params({"stop": []}).stop == ()


def test_up_to_32_stop_strings_are_allowed():
    stops = [f"s{i}" for i in range(MAX_STOP_STRINGS)]
    assert MAX_STOP_STRINGS == 32
    assert parse_sampling_params({"stop": stops}).stop == tuple(stops)
    with pytest.raises(SamplingError, match="at most 32 stop strings"):
        parse_sampling_params({"stop": [*stops, "one more"]})


@pytest.mark.parametrize("stop", [5, ["a", 5], {"a": 1}, [None]])
def test_stop_must_be_a_string_or_a_list_of_strings(stop):
    with pytest.raises(SamplingError, match="stop must be a string or a list of strings"):
        parse_sampling_params({"stop": stop})


def test_stop_token_ids_must_be_non_negative_integers_in_a_list():
    assert parse_sampling_params({"stop_token_ids": [0, 7]}).stop_token_ids == (0, 7)
    with pytest.raises(SamplingError, match="stop_token_ids must be a list"):
        parse_sampling_params({"stop_token_ids": 7})
    with pytest.raises(SamplingError, match="stop_token_ids must be at least 0"):
        parse_sampling_params({"stop_token_ids": [-1]})
    with pytest.raises(SamplingError, match="stop_token_ids must be an integer"):
        parse_sampling_params({"stop_token_ids": [1.0]})


def test_logit_bias_keys_are_token_ids_given_as_text():
    assert parse_sampling_params({"logit_bias": {"10": 1, "2": -0.5}}).logit_bias == ((2, -0.5), (10, 1.0))
    with pytest.raises(SamplingError, match="is not a token id"):
        parse_sampling_params({"logit_bias": {"hello": 1.0}})
    with pytest.raises(SamplingError, match="logit_bias must be an object"):
        parse_sampling_params({"logit_bias": [[1, 2.0]]})


def test_a_logit_bias_value_that_is_not_a_number_is_reported_as_a_bad_value_not_a_bad_key():
    with pytest.raises(SamplingError) as caught:
        parse_sampling_params({"logit_bias": {"5": "high"}})
    message = str(caught.value)
    assert "must be a number" in message
    assert "keys must be token ids" not in message


# --- greedy -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0.0, True), (1e-7, True), (GREEDY_TEMPERATURE, False), (0.01, False), (1.0, False)]
)
def test_a_temperature_below_one_millionth_means_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).greedy is greedy


# --- find_stop --------------------------------------------------------------------------------


def reference_find_stop(text: str, stops: list[str], ends_after: int) -> StopMatch | None:
    for start in range(len(text) + 1):
        matching = [stop for stop in stops if text.startswith(stop, start) and start + len(stop) > ends_after]
        if matching:
            return StopMatch(start, max(matching, key=len))
    return None


def test_find_stop_returns_the_earliest_match_and_prefers_the_longer_stop_at_the_same_start():
    assert find_stop("say hello world", ["world", "hello"]) == StopMatch(4, "hello")
    assert find_stop("abcdef", ["cd", "cde", "c"]) == StopMatch(2, "cde")
    assert find_stop("abc", ["x"]) is None
    assert find_stop("abc", []) is None
    # The miner passes a buyer's stop strings unfiltered; an empty one matches at the start.
    assert find_stop("abc", [""]) == StopMatch(0, "")


def test_find_stop_finds_only_matches_that_end_past_ends_after():
    assert find_stop("stop here, stop there", ["stop"], ends_after=4) == StopMatch(11, "stop")
    # A match that starts before ends_after counts when the new characters complete it.
    assert find_stop("xxSTOP", ["STOP"], ends_after=3) == StopMatch(2, "STOP")
    # A shorter stop lying wholly in the searched text does not hide a longer one that ends later.
    assert find_stop("xabcd", ["ab", "bcd"], ends_after=3) == StopMatch(2, "bcd")


SMALL_TEXT = st.text(alphabet="abc", max_size=30)
STOPS = st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=5)


@given(SMALL_TEXT, STOPS, st.integers(min_value=0, max_value=35))
@settings(max_examples=200)
def test_find_stop_equals_a_brute_force_scan_from_left_to_right(text, stops, ends_after):
    assert find_stop(text, stops, ends_after=ends_after) == reference_find_stop(text, stops, ends_after)


# --- stop_holdback ----------------------------------------------------------------------------


def reference_holdback(text: str, stops: list[str]) -> int:
    """The longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for size in range(1, len(text) + 1):
        suffix = text[len(text) - size :]
        if any(len(stop) > size and stop.startswith(suffix) for stop in stops):
            best = size
    return best


def test_stop_holdback_holds_back_a_tail_that_could_still_become_a_stop_string():
    assert stop_holdback("Hello <|e", ["<|end|>"]) == 3
    assert stop_holdback("Hello <", ["<|end|>"]) == 1
    assert stop_holdback("Hello", ["<|end|>"]) == 0
    # A complete stop string is find_stop's business, not a prefix to hold back.
    assert stop_holdback("ab", ["ab"]) == 0
    assert stop_holdback("xaa", ["aab", "ab"]) == 2
    assert stop_holdback("", ["abc"]) == 0
    assert stop_holdback("abc", []) == 0


@given(SMALL_TEXT, STOPS)
@settings(max_examples=200)
def test_stop_holdback_is_the_longest_suffix_that_is_a_proper_prefix_of_a_stop(text, stops):
    held = stop_holdback(text, stops)
    assert held == reference_holdback(text, stops)
    assert 0 <= held <= len(text)
    if held:
        tail = text[len(text) - held :]
        assert any(len(stop) > held and stop.startswith(tail) for stop in stops)


@given(st.text(alphabet="abc", max_size=30), STOPS)
@settings(max_examples=100)
def test_stop_holdback_never_holds_back_when_the_text_ends_in_a_character_no_stop_contains(prefix, stops):
    assert stop_holdback(prefix + "z", stops) == 0


# --- stream_holdback --------------------------------------------------------------------------


def test_stream_holdback_holds_back_a_trailing_replacement_run_and_a_stop_prefix_before_it():
    assert stream_holdback("dottore \ufffd", []) == 1
    assert stream_holdback("a\ufffdb\ufffd\ufffd", []) == 2, "only the trailing run; the inner one is settled"
    assert stream_holdback("dottore è", []) == 0
    assert stream_holdback("", []) == 0
    assert stream_holdback("\ufffd\ufffd", ["x"]) == 2
    # The stop prefix "<|" sits before the partial character, which may yet complete "<|é".
    assert stream_holdback("ok <|\ufffd", ["<|é|>"]) == 3
    assert stream_holdback("ok <|", ["<|é|>"]) == 2
    assert stream_holdback("\ufffd<", ["<<"]) == 1, "a settled U+FFFD before a stop prefix is shown"


@given(
    st.text(alphabet=f"ab<{REPLACEMENT_CHARACTER}", max_size=30),
    st.lists(st.text(alphabet=f"ab<{REPLACEMENT_CHARACTER}", min_size=1, max_size=4), max_size=4),
)
@settings(max_examples=200)
def test_stream_holdback_never_streams_the_trailing_replacement_run_and_holds_back_at_least_a_stop_prefix(text, stops):
    held = stream_holdback(text, stops)
    assert 0 <= held <= len(text)
    # A U+FFFD followed by other text is settled and may be shown (a stop prefix held after it).
    assert len(text) - held <= len(text.rstrip(REPLACEMENT_CHARACTER))
    assert held >= stop_holdback(text, stops), "a stop prefix reaching into the run is held back too"


# --- choose_token: greedy ---------------------------------------------------------------------


def test_greedy_choice_is_the_argmax_with_its_raw_log_softmax_logprob():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    token, logprob = choose_token(logits, GREEDY, [], None, position=0)
    assert token == 1
    assert logprob == pytest.approx(float(torch.log_softmax(logits, dim=-1)[1]), abs=1e-6)
    assert logprob < 0


@given(st.integers(min_value=0, max_value=10_000))
@settings(max_examples=100)
def test_greedy_choice_matches_torch_argmax_on_random_logits(seed):
    logits = random_logits(32, seed)
    token, logprob = choose_token(logits, GREEDY, [], seeded(seed), position=0)
    assert token == int(torch.argmax(logits))
    assert math.isclose(logprob, float(torch.log_softmax(logits, dim=-1)[token]), abs_tol=1e-5)


def test_greedy_choice_works_on_half_precision_logits():
    logits = torch.tensor([0.1, 0.2, 4.0, 0.3], dtype=torch.bfloat16)
    token, logprob = choose_token(logits, GREEDY, [], None, position=0)
    assert token == 2
    assert logprob == pytest.approx(float(torch.log_softmax(logits.float(), dim=-1)[2]), abs=1e-6)


def test_choose_token_does_not_modify_the_callers_logits():
    logits = random_logits()
    before = logits.clone()
    params = SamplingParams(
        temperature=0.5, top_k=3, top_p=0.9, repetition_penalty=1.5, frequency_penalty=1.0, logit_bias=((0, 5.0),)
    )
    choose_token(logits, params, [1, 2, 2], seeded(), position=0)
    assert torch.equal(logits, before)


# --- choose_token: sampling -------------------------------------------------------------------


def test_a_seeded_generator_gives_reproducible_draws():
    logits = torch.zeros(50)
    params = SamplingParams(temperature=1.0)
    first = draws(logits, params, 100, seed=1234)
    again = draws(logits, params, 100, seed=1234)
    other = draws(logits, params, 100, seed=4321)
    assert first == again
    assert first != other
    assert len(set(first)) > 10  # it really samples


def test_the_returned_logprob_is_the_raw_one_whatever_the_temperature():
    logits = random_logits(8, seed=3)
    raw = torch.log_softmax(logits, dim=-1)
    generator = seeded(5)
    for _ in range(50):
        token, logprob = choose_token(logits, SamplingParams(temperature=3.0), [], generator, position=0)
        assert logprob == pytest.approx(float(raw[token]), abs=1e-6)


@given(st.integers(min_value=0, max_value=10_000))
@settings(max_examples=100)
def test_top_k_of_one_always_samples_the_argmax(seed):
    logits = random_logits(20, seed)
    token, _ = choose_token(logits, SamplingParams(temperature=2.0, top_k=1), [], seeded(seed), position=0)
    assert token == int(torch.argmax(logits))


def test_top_k_never_samples_outside_the_k_highest_logits():
    logits = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5])
    chosen = set(draws(logits, SamplingParams(temperature=5.0, top_k=3), 400))
    assert chosen == {0, 1, 2}


@given(st.integers(min_value=0, max_value=10_000))
@settings(max_examples=100)
def test_a_tiny_top_p_always_samples_the_argmax(seed):
    logits = random_logits(20, seed)
    token, _ = choose_token(logits, SamplingParams(temperature=1.0, top_p=1e-6), [], seeded(seed), position=0)
    assert token == int(torch.argmax(logits))


def test_top_p_keeps_the_smallest_set_of_tokens_whose_mass_reaches_it():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert set(draws(logits, SamplingParams(top_p=0.6), 400)) == {0, 1}
    assert set(draws(logits, SamplingParams(top_p=0.9), 400)) == {0, 1, 2}
    assert set(draws(logits, SamplingParams(top_p=0.4), 200)) == {0}


def test_min_p_drops_tokens_far_less_likely_than_the_best():
    logits = torch.log(torch.tensor([0.4, 0.35, 0.2, 0.05]))
    # Threshold 0.4 * 0.4 = 0.16: token 3 is dropped, token 2 stays.
    assert set(draws(logits, SamplingParams(min_p=0.4), 500)) == {0, 1, 2}
    # Threshold 0.8 * 0.4 = 0.32: only the two best remain.
    assert set(draws(logits, SamplingParams(min_p=0.8), 400)) == {0, 1}
    assert set(draws(logits, SamplingParams(min_p=1.0), 100)) == {0}


def test_a_large_logit_bias_forces_its_token_when_sampling_and_when_greedy():
    logits = random_logits(12, seed=9)
    weakest = int(torch.argmin(logits))
    params = SamplingParams(temperature=1.0, logit_bias=((weakest, 100.0),))
    assert set(draws(logits, params, 50)) == {weakest}
    token, logprob = choose_token(
        logits, SamplingParams(temperature=0.0, logit_bias=((weakest, 100.0),)), [], None, position=0
    )
    assert token == weakest
    # The reported logprob is still the unbiased one.
    assert logprob == pytest.approx(float(torch.log_softmax(logits, dim=-1)[weakest]), abs=1e-6)


def test_a_negative_logit_bias_can_ban_the_argmax():
    logits = torch.tensor([1.0, 5.0, 2.0])
    token, _ = choose_token(logits, SamplingParams(temperature=0.0, logit_bias=((1, -100.0),)), [], None, position=0)
    assert token == 2


@pytest.mark.parametrize("token_id", [4, 1000, -1, -3])
def test_a_logit_bias_for_a_token_id_outside_the_vocabulary_has_no_effect(token_id):
    logits = torch.tensor([3.0, 1.0, 0.0, 0.5])  # vocabulary of 4: ids 0..3
    params = SamplingParams(temperature=0.0, logit_bias=((token_id, 100.0),))
    token, _ = choose_token(logits, params, [], None, position=0)
    assert token == 0


# --- choose_token: penalties ------------------------------------------------------------------


def test_a_repetition_penalty_divides_a_repeated_positive_logit_and_can_flip_the_argmax():
    logits = torch.tensor([2.0, 1.9, 0.5])
    assert choose_token(logits, GREEDY, [0], None, position=0)[0] == 0
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.2)  # 2.0 / 1.2 < 1.9
    assert choose_token(logits, penalised, [0], None, position=0)[0] == 1
    # Without the token in the history nothing changes.
    assert choose_token(logits, penalised, [2], None, position=0)[0] == 0


def test_a_repetition_penalty_multiplies_a_repeated_negative_logit():
    logits = torch.tensor([-1.0, -1.1])
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.2)  # -1.0 * 1.2 < -1.1
    assert choose_token(logits, penalised, [0], None, position=0)[0] == 1


def test_a_frequency_penalty_grows_with_each_repetition():
    logits = torch.tensor([2.0, 1.5])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.3)
    assert choose_token(logits, params, [0], None, position=0)[0] == 0  # 2.0 - 0.3 > 1.5
    assert choose_token(logits, params, [0, 0], None, position=0)[0] == 1  # 2.0 - 0.6 < 1.5


def test_a_presence_penalty_is_the_same_however_often_a_token_appeared():
    logits = torch.tensor([2.0, 1.5])
    mild = SamplingParams(temperature=0.0, presence_penalty=0.4)
    strong = SamplingParams(temperature=0.0, presence_penalty=0.6)
    assert choose_token(logits, mild, [0, 0, 0, 0], None, position=0)[0] == 0
    assert choose_token(logits, strong, [0], None, position=0)[0] == 1


def test_a_negative_frequency_penalty_encourages_repetition():
    logits = torch.tensor([1.5, 2.0])
    params = SamplingParams(temperature=0.0, frequency_penalty=-1.0)
    assert choose_token(logits, params, [0], None, position=0)[0] == 0


def test_penalties_lower_a_repeated_tokens_share_of_sampled_draws():
    logits = torch.zeros(4)
    history = [0, 0, 0]
    plain = draws(logits, SamplingParams(), 400, seed=11, history=history)
    penalised = draws(
        logits, SamplingParams(frequency_penalty=0.5, repetition_penalty=1.5), 400, seed=11, history=history
    )
    assert penalised.count(0) < plain.count(0) / 2


def test_history_tokens_outside_the_vocabulary_do_not_break_the_penalties():
    logits = torch.tensor([2.0, 1.0, 0.0])
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0)
    assert choose_token(logits, params, [7, 100], None, position=0)[0] == 0
    assert choose_token(logits, params, [0, 100], None, position=0)[0] == 1
