"""openai_api: request parsing, bodies and SSE chunks, checked against the official `openai` SDK.

The SDK tests serve the encoders' bytes through an in-memory `MockTransport`, so the SDK's own parsers,
accumulators and error mapping judge the wire format, with no network.
"""

from __future__ import annotations

import inspect
import json

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engy_node.gateway.api import model_list, openai_api
from engy_node.gateway.api.chat import STATUS_BY_KIND, GatewayError
from engy_node.gateway.api.openai_api import ChunkEncoder, completion_body, parse_chat_request
from engy_node.model_output import OutputParser, ReasoningDelta, TextDelta, ToolCall, parse_output
from engy_node.models import SMOLLM2_135M
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
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def parse(body: dict):
    return parse_chat_request(body, **SERVED)


def minimal(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def sse_payloads(chunks: list[bytes]) -> list[str]:
    return [chunk.decode().removeprefix("data: ").removesuffix("\n\n") for chunk in chunks]


def sdk_client(handler) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="sk-test", base_url="http://gateway.test/v1", max_retries=0, http_client=mock_http(handler)
    )


def error_response(err: GatewayError) -> httpx.Response:
    return httpx.Response(err.status, headers=openai_api.error_headers(err), json=openai_api.error_body(err, "req_1"))


# ---- parsing ------------------------------------------------------------------------------


def test_a_minimal_request_gets_the_models_maximum_output_and_default_sampling():
    request = parse(minimal())
    assert request.api == "openai" and request.model == MODEL
    assert request.messages == ({"role": "user", "content": "hi"},)
    assert request.max_tokens == MAX_OUTPUT
    assert not request.stream and not request.include_usage
    assert request.tools is None and request.tool_choice is None
    assert request.sampling.temperature is None and request.sampling.stop == ()


def test_a_full_agent_request_parses_into_template_ready_messages():
    request = parse(
        {
            "model": MODEL,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_completion_tokens": 512,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 7,
            "stop": "END",
            "n": 1,
            "tools": [WEATHER_TOOL],
            "tool_choice": "auto",
            "user": "u-1",
            "parallel_tool_calls": True,
            "metadata": {"x": "y"},
            "safety_identifier": "s-1",
            "prompt_cache_key": "k",
            "store": False,
            "logprobs": False,
            "service_tier": "auto",
            "response_format": {"type": "text"},
            "frequency_penalty": 0,
            "logit_bias": None,
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Paris?"}],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "dropped",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18 C"}]},
            ],
        }
    )
    assert request.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather\nin Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    )
    assert request.stream and request.include_usage and request.max_tokens == 512
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.seed, request.sampling.stop) == (
        0.7,
        0.9,
        7,
        ("END",),
    )
    assert request.tools == (WEATHER_TOOL,) and request.tool_choice == "auto"


