"""Golden frames, written by hand, pin the wire in both dialects (docs/protocol.md).

`frames/ours.json` is exactly what this project sends: building each frame's dataclass and
calling `to_wire()` must give that JSON, types included (an int stays an int: `max_request_s` is
`1800`, never `1800.0`), and parsing it must give the dataclass back. A change to either file
is a protocol change that other deployed peers will see.

`frames/public.json` is what peers we do not control send: the public one-file miner 0.4.4, the
TEE miner and the public gateway. Each must be read (liberal in what we accept), and the tests
say what it reads as, so a reading that drifts (a float count refused, a missing field no longer
defaulted) fails here rather than as a miner the gateway silently drops. Refusals that must
stay refusals are pinned with the field the error names, since that field is what gets logged
and sent back as the close reason.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from engy_node.protocol.miner import (
    CLOSE_REASON_MAX_BYTES,
    OUR_FEATURES,
    Admit,
    Cancel,
    Capacity,
    Chunk,
    Deny,
    Heartbeat,
    Hello,
    Message,
    Ping,
    ProtocolError,
    Reconnect,
    Response,
    Sampling,
    Serve,
    ServeRequest,
    close_reason,
    encode,
    parse_gateway_frame,
    parse_miner_frame,
)

FRAMES = Path(__file__).parent / "frames"
OURS = json.loads((FRAMES / "ours.json").read_text(encoding="utf-8"))
PUBLIC = json.loads((FRAMES / "public.json").read_text(encoding="utf-8"))
PARSERS = {"miner_to_gateway": parse_miner_frame, "gateway_to_miner": parse_gateway_frame}


def exact(value: Any) -> str:
    """Canonical JSON text: unlike `==`, it tells `1800` from `1800.0` and `true` from `1`."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def golden(dialect: dict, name: str) -> tuple[str, dict]:
    """(direction, frame) of the golden frame `name`."""
    for direction, frames in dialect.items():
        if name in frames:
            return direction, frames[name]["frame"]
    raise KeyError(name)


def text_of(frame: dict) -> str:
    # json.dumps keeps a float a float (`1800.0`), as the peer wrote it.
    return json.dumps(frame, ensure_ascii=False)


MODEL_ROOT = "5535cb7fc8eeacd99575d61234b96202dccfcab3448dbc77e4c0204581a4934a"
WORKER_ID = "3f2a9c1e8b7d4e6fa1c2d3e4f5a6b7c8"
CORR_ID = "9b1f0c2d4e5a4b6c8d7e6f5a4b3c2d1e"
HOTKEY = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
RIG_HW = {
    "parallelism": "tp",
    "host": "rig-1",
    "cpus": 32,
    "ram_gb": 125.7,
    "gpu": "NVIDIA GeForce RTX 4090",
    "gpu_count": 4,
    "gpu_mem_gb": 24.0,
    "torch": "2.13.0",
    "cuda": "12.8",
    "gpus": "4x NVIDIA GeForce RTX 4090",
}
RIG_CAPACITY = Capacity(
    max_inflight=16, max_inflight_total=64, max_input_tokens=229376, max_output_tokens=32768, max_request_s=1800
)
COMMITMENT = {
    "model_root": MODEL_ROOT,
    "output_token_ids": [28305, 314, 260, 3575, 282, 4649, 28, 284],
    "toploc": {
        "proofs": ["AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJw=="],
        "topk": 128,
        "decode_batching_size": 32,
        "skip_prefill": True,
        "n_tokens": 8,
        "prompt_ids": [1, 9690, 198, 2683, 339, 253, 5356, 5646, 2, 198, 1, 4093],
    },
}


