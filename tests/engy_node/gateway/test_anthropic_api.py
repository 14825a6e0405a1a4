"""anthropic_api: request translation, bodies and named SSE events, checked against the `anthropic` SDK.

The SDK tests serve the encoders' bytes through an in-memory `MockTransport`, so the SDK's own stream
accumulator and error mapping judge the wire format, with no network.
"""

from __future__ import annotations

import inspect
import json

import anthropic
import pytest
from hypothesis import given, settings

from engy_node.gateway.api import anthropic_api
from engy_node.gateway.api.anthropic_api import EventEncoder, message_body, parse_messages_request
from engy_node.gateway.api.chat import STATUS_BY_KIND, GatewayError, Usage
from engy_node.model_output import OutputParser, ReasoningDelta, TextDelta, ToolCall, parse_output
from tests.engy_node.gateway.wire_helpers import (
    MAX_OUTPUT,
    MODEL,
    QWEN_OUTPUT,
    SERVED,
    USAGE,
    event_batches,
    httpx,
    mock_http,
    stream_response,
)

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def parse(body: dict):
    return parse_messages_request(body, **SERVED)


def minimal(**fields) -> dict:
    return {"model": MODEL, "max_tokens": 256, "messages": [{"role": "user", "content": "hi"}], **fields}


def decode_events(chunks: list[bytes]) -> list[tuple[str, dict]]:
    """(event name, data) per SSE event, asserting the framing on the way."""
    events = []
    for chunk in chunks:
        text = chunk.decode()
        assert text.endswith("\n\n") and text.count("\n") == 3
        name_line, data_line = text[:-2].split("\n")
        name = name_line.removeprefix("event: ")
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        events.append((name, data))
    return events


def sdk_client(handler) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        api_key="sk-test", base_url="http://gateway.test", max_retries=0, http_client=mock_http(handler)
    )


def stream_qwen_output(message_id: str, *, piece: int = 5) -> list[bytes]:
    """The gateway's streaming path: raw miner text in small pieces through the parser and encoder."""
    parser = OutputParser(call_id_prefix=message_id)
    encoder = EventEncoder(message_id=message_id, model=MODEL)
    chunks = encoder.start(Usage(prompt_tokens=120, completion_tokens=0, cached_tokens=64))
    for i in range(0, len(QWEN_OUTPUT), piece):
        chunks += encoder.events(parser.feed(QWEN_OUTPUT[i : i + piece])) + encoder.ping()
    return chunks + encoder.events(parser.finish()) + encoder.finish("stop", stop_sequence=None, usage=USAGE)


# ---- parsing ------------------------------------------------------------------------------


def test_a_claude_code_style_request_translates_to_chat_messages():
    request = parse(
        {
            "model": MODEL,
            "max_tokens": 4096,
            "stream": True,
            "temperature": 1,
            "cache_control": {"type": "ephemeral"},
            "metadata": {"user_id": "user_abc"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "service_tier": "standard_only",
            "speed": "standard",
            "system": [
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be careful."},
            ],
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": False},
            "stop_sequences": ["</answer>"],
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                        {"type": "text", "text": "Weather in Paris?", "cache_control": {"type": "ephemeral"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hidden", "signature": "sig"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Nice"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "is_error": True,
                            "content": [{"type": "text", "text": "timeout"}],
                        },
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
        }
    )
    assert request.api == "anthropic" and request.max_tokens == 4096 and request.stream
    assert request.messages == (
        {"role": "system", "content": "You are Claude Code.\nBe careful."},
        {"role": "user", "content": "<system-reminder>ctx</system-reminder>\nWeather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "timeout"},
        {"role": "user", "content": "And tomorrow?"},
    )
    assert request.tools == (
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather",
                "parameters": WEATHER_TOOL["input_schema"],
            },
        },
    )
    assert request.tool_choice == "auto"
    assert request.sampling.temperature == 1.0 and request.sampling.stop == ("</answer>",)


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "any"}, "required"),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
        ({"type": "auto"}, "auto"),
    ],
)
def test_tool_choice_maps_to_the_openai_form(choice, expected):
    assert parse(minimal(tools=[WEATHER_TOOL], tool_choice=choice)).tool_choice == expected


