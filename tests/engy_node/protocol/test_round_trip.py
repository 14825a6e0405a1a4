"""Round trips: whatever frame this project builds, the peer's parser reads back unchanged.

The golden frames pin a handful of shapes; these properties cover the rest of the space
(unicode everywhere, counts up to the 64-bit edge, feature sets, every optional field present
and absent), so a field added to a dataclass but forgotten in `to_wire` or in `parse`, or a type
that `encode` writes loosely, fails here. Where the wire normalises a value instead of carrying
it (idle seconds rounded to milliseconds, an empty commitment read as none), the strategies in
`strategies.py` stay inside what is carried and the normalisation gets its own test below.

What we send must also be standard JSON, readable by any peer's parser, with every count a JSON
integer: the public gateway's validation of `1800.0` is its business, ours is never to send it.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from engy_node.protocol.miner import (
    Capacity,
    Heartbeat,
    Hello,
    KvLoad,
    Message,
    Response,
    Serve,
    encode,
    parse_gateway_frame,
    parse_miner_frame,
)

from .strategies import capacities, gateway_frames, miner_frames, texts


@given(miner_frames)
def test_a_miner_frame_survives_encode_then_parse(frame):
    assert parse_miner_frame(encode(frame)) == frame


@given(gateway_frames)
def test_a_gateway_frame_survives_encode_then_parse(frame):
    assert parse_gateway_frame(encode(frame)) == frame


@given(miner_frames)
def test_a_miner_frame_read_from_bytes_reads_the_same(frame):
    assert parse_miner_frame(encode(frame).encode()) == frame


CAPACITY_FIELDS = ("max_inflight", "max_inflight_total", "max_input_tokens", "max_output_tokens", "max_request_s")
INTEGER_PATHS = {
    "hello": [("ts",), *(("capacity", key) for key in CAPACITY_FIELDS)],
    "heartbeat": [("inflight",), *(("capacity", key) for key in CAPACITY_FIELDS)],
    "serve": [("request", "max_tokens"), ("request", "sampling", "seed")],
}


def at(wire: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(wire, dict) or key not in wire:
            return None
        wire = wire[key]
    return wire


@given(st.one_of(miner_frames, gateway_frames))
def test_encode_writes_standard_json_with_every_count_a_json_integer(frame):
    text = encode(frame)
    wire = json.loads(text)  # the standard library's reader: no NaN, no lone surrogates
    assert wire == frame.to_wire()
    assert isinstance(wire["type"], str)
    for path in INTEGER_PATHS.get(wire["type"], []):
        value = at(wire, path)
        assert value is None or type(value) is int, (path, value)


@given(capacities)
def test_capacity_goes_out_as_five_json_integers(capacity):
    wire = orjson.loads(encode(Heartbeat(inflight=0, idle_seconds=0.0, capacity=capacity)))["capacity"]
    assert set(wire) == set(CAPACITY_FIELDS)
    assert all(type(value) is int for value in wire.values())


# ---- normalisations the wire applies -------------------------------------------------------


@given(st.floats(min_value=0, allow_nan=False, allow_infinity=False))
def test_idle_seconds_come_back_rounded_to_milliseconds(idle):
    assert parse_miner_frame(encode(Heartbeat(inflight=0, idle_seconds=idle))).idle_seconds == round(idle, 3)


@given(texts, texts)
def test_an_empty_commitment_output_or_error_comes_back_as_none(corr_id, request_id):
    sent = Response(corr_id=corr_id, request_id=request_id, commitment={}, output={}, error="")
    assert parse_miner_frame(encode(sent)) == Response(
        corr_id=corr_id, request_id=request_id, commitment=None, output=None
    )


@given(texts, texts)
def test_a_message_keeps_its_own_role_and_content_over_same_named_extra_fields(role, content):
    message = Message(role=role, content=content, extra={"role": "system", "content": "injected", "name": "n"})
    assert message.for_template() == {"name": "n", "role": role, "content": content}


@given(st.integers(min_value=0, max_value=2**53))
def test_a_whole_max_request_s_comes_back_exactly(seconds):
    capacity = Capacity(
        max_inflight=1, max_inflight_total=1, max_input_tokens=0, max_output_tokens=0, max_request_s=seconds
    )
    assert parse_miner_frame(encode(Heartbeat(inflight=0, idle_seconds=0.0, capacity=capacity))).capacity == capacity


def test_a_hello_ts_and_signature_without_a_hotkey_are_not_sent():
    hello = Hello(
        miner_key="k",
        model="m",
        model_root="r",
        hw={},
        versions={},
        capacity=Capacity(1, 1, 0, 0, 0),
        worker_name="w",
        worker_id="",
        ts=5,
        signature="s",
    )
    assert not {"hotkey", "ts", "signature"} & set(hello.to_wire())


def test_a_serve_without_sampling_sends_no_sampling_object_and_reads_back_greedy():
    serve = Serve(
        corr_id="c",
        request=parse_gateway_frame(
            '{"type":"serve","corr_id":"c","request":{"messages":[{"role":"user","content":"x"}]}}'
        ).request,
        stream=False,
    )
    assert "sampling" not in serve.to_wire()["request"]
    assert parse_gateway_frame(encode(serve)).request.sampling.greedy


_ranks = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "num_tokens": st.integers(0, 10**7),
                "num_reqs": st.integers(0, 512),
                "num_waiting_reqs": st.integers(0, 512),
                "num_pending_tokens": st.integers(0, 10**6),
            }
        ),
        st.dictionaries(
            st.sampled_from(["num_tokens", "num_reqs", "dp_rank"]),
            st.one_of(st.none(), st.booleans(), st.text(max_size=3), st.integers(-5, 5), st.floats(allow_nan=False)),
        ),
        st.integers(),
        st.text(max_size=3),
    ),
    max_size=6,
)


@given(_ranks, st.one_of(st.none(), st.integers(1, 10**8)))
def test_sglangs_load_list_sums_into_a_kv_block_that_reads_back(ranks, limit):
    load = KvLoad.of_ranks(ranks, limit)
    read = [rank for rank in ranks if isinstance(rank, dict)]
    if not read:
        assert load is None
        return

    def total(key: str) -> int:
        return sum(v for rank in read if type(v := rank.get(key)) is int and v >= 0)

    assert load == KvLoad(
        used=total("num_tokens"), limit=limit, running=total("num_reqs"), waiting=total("num_waiting_reqs")
    )
    assert parse_miner_frame(encode(Heartbeat(inflight=0, idle_seconds=0.0, kv=load))).kv == load


def test_a_load_that_is_not_sglangs_list_is_no_kv_block():
    assert KvLoad.of_ranks({"num_tokens": 5}, 10) is None
    assert KvLoad.of_ranks([], 10) is None