def answer(finish_reason: str, **usage_extra: Any) -> dict:
    return {
        "choices": [
            {
                "index": 0,
                "finish_reason": finish_reason,
                "message": {"role": "assistant", "content": "Paris is the capital of France, and"},
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20, **usage_extra},
    }


OUR_FRAMES = {
    "hello_signed": Hello(
        miner_key="",
        model="smollm2-135m",
        model_root=MODEL_ROOT,
        hw=RIG_HW,
        versions={"engy_node": "0.1.0", "protocol": 1, "toploc": "0.1.6", "transformers": "5.24.0", "sglang": None},
        capacity=RIG_CAPACITY,
        worker_name="rig-1",
        worker_id=WORKER_ID,
        hotkey=HOTKEY,
        ts=1764400000,
        signature="0073ec266d4fb4adbf3d104aa714f9f11032fd8ab6d8829fc40b52c86f6485d7"
        "928cc2ebd4646f3fe3f374be11d905bf4be275fa86f3889d82a9f7dc5e41dd32",
        features=OUR_FEATURES,
    ),
    "hello_with_miner_key": Hello(
        miner_key="mk-local-7d1e",
        model="smollm2-135m",
        model_root=MODEL_ROOT,
        hw={"parallelism": "none", "host": "laptop", "cpus": 8, "ram_gb": 31.2, "gpu_count": 0},
        versions={"engy_node": "0.1.0", "protocol": 1},
        capacity=Capacity(
            max_inflight=1, max_inflight_total=2, max_input_tokens=8192, max_output_tokens=2048, max_request_s=600
        ),
        worker_name="laptop",
        worker_id="0a1b2c3d4e5f60718293a4b5c6d7e8f9",
        features=OUR_FEATURES,
    ),
    "heartbeat": Heartbeat(inflight=3, idle_seconds=12.5, capacity=RIG_CAPACITY),
    "heartbeat_without_capacity": Heartbeat(inflight=0, idle_seconds=0.0),
    "chunk": Chunk(corr_id=CORR_ID, content="Paris é 🗼"),
    "response": Response(
        corr_id=CORR_ID,
        request_id="req-5c0ffee0",
        commitment=COMMITMENT,
        output=answer("length", prompt_tokens_details={"cached_tokens": 0}),
    ),
    "response_with_error": Response(
        corr_id=CORR_ID,
        request_id="req-5c0ffee0",
        commitment=None,
        output=None,
        error="model server error: HTTP 500",
        error_type="ServeError",
        error_status=500,
    ),
    "admit": Admit(),
    "deny": Deny(reason="signature: stale ts"),
    "serve": Serve(
        corr_id=CORR_ID,
        request=ServeRequest(
            messages=(
                Message(role="system", content="You can call tools."),
                Message(role="user", content=[{"type": "text", "text": "Weather in Paris?"}]),
                Message(
                    role="assistant",
                    content="",
                    extra={
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                            },
                        ]
                    },
                ),
                Message(role="tool", content="18 °C, clear", extra={"tool_call_id": "call_1"}),
            ),
            max_tokens=256,
            engy_request_id="req-5c0ffee0",
            tools=(
                {
                    "type": "function",
                    "function": {
                        "name": "weather",
                        "description": "Current weather.",
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                            "required": ["city"],
                        },
                    },
                },
            ),
            sampling=Sampling(temperature=0.7, top_p=0.95, seed=1234, stop=("</s>", "\n\nUser:")),
        ),
        stream=True,
    ),
    "serve_greedy": Serve(
        corr_id="0d9c8b7a6f5e4d3c2b1a098765432100",
        request=ServeRequest(
            messages=(Message(role="user", content="Hi"),), max_tokens=None, engy_request_id="req-0d9c8b7a"
        ),
        stream=False,
    ),
    "cancel": Cancel(corr_id=CORR_ID),
    "ping": Ping(),
    "reconnect": Reconnect(),
}

# ---- ours: exact in what we send -----------------------------------------------------------


def test_every_golden_frame_of_ours_is_built_here_and_every_frame_type_has_one():
    assert set(OUR_FRAMES) == {name for frames in OURS.values() for name in frames}
    assert {type(frame) for frame in OUR_FRAMES.values()} == {
        Hello,
        Heartbeat,
        Chunk,
        Response,
        Admit,
        Deny,
        Serve,
        Cancel,
        Ping,
        Reconnect,
    }


