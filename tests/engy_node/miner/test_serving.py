"""What the miner and the gateway both derive from a conversation: its prompt token ids.

`ServedModel.render_prompt` takes a shortcut past transformers' tokenizer call; the ids must be
exactly those of `apply_chat_template(tokenize=True)`, or a miner's commitment would not match
the gateway's own tokenisation. Checked on the embedded model's real chat template.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engy_node.models import SMOLLM2_135M
from engy_node.protocol.miner import Message, ServeRequest
from engy_node.served_model import ServedModel, load_served_model

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>"]
text = st.lists(
    st.one_of(st.text(max_size=40), st.sampled_from(SPECIAL), st.sampled_from([" ", "\n", "  x", "é", "🙂"])),
    max_size=8,
).map("".join)
message = st.builds(
    lambda role, content: Message(role=role, content=content), st.sampled_from(["system", "user", "assistant"]), text
)
tool = st.builds(
    lambda name, description: {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": {"type": "object", "properties": {}}},
    },
    st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
    text,
)


@pytest.fixture(scope="module")
def served(checkpoint) -> ServedModel:
    return load_served_model(SMOLLM2_135M, checkpoint)


def template_ids(served: ServedModel, request: ServeRequest) -> list[int]:
    kwargs = {"tools": list(request.tools)} if request.tools else {}
    ids = served.tokenizer.apply_chat_template(
        [m.for_template() for m in request.messages], add_generation_prompt=True, tokenize=True, **kwargs
    )
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(message, min_size=1, max_size=5), tools=st.lists(tool, max_size=2))
def test_prompt_ids_are_exactly_the_chat_templates(served, messages, tools):
    request = ServeRequest(messages=tuple(messages), max_tokens=16, engy_request_id="r", tools=tuple(tools) or None)
    assert served.render_prompt(request) == template_ids(served, request)


def test_special_token_text_in_a_message_is_tokenised_as_the_template_does(served):
    request = ServeRequest(
        messages=(Message(role="user", content="say <|im_end|> then stop"),), max_tokens=4, engy_request_id="r"
    )
    ids = served.render_prompt(request)
    assert ids == template_ids(served, request)
    assert ids[-4:] == served.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    im_end = served.tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain = ServeRequest(messages=(Message(role="user", content="say then stop"),), max_tokens=4, engy_request_id="r")
    assert ids.count(im_end) == served.render_prompt(plain).count(im_end) + 1, "the text's own is one special token"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.one_of(st.integers(0, 49151), st.sampled_from([0, 1, 2, 3])), max_size=40))
def test_decode_is_exactly_the_tokenizers(served, ids):
    assert served.decode(ids) == served.tokenizer.decode(ids, skip_special_tokens=True)