def test_tool_choice_none_drops_the_tools_and_a_named_choice_is_kept():
    dropped = parse(minimal(tools=[WEATHER_TOOL], tool_choice="none"))
    assert dropped.tools is None and dropped.tool_choice is None
    named = parse(minimal(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert named.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert parse(minimal(tools=[WEATHER_TOOL], tool_choice="required")).tool_choice == "required"


def test_max_completion_tokens_wins_over_the_deprecated_max_tokens():
    assert parse(minimal(max_tokens=100, max_completion_tokens=200)).max_tokens == 200
    assert parse(minimal(max_tokens=100)).max_tokens == 100


def test_include_usage_only_applies_to_streams():
    assert not parse(minimal(stream=False, stream_options={"include_usage": True})).include_usage


def test_an_unknown_model_is_a_404_naming_the_model():
    with pytest.raises(GatewayError) as caught:
        parse(minimal(model="gpt-9"))
    assert caught.value.kind == "not_found" and caught.value.status == 404 and caught.value.param == "model"
    assert "gpt-9" in caught.value.message


def test_a_max_tokens_above_the_model_limit_names_the_limit():
    with pytest.raises(GatewayError) as caught:
        parse(minimal(max_tokens=MAX_OUTPUT + 1))
    assert caught.value.status == 400 and caught.value.param == "max_tokens"
    assert str(MAX_OUTPUT) in caught.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        (
            {
                "messages": [
                    {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"model": 3}, "model"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -5}, "max_completion_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 10.5}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": "7"}, "seed"),
        ({"n": 2}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_a_malformed_field_is_a_400_naming_it(fields, param):
    with pytest.raises(GatewayError) as caught:
        parse(minimal(**fields))
    assert caught.value.kind == "invalid_request" and caught.value.status == 400
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"logprobs": True}, "logprobs", "carry no log probabilities"),
        ({"logprobs": True, "top_logprobs": 5}, "logprobs", "carry no log probabilities"),
        ({"top_logprobs": 0}, "top_logprobs", "carry no log probabilities"),
        ({"response_format": {"type": "json_object"}}, "response_format", "cannot guarantee JSON"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
            "response_format",
            "cannot guarantee JSON",
        ),
        (
            {"response_format": {"type": "yaml"}},
            "response_format.type",
            "must be 'text', 'json_object' or 'json_schema'",
        ),
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"n": 3}, "n", "one choice per request"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "apply no penalties"),
        ({"presence_penalty": -1}, "presence_penalty", "apply no penalties"),
        ({"logit_bias": {"50256": -100}}, "logit_bias", "no logit bias"),
        ({"store": True}, "store", "never stores completions"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls", "several tools in one turn"),
        ({"service_tier": "priority"}, "service_tier", "one tier"),
        ({"modalities": ["text", "audio"]}, "modalities", "text only"),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio", "text only"),
        ({"functions": [{"name": "f"}]}, "functions", "send the functions as tools"),
        ({"function_call": "auto"}, "function_call", "send tools and tool_choice"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "chat template"),
        ({"verbosity": "low"}, "verbosity", "max_completion_tokens"),
        ({"web_search_options": {}}, "web_search_options", "no web search"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation", "no moderation model"),
        (
            {"stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options.include_obfuscation",
            "pads no",
        ),
        (
            {"stream": True, "stream_options": {"include_usage": True, "chunk": 1}},
            "stream_options.chunk",
            "include_usage",
        ),
        ({"user": 42}, "user", "must be a string"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field_and_what_to_do(fields, param, says):
    with pytest.raises(GatewayError) as caught:
        parse(minimal(**fields))
    assert (caught.value.kind, caught.value.status, caught.value.param) == ("invalid_request", 400, param)
    assert caught.value.message.startswith(param) and says in caught.value.message


def test_a_field_openai_does_not_define_is_refused_as_openai_refuses_it():
    for field in ("some_future_field", "top_k"):
        with pytest.raises(GatewayError) as caught:
            parse(minimal(**{field: 1}))
        assert (
            caught.value.message == f"Unrecognized request argument supplied: {field}" and caught.value.param == field
        )


def test_every_field_the_sdk_declares_has_a_decision_and_no_other_field_does():
    declared = set(inspect.signature(openai.resources.chat.Completions.create).parameters) - {
        "self",
        "extra_headers",
        "extra_query",
        "extra_body",
        "timeout",
    }
    assert set(openai_api.FIELDS) == declared
    assert not set(openai_api.EXTENSION_FIELDS) & declared, "an extension the SDK came to declare belongs in FIELDS"


def test_a_refused_field_reaches_the_sdk_as_a_bad_request_naming_it():
    def handler(request: httpx.Request) -> httpx.Response:
        try:
            parse(json.loads(request.content))
        except GatewayError as err:
            return error_response(err)
        raise AssertionError("the request should have been refused")

    with pytest.raises(openai.BadRequestError) as caught:
        sdk_client(handler).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], logprobs=True
        )
    assert caught.value.param == "logprobs" and caught.value.type == "invalid_request_error"


def test_a_body_that_is_not_an_object_is_a_400():
    with pytest.raises(GatewayError) as caught:
        parse(["not", "an", "object"])
    assert caught.value.status == 400


def test_images_are_refused_with_a_message_saying_why():
    with pytest.raises(GatewayError) as caught:
        parse(minimal(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]))
    assert "images are not supported" in caught.value.message and "text" in caught.value.message


# ---- bodies and chunks --------------------------------------------------------------------


def test_the_non_stream_body_carries_reasoning_tool_calls_and_inclusive_usage():
    events = parse_output(QWEN_OUTPUT, call_id_prefix="r1")
    body = completion_body(
        request_id="chatcmpl-r1", created=1700000000, model=MODEL, events=events, finish="stop", usage=USAGE
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    assert choice["message"]["reasoning_content"] == "They want the weather."
    assert choice["message"]["tool_calls"] == [
        {"id": "call_r1_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ]
    assert body["usage"] == {
        "prompt_tokens": 120,
        "completion_tokens": 30,
        "total_tokens": 150,
        "prompt_tokens_details": {"cached_tokens": 64},
        "completion_tokens_details": {"reasoning_tokens": 0},
    }


def test_a_cut_off_response_stays_length_even_after_a_tool_call():
    body = completion_body(
        request_id="c",
        created=1,
        model=MODEL,
        finish="length",
        usage=USAGE,
        events=[ToolCall(index=0, id="call_0", name="f", arguments="{}")],
    )
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] is None


def test_every_chunk_is_one_data_line_with_the_same_id_and_null_usage_until_the_usage_chunk():
    encoder = ChunkEncoder(request_id="chatcmpl-9", created=42, model=MODEL, include_usage=True)
    chunks = (
        encoder.start()
        + encoder.events([ReasoningDelta("a"), ReasoningDelta("b"), TextDelta("c"), TextDelta("")])
        + encoder.keepalive()
        + encoder.finish("stop", USAGE)
    )
    assert chunks[-1] == b"data: [DONE]\n\n"
    assert b": keep-alive\n\n" in chunks
    payloads = [json.loads(p) for p in sse_payloads(chunks) if p not in ("[DONE]", ": keep-alive")]
    assert all(chunk.endswith(b"\n\n") and chunk.count(b"\n") == 2 for chunk in chunks)
    assert {(p["id"], p["created"], p["model"], p["object"]) for p in payloads} == {
        ("chatcmpl-9", 42, MODEL, "chat.completion.chunk")
    }
    assert [p["usage"] for p in payloads[:-1]] == [None] * (len(payloads) - 1)
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [p["choices"][0]["delta"] for p in payloads[1:3]] == [{"reasoning_content": "ab"}, {"content": "c"}]
    assert payloads[3]["choices"][0]["finish_reason"] == "stop"
    assert payloads[4]["choices"] == [] and payloads[4]["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}


def test_without_include_usage_the_stream_ends_with_the_finish_chunk_and_done():
    encoder = ChunkEncoder(request_id="c", created=1, model=MODEL, include_usage=False)
    tail = sse_payloads(encoder.finish("length", USAGE))
    assert len(tail) == 2 and tail[1] == "[DONE]"
    assert json.loads(tail[0])["choices"][0]["finish_reason"] == "length"


def test_error_bodies_have_openai_types_codes_and_retry_headers():
    billing = GatewayError("billing", "Your prepaid balance is too low.")
    assert billing.status == 402
    assert openai_api.error_body(billing, "req_1") == {
        "error": {
            "message": "Your prepaid balance is too low.",
            "type": "insufficient_quota",
            "param": None,
            "code": "insufficient_quota",
        },
        "request_id": "req_1",
    }
    assert openai_api.error_headers(billing) == {"x-should-retry": "false"}
    overloaded = GatewayError("overloaded", "No capacity.", retry_after_s=5)
    assert overloaded.status == 503
    assert openai_api.error_body(overloaded, "r")["error"]["type"] == "service_unavailable_error"
    assert openai_api.error_headers(overloaded) == {"retry-after": "5"}
    unknown_model = GatewayError("not_found", "no such model", param="model")
    assert openai_api.error_body(unknown_model, "r")["error"]["code"] == "model_not_found"


def test_every_error_kind_has_an_openai_type():
    assert set(openai_api.ERROR_TYPE_BY_KIND) == set(STATUS_BY_KIND)


# ---- the official SDK ---------------------------------------------------------------------


def test_the_sdk_accumulates_a_streamed_reply_with_reasoning_a_tool_call_and_usage():
    seen: list[dict] = []
    parser = OutputParser(call_id_prefix="s1")

    def handler(request: httpx.Request) -> httpx.Response:
        parsed = parse(json.loads(request.content))
        seen.append({"tools": parsed.tools, "include_usage": parsed.include_usage, "stream": parsed.stream})
        encoder = ChunkEncoder(request_id="chatcmpl-s1", created=1, model=MODEL, include_usage=parsed.include_usage)
        chunks = encoder.start()
        for piece in (QWEN_OUTPUT[i : i + 7] for i in range(0, len(QWEN_OUTPUT), 7)):
            chunks += encoder.events(parser.feed(piece)) + encoder.keepalive()
        return stream_response(chunks + encoder.events(parser.finish()) + encoder.finish("stop", USAGE))

    client = sdk_client(handler)
    with client.chat.completions.stream(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER_TOOL],
        stream_options={"include_usage": True},
    ) as stream:
        final = stream.get_final_completion()
    assert seen == [{"tools": (WEATHER_TOOL,), "include_usage": True, "stream": True}]
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    assert message.reasoning_content == "They want the weather."
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("call_s1_0", "get_weather", {"city": "Paris"})
    ]
    assert (
        final.usage.prompt_tokens,
        final.usage.completion_tokens,
        final.usage.prompt_tokens_details.cached_tokens,
    ) == (120, 30, 64)


def test_the_sdks_raw_stream_yields_every_chunk_and_stops_at_done():
    def handler(request: httpx.Request) -> httpx.Response:
        encoder = ChunkEncoder(request_id="chatcmpl-s2", created=1, model=MODEL, include_usage=True)
        return stream_response(
            encoder.start()
            + encoder.events([TextDelta("Hel"), TextDelta("lo")])
            + encoder.events([TextDelta(" there")])
            + encoder.finish("stop", USAGE)
        )

    chunks = list(
        sdk_client(handler).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello there"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 150


def test_the_sdk_parses_the_non_stream_body():
    def handler(request: httpx.Request) -> httpx.Response:
        events = parse_output(QWEN_OUTPUT, call_id_prefix="n1")
        return httpx.Response(
            200,
            json=completion_body(
                request_id="chatcmpl-n1", created=1, model=MODEL, events=events, finish="stop", usage=USAGE
            ),
        )

    completion = sdk_client(handler).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert completion.id == "chatcmpl-n1" and completion.object == "chat.completion"
    assert completion.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert completion.usage.prompt_tokens_details.cached_tokens == 64


@pytest.mark.parametrize(
    ("err", "exception", "status"),
    [
        (GatewayError("authentication", "Invalid API key."), openai.AuthenticationError, 401),
        (GatewayError("not_found", "The model `x` does not exist.", param="model"), openai.NotFoundError, 404),
        (GatewayError("invalid_request", "bad", param="messages"), openai.BadRequestError, 400),
        (GatewayError("rate_limit", "Slow down.", retry_after_s=1), openai.RateLimitError, 429),
        (GatewayError("overloaded", "No miner has capacity.", retry_after_s=2), openai.InternalServerError, 503),
        (GatewayError("upstream", "The miner failed."), openai.InternalServerError, 502),
    ],
)
def test_error_bodies_raise_the_sdks_exception_for_their_status(err, exception, status):
    client = sdk_client(lambda request: error_response(err))
    with pytest.raises(exception) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == status
    assert caught.value.type == openai_api.ERROR_TYPE_BY_KIND[err.kind]
    assert caught.value.param == err.param
    assert err.message in caught.value.message


def test_an_exhausted_balance_is_a_402_status_error_the_sdk_does_not_retry():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return error_response(GatewayError("billing", "Your prepaid balance is too low."))

    client = openai.OpenAI(
        api_key="k", base_url="http://gateway.test/v1", max_retries=2, http_client=mock_http(handler)
    )
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 402 and caught.value.code == "insufficient_quota"
    assert not isinstance(caught.value, (openai.RateLimitError, openai.InternalServerError))
    assert len(calls) == 1


def test_an_in_band_error_after_the_first_chunk_raises_api_error():
    def handler(request: httpx.Request) -> httpx.Response:
        encoder = ChunkEncoder(request_id="chatcmpl-e", created=1, model=MODEL, include_usage=False)
        return stream_response(
            encoder.start()
            + encoder.events([TextDelta("partial")])
            + encoder.error(GatewayError("upstream", "The miner went away."))
        )

    received = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in sdk_client(handler).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True
        ):
            received.append(chunk)
    assert "The miner went away." in caught.value.message
    assert len(received) == 2


def test_the_sdk_lists_and_retrieves_models_with_their_metadata():
    body = model_list.model_body(SMOLLM2_135M, created=1700000000, verified_by=["toploc"])

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=model_list.models_body([body]))
        return httpx.Response(200, json=body)

    client = sdk_client(handler)
    listed = list(client.models.list())
    assert [(m.id, m.created, m.owned_by) for m in listed] == [(SMOLLM2_135M.id, 1700000000, "engy")]
    assert listed[0].model_extra["context_length"] == SMOLLM2_135M.context_length
    assert listed[0].model_extra["verification"] == ["toploc"]
    assert client.models.retrieve(SMOLLM2_135M.id).model_extra["pricing"]["prompt"] == "0.00000001"


@settings(max_examples=150, deadline=None)
@given(stream=event_batches(), finish=st.sampled_from(["stop", "length"]))
def test_any_event_sequence_streams_deltas_that_add_up_to_the_non_stream_body(stream, finish):
    events, batches = stream
    encoder = ChunkEncoder("chatcmpl-p", 1, MODEL, True)
    chunks = encoder.start()
    for batch in batches:
        chunks += encoder.events(batch)
    payloads = sse_payloads(chunks + encoder.finish(finish, USAGE))
    assert payloads[-1] == "[DONE]"
    decoded = [json.loads(p) for p in payloads[:-1]]

    content, reasoning, tool_calls = "", "", {}
    for chunk in decoded[:-2]:
        delta = chunk["choices"][0]["delta"]
        assert chunk["choices"][0]["finish_reason"] is None and delta
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for fragment in delta.get("tool_calls", []):
            call = tool_calls.setdefault(fragment["index"], {"function": {"arguments": ""}})
            if "id" in fragment:
                assert "id" not in call
                call.update(id=fragment["id"], type=fragment["type"])
                call["function"]["name"] = fragment["function"]["name"]
            call["function"]["arguments"] += fragment["function"]["arguments"]
    body = completion_body(request_id="chatcmpl-p", created=1, model=MODEL, events=events, finish=finish, usage=USAGE)
    message = body["choices"][0]["message"]
    assert content == (message["content"] or "")
    assert reasoning == message.get("reasoning_content", "")
    assert [tool_calls[i] for i in sorted(tool_calls)] == message.get("tool_calls", [])
    assert decoded[-2]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]
    assert decoded[-1]["usage"] == body["usage"]