def test_tool_choice_none_drops_the_tools():
    request = parse(minimal(tools=[WEATHER_TOOL], tool_choice={"type": "none"}))
    assert request.tools is None and request.tool_choice is None


def test_an_unknown_model_is_a_404():
    with pytest.raises(GatewayError) as caught:
        parse(minimal(model="claude-opus-9"))
    assert caught.value.status == 404 and "claude-opus-9" in caught.value.message


def test_max_tokens_above_the_model_limit_names_the_limit():
    with pytest.raises(GatewayError) as caught:
        parse(minimal(max_tokens=MAX_OUTPUT + 1))
    assert caught.value.status == 400 and str(MAX_OUTPUT) in caught.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]},
            "messages.0.content.0.type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages.0.content.0.type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}
                        ],
                    }
                ]
            },
            "messages.0.content.0.content.0.type",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages.0.content.0.tool_use_id"),
        (
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}
                ]
            },
            "messages.0.content.0.input",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "server_tool_use"}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": ["text"], "text": "x"}]}]}, "messages.0.content.0.type"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": {"t": 1}}]}],
                    }
                ]
            },
            "messages.0.content.0.content.0",
        ),
        ({"system": 5}, "system"),
        ({"system": [{"type": "image"}]}, "system.0.type"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
        ({"stream": 1}, "stream"),
        ({"thinking": {"type": "sometimes"}}, "thinking"),
        ({"thinking": {"type": "enabled", "budget_tokens": "lots"}}, "thinking.budget_tokens"),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
    ],
)
def test_a_malformed_field_is_a_400_whose_message_starts_with_its_path(fields, param):
    with pytest.raises(GatewayError) as caught:
        parse(minimal(**fields))
    assert caught.value.kind == "invalid_request" and caught.value.param == param
    assert caught.value.message.startswith(f"{param}: ")


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"top_k": 40}, "top_k", "send top_p"),
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {}}}},
            "output_config.format",
            "cannot guarantee JSON",
        ),
        ({"output_config": {"effort": "high"}}, "output_config.effort", "chat template"),
        ({"output_config": {"verbosity": 1}}, "output_config.verbosity", "Extra inputs are not permitted"),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
            "tool_choice.disable_parallel_tool_use",
            "several tools in one turn",
        ),
        ({"service_tier": "priority"}, "service_tier", "standard tier only"),
        ({"speed": "fast"}, "speed", "one speed"),
        ({"container": "container_1"}, "container", "no code-execution containers"),
        ({"inference_geo": "us"}, "inference_geo", "cannot choose where the miners run"),
        ({"diagnostics": {"previous_message_id": "msg_1"}}, "diagnostics", "no cache diagnostics"),
        ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers", "no MCP servers"),
        ({"context_management": {"edits": []}}, "context_management", "does not edit the context"),
        ({"metadata": "user_abc"}, "metadata", "must be an object"),
        ({"logprobs": True}, "logprobs", "Extra inputs are not permitted"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_whose_message_starts_with_the_field(fields, param, says):
    with pytest.raises(GatewayError) as caught:
        parse(minimal(**fields))
    assert (caught.value.kind, caught.value.status, caught.value.param) == ("invalid_request", 400, param)
    assert caught.value.message.startswith(f"{param}: ") and says in caught.value.message


def test_a_field_anthropic_does_not_define_is_refused_as_anthropic_refuses_it():
    with pytest.raises(GatewayError) as caught:
        parse(minimal(some_future_field=[1]))
    assert caught.value.message == "some_future_field: Extra inputs are not permitted"
    with pytest.raises(GatewayError) as caught:
        anthropic_api.parse_count_tokens_request(minimal(), **SERVED)
    assert caught.value.message == "max_tokens: Extra inputs are not permitted"
    with pytest.raises(GatewayError) as caught:
        anthropic_api.parse_count_tokens_request(
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "output_format": {"type": "json_schema"}},
            **SERVED,
        )
    assert caught.value.param == "output_format" and "cannot guarantee JSON" in caught.value.message


