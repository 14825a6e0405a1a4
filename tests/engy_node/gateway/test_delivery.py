"""The delivery the gateway records for the audit: what the buyer received, as token ids, measured
against the committed output on the embedded model's tokenizer, and judged by
`proof.check_delivery` as the verifier will judge it."""

from __future__ import annotations

import pytest

from engy_node import proof
from engy_node.gateway.request.accounting import relayed_tokens
from engy_node.models import SMOLLM2_135M
from engy_node.served_model import load_served_model

ANSWER = "The capital of France is Paris. It is known for the Eiffel Tower."


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_served_model(SMOLLM2_135M, checkpoint)


@pytest.fixture(scope="module")
def committed(model) -> list[int]:
    """An answer as a miner commits it: its tokens, then the end-of-answer token."""
    return model.tokenizer.encode(ANSWER, add_special_tokens=False) + [min(model.end_token_ids)]


def judged(model, committed, relay, max_tokens=64) -> str | None:
    delivery = proof.Delivery(
        relayed_output_ids=relay.output_ids, ended_at_stop=relay.stop is not None, max_tokens=max_tokens
    )
    return proof.check_delivery(committed, delivery, model.end_token_ids)


def test_a_relay_of_the_whole_answer_is_the_committed_ids(model, committed):
    relay = relayed_tokens(model, ANSWER, committed, stops=(), cut_at=None, finish_stop=True)
    assert relay.output_ids == tuple(committed) and relay.proved and relay.stop is None
    assert relay.tokens == len(committed)
    assert judged(model, committed, relay) is None
    assert judged(model, committed, relay, max_tokens=len(committed) - 1) == "past-max-tokens"


@pytest.mark.parametrize("cut_by_gateway", [True, False])
def test_an_answer_ended_at_a_stop_string_relays_a_prefix_of_the_proof(model, committed, cut_by_gateway):
    relayed = ANSWER[: ANSWER.index("Paris")]
    relay = relayed_tokens(
        model,
        relayed,
        committed,
        stops=("Paris",),
        cut_at="Paris" if cut_by_gateway else None,
        finish_stop=not cut_by_gateway,
    )
    assert relay.proved and relay.stop == "Paris"
    prefix = relay.output_ids
    assert committed[: len(prefix)] == list(prefix)
    assert model.decode(list(prefix)).startswith(relayed) and not model.decode(list(prefix[:-1])).startswith(relayed)
    assert relay.tokens == len(model.tokenizer.encode(relayed, add_special_tokens=False)) + (0 if cut_by_gateway else 1)
    assert judged(model, committed, relay) is None


def test_a_relay_that_is_not_what_was_proved_is_caught(model, committed):
    swapped = ANSWER.replace("Paris", "Lyon")
    relay = relayed_tokens(model, swapped, committed, stops=(), cut_at=None, finish_stop=True)
    assert not relay.proved
    assert judged(model, committed, relay) == "output-mismatch"


def test_a_tail_the_miner_held_back_is_a_defect_and_the_buyer_gets_the_whole_proven_answer(model, committed):
    held_back = ANSWER[: ANSWER.index(" It is")]
    relay = relayed_tokens(model, held_back, committed, stops=("Paris",), cut_at=None, finish_stop=True)
    assert relay.proved and relay.stop is None, "an unrelated continuation is not taken for a stop"
    assert relay.defect == "held-back" and relay.proven_text == ANSWER
    assert relay.output_ids == tuple(committed) and relay.tokens == len(committed)
    assert judged(model, committed, relay) is None


@pytest.mark.parametrize(
    "sent, defect",
    [
        (ANSWER.replace("known for", "knownfor"), "whitespace"),
        (ANSWER.replace(". It", ".\n\nIt"), "whitespace"),
        (ANSWER.replace("France ", "France  "), "whitespace"),
    ],
)
def test_text_that_differs_from_the_proof_in_whitespace_only_is_a_defect(model, committed, sent, defect):
    relay = relayed_tokens(model, sent, committed, stops=(), cut_at=None, finish_stop=True)
    assert relay.proved and relay.defect == defect
    assert relay.proven_text == ANSWER, "the buyer is given the proven text"
    assert judged(model, committed, relay) is None


def test_a_replacement_character_for_a_character_the_miner_did_not_wait_for_is_a_defect(model):
    answer = "Il dottore è il migliore."
    ids = model.tokenizer.encode(answer, add_special_tokens=False) + [min(model.end_token_ids)]
    relay = relayed_tokens(model, answer.replace("è", "\ufffd"), ids, stops=(), cut_at=None, finish_stop=True)
    assert relay.proved and relay.defect == "replacement-character" and relay.proven_text == answer


@pytest.mark.parametrize(
    "sent",
    [
        ANSWER.replace("Paris", "Paris!"),
        ANSWER.replace("Eiffel", "Eifel"),
        ANSWER.replace("Paris", "\ufffd"),
        ANSWER + " Visit soon.",
    ],
)
def test_a_different_character_anywhere_is_still_a_mismatch(model, committed, sent):
    relay = relayed_tokens(model, sent, committed, stops=(), cut_at=None, finish_stop=True)
    assert not relay.proved and relay.proven_text is None
    assert judged(model, committed, relay) == "output-mismatch"