@pytest.mark.parametrize("name", sorted(OUR_FRAMES))
def test_to_wire_gives_exactly_our_golden_frame(name):
    _, expected = golden(OURS, name)
    frame = OUR_FRAMES[name]
    assert exact(frame.to_wire()) == exact(expected)
    assert exact(orjson.loads(encode(frame))) == exact(expected)


@pytest.mark.parametrize("name", sorted(OUR_FRAMES))
def test_our_golden_frame_parses_back_to_its_dataclass(name):
    direction, expected = golden(OURS, name)
    parse = PARSERS[direction]
    assert parse(text_of(expected)) == OUR_FRAMES[name]
    assert parse(text_of(expected).encode()) == OUR_FRAMES[name]


def test_a_miner_frame_is_not_a_gateway_frame_nor_the_reverse():
    for name, frame in OUR_FRAMES.items():
        direction, _ = golden(OURS, name)
        other = parse_gateway_frame if direction == "miner_to_gateway" else parse_miner_frame
        with pytest.raises(ProtocolError) as refused:
            other(encode(frame))
        assert refused.value.field == "frame.type"


def test_idle_seconds_goes_out_rounded_to_milliseconds():
    wire = orjson.loads(encode(Heartbeat(inflight=0, idle_seconds=12.3456789)))
    assert wire["idle_seconds"] == 12.346


def test_a_hello_sends_no_features_key_when_it_honours_nothing_extra():
    wire = dataclasses.replace(OUR_FRAMES["hello_with_miner_key"], features=frozenset()).to_wire()
    assert "features" not in wire
    assert "hotkey" not in wire and "ts" not in wire and "signature" not in wire


# ---- public: liberal in what we accept -----------------------------------------------------

PUBLIC_CAPACITY = Capacity(
    max_inflight=16, max_inflight_total=64, max_input_tokens=229376, max_output_tokens=32768, max_request_s=1800
)
PUBLIC_HW = PUBLIC["miner_to_gateway"]["hello"]["frame"]["hw"]
PUBLIC_READINGS = {
    "hello": Hello(
        miner_key=HOTKEY,
        model="smollm2-135m",
        model_root=MODEL_ROOT,
        hw=PUBLIC_HW,
        versions={},
        capacity=PUBLIC_CAPACITY,
        worker_name="ins-0123456789ab",
        worker_id=WORKER_ID,
    ),
    "hello_without_worker_id": Hello(
        miner_key=HOTKEY,
        model="smollm2-135m",
        model_root=MODEL_ROOT,
        hw={"parallelism": "tp", "host": "rig-1", "gpus": "4x NVIDIA GeForce RTX 4090"},
        versions={},
        capacity=PUBLIC_CAPACITY,
        worker_name="ins-0123456789ab",
        worker_id="",
    ),
    "heartbeat": Heartbeat(inflight=0, idle_seconds=0.0, capacity=PUBLIC_CAPACITY),
    "chunk": Chunk(corr_id=CORR_ID, content="Par"),
    "chunk_with_empty_delta": Chunk(corr_id=CORR_ID, content=""),
    "response": Response(corr_id=CORR_ID, request_id="req-5c0ffee0", commitment=COMMITMENT, output=answer("stop")),
    "response_with_error": Response(
        corr_id=CORR_ID, request_id="req-5c0ffee0", commitment=None, output=None, error="RuntimeError('serve 500')"
    ),
    "tee_response_with_error_object": Response(
        corr_id=CORR_ID,
        request_id="req-5c0ffee0",
        commitment=None,
        output=None,
        error="boom",
        error_type="RuntimeError",
    ),
    "admit": Admit(),
    "deny_without_reason": Deny(reason="denied"),
    "serve_without_stream": Serve(
        corr_id=CORR_ID,
        request=ServeRequest(
            messages=(Message(role="user", content="What is the capital of France?"),),
            max_tokens=64,
            engy_request_id="req-5c0ffee0",
        ),
        stream=False,
    ),
    "serve_with_openai_sampling_at_top_level": Serve(
        corr_id="0d9c8b7a6f5e4d3c2b1a098765432100",
        request=ServeRequest(
            messages=(
                Message(role="system", content="You are terse."),
                Message(role="user", content="Name three primes."),
            ),
            max_tokens=512,
            engy_request_id="0d9c8b7a6f5e4d3c2b1a098765432100",
            sampling=Sampling(temperature=0.7, top_p=0.9, seed=42, stop=("\n\n", "###")),
        ),
        stream=True,
    ),
    "ping": Ping(),
    "reconnect": Reconnect(),
    "cancel": Cancel(corr_id=CORR_ID),
}


