"""The miner's answer in the newest public protocol's parts: reasoning apart, tool calls whole,
the text alone (null when there is none), and streamed chunks that add up to the final message."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.miner.serving import chunk_of, message_of
from engy_node.model_output import OutputParser, parse_output

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]
RAW = (
    "<think>\nThey want the weather.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


def test_a_qwen3_answer_goes_out_as_reasoning_text_and_a_whole_call():
    message = message_of(parse_output(RAW, call_id_prefix="c1", tools=TOOLS))
    assert message == {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "They want the weather.",
        "tool_calls": [
            {
                "id": "call_c1_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})},
            }
        ],
    }


def test_text_without_markup_goes_out_as_it_was_and_an_answer_of_only_parts_has_null_content():
    assert message_of(parse_output("Paris is the capital.", call_id_prefix="c")) == {
        "role": "assistant",
        "content": "Paris is the capital.",
    }
    assert message_of(parse_output("", call_id_prefix="c")) == {"role": "assistant", "content": ""}
    assert message_of(parse_output("<think>\nhm\n</think>\n\n", call_id_prefix="c"))["content"] is None


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, len(RAW)), max_size=10))
def test_streamed_chunks_add_up_to_the_final_message_however_the_text_arrives(cuts):
    parser = OutputParser(call_id_prefix="c1", tools=TOOLS)
    bounds = [0, *sorted(cuts), len(RAW)]
    chunks = [chunk_of("corr", parser.feed(RAW[a:b])) for a, b in zip(bounds, bounds[1:])] + [
        chunk_of("corr", parser.finish())
    ]
    final = message_of(parse_output(RAW, call_id_prefix="c1", tools=TOOLS))
    assert "".join(c.reasoning for c in chunks) == final["reasoning_content"]
    assert "".join(c.content for c in chunks) == final["content"]
    assert [{k: v for k, v in call.items() if k != "index"} for c in chunks for call in c.tool_calls] == final[
        "tool_calls"
    ]
