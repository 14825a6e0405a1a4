"""corrections: stop strings applied to a relay whatever the miner did, and the real finish reason.

The scanner is checked against the whole text cut at its stop string, however the text arrives
in chunks; the finish reason against every combination of the facts it reads.
"""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from engy_node.gateway.request.corrections import ReplacementHold, StopScanner, corrected_finish, presentation_match
from engy_node.serve.sampling import REPLACEMENT_CHARACTER as FFFD

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


@given(
    text=texts, stop=st.text(alphabet=alphabet, min_size=1, max_size=4), cuts=st.lists(st.integers(0, 100), max_size=10)
)
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


@given(
    reported=st.sampled_from(["stop", "length", "tool_calls", "eos", ""]),
    completion=st.integers(0, 50),
    max_tokens=st.integers(1, 50),
    ended=st.booleans(),
    stopped=st.booleans(),
)
def test_the_finish_reason_follows_the_facts_the_gateway_holds(reported, completion, max_tokens, ended, stopped):
    finish = corrected_finish(
        reported=reported,
        completion_tokens=completion,
        max_tokens=max_tokens,
        ended_by_end_token=ended,
        stop_matched=stopped,
    )
    if stopped:
        assert finish == "stop"
    elif completion >= max_tokens and not ended:
        assert finish == "length"
    else:
        assert finish == ("length" if reported == "length" else "stop")


def test_the_public_miners_stop_at_the_token_limit_is_a_length():
    assert (
        corrected_finish(
            reported="stop", completion_tokens=16, max_tokens=16, ended_by_end_token=False, stop_matched=False
        )
        == "length"
    )
    assert (
        corrected_finish(
            reported="stop", completion_tokens=16, max_tokens=16, ended_by_end_token=True, stop_matched=False
        )
        == "stop"
    ), "an answer may end naturally on its last allowed token"


# ---- presentation: a peer's text against the proven text ------------------------------------

TEXT = st.text(alphabet=st.sampled_from(list("ab é\n") + ["è", FFFD]), max_size=24)


@given(TEXT)
def test_the_proven_text_and_every_prefix_of_it_match_themselves(proven):
    assert presentation_match(proven, proven) == len(proven)
    for end in range(len(proven) + 1):
        covered = presentation_match(proven[:end], proven)
        # a trailing U+FFFD run may stand for more of the non-ASCII characters after it
        assert covered is not None and covered >= len(proven[:end].rstrip())


@given(TEXT, st.data())
def test_whitespace_anywhere_is_presentation(proven, data):
    respaced = "".join(ch + data.draw(st.sampled_from(["", " ", "\n"])) for ch in proven if not ch.isspace())
    assert presentation_match(respaced, proven) is not None


@given(TEXT, st.data())
def test_a_changed_character_is_content(proven, data):
    letters = [i for i, ch in enumerate(proven) if ch in "ab"]
    if not letters:
        return
    i = data.draw(st.sampled_from(letters))
    changed = proven[:i] + ("b" if proven[i] == "a" else "a") + proven[i + 1 :]
    assert presentation_match(changed, proven) is None


def test_a_replacement_character_stands_for_non_ascii_characters_only():
    assert presentation_match(f"dottore {FFFD} il", "dottore è il") == len("dottore è il")
    assert presentation_match(f"dottore {FFFD}{FFFD} il", "dottore è il") == len("dottore è il")
    assert presentation_match(f"dottore {FFFD} il", "dottore e il") is None
    assert presentation_match("dottore  il", "dottore è il") is None, "a lost character is content"
    assert presentation_match("ab", f"a{FFFD}b") == 3, "a replacement the miner left out is presentation"


def test_the_covered_end_stops_before_whitespace_the_text_has_not_reached():
    assert presentation_match("To improveit", "To improve it. Then") == len("To improve it")
    assert presentation_match("To improve it ", "To improve it  Then") == len("To improve it  ")


def test_replacement_characters_at_the_end_of_what_arrived_are_held_and_dropped_when_text_follows():
    hold = ReplacementHold()
    assert hold.feed("dottore " + FFFD) == "dottore "
    assert hold.feed(FFFD) == ""
    assert hold.feed(FFFD + " il") == " il", "what the run stood for is not known until the proof comes"
    assert hold.feed("a" + FFFD + "b") == "a" + FFFD + "b", (
        "a replacement inside text that arrived together is the model's own"
    )


def test_streamed_call_fragments_merge_by_index_as_openai_clients_merge_them():
    from engy_node.gateway.request.corrections import StructuredParts

    parts = StructuredParts()
    parts.add_calls(
        [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]
    )
    parts.add_calls([{"index": 0, "function": {"arguments": '{"city": '}}, {"index": 1, "function": {"name": "now"}}])
    parts.add_calls([{"index": 0, "function": {"arguments": '"Paris"}'}}, {"index": 1, "function": {"arguments": {}}}])
    assert parts.tool_calls == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]


def test_the_final_messages_parts_replace_what_was_streamed():
    from engy_node.gateway.request.corrections import StructuredParts

    parts = StructuredParts(reasoning="partial")
    parts.add_calls([{"index": 0, "function": {"name": "f", "arguments": '{"x"'}}])
    parts.settle(
        {
            "reasoning_content": "whole reasoning",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
        }
    )
    assert (parts.reasoning, parts.tool_calls) == ("whole reasoning", [("f", '{"x": 1}')])
    parts.settle({"content": "no parts here"})
    assert (parts.reasoning, parts.tool_calls) == ("whole reasoning", [("f", '{"x": 1}')]), (
        "absent parts keep the streamed ones"
    )
