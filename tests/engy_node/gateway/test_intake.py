"""The cheap checks' floor: never above what the tokenizer really produces, on any text."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engy_node.gateway.api.chat import ChatRequest
from engy_node.gateway.request import intake
from engy_node.models import SMOLLM2_135M
from engy_node.protocol.miner import Message, ServeRequest
from engy_node.served_model import load_served_model


@pytest.fixture(scope="module")
def served(checkpoint):
    return load_served_model(SMOLLM2_135M, checkpoint, with_token_floor=True)


def chat(*contents: str, tools=None) -> ChatRequest:
    messages = tuple(
        {"role": "user" if index % 2 == 0 else "assistant", "content": content}
        for index, content in enumerate(contents)
    )
    return ChatRequest(api="openai", model=SMOLLM2_135M.id, messages=messages, max_tokens=1, stream=False, tools=tools)


def prompt_ids(served, request: ChatRequest) -> list[int]:
    return served.render_prompt(
        ServeRequest(
            messages=tuple(Message(role=m["role"], content=m["content"], extra={}) for m in request.messages),
            max_tokens=1,
            engy_request_id="r",
        )
    )


# Text that stresses a byte-level tokenizer's longest tokens: whitespace and punctuation runs,
# the added tokens' own spellings, multi-byte characters and lone surrogates' neighbours.
RUNS = st.sampled_from(
    [" " * 80, "\n" + " " * 80, "#" * 80, "=" * 65, "-" * 64, "<|im_start|>", "<|im_end|>", "\n\n", "\t"]
)
TEXT = st.lists(st.one_of(st.text(min_size=0, max_size=40), RUNS), max_size=20).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(contents=st.lists(TEXT, min_size=1, max_size=4))
def test_the_floor_never_exceeds_the_real_prompt_length(served, contents):
    request = chat(*contents)
    floor = intake.token_floor(intake.prompt_size(request), max_token_bytes=served.max_token_bytes)
    assert floor <= len(prompt_ids(served, request))


def test_the_embedded_model_has_a_floor_and_it_is_tight_enough_to_matter(served):
    # SmolLM2's longest token is 81 bytes of whitespace; a 1 MB prompt is refused unread.
    assert served.max_token_bytes == 82
    size = intake.prompt_size(chat("x" * 1_000_000))
    floor = intake.token_floor(size, max_token_bytes=served.max_token_bytes)
    assert floor > SMOLLM2_135M.max_input_tokens
    reason = intake.too_long(size, floor=floor, max_input_tokens=SMOLLM2_135M.max_input_tokens, model="smollm2-135m")
    assert reason == (
        f"the prompt is at least {floor} tokens (1000000 bytes of message text); smollm2-135m accepts at most "
        "6144: shorten the conversation"
    )


def test_a_prompt_within_the_floor_is_left_to_the_exact_count():
    size = intake.prompt_size(chat("hello " * 100))
    assert (
        intake.too_long(size, floor=intake.token_floor(size, max_token_bytes=82), max_input_tokens=6144, model="m")
        is None
    )


def test_sizes_count_characters_of_every_rendered_text_and_bytes_of_stripped_contents():
    tools = ({"type": "function", "function": {"name": "f", "parameters": {}}},)
    size = intake.prompt_size(chat("  é  ", "abc", tools=tools))
    assert size.content_bytes == len("é".encode()) + 3
    assert size.chars == 5 + 3 + len(str(tools))


def test_no_floor_is_claimed_without_a_known_token_length():
    size = intake.prompt_size(chat("x" * 10_000))
    assert intake.token_floor(size, max_token_bytes=None) == 0
