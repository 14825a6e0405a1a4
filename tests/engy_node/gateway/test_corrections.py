"""corrections: stop strings applied to a relay whatever the miner did, and the real finish reason.

The scanner is checked against the whole text cut at its stop string, however the text arrives
in chunks; the finish reason against every combination of the facts it reads.
"""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway.corrections import StopScanner, corrected_finish

alphabet = st.sampled_from("ab \n.Pé")
texts = st.text(alphabet=alphabet, max_size=60)
stop_lists = st.lists(st.text(alphabet=alphabet, min_size=1, max_size=4), max_size=3)


def relay(text: str, stops: list[str], cuts: list[int]) -> tuple[str, StopScanner, list[str]]:
    scanner = StopScanner(stops)
    bounds = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    pieces = [scanner.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    pieces.append(scanner.finish())
    return "".join(pieces), scanner, pieces


@given(text=texts, stops=stop_lists, cuts=st.lists(st.integers(0, 100), max_size=10))
def test_nothing_relayed_ever_holds_a_stop_string_and_the_relay_is_the_text_up_to_its_stop(text, stops, cuts):
    relayed, scanner, _ = relay(text, stops, cuts)
    assert not any(stop in relayed for stop in stops)
    if scanner.matched is None:
        assert relayed == text
    else:
        assert (relayed + scanner.matched) in text and text.startswith(relayed + scanner.matched)


@given(text=texts, stop=st.text(alphabet=alphabet, min_size=1, max_size=4), cuts=st.lists(st.integers(0, 100), max_size=10))
def test_with_one_stop_string_the_relay_does_not_depend_on_how_the_text_was_chunked(text, stop, cuts):
    relayed, scanner, _ = relay(text, [stop], cuts)
    index = text.find(stop)
    assert relayed == (text if index < 0 else text[:index])
    assert scanner.matched == (None if index < 0 else stop)


@given(text=texts, cuts=st.lists(st.integers(0, 100), max_size=10))
def test_without_stop_strings_every_chunk_passes_at_once(text, cuts):
    relayed, _, pieces = relay(text, [], cuts)
    assert relayed == text and pieces[-1] == ""


def test_a_possible_stop_is_held_until_the_next_chunk_shows_it_was_not_one():
    scanner = StopScanner(["Paris"])
    assert scanner.feed("The capital is Pa") == "The capital is "
    assert scanner.feed("lo Alto") == "Palo Alto"
    assert scanner.feed(" and Par") == " and "
    assert scanner.feed("is.") == ""
    assert scanner.matched == "Paris" and scanner.finish() == "" and scanner.feed("more") == ""


def test_an_empty_stop_string_stops_nothing():
    scanner = StopScanner([""])
    assert scanner.feed("text") == "text" and scanner.matched is None


@given(reported=st.sampled_from(["stop", "length", "tool_calls", "eos", ""]), completion=st.integers(0, 50),
       max_tokens=st.integers(1, 50), ended=st.booleans(), stopped=st.booleans())
def test_the_finish_reason_follows_the_facts_the_gateway_holds(reported, completion, max_tokens, ended, stopped):
    finish = corrected_finish(reported=reported, completion_tokens=completion, max_tokens=max_tokens,
                              ended_by_end_token=ended, stop_matched=stopped)
    if stopped:
        assert finish == "stop"
    elif completion >= max_tokens and not ended:
        assert finish == "length"
    else:
        assert finish == ("length" if reported == "length" else "stop")


def test_the_public_miners_stop_at_the_token_limit_is_a_length():
    assert corrected_finish(reported="stop", completion_tokens=16, max_tokens=16, ended_by_end_token=False,
                            stop_matched=False) == "length"
    assert corrected_finish(reported="stop", completion_tokens=16, max_tokens=16, ended_by_end_token=True,
                            stop_matched=False) == "stop", "an answer may end naturally on its last allowed token"
