"""Fuzzing the parsers: a frame from the network raises `ProtocolError` or reads as a well-typed frame.

Every frame is attacker-controlled (the gateway is public; a miner dials whatever gateway it is
told to). The callers catch `ProtocolError` alone, log its field and close the leg with it as the
reason; any other exception escaping the parser would take down the connection handler or worse.
So these properties feed the parsers arbitrary bytes and text, arbitrary JSON values, and objects
with a known `type` whose every known key (nested ones too) holds any JSON value, and check that
nothing but `ProtocolError` comes out and that what does come out is a frame whose fields have
the types the dataclasses declare, which is what the rest of the node relies on without checking.

`close_reason` is what the caller sends in the close frame, so it must fit RFC 6455's 123 bytes
for any text at all, without cutting more than it has to.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engy_node.protocol.miner import (
    CLOSE_REASON_MAX_BYTES,
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

from .strategies import GATEWAY_TYPES, MINER_TYPES, SHAPED_FRAMES, any_texts, json_text_of, wild_json

PARSERS = [parse_miner_frame, parse_gateway_frame]
fuzzing = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def is_text(value: Any) -> bool:
    return type(value) is str


def is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def is_json_object(value: Any) -> bool:
    return type(value) is dict and all(type(key) is str for key in value)


def assert_capacity(capacity: Any) -> None:
    assert type(capacity) is Capacity
    counts = ("max_inflight", "max_inflight_total", "max_input_tokens", "max_output_tokens", "max_request_s")
    assert all(is_count(getattr(capacity, field)) for field in counts), capacity
    assert capacity.context_length is None or (is_count(capacity.context_length) and capacity.context_length > 0)
    assert type(capacity.input_modalities) is tuple and all(is_text(m) for m in capacity.input_modalities)


def assert_well_typed(frame: Any) -> None:
    """The frame's fields hold what its dataclass declares (the parsers' promise to the node)."""
    match frame:
        case Hello():
            assert all(
                is_text(getattr(frame, f)) for f in ("miner_key", "model", "model_root", "worker_name", "worker_id")
            )
            assert is_json_object(frame.hw) and is_json_object(frame.versions)
            assert_capacity(frame.capacity)
            assert frame.hotkey is None or is_text(frame.hotkey)
            assert frame.signature is None or is_text(frame.signature)
            assert frame.ts is None or is_count(frame.ts)
            assert type(frame.features) is frozenset and all(is_text(f) for f in frame.features)
        case Heartbeat():
            assert is_count(frame.inflight)
            assert type(frame.idle_seconds) is float and math.isfinite(frame.idle_seconds) and frame.idle_seconds >= 0
            if frame.capacity is not None:
                assert_capacity(frame.capacity)
            if frame.kv is not None:
                assert all(is_count(v) for v in (frame.kv.used, frame.kv.running, frame.kv.waiting))
                assert frame.kv.limit is None or is_count(frame.kv.limit)
        case Chunk():
            assert is_text(frame.corr_id) and is_text(frame.content) and is_text(frame.reasoning)
            assert type(frame.tool_calls) is tuple and all(is_json_object(call) for call in frame.tool_calls)
        case Response():
            assert is_text(frame.corr_id) and is_text(frame.request_id)
            for part in (frame.commitment, frame.output):
                assert part is None or (is_json_object(part) and part)
            assert frame.error is None or (is_text(frame.error) and frame.error)
            assert frame.error_type is None or (is_text(frame.error_type) and frame.error_type)
            assert frame.error_status is None or (type(frame.error_status) is int and 100 <= frame.error_status <= 599)
        case Serve():
            assert is_text(frame.corr_id) and type(frame.stream) is bool
            request = frame.request
            assert type(request) is ServeRequest
            assert type(request.messages) is tuple and request.messages
            for message in request.messages:
                assert type(message) is Message and is_text(message.role)
                assert is_text(message.content) or type(message.content) is list
                assert is_json_object(message.extra) and not {"role", "content"} & set(message.extra)
            assert request.max_tokens is None or is_count(request.max_tokens)
            assert is_text(request.engy_request_id)
            assert request.tools is None or (
                type(request.tools) is tuple and all(is_json_object(t) for t in request.tools)
            )
            assert request.tool_choice is None or is_text(request.tool_choice) or is_json_object(request.tool_choice)
            assert request.chat_template_kwargs is None or (
                is_json_object(request.chat_template_kwargs) and request.chat_template_kwargs
            )
            sampling = request.sampling
            assert type(sampling) is Sampling
            for number in (sampling.temperature, sampling.top_p):
                assert number is None or (type(number) is float and math.isfinite(number))
            assert sampling.seed is None or type(sampling.seed) is int
            assert type(sampling.stop) is tuple and all(is_text(s) for s in sampling.stop)
        case Deny():
            assert is_text(frame.reason)
        case Cancel():
            assert is_text(frame.corr_id)
        case Admit() | Ping() | Reconnect():
            pass
        case _:
            raise AssertionError(f"not a frame: {frame!r}")


def read_or_refuse(parse, text: str | bytes) -> Any:
    """The frame `parse` reads from `text`, or None when it refuses it with a `ProtocolError`."""
    try:
        frame = parse(text)
    except ProtocolError as error:
        assert isinstance(error.field, str) and error.field
        assert isinstance(error.reason, str) and error.reason
        return None
    expected = (
        (Hello, Heartbeat, Chunk, Response)
        if parse is parse_miner_frame
        else (Admit, Deny, Serve, Cancel, Ping, Reconnect)
    )
    assert isinstance(frame, expected), frame
    assert_well_typed(frame)
    return frame


# ---- (a) arbitrary bytes and text ----------------------------------------------------------


@pytest.mark.parametrize("parse", PARSERS)
@given(data=st.binary())
def test_arbitrary_bytes_raise_nothing_but_protocol_error(parse, data):
    read_or_refuse(parse, data)


@pytest.mark.parametrize("parse", PARSERS)
@given(text=any_texts)
def test_arbitrary_text_raises_nothing_but_protocol_error(parse, text):
    read_or_refuse(parse, text)


# ---- (b) arbitrary JSON values -------------------------------------------------------------


@pytest.mark.parametrize("parse", PARSERS)
@fuzzing
@given(text=json_text_of(wild_json))
def test_arbitrary_json_raises_nothing_but_protocol_error(parse, text):
    read_or_refuse(parse, text)


@pytest.mark.parametrize("parse", PARSERS)
@fuzzing
@given(text=json_text_of(st.dictionaries(st.sampled_from(["type", "corr_id", "capacity", "request", "x"]), wild_json)))
def test_arbitrary_json_objects_with_frame_like_keys_raise_nothing_but_protocol_error(parse, text):
    read_or_refuse(parse, text)


# ---- (c) a known type, any value for every known key ---------------------------------------


@pytest.mark.parametrize("kind", MINER_TYPES)
@fuzzing
@given(data=st.data())
def test_a_miner_frame_with_any_values_in_its_fields_reads_well_typed_or_is_refused(kind, data):
    text = data.draw(json_text_of(SHAPED_FRAMES[kind]))
    frame = read_or_refuse(parse_miner_frame, text)
    assert frame is None or frame.to_wire()["type"] == kind
    assert read_or_refuse(parse_gateway_frame, text) is None


@pytest.mark.parametrize("kind", GATEWAY_TYPES)
@fuzzing
@given(data=st.data())
def test_a_gateway_frame_with_any_values_in_its_fields_reads_well_typed_or_is_refused(kind, data):
    text = data.draw(json_text_of(SHAPED_FRAMES[kind]))
    frame = read_or_refuse(parse_gateway_frame, text)
    assert frame is None or frame.to_wire()["type"] == kind
    assert read_or_refuse(parse_miner_frame, text) is None


# ---- inputs found by fuzzing that once broke the parser's promise ----------------------------


def test_an_error_object_nested_past_orjsons_write_depth_raises_nothing_but_protocol_error():
    depth = 254
    read_or_refuse(
        parse_miner_frame, '{"type":"response","corr_id":"c","error":{"detail":' + "[" * depth + "]" * depth + "}}"
    )


@pytest.mark.parametrize(
    "text",
    [
        '{"type":"heartbeat","inflight":1e300}',
        '{"type":"heartbeat","capacity":{"max_inflight":18446744073709551616}}',
        '{"type":"serve","corr_id":"c","request":{"messages":[{"role":"user","content":"x"}],"max_tokens":1e20}}',
    ],
)
def test_a_frame_read_from_the_wire_can_be_encoded_again(text):
    parse = parse_gateway_frame if '"serve"' in text else parse_miner_frame
    frame = read_or_refuse(parse, text)  # refusing such a count would keep the promise too
    if frame is not None:
        encode(frame)


# ---- close_reason --------------------------------------------------------------------------


@given(any_texts | st.text(min_size=100, max_size=300))
def test_close_reason_fits_a_close_frame_and_cuts_no_more_than_it_must(text):
    reason = close_reason(text)
    assert len(reason.encode("utf-8")) <= CLOSE_REASON_MAX_BYTES  # strict UTF-8: no surrogate survives
    # A lone surrogate (which no frame the parsers accept can hold) goes out as "?".
    sendable = text.encode("utf-8", errors="replace").decode("utf-8")
    assert sendable.startswith(reason)
    if reason != sendable:
        assert len(sendable[: len(reason) + 1].encode("utf-8")) > CLOSE_REASON_MAX_BYTES


@given(st.text())
def test_close_reason_is_a_prefix_of_any_text_a_frame_can_carry(text):
    assert text.startswith(close_reason(text))
    if len(text.encode()) <= CLOSE_REASON_MAX_BYTES:
        assert close_reason(text) == text


@given(st.text(alphabet="é🗼x", min_size=120, max_size=200))
def test_close_reason_never_cuts_a_character_in_half(text):
    reason = close_reason(text)
    assert text.startswith(reason)
    assert CLOSE_REASON_MAX_BYTES - 3 <= len(reason.encode()) <= CLOSE_REASON_MAX_BYTES


def test_a_refusal_of_any_length_fits_a_close_frame():
    error = ProtocolError("serve.request.messages[12345].content", "must be a string or a list of parts " + "é" * 200)
    assert len(close_reason(str(error)).encode()) <= CLOSE_REASON_MAX_BYTES
    assert close_reason(str(error)).startswith("serve.request.messages[12345].content: must be")


def test_json_text_of_writes_what_the_fuzzers_mean():
    """The fuzzers rely on Python's encoder writing any int and refusing NaN (which orjson would refuse anyway)."""
    assert json.dumps(2**200) == str(2**200)
    with pytest.raises(ValueError):
        json.dumps(float("nan"), allow_nan=False)
