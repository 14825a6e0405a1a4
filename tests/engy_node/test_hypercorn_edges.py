"""hypercorn_edges: the upstream code it replaces is the code it was written against, a server
with an `EdgeConfig` answers what h11 refuses with the body it is given, and a server without one
still answers as hypercorn does (the classes are installed process-wide); an edge connection
frames every response exactly as h11 does.

The gateway's own answers (JSON in each API's dialect, the miner endpoint's frame limit) are
tested end to end in tests/engy_node/gateway/test_edges.py and test_pool.py.
"""

from __future__ import annotations

import hashlib
import inspect

import h11
import hypercorn.config
import hypercorn.protocol
import hypercorn.protocol.h2
import hypercorn.protocol.h11
import hypercorn.protocol.ws_stream
import hypercorn.trio.run
import hypercorn.trio.tcp_server
import pytest
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette

from engy_node.hypercorn_edges import (
    EdgeConfig,
    EdgeConnection,
    EdgeH11Protocol,
    EdgeTCPServer,
    EdgeWSStream,
    frame_refusal,
    request_path,
)

UPSTREAM = {
    # The loop EdgeWSStream._handle_events copies, and the constructor that sets what it uses.
    "ws_stream.WSStream._handle_events": (hypercorn.protocol.ws_stream.WSStream._handle_events, "b90f3f595ff9fd47"),
    "ws_stream.WSStream.__init__": (hypercorn.protocol.ws_stream.WSStream.__init__, "3534d3ebe8f7a1a4"),
    # The method EdgeH11Protocol replaces, and its one caller (which passes h11's status hint).
    "h11.H11Protocol._send_error_response": (
        hypercorn.protocol.h11.H11Protocol._send_error_response,
        "58c2b47ae295d000",
    ),
    "h11.H11Protocol._handle_events": (hypercorn.protocol.h11.H11Protocol._handle_events, "bd4a76b2837e8722"),
    # Where the module globals `install` sets are looked up.
    "ProtocolWrapper.__init__": (hypercorn.protocol.ProtocolWrapper.__init__, "df25e181b9e2e64d"),
    "h11.H11Protocol._create_stream": (hypercorn.protocol.h11.H11Protocol._create_stream, "a2338a57ab343908"),
    "h2.H2Protocol._create_stream": (hypercorn.protocol.h2.H2Protocol._create_stream, "91eb123ddf247ede"),
    # The read loop EdgeTCPServer replaces, and where hypercorn's trio server looks its
    # connection handler up (`serve_listener` looks it up there too).
    "trio.TCPServer._read_data": (hypercorn.trio.tcp_server.TCPServer._read_data, "7ca747d922c65cf1"),
    "trio.run.worker_serve": (hypercorn.trio.run.worker_serve, "8dc8347a9fc357ca"),
    # What EdgeConnection settles in one pass where the answer is plain, and the framing rule
    # that pass follows.
    "h11.Connection._clean_up_response_headers_for_sending": (
        h11.Connection._clean_up_response_headers_for_sending,
        "a190401e4767c641",
    ),
    "h11._connection._body_framing": (h11._connection._body_framing, "bbbb12006a0c9b1d"),
    # What EdgeConnection.send frames itself: a chunk of a chunked body, and how h11 sends one.
    "h11._writers.ChunkedWriter.send_data": (h11._writers.ChunkedWriter.send_data, "0fbc8fb565f7029f"),
    "h11.Connection.send": (h11.Connection.send, "cd6b139277cf57fa"),
    "h11.Connection.send_with_data_passthrough": (h11.Connection.send_with_data_passthrough, "e8332d21fb1a2963"),
    "h11.Connection._process_event": (h11.Connection._process_event, "34a61e13cd672ae1"),
    # What EdgeConfig.response_headers builds once a second: only the date in it changes.
    "Config.response_headers": (hypercorn.config.Config.response_headers, "5a637c3d48180e55"),
}


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_the_upstream_code_is_the_code_these_classes_were_written_against(name):
    """If this fails, hypercorn changed: re-read the method, update hypercorn_edges to match, then
    the digest."""
    method, digest = UPSTREAM[name]
    assert hashlib.sha256(inspect.getsource(method).encode()).hexdigest()[:16] == digest


def test_creating_an_edge_config_installs_the_classes_where_hypercorn_looks_them_up():
    EdgeConfig(protocol_error_body=lambda status, path: ([], b""))
    assert hypercorn.protocol.H11Protocol is EdgeH11Protocol and hypercorn.trio.run.TCPServer is EdgeTCPServer
    assert hypercorn.protocol.h11.WSStream is EdgeWSStream and hypercorn.protocol.h2.WSStream is EdgeWSStream


def test_the_headers_added_to_every_response_are_those_hypercorn_adds_and_dated_to_the_second(monkeypatch):
    now = [1_764_000_000.2]
    monkeypatch.setattr("engy_node.hypercorn_edges.time.time", lambda: now[0])
    monkeypatch.setattr("hypercorn.config.time", lambda: now[0])
    edge, plain = EdgeConfig(protocol_error_body=lambda status, path: ([], b"")), Config()
    first = edge.response_headers("h11")
    assert first == plain.response_headers("h11")
    assert dict(first)[b"date"] == b"Mon, 24 Nov 2025 16:00:00 GMT"
    first.append((b"x-mutated", b"by a caller"))
    now[0] += 0.7
    assert edge.response_headers("h11") == plain.response_headers("h11")
    now[0] += 0.2
    assert dict(edge.response_headers("h11"))[b"date"] == b"Mon, 24 Nov 2025 16:00:01 GMT"
    assert edge.response_headers("h2") == plain.response_headers("h2")