def test_every_field_the_sdk_declares_has_a_decision_and_no_other_field_does():
    from anthropic.resources.messages import Messages

    def declared(method) -> set[str]:
        return set(inspect.signature(method).parameters) - {
            "self",
            "extra_headers",
            "extra_query",
            "extra_body",
            "timeout",
        }

    # Sampling fields older SDKs send, and the beta fields asking for server-side work.
    legacy, beta = {"temperature", "top_p", "top_k"}, {"mcp_servers", "context_management"}
    assert set(anthropic_api.MESSAGES_FIELDS) == declared(Messages.create) | legacy | beta
    assert set(anthropic_api.COUNT_TOKENS_FIELDS) == declared(Messages.count_tokens) | beta


def test_thinking_of_every_kind_is_accepted_as_sent():
    for thinking in (
        {"type": "adaptive"},
        {"type": "between_tools"},
        {"type": "disabled"},
        {"type": "enabled", "budget_tokens": 2048},
    ):
        assert parse(minimal(thinking=thinking)).messages == ({"role": "user", "content": "hi"},)


def test_count_tokens_needs_no_max_tokens():
    request = anthropic_api.parse_count_tokens_request(
        {"model": MODEL, "system": "sys", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL]},
        **SERVED,
    )
    assert request.messages == ({"role": "system", "content": "sys"}, {"role": "user", "content": "hi"})
    assert request.tools is not None and not request.stream
    assert anthropic_api.count_tokens_body(17) == {"input_tokens": 17}


# ---- bodies and events --------------------------------------------------------------------


def test_the_message_body_has_thinking_text_and_tool_use_blocks_and_exclusive_usage():
    body = message_body(
        message_id="msg_1",
        model=MODEL,
        events=parse_output(QWEN_OUTPUT, call_id_prefix="m1"),
        finish="stop",
        stop_sequence=None,
        usage=USAGE,
    )
    assert body["content"] == [
        {"type": "thinking", "thinking": "They want the weather.", "signature": ""},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "call_m1_0", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert body["stop_reason"] == "tool_use" and body["stop_sequence"] is None
    assert body["usage"] == {
        "input_tokens": 56,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 64,
        "output_tokens": 30,
    }


@pytest.mark.parametrize(
    ("finish", "stop_sequence", "events", "reason"),
    [
        ("stop", None, [TextDelta("hi")], "end_turn"),
        ("stop", "</answer>", [TextDelta("hi")], "stop_sequence"),
        ("length", None, [TextDelta("hi")], "max_tokens"),
        ("length", None, [ToolCall(index=0, id="c", name="f", arguments="{}")], "max_tokens"),
        ("stop", "</answer>", [ToolCall(index=0, id="c", name="f", arguments="{}")], "tool_use"),
    ],
)
def test_stop_reasons(finish, stop_sequence, events, reason):
    body = message_body(
        message_id="m", model=MODEL, events=events, finish=finish, stop_sequence=stop_sequence, usage=USAGE
    )
    assert body["stop_reason"] == reason
    assert body["stop_sequence"] == (stop_sequence if reason == "stop_sequence" else None)


def test_the_stream_opens_blocks_in_order_and_closes_every_one():
    encoder = EventEncoder(message_id="msg_2", model=MODEL)
    chunks = (
        encoder.start(Usage(prompt_tokens=120, completion_tokens=0, cached_tokens=64))
        + encoder.events([ReasoningDelta("a"), ReasoningDelta("b"), TextDelta(""), TextDelta("c")])
        + encoder.ping()
        + encoder.events(
            [
                ToolCall(index=0, id="t0", name="f", arguments='{"x": 1}'),
                ToolCall(index=1, id="t1", name="g", arguments="{}"),
            ]
        )
        + encoder.finish("stop", stop_sequence=None, usage=USAGE)
    )
    events = decode_events(chunks)
    names = [name for name, _ in events]
    assert names.count("message_start") == 1 and names[0] == "message_start" and names[-1] == "message_stop"
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["output_tokens"] == 1 and start["usage"]["input_tokens"] == 56
    blocks = [(data["index"], data["content_block"]["type"]) for name, data in events if name == "content_block_start"]
    assert blocks == [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use")]
    stops = [data["index"] for name, data in events if name == "content_block_stop"]
    assert stops == [0, 1, 2, 3] and names.index("message_delta") > names.index("content_block_stop") + 3
    delta_types = {(data["index"], data["delta"]["type"]) for name, data in events if name == "content_block_delta"}
    assert delta_types == {(0, "thinking_delta"), (1, "text_delta"), (2, "input_json_delta"), (3, "input_json_delta")}
    message_delta = events[-2][1]
    assert message_delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert message_delta["usage"] == {
        "input_tokens": 56,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 64,
        "output_tokens": 30,
    }


def test_a_tool_call_straight_after_the_start_has_no_empty_text_block_before_it():
    encoder = EventEncoder(message_id="m", model=MODEL)
    events = decode_events(
        encoder.start(USAGE)
        + encoder.events(parse_output('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', call_id_prefix="x"))
        + encoder.finish("stop", stop_sequence=None, usage=USAGE)
    )
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert starts == [{"type": "tool_use", "id": "call_x_0", "name": "f", "input": {}}]


def test_error_bodies_statuses_and_headers_follow_anthropic():
    overloaded = GatewayError("overloaded", "No miner has capacity.", retry_after_s=3)
    assert anthropic_api.status_for(overloaded) == 529
    assert anthropic_api.error_body(overloaded, "req_9") == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "No miner has capacity."},
        "request_id": "req_9",
    }
    assert anthropic_api.error_headers(overloaded) == {"retry-after": "3"}
    billing = GatewayError("billing", "Balance too low.")
    assert anthropic_api.status_for(billing) == 402
    assert anthropic_api.error_body(billing, "r")["error"]["type"] == "billing_error"
    assert anthropic_api.error_headers(billing) == {"x-should-retry": "false"}
    assert {kind: anthropic_api.status_for(GatewayError(kind, "m")) for kind in ("upstream", "timeout")} == {
        "upstream": 502,
        "timeout": 504,
    }