def parse_public(name: str):
    direction, frame = golden(PUBLIC, name)
    return PARSERS[direction](text_of(frame))


def test_every_public_golden_frame_has_a_stated_reading():
    assert set(PUBLIC_READINGS) == {name for frames in PUBLIC.values() for name in frames}


@pytest.mark.parametrize("name", sorted(PUBLIC_READINGS))
def test_a_public_frame_reads_as_stated(name):
    assert parse_public(name) == PUBLIC_READINGS[name]


@pytest.mark.parametrize("name", sorted(PUBLIC_READINGS))
def test_what_a_public_frame_reads_as_is_what_we_would_send_for_it(name):
    """Reading normalises once: encoding the reading and reading it again changes nothing."""
    direction, _ = golden(PUBLIC, name)
    reading = parse_public(name)
    assert PARSERS[direction](encode(reading)) == reading


def test_the_public_hello_float_max_request_s_reads_as_whole_seconds_and_goes_out_as_an_int():
    hello = parse_public("hello")
    assert hello.capacity.max_request_s == 1800
    assert type(hello.capacity.max_request_s) is int
    sent = encode(hello)
    assert type(orjson.loads(sent)["capacity"]["max_request_s"]) is int
    assert "1800.0" not in sent


def test_the_public_hello_keeps_its_hardware_strings_as_sent():
    hello = parse_public("hello")
    assert hello.hw["gpus"] == "4x NVIDIA GeForce RTX 4090"
    assert hello.hw["parallelism"] == "tp"
    assert hello.hw["ram_gb"] == 125.7
    assert hello.versions == {}
    assert hello.features == frozenset()
    assert hello.hotkey is None and hello.ts is None and hello.signature is None


def test_a_public_hello_without_worker_id_reads_as_the_empty_id():
    assert parse_public("hello_without_worker_id").worker_id == ""


def test_the_public_heartbeat_reports_nothing_in_flight_and_repeats_capacity():
    heartbeat = parse_public("heartbeat")
    assert heartbeat.inflight == 0
    assert heartbeat.capacity == PUBLIC_CAPACITY


def test_a_public_chunk_with_an_empty_delta_relays_no_text():
    assert parse_public("chunk_with_empty_delta").content == ""


def test_the_public_finish_reason_stop_at_the_token_limit_is_kept_for_the_gateway_to_correct():
    response = parse_public("response")
    assert response.output["choices"][0]["finish_reason"] == "stop"
    assert response.output["usage"]["completion_tokens"] == len(response.commitment["output_token_ids"])
    assert response.commitment["toploc"]["skip_prefill"] is True
    assert response.error is None


def test_error_responses_read_as_no_commitment_no_output_and_the_error_as_text():
    public = parse_public("response_with_error")
    assert (public.commitment, public.output, public.error) == (None, None, "RuntimeError('serve 500')")
    tee = parse_public("tee_response_with_error_object")
    assert (tee.commitment, tee.output, tee.error_text) == (None, None, "RuntimeError: boom")