@pytest.mark.parametrize(
    ("head", "path"),
    [
        (b"POST /v1/messages?beta=true HTTP/1.1\r\nhost: x\r\ncookie: ccc", "/v1/messages"),
        (b"GET /health HTTP/1.1\n", "/health"),
        (b"POST /v1/chat/completions HTTP/1.1", "/v1/chat/completions"),
        (b"POST /v1/chat/comp", None),
        (b"POST * HTTP/1.1\r\n", None),
        (b"", None),
        (b"\xff\xfe garbage \x00", None),
    ],
)
def test_the_request_path_is_read_from_the_request_line_or_is_none(head, path):
    assert request_path(head) == path


HEADER_NAMES = [
    "Content-Type",
    "content-length",
    "Content-Length",
    "transfer-encoding",
    "Connection",
    "connection",
    "x-request-id",
    "Cache-Control",
]
HEADER_VALUES = {
    "content-length": ["0", "12", "12, 12"],
    "transfer-encoding": ["chunked", "Chunked"],
    "connection": ["close", "keep-alive", "Upgrade", "keep-alive, x-thing"],
}


@st.composite
def exchanges(draw):
    """A request as a client sends it and the response an app gives back, in every combination
    of what decides a response's framing headers."""
    method = draw(st.sampled_from(["GET", "POST", "HEAD", "CONNECT"]))
    version = draw(st.sampled_from(["1.0", "1.1"]))
    request_headers = [("host", "x")] + draw(
        st.sampled_from([[], [("connection", "close")], [("connection", "keep-alive")]])
    )
    if method == "POST":
        request_headers.append(("content-length", "0"))
    names = draw(st.lists(st.sampled_from(HEADER_NAMES), max_size=4))
    if sum(name.lower() == "transfer-encoding" for name in names) > 1:
        names = [name for name in names if name.lower() != "transfer-encoding"]
    headers = [(name, draw(st.sampled_from(HEADER_VALUES.get(name.lower(), ["text/plain", "abc"])))) for name in names]
    if len({value.split(",")[0].strip() for name, value in headers if name.lower() == "content-length"}) > 1:
        headers = [(name, value) for name, value in headers if name.lower() != "content-length"]
    status = draw(st.sampled_from([200, 201, 204, 304, 404, 500]))
    return (
        (f"{method} / HTTP/{version}\r\n" + "".join(f"{n}: {v}\r\n" for n, v in request_headers) + "\r\n").encode(),
        headers,
        status,
    )


def sent_by(connection: h11.Connection, event: h11.Event) -> tuple:
    """What sending `event` gives back, or the error it raises, and the states after it."""
    try:
        outcome: object = connection.send(event)
    except h11.LocalProtocolError as error:
        outcome = ("refused", str(error))
    return outcome, connection.our_state, connection.their_state


@given(exchanges(), st.lists(st.binary(max_size=40), max_size=4), st.booleans())
def test_an_edge_connection_frames_every_response_exactly_as_h11_does(exchange, chunks, ends):
    """The head, each body chunk (empty ones too) and the end: the same bytes, errors and states."""
    request, headers, status = exchange
    sent = []
    for kind in (h11.Connection, EdgeConnection):
        connection = kind(h11.SERVER)
        connection.receive_data(request)
        while not isinstance(connection.next_event(), h11.EndOfMessage):
            pass
        response = h11.Response(status_code=status, headers=headers, reason=b"X")
        events = [response, *(h11.Data(data=chunk) for chunk in chunks), *([h11.EndOfMessage()] if ends else [])]
        sent.append([sent_by(connection, event) for event in events])
    assert sent[0] == sent[1]


def test_the_close_reason_names_the_limit_and_fits_a_close_frame():
    assert frame_refusal(7 * 1024 * 1024) == "frame exceeds 7340032 bytes"
    assert len(frame_refusal(2**63).encode()) <= 123


async def answer_to_oversized_head(nursery, config: Config) -> bytes:
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    url = (await nursery.start(serve, Starlette(), config))[0]  # no route: the head never reaches the app
    host, port = url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncookie: " + b"c" * 100_000 + b"\r\n\r\n")
        received = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some():
                received += chunk
    return received


async def test_an_edge_server_answers_a_refused_head_with_its_body_and_a_plain_one_as_hypercorn_does(nursery):
    seen = []

    def body(status, path):
        seen.append((status, path))
        return [(b"content-type", b"application/json"), (b"content-length", b"2")], b"{}"

    edge = await answer_to_oversized_head(nursery, EdgeConfig(protocol_error_body=body))
    assert (
        edge.startswith(b"HTTP/1.1 431 ") and b"content-type: application/json" in edge and edge.endswith(b"\r\n\r\n{}")
    )
    assert seen == [(431, "/v1/messages")]
    plain = await answer_to_oversized_head(nursery, Config())
    assert plain.startswith(b"HTTP/1.1 431 ") and b"content-length: 0" in plain and plain.endswith(b"\r\n\r\n")