def test_every_error_kind_has_an_anthropic_type():
    assert set(anthropic_api.ERROR_TYPE_BY_KIND) == set(STATUS_BY_KIND)


# ---- the official SDK ---------------------------------------------------------------------


def test_the_sdks_stream_helper_accumulates_thinking_text_tool_use_and_usage():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(parse(json.loads(request.content)))
        return stream_response(stream_qwen_output("msg_s1"))

    client = sdk_client(handler)
    with client.messages.stream(
        model=MODEL,
        max_tokens=1024,
        system="Be brief.",
        tools=[WEATHER_TOOL],
        thinking={"type": "enabled", "budget_tokens": 512},
        metadata={"user_id": "u"},
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    ) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert seen[0].stream and seen[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert "".join(texts) == "Let me check."
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "They want the weather."
    assert final.content[2].input == {"city": "Paris"} and final.content[2].name == "get_weather"
    assert final.stop_reason == "tool_use"
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.output_tokens) == (56, 64, 30)


def test_the_sdks_raw_event_stream_sees_exactly_one_message_start():
    client = sdk_client(lambda request: stream_response(stream_qwen_output("msg_s2", piece=3)))
    events = list(
        client.messages.create(model=MODEL, max_tokens=64, stream=True, messages=[{"role": "user", "content": "hi"}])
    )
    types = [event.type for event in events]
    assert types.count("message_start") == 1 and types[-1] == "message_stop"
    assert events[0].message.usage.output_tokens == 1


def test_the_sdk_parses_the_non_stream_message():
    def handler(request: httpx.Request) -> httpx.Response:
        events = parse_output(QWEN_OUTPUT, call_id_prefix="n1")
        return httpx.Response(
            200,
            json=message_body(
                message_id="msg_n1", model=MODEL, events=events, finish="stop", stop_sequence=None, usage=USAGE
            ),
        )

    message = sdk_client(handler).messages.create(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "x"}]
    )
    assert isinstance(message, anthropic.types.Message)
    assert isinstance(message.content[0], anthropic.types.ThinkingBlock) and message.content[0].signature == ""
    assert isinstance(message.content[2], anthropic.types.ToolUseBlock) and message.content[2].input == {
        "city": "Paris"
    }
    assert message.usage.cache_creation_input_tokens == 0


def test_the_sdk_counts_tokens_through_the_count_tokens_body():
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/messages/count_tokens"
        anthropic_api.parse_count_tokens_request(json.loads(request.content), **SERVED)
        return httpx.Response(200, json=anthropic_api.count_tokens_body(42))

    count = sdk_client(handler).messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens == 42