def test_a_serve_request_without_a_sampling_object_reads_the_openai_fields_at_its_top():
    serve = parse_public("serve_with_openai_sampling_at_top_level")
    assert serve.request.sampling == Sampling(temperature=0.7, top_p=0.9, seed=42, stop=("\n\n", "###"))
    assert not serve.request.sampling.greedy
    assert serve.request.max_tokens == 512 and type(serve.request.max_tokens) is int
    assert serve.request.engy_request_id == serve.corr_id
    assert serve.request.tools is None
    assert serve.stream is True


def test_a_serve_without_stream_does_not_stream_and_samples_greedily():
    serve = parse_public("serve_without_stream")
    assert serve.stream is False
    assert serve.request.sampling == Sampling()
    assert serve.request.sampling.greedy


def test_a_deny_without_reason_reads_as_denied():
    assert parse_public("deny_without_reason") == Deny(reason="denied")


# ---- other liberal readings ----------------------------------------------------------------


def hello_with(**changes: Any) -> dict:
    frame = copy.deepcopy(PUBLIC["miner_to_gateway"]["hello"]["frame"])
    frame.update(changes)
    return frame


def test_hardware_sent_as_one_string_is_kept_as_its_summary():
    assert parse_miner_frame(text_of(hello_with(hw="4x RTX 4090"))).hw == {"summary": "4x RTX 4090"}


def test_a_hello_without_worker_name_is_known_by_its_instance_id():
    frame = hello_with(instance_id="ins-fallback")
    del frame["worker_name"]
    assert parse_miner_frame(text_of(frame)).worker_name == "ins-fallback"


def test_capacity_with_only_max_inflight_defaults_the_total_to_it_and_the_limits_to_unannounced():
    hello = parse_miner_frame(text_of(hello_with(capacity={"max_inflight": 4})))
    assert hello.capacity == Capacity(
        max_inflight=4, max_inflight_total=4, max_input_tokens=0, max_output_tokens=0, max_request_s=0
    )


def test_a_fractional_max_request_s_rounds_up_because_it_is_a_deadline():
    hello = parse_miner_frame(text_of(hello_with(capacity={"max_inflight": 1, "max_request_s": 1799.2})))
    assert hello.capacity.max_request_s == 1800


def test_a_features_list_keeps_only_its_strings():
    hello = parse_miner_frame(text_of(hello_with(features=["sampling", 7, None, "tools"])))
    assert hello.features == frozenset({"sampling", "tools"})


def test_a_heartbeat_with_an_empty_capacity_announces_none():
    assert parse_miner_frame('{"type":"heartbeat","inflight":2,"idle_seconds":1,"capacity":{}}') == Heartbeat(
        inflight=2, idle_seconds=1.0
    )


def test_a_chunk_whose_delta_is_a_bare_string_relays_that_string():
    assert parse_miner_frame('{"type":"chunk","corr_id":"c","delta":"Par"}') == Chunk(corr_id="c", content="Par")


