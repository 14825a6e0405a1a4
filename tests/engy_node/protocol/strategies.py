"""Hypothesis strategies for the miner ↔ gateway wire (`engy_node.protocol.miner`).

Two families. `miner_frames` / `gateway_frames` build frame dataclasses holding only values the
wire carries unchanged, so a round trip must give back an equal frame; every place where the
protocol normalises instead (and the generator therefore stays inside what it preserves) says so
in a comment. `json_text_of` / `shaped_frames` build hostile input for the parsers: any JSON a
peer can send, including shapes that look almost right, so parsing reaches the nested fields.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

from engy_node.protocol.miner import (
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
    Reconnect,
    Response,
    Sampling,
    Serve,
    ServeRequest,
)

# orjson reads and writes integers within 64 bits: it refuses to write a bigger one and reads
# one back as a float. So "big" here means up to the 64-bit edges, which hypothesis favours.
INT64_MIN = -(2**63)
UINT64_MAX = 2**64 - 1

# ---- values the wire preserves -------------------------------------------------------------

texts = st.text()
"""Any unicode except lone surrogates, which UTF-8 (and so a JSON text frame) cannot carry."""
counts = st.integers(min_value=0, max_value=UINT64_MAX)
finite_floats = st.floats(allow_nan=False, allow_infinity=False)
"""orjson writes NaN and infinities as `null`; a finite float round-trips bit for bit."""

json_scalars = (
    st.none() | st.booleans() | st.integers(min_value=INT64_MIN, max_value=UINT64_MAX) | finite_floats | texts
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(texts, children, max_size=4),
    max_leaves=12,
)
json_objects = st.dictionaries(texts, json_values, max_size=5)

capacities = st.builds(
    Capacity,
    max_inflight=counts,
    max_inflight_total=counts,
    max_input_tokens=counts,
    max_output_tokens=counts,
    # Parsing reads max_request_s as seconds (a float) and rounds up, so only whole numbers
    # a double holds exactly (up to 2**53, some 285 million years) come back unchanged.
    max_request_s=st.integers(min_value=0, max_value=2**53),
)
feature_sets = st.frozensets(st.sampled_from(sorted(OUR_FEATURES)) | texts, max_size=5)


@st.composite
def hellos(draw: st.DrawFn) -> Hello:
    # `to_wire` writes ts and signature only alongside a hotkey, so without one they are None.
    signed = draw(st.booleans())
    return Hello(
        miner_key=draw(texts),
        model=draw(texts),
        model_root=draw(texts),
        hw=draw(json_objects),
        versions=draw(json_objects),
        capacity=draw(capacities),
        worker_name=draw(texts),
        worker_id=draw(texts),
        hotkey=draw(texts) if signed else None,
        ts=draw(st.none() | counts) if signed else None,
        signature=draw(st.none() | texts) if signed else None,
        features=draw(feature_sets),
    )


heartbeats = st.builds(
    Heartbeat,
    inflight=counts,
    # `to_wire` rounds idle_seconds to milliseconds; generate values already rounded.
    idle_seconds=st.floats(min_value=0, allow_nan=False, allow_infinity=False).map(lambda s: round(s, 3)),
    capacity=st.none() | capacities,
)
chunks = st.builds(Chunk, corr_id=texts, content=texts)
responses = st.builds(
    Response,
    corr_id=texts,
    request_id=texts,
    # An empty commitment or output object, and an empty error, read as "none".
    commitment=st.none() | st.dictionaries(texts, json_values, min_size=1, max_size=5),
    output=st.none() | st.dictionaries(texts, json_values, min_size=1, max_size=5),
    error=st.none() | st.text(min_size=1),
)
miner_frames = st.one_of(hellos(), heartbeats, chunks, responses)

messages = st.builds(
    Message,
    role=texts,
    # A missing or null content reads as "", so content is always a string or a list of parts.
    content=texts | st.lists(json_values, max_size=3),
    # `role` and `content` are the message's own fields: on the wire they would overwrite these.
    extra=st.dictionaries(texts.filter(lambda key: key not in ("role", "content")), json_values, max_size=3),
)
samplings = st.builds(
    Sampling,
    temperature=st.none() | finite_floats,
    top_p=st.none() | finite_floats,
    # A seed is sglang's sampling_seed: a signed 64-bit integer.
    seed=st.none() | st.integers(min_value=INT64_MIN, max_value=2**63 - 1),
    stop=st.lists(texts, max_size=3).map(tuple),
)
serve_requests = st.builds(
    ServeRequest,
    messages=st.lists(messages, min_size=1, max_size=4).map(tuple),
    max_tokens=st.none() | counts,
    engy_request_id=texts,
    tools=st.none() | st.lists(json_objects, max_size=3).map(tuple),
    sampling=samplings,
)
gateway_frames = st.one_of(
    st.just(Admit()),
    st.builds(Deny, reason=texts),
    st.builds(Serve, corr_id=texts, request=serve_requests, stream=st.booleans()),
    st.builds(Cancel, corr_id=texts),
    st.just(Ping()),
    st.just(Reconnect()),
)

# ---- hostile input -------------------------------------------------------------------------

any_texts = st.text(
    st.characters(codec=None, exclude_categories=())
    | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())
)
"""Any str, lone surrogates included (a Python str can hold them even if no frame can)."""

wild_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**200), max_value=2**200),  # past 64 bits: orjson reads these as floats
    st.integers(min_value=-(10**6), max_value=10**6).map(float),  # integral floats, as in `1800.0`
    st.floats(allow_nan=False, allow_infinity=False),  # JSON has no NaN or infinity
    any_texts,
)
wild_json = st.recursive(
    wild_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(any_texts, children, max_size=5),
    max_leaves=20,
)


def anything(*plausible: st.SearchStrategy) -> st.SearchStrategy:
    """Any JSON value one time in five, else one of the `plausible` ones, which let parsing get
    further in (a frame reaches its nested fields only when the ones read before them pass)."""
    if not plausible:
        return wild_json
    likely = st.one_of(*plausible)
    # st.one_of would treat repeated branches as one, so the odds are drawn explicitly.
    return st.sampled_from((likely, likely, likely, likely, wild_json)).flatmap(lambda chosen: chosen)


wild_counts = anything(
    st.integers(min_value=-2, max_value=2**70),
    st.floats(min_value=-1, max_value=1e300, allow_nan=False),
    st.sampled_from([0.5, 1800.0, 2.0**63, 2.0**64, 1e20]),
)
wild_numbers = anything(st.floats(allow_nan=False, allow_infinity=False), st.integers(min_value=-5, max_value=5))
wild_texts = anything(texts)

_CAPACITY = st.fixed_dictionaries(
    {"max_inflight": wild_counts},
    optional={
        key: wild_counts for key in ("max_inflight_total", "max_input_tokens", "max_output_tokens", "max_request_s")
    },
)
_MESSAGE = st.fixed_dictionaries(
    {"role": wild_texts},
    optional={
        "content": anything(texts, st.lists(wild_json, max_size=3)),
        "tool_calls": wild_json,
        "tool_call_id": wild_texts,
        "name": wild_texts,
    },
)
_SAMPLING_FIELDS = {
    "temperature": wild_numbers,
    "top_p": wild_numbers,
    "seed": wild_counts,
    "stop": anything(texts, st.lists(wild_texts, max_size=3)),
}
_REQUEST = st.fixed_dictionaries(
    {"messages": anything(st.lists(anything(_MESSAGE), min_size=1, max_size=3))},
    optional={
        "max_tokens": wild_counts,
        "engy_request_id": wild_texts,
        "tools": anything(st.lists(anything(st.dictionaries(texts, wild_json, max_size=3)), max_size=3)),
        "sampling": anything(st.fixed_dictionaries({}, optional=_SAMPLING_FIELDS)),
        **_SAMPLING_FIELDS,
    },
)

SHAPED_FRAMES: dict[str, st.SearchStrategy] = {
    # Keys a parser requires are always present (with any value); the rest come and go.
    "hello": st.fixed_dictionaries(
        {"type": st.just("hello"), "model": wild_texts, "model_root": wild_texts, "capacity": anything(_CAPACITY)},
        optional={
            "miner_key": wild_texts,
            "hw": anything(st.dictionaries(texts, wild_json, max_size=3)),
            "versions": wild_json,
            "worker_name": wild_texts,
            "instance_id": wild_texts,
            "worker_id": wild_texts,
            "hotkey": wild_texts,
            "ts": wild_counts,
            "signature": wild_texts,
            "features": anything(st.lists(anything(st.sampled_from(sorted(OUR_FEATURES))), max_size=4)),
        },
    ),
    "heartbeat": st.fixed_dictionaries(
        {"type": st.just("heartbeat")},
        optional={"inflight": wild_counts, "idle_seconds": wild_numbers, "capacity": anything(_CAPACITY)},
    ),
    "chunk": st.fixed_dictionaries(
        {"type": st.just("chunk"), "corr_id": wild_texts},
        optional={
            "delta": anything(texts, st.fixed_dictionaries({}, optional={"content": wild_texts, "role": wild_texts}))
        },
    ),
    "response": st.fixed_dictionaries(
        {"type": st.just("response"), "corr_id": wild_texts},
        optional={
            "request_id": wild_texts,
            "commitment": anything(st.dictionaries(texts, wild_json, max_size=3)),
            "output": anything(st.dictionaries(texts, wild_json, max_size=3)),
            "error": anything(texts, st.fixed_dictionaries({}, optional={"message": wild_json, "type": wild_json})),
        },
    ),
    "admit": st.fixed_dictionaries({"type": st.just("admit")}, optional={"reason": wild_json}),
    "deny": st.fixed_dictionaries({"type": st.just("deny")}, optional={"reason": wild_texts}),
    "serve": st.fixed_dictionaries(
        {"type": st.just("serve"), "corr_id": wild_texts, "request": anything(_REQUEST)},
        optional={"stream": anything(st.booleans(), st.sampled_from([0, 1, 2, 1.0]))},
    ),
    "cancel": st.fixed_dictionaries({"type": st.just("cancel")}, optional={"corr_id": wild_texts}),
    "ping": st.fixed_dictionaries({"type": st.just("ping")}, optional={"nonce": wild_json}),
    "reconnect": st.fixed_dictionaries({"type": st.just("reconnect")}, optional={"after_s": wild_json}),
}
MINER_TYPES = ("hello", "heartbeat", "chunk", "response")
GATEWAY_TYPES = ("admit", "deny", "serve", "cancel", "ping", "reconnect")


@st.composite
def json_text_of(draw: st.DrawFn, values: st.SearchStrategy) -> str:
    """A JSON text of a drawn value, escaped to ASCII or not. Python's encoder writes any int
    (past 64 bits too) and, with `allow_nan=False`, only what JSON allows."""
    return json.dumps(draw(values), ensure_ascii=draw(st.booleans()), allow_nan=False)