# ---- answers sent in parts (the newest public miners: reasoning_content, tool_calls, content null)

from engy_node.gateway.request.accounting import structured_relayed_tokens  # noqa: E402
from engy_node.gateway.request.corrections import StructuredParts  # noqa: E402

REASONING = "The user asks for a capital. France's is Paris."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "year": {"type": "integer"}}},
        },
    }
]
RAW = (
    f"<think>\n{REASONING}\n</think>\n\n{ANSWER}\n<tool_call>\n<function=lookup>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=year>\n1889\n</parameter>\n</function>\n</tool_call>"
)
"""What a Qwen3-family model writes: its reasoning, its answer, then a call in the XML format."""


@pytest.fixture(scope="module")
def raw_committed(model) -> list[int]:
    return model.tokenizer.encode(RAW, add_special_tokens=False) + [min(model.end_token_ids)]


def parts(reasoning: str = REASONING, calls=(("lookup", '{"city": "Paris", "year": 1889}'),)) -> StructuredParts:
    sent = StructuredParts(reasoning=reasoning)
    sent.add_calls(
        [
            {"index": i, "id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}
            for i, (name, arguments) in enumerate(calls)
        ]
    )
    return sent


def judged_raw(model, raw_committed, relay) -> str | None:
    return judged(model, raw_committed, relay, max_tokens=len(raw_committed))


def structured(model, raw_committed, content, sent, **terms):
    return structured_relayed_tokens(
        model,
        content,
        raw_committed,
        parts=sent,
        tools=TOOLS,
        **{"stops": (), "cut_at": None, "finish_stop": True, **terms},
    )


def test_an_answer_sent_in_parts_that_the_proof_says_whole_is_proved_and_no_defect(model, raw_committed):
    relay = structured(model, raw_committed, ANSWER, parts())
    assert relay.proved and relay.defect is None and relay.proven_text == RAW
    assert relay.output_ids == tuple(raw_committed) and relay.tokens == len(raw_committed), "reasoning is billed"
    assert judged_raw(model, raw_committed, relay) is None


def test_call_arguments_typed_otherwise_are_the_same_call(model, raw_committed):
    # A template-typed "1889", a schema-typed 1889, key order and spacing: one call.
    relay = structured(model, raw_committed, ANSWER, parts(calls=(("lookup", '{"year":"1889","city":"Paris"}'),)))
    assert relay.proved and relay.defect is None


@pytest.mark.parametrize(
    "content, sent, defect",
    [
        (ANSWER.replace("known for", "knownfor"), parts(), "whitespace"),
        (ANSWER, parts(reasoning=REASONING.replace(" ", "  ")), "whitespace"),
        (ANSWER[: ANSWER.index(" It is")], parts(calls=()), "held-back"),
    ],
)
def test_parts_that_differ_in_presentation_only_are_a_defect(model, raw_committed, content, sent, defect):
    relay = structured(model, raw_committed, content, sent)
    assert relay.proved and relay.defect == defect and relay.proven_text == RAW
    assert judged_raw(model, raw_committed, relay) is None


@pytest.mark.parametrize(
    "content, sent",
    [
        (ANSWER.replace("Paris", "Lyon"), parts()),
        (ANSWER, parts(reasoning="Something else entirely.")),
        (ANSWER, parts(calls=(("lookup", '{"city": "Lyon", "year": 1889}'),))),
        (ANSWER, parts(calls=(("delete_everything", "{}"),))),
        (ANSWER, parts(calls=(("lookup", '{"city": "Paris", "year": 1889}'), ("lookup", "{}")))),
    ],
)
def test_parts_that_say_something_the_proof_does_not_are_a_mismatch(model, raw_committed, content, sent):
    relay = structured(model, raw_committed, content, sent)
    assert not relay.proved
    assert judged_raw(model, raw_committed, relay) == "output-mismatch"


def test_an_answer_in_parts_cut_at_a_stop_string_relays_the_proven_prefix_through_the_reasoning(model, raw_committed):
    content = ANSWER[: ANSWER.index("Paris")]
    relay = structured(
        model, raw_committed, content, parts(calls=()), stops=("Paris",), cut_at="Paris", finish_stop=False
    )
    assert relay.proved and relay.stop == "Paris" and relay.defect is None
    assert relay.proven_text == RAW[: RAW.index(content) + len(content)]
    assert judged_raw(model, raw_committed, relay) is None


def test_the_reasoning_tokens_are_the_proven_tokens_up_to_the_closing_tag(model, raw_committed):
    from engy_node.gateway.request.accounting import reasoning_tokens

    count = reasoning_tokens(model, raw_committed, RAW)
    closed = RAW[: RAW.index("</think>") + len("</think>")]
    assert model.decode(raw_committed[:count]).startswith(closed)
    assert not model.decode(raw_committed[: count - 1]).startswith(closed)
    assert reasoning_tokens(model, raw_committed, ANSWER) == 0, "an answer without reasoning has none"
    assert reasoning_tokens(model, None, RAW) == len(model.tokenizer.encode(REASONING, add_special_tokens=False))
    unclosed = "<think>\nStill thinking when the budget ran out"
    assert reasoning_tokens(model, [1, 2, 3], unclosed) == 3