def test_structured_deltas_of_the_newest_public_miners_are_read_apart_from_the_text():
    # engy_miner.py after 0.4.4 sends one kind per frame and whole tool calls; tee_miner.py
    # passes sglang's deltas through (several kinds at once, call fragments, chunk logprobs).
    reasoning = parse_miner_frame('{"type":"chunk","corr_id":"c","delta":{"reasoning_content":"Let me think."}}')
    assert reasoning == Chunk(corr_id="c", content="", reasoning="Let me think.") and not reasoning.plain
    call = {
        "index": 0,
        "id": "call_0123456789abcdef01234567",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    whole = parse_miner_frame(orjson.dumps({"type": "chunk", "corr_id": "c", "delta": {"tool_calls": [call]}}))
    assert whole == Chunk(corr_id="c", content="", tool_calls=(call,))
    mixed = parse_miner_frame(
        '{"type":"chunk","corr_id":"c","delta":{"content":"Hi","reasoning_content":null,'
        '"tool_calls":[{"index":0,"function":{"arguments":"{\\"ci"}}, 7]},"logprobs":{"content":[]}}'
    )
    assert mixed == Chunk(corr_id="c", content="Hi", tool_calls=({"index": 0, "function": {"arguments": '{"ci'}},))
    assert parse_miner_frame('{"type":"chunk","corr_id":"c","delta":{"content":null}}') == Chunk(
        corr_id="c", content=""
    )


def test_a_structured_chunk_goes_out_as_the_public_miners_send_it():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert Chunk(corr_id="c", content="", reasoning="hm").to_wire() == {
        "type": "chunk",
        "corr_id": "c",
        "delta": {"reasoning_content": "hm"},
    }
    assert Chunk(corr_id="c", content="", tool_calls=(call,)).to_wire()["delta"] == {"tool_calls": [call]}
    assert Chunk(corr_id="c", content="").to_wire()["delta"] == {"content": ""}
    for chunk in (Chunk(corr_id="c", content="a", reasoning="b", tool_calls=(call,)), Chunk(corr_id="c", content="x")):
        assert parse_miner_frame(orjson.dumps(chunk.to_wire())) == chunk


def test_an_error_object_without_a_message_is_kept_whole_as_json_text():
    response = parse_miner_frame('{"type":"response","corr_id":"c","error":{"type":"Timeout","code":504}}')
    assert response.error_text == 'Timeout: {"type":"Timeout","code":504}' and response.error_status is None


def test_an_error_objects_status_is_read_and_sent_as_the_newest_public_miners_send_it():
    response = parse_miner_frame(
        '{"type":"response","corr_id":"c","request_id":"r","commitment":{},"output":{},'
        '"error":{"message":"prompt too long","type":"ServeError","status":400}}'
    )
    assert (response.error, response.error_type, response.error_status) == ("prompt too long", "ServeError", 400)
    assert response.error_text == "ServeError: prompt too long"
    assert parse_miner_frame(orjson.dumps(response.to_wire())) == response
    for odd in ("400", 99, 600, True, 400.0):
        assert (
            parse_miner_frame(
                orjson.dumps({"type": "response", "corr_id": "c", "error": {"message": "x", "status": odd}})
            ).error_status
            is None
        )
    plain = Response(corr_id="c", request_id="r", commitment=None, output=None, error="boom")
    assert plain.to_wire()["error"] == "boom", "a failure without a status goes as text, as 0.4.4 sends it"


def test_a_message_with_null_content_reads_as_empty_text_and_keeps_its_other_fields():
    serve = parse_gateway_frame(
        '{"type":"serve","corr_id":"c","request":{"messages":[{"role":"assistant","content":null,"tool_calls":[]}]}}'
    )
    assert serve.request.messages == (Message(role="assistant", content="", extra={"tool_calls": []}),)
    assert serve.request.max_tokens is None


def test_a_sampling_object_wins_over_fields_at_the_top_of_the_request():
    serve = parse_gateway_frame(
        '{"type":"serve","corr_id":"c","request":{"messages":[{"role":"user","content":"x"}],'
        '"temperature":1.0,"sampling":{"seed":7,"stop":"END"}}}'
    )
    assert serve.request.sampling == Sampling(seed=7, stop=("END",))


@pytest.mark.parametrize(("stream", "expected"), [(True, True), (False, False), (1, True), (0, False), (None, False)])
def test_stream_reads_booleans_and_their_zero_one_spelling(stream, expected):
    frame = {
        "type": "serve",
        "corr_id": "c",
        "request": {"messages": [{"role": "user", "content": "x"}]},
        "stream": stream,
    }
    assert parse_gateway_frame(text_of(frame)).stream is expected


# ---- refusals ------------------------------------------------------------------------------

DELETE = object()


def altered(dialect: dict, name: str, path: str, value: Any) -> str:
    """The golden frame `name` with the value at dotted `path` replaced (or deleted), as text."""
    _, frame = golden(dialect, name)
    frame = copy.deepcopy(frame)
    *parents, last = path.split(".")
    target = frame
    for part in parents:
        target = target[int(part)] if isinstance(target, list) else target[part]
    key = int(last) if isinstance(target, list) else last
    if value is DELETE:
        del target[key]
    else:
        target[key] = value
    return text_of(frame)


MINER_REFUSALS = [
    ("hello", "capacity.max_inflight", 1.5, "hello.capacity.max_inflight"),
    ("hello", "capacity.max_inflight", True, "hello.capacity.max_inflight"),
    ("hello", "capacity.max_inflight", -1, "hello.capacity.max_inflight"),
    ("hello", "capacity.max_inflight", "16", "hello.capacity.max_inflight"),
    ("hello", "capacity.max_inflight", DELETE, "hello.capacity.max_inflight"),
    ("hello", "capacity.max_inflight_total", 64.5, "hello.capacity.max_inflight_total"),
    ("hello", "capacity.max_request_s", "1800", "hello.capacity.max_request_s"),
    ("hello", "capacity.max_request_s", -1.0, "hello.capacity.max_request_s"),
    ("hello", "capacity.max_request_s", False, "hello.capacity.max_request_s"),
    ("hello", "capacity", DELETE, "hello.capacity"),
    ("hello", "capacity", [16], "hello.capacity"),
    ("hello", "model", DELETE, "hello.model"),
    ("hello", "model", None, "hello.model"),
    ("hello", "model_root", 7, "hello.model_root"),
    ("hello", "worker_id", 123, "hello.worker_id"),
    ("hello", "ts", -5, "hello.ts"),
    ("hello", "hotkey", ["5Grw"], "hello.hotkey"),
    ("heartbeat", "inflight", 0.5, "heartbeat.inflight"),
    ("heartbeat", "idle_seconds", -0.5, "heartbeat.idle_seconds"),
    ("heartbeat", "idle_seconds", "0", "heartbeat.idle_seconds"),
    ("heartbeat", "capacity", "16", "heartbeat.capacity"),
    ("heartbeat", "capacity.max_inflight", 2.5, "heartbeat.capacity.max_inflight"),
    ("chunk", "corr_id", DELETE, "chunk.corr_id"),
    ("chunk", "delta", ["Par"], "chunk.delta"),
    ("chunk", "delta.content", 5, "chunk.delta.content"),
    ("response", "corr_id", 42, "response.corr_id"),
    ("response", "commitment", [], "response.commitment"),
    ("response", "output", "ok", "response.output"),
    ("response_with_error", "error", 500, "response.error"),
    ("response_with_error", "error", ["boom"], "response.error"),
]
GATEWAY_REFUSALS = [
    ("serve_without_stream", "request.messages", [], "serve.request.messages"),
    ("serve_without_stream", "request.messages", DELETE, "serve.request.messages"),
    ("serve_without_stream", "request.messages", "hi", "serve.request.messages"),
    ("serve_without_stream", "request.messages.0", "hi", "serve.request.messages[0]"),
    ("serve_without_stream", "request.messages.0.role", DELETE, "serve.request.messages[0].role"),
    ("serve_with_openai_sampling_at_top_level", "request.messages.1.content", 7, "serve.request.messages[1].content"),
    ("serve_without_stream", "request.max_tokens", 512.5, "serve.request.max_tokens"),
    ("serve_without_stream", "request.max_tokens", -1, "serve.request.max_tokens"),
    ("serve_without_stream", "request", DELETE, "serve.request"),
    ("serve_without_stream", "request", [], "serve.request"),
    ("serve_without_stream", "corr_id", DELETE, "serve.corr_id"),
    ("serve_without_stream", "request.engy_request_id", 9, "serve.request.engy_request_id"),
    ("serve_without_stream", "request.tools", {"type": "function"}, "serve.request.tools"),
    ("serve_without_stream", "request.tools", ["weather"], "serve.request.tools"),
    ("serve_with_openai_sampling_at_top_level", "request.temperature", "hot", "serve.request.temperature"),
    ("serve_with_openai_sampling_at_top_level", "request.top_p", True, "serve.request.top_p"),
    ("serve_with_openai_sampling_at_top_level", "request.seed", 4.2, "serve.request.seed"),
    ("serve_with_openai_sampling_at_top_level", "request.stop", [1], "serve.request.stop"),
    ("serve_with_openai_sampling_at_top_level", "request.sampling", "greedy", "serve.request.sampling"),
    ("serve_with_openai_sampling_at_top_level", "request.sampling", {"stop": 3}, "serve.request.sampling.stop"),
    ("serve_with_openai_sampling_at_top_level", "stream", "yes", "serve.stream"),
    ("serve_with_openai_sampling_at_top_level", "stream", 2, "serve.stream"),
    ("cancel", "corr_id", DELETE, "cancel.corr_id"),
]


def assert_refused(parse, text: str | bytes, field: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        parse(text)
    error = refused.value
    assert error.field == field, error
    assert error.reason and str(error) == f"{field}: {error.reason}"
    assert len(close_reason(str(error)).encode()) <= CLOSE_REASON_MAX_BYTES


@pytest.mark.parametrize(("name", "path", "value", "field"), MINER_REFUSALS)
def test_a_miner_frame_that_cannot_be_read_is_refused_naming_the_field(name, path, value, field):
    assert_refused(parse_miner_frame, altered(PUBLIC, name, path, value), field)


@pytest.mark.parametrize(("name", "path", "value", "field"), GATEWAY_REFUSALS)
def test_a_gateway_frame_that_cannot_be_read_is_refused_naming_the_field(name, path, value, field):
    assert_refused(parse_gateway_frame, altered(PUBLIC, name, path, value), field)


WHOLE_FRAME_REFUSALS = [
    ('{"type": "goodbye"}', "frame.type"),
    ('{"inflight": 0}', "frame.type"),
    ('{"type": null}', "frame.type"),
    ('{"type": 5}', "frame.type"),
    ('{"type": ["hello"]}', "frame.type"),
    ('{"type": "hello"', "frame"),
    ("", "frame"),
    ("hello", "frame"),
    ("[]", "frame"),
    ('"hello"', "frame"),
    ("null", "frame"),
    ('{"type": "heartbeat", "idle_seconds": NaN}', "frame"),
    ('{"type": "heartbeat", "idle_seconds": Infinity}', "frame"),
    ('{"type": "heartbeat", "idle_seconds": 1e400}', "frame"),
    ('{"type": "chunk", "corr_id": "\\ud800"}', "frame"),
    (b'{"type": "chunk", "corr_id": "\xff"}', "frame"),
    (b"\xef\xbb\xbf{}", "frame"),
]


@pytest.mark.parametrize("parse", [parse_miner_frame, parse_gateway_frame])
@pytest.mark.parametrize(("text", "field"), WHOLE_FRAME_REFUSALS)
def test_a_frame_that_is_no_json_object_with_a_known_type_is_refused(parse, text, field):
    assert_refused(parse, text, field)


def test_a_frame_of_the_other_direction_is_an_unknown_type():
    assert_refused(parse_gateway_frame, text_of(golden(PUBLIC, "hello")[1]), "frame.type")
    assert_refused(parse_miner_frame, text_of(golden(PUBLIC, "serve_without_stream")[1]), "frame.type")


def test_an_unknown_type_is_quoted_at_most_forty_characters_long():
    with pytest.raises(ProtocolError) as refused:
        parse_miner_frame(json.dumps({"type": "x" * 10_000}))
    assert "x" * 40 in refused.value.reason and "x" * 41 not in refused.value.reason


def test_the_largest_honest_answer_of_every_catalog_model_fits_a_frame():
    from engy_node.models import CATALOG
    from engy_node.protocol.miner import MAX_FRAME_BYTES, largest_response_bytes

    assert all(largest_response_bytes(spec) < MAX_FRAME_BYTES / 8 for spec in CATALOG.values())