@pytest.mark.parametrize(
    ("err", "exception", "status"),
    [
        (GatewayError("authentication", "invalid x-api-key"), anthropic.AuthenticationError, 401),
        (GatewayError("billing", "Balance too low."), anthropic.APIStatusError, 402),
        (GatewayError("not_found", "model: nope", param="model"), anthropic.NotFoundError, 404),
        (GatewayError("invalid_request", "max_tokens: required", param="max_tokens"), anthropic.BadRequestError, 400),
        (GatewayError("rate_limit", "Slow down.", retry_after_s=1), anthropic.RateLimitError, 429),
        (GatewayError("overloaded", "No miner has capacity.", retry_after_s=2), anthropic.InternalServerError, 529),
        (GatewayError("timeout", "The miner timed out."), anthropic.InternalServerError, 504),
    ],
)
def test_error_bodies_raise_the_sdks_exception_for_their_status(err, exception, status):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            anthropic_api.status_for(err),
            headers=anthropic_api.error_headers(err),
            json=anthropic_api.error_body(err, "req_1"),
        )

    with pytest.raises(exception) as caught:
        sdk_client(handler).messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == status
    assert caught.value.body["error"]["type"] == anthropic_api.ERROR_TYPE_BY_KIND[err.kind]
    assert err.message in caught.value.message


def test_an_in_band_error_event_raises_in_the_sdk():
    def handler(request: httpx.Request) -> httpx.Response:
        encoder = EventEncoder(message_id="msg_e", model=MODEL)
        return stream_response(
            encoder.start(USAGE)
            + encoder.events([TextDelta("partial")])
            + encoder.error(GatewayError("overloaded", "Miner capacity lost."))
        )

    with pytest.raises(anthropic.APIStatusError) as caught:
        with sdk_client(handler).messages.stream(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}]
        ) as stream:
            stream.get_final_message()
    assert caught.value.body["error"] == {"type": "overloaded_error", "message": "Miner capacity lost."}


def test_a_stop_sequence_reaches_the_sdk_through_message_delta():
    def handler(request: httpx.Request) -> httpx.Response:
        encoder = EventEncoder("msg_ss", MODEL)
        return stream_response(
            encoder.start(USAGE)
            + encoder.events([TextDelta("<answer>42")])
            + encoder.finish("stop", stop_sequence="</answer>", usage=USAGE)
        )

    with sdk_client(handler).messages.stream(
        model=MODEL, max_tokens=8, stop_sequences=["</answer>"], messages=[{"role": "user", "content": "x"}]
    ) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == (
        "stop_sequence",
        "</answer>",
        "<answer>42",
    )


@settings(max_examples=150, deadline=None)
@given(stream=event_batches())
def test_any_event_sequence_streams_well_formed_blocks_that_add_up_to_the_message_body(stream):
    events, batches = stream
    encoder = EventEncoder("msg_p", MODEL)
    chunks = encoder.start(USAGE)
    for batch in batches:
        chunks += encoder.events(batch)
    decoded = decode_events(chunks + encoder.finish("stop", stop_sequence=None, usage=USAGE))

    blocks: list[dict] = []
    open_index = None
    for name, payload in decoded[1:-2]:
        if name == "content_block_start":
            assert open_index is None and payload["index"] == len(blocks)
            block = dict(payload["content_block"])
            assert block.get("text", block.get("thinking", "")) == "" and block.get("input", {}) == {}
            blocks.append(block)
            open_index = payload["index"]
        elif name == "content_block_delta":
            assert payload["index"] == open_index
            delta, block = payload["delta"], blocks[open_index]
            kind = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "tool_use"}[delta["type"]]
            assert block["type"] == kind
            if kind == "tool_use":
                block["input"] = json.loads(delta["partial_json"])
            else:
                assert delta[kind]
                block[kind] += delta[kind]
        else:
            assert name == "content_block_stop" and payload["index"] == open_index
            open_index = None
    assert open_index is None
    assert [name for name, _ in decoded].count("message_start") == 1
    assert [name for name, _ in decoded[-2:]] == ["message_delta", "message_stop"]
    body = message_body(message_id="msg_p", model=MODEL, events=events, finish="stop", stop_sequence=None, usage=USAGE)
    assert blocks == body["content"]
    assert decoded[-2][1]["delta"]["stop_reason"] == body["stop_reason"]
