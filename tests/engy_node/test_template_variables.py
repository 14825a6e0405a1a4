"""Chat-template variables a request carries (`chat_template_kwargs`, Anthropic's `thinking`),
rendered the same way by the gateway and the miner: on the Qwen3 chat template (a fixture; it
renders tools and reads `enable_thinking`) and through the protocol's serve request."""

from __future__ import annotations

from pathlib import Path

import pytest

from engy_node.chat_template import RESERVED_VARIABLES, ChatTemplates
from engy_node.gateway.api import anthropic_api, openai_api
from engy_node.gateway.api.chat import GatewayError
from engy_node.protocol.miner import Message, Serve, ServeRequest, encode, parse_gateway_frame

QWEN3 = ChatTemplates(
    (Path(__file__).parents[1] / "fixtures" / "qwen3-chat-template" / "chat_template.jinja").read_text()
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
SERVED = {"known_models": {"qwen3"}, "max_output_tokens_for": lambda model: 4096}


def render(request: ServeRequest) -> str:
    return QWEN3.render(
        [m.for_template() for m in request.messages],
        tools=list(request.tools) if request.tools else None,
        add_generation_prompt=True,
        variables=request.template_variables(),
    )


def test_enable_thinking_false_opens_the_answer_with_an_empty_think_block_and_tools_are_rendered():
    request = ServeRequest(
        messages=(Message("user", "Weather in Paris?"),),
        max_tokens=64,
        engy_request_id="r",
        tools=tuple(TOOLS),
        tool_choice="auto",
        chat_template_kwargs={"enable_thinking": False},
    )
    text = render(request)
    assert "# Tools" in text and '"name": "get_weather"' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(ServeRequest(messages=request.messages, max_tokens=64, engy_request_id="r")).endswith(
        "<|im_start|>assistant\n"
    )


def test_the_variables_and_tool_choice_travel_in_the_serve_request_and_render_the_same_on_the_other_side():
    request = ServeRequest(
        messages=(Message("user", "hi"),),
        max_tokens=8,
        engy_request_id="r",
        tools=tuple(TOOLS),
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        chat_template_kwargs={"enable_thinking": False},
    )
    received = parse_gateway_frame(encode(Serve("c", request, False))).request
    assert received == request
    assert render(received) == render(request)


def test_a_peers_variables_that_the_renderer_sets_itself_are_dropped():
    frame = (
        '{"type":"serve","corr_id":"c","request":{"messages":[{"role":"user","content":"x"}],'
        '"chat_template_kwargs":{"messages":[],"enable_thinking":true}}}'
    )
    assert parse_gateway_frame(frame).request.chat_template_kwargs == {"enable_thinking": True}


def test_the_openai_api_takes_chat_template_kwargs_and_refuses_the_renderers_own_names():
    body = {
        "model": "qwen3",
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    assert openai_api.parse_chat_request(body, **SERVED).chat_template_kwargs == {"enable_thinking": False}
    for name in sorted(RESERVED_VARIABLES):
        with pytest.raises(GatewayError) as refused:
            openai_api.parse_chat_request({**body, "chat_template_kwargs": {name: 1}}, **SERVED)
        assert refused.value.param == f"chat_template_kwargs.{name}"
    with pytest.raises(GatewayError):
        openai_api.parse_chat_request({**body, "chat_template_kwargs": ["enable_thinking"]}, **SERVED)


@pytest.mark.parametrize(
    ("thinking", "variables"),
    [
        ({"type": "disabled"}, {"enable_thinking": False}),
        ({"type": "enabled", "budget_tokens": 1024}, {"enable_thinking": True}),
        ({"type": "adaptive"}, None),
        (None, None),
    ],
)
def test_anthropic_thinking_switches_the_templates_reasoning(thinking, variables):
    body = {
        "model": "qwen3",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
        **({"thinking": thinking} if thinking is not None else {}),
    }
    assert anthropic_api.parse_messages_request(body, **SERVED).chat_template_kwargs == variables
