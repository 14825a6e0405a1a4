"""hypercorn_edges' HTTP/1.1 stream: the upstream code it relies on is the code it was written
against; with an `EdgeConfig` a response takes fewer writes and reaches the client byte for byte
as hypercorn's own would, connections are still reused, and a client hanging up cancels an app's
`watch_disconnect` through the scope's `ClientGone`, with no task reading `receive`; without one
(a plain `Config`) the watch falls back on reading `receive`.

The gateway's use of them (a buyer hanging up mid-stream, shutdown, the queue) is tested end to
end in tests/engy_node/gateway/test_gateway.py and test_hostile.py.
"""

from __future__ import annotations

import hashlib
import inspect
import re

import h11
import hypercorn.protocol.h11
import hypercorn.protocol.http_stream
import hypercorn.trio.task_group
import hypercorn.trio.tcp_server
import pytest
import trio
from hypercorn.config import Config
from hypercorn.events import RawData
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer

from engy_node.asgi import CLIENT_GONE, ClientGone, watch_disconnect
from engy_node.hypercorn_edges import EdgeConfig, EdgeHTTPStream

UPSTREAM = {
    # What EdgeHTTPStream wraps: the scope it finds, the states it reads, the events it sees.
    "http_stream.HTTPStream.handle": (hypercorn.protocol.http_stream.HTTPStream.handle, "6ed2e34c5e708c6a"),
    "http_stream.HTTPStream.app_send": (hypercorn.protocol.http_stream.HTTPStream.app_send, "c806044b99736985"),
    "http_stream.HTTPStream._send_closed": (hypercorn.protocol.http_stream.HTTPStream._send_closed, "9aaf2e1ac611e51c"),
    # Where EdgeH11Protocol finds the connection's send, what goes through it, and the recycle it
    # writes before; the stream's send is the protocol's stream_send.
    "h11.H11Protocol.__init__": (hypercorn.protocol.h11.H11Protocol.__init__, "c7c989fd6a352626"),
    "h11.H11Protocol._send_h11_event": (hypercorn.protocol.h11.H11Protocol._send_h11_event, "5e40283daa303ec7"),
    "h11.H11Protocol.stream_send": (hypercorn.protocol.h11.H11Protocol.stream_send, "56a36254a368d71a"),
    "h11.H11Protocol._maybe_recycle": (hypercorn.protocol.h11.H11Protocol._maybe_recycle, "3ac53f52bc4e65de"),
    "h11.H11Protocol._create_stream": (hypercorn.protocol.h11.H11Protocol._create_stream, "a2338a57ab343908"),
    # Spawning the app does not yield, so the extension is in the scope before the app runs.
    "trio.task_group.TaskGroup.spawn_app": (hypercorn.trio.task_group.TaskGroup.spawn_app, "b4c1131427529801"),
    # A write to a connection the client closed tells the protocol (and so the app) at once.
    "trio.tcp_server.TCPServer.protocol_send": (hypercorn.trio.tcp_server.TCPServer.protocol_send, "225856426bff7be0"),
}

SSE = [b"data: one\n\n", b"data: two\n\n", b"data: three\n\ndata: [DONE]\n\n"]
JSON = b'{"answer": 42}'


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_the_upstream_code_is_the_code_these_classes_were_written_against(name):
    """If this fails, hypercorn changed: re-read the method, update hypercorn_edges to match, then
    the digest."""
    method, digest = UPSTREAM[name]
    assert hashlib.sha256(inspect.getsource(method).encode()).hexdigest()[:16] == digest


def test_creating_an_edge_config_installs_the_stream_where_hypercorn_looks_it_up():
    EdgeConfig(protocol_error_body=lambda status, path: ([], b""))
    assert hypercorn.protocol.h11.HTTPStream is EdgeHTTPStream


def edge_config() -> Config:
    return EdgeConfig(protocol_error_body=lambda status, path: ([], b""))


CONFIGS = {"edge": edge_config, "plain": Config}


async def lifespan(scope, receive, send) -> bool:
    """Answer hypercorn's lifespan messages; True when `scope` was the lifespan's."""
    if scope["type"] != "lifespan":
        return False
    while (await receive())["type"] == "lifespan.startup":
        await send({"type": "lifespan.startup.complete"})
    await send({"type": "lifespan.shutdown.complete"})
    return True


async def app(scope, receive, send) -> None:
    """`/sse`: a streamed answer in three body messages; anything else: JSON with a length."""
    if await lifespan(scope, receive, send):
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/sse":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for index, event in enumerate(SSE):
            await send({"type": "http.response.body", "body": event, "more_body": index < len(SSE) - 1})
    else:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(JSON)).encode())]})
        await send({"type": "http.response.body", "body": JSON, "more_body": False})


@pytest.fixture
def writes(monkeypatch) -> list[int]:
    """The size of every non-empty write the server makes to a connection."""
    sizes: list[int] = []
    original = TCPServer.protocol_send

    async def counting(self, event) -> None:
        if isinstance(event, RawData) and event.data:
            sizes.append(len(event.data))
        await original(self, event)

    monkeypatch.setattr(TCPServer, "protocol_send", counting)
    return sizes


async def start(nursery, served, config: Config) -> trio.SocketStream:
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    url = (await nursery.start(serve, served, config))[0]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def exchange(stream: trio.SocketStream, client: h11.Connection, path: str) -> bytes:
    """Send a POST to `path` on the connection, read the whole answer; its bytes as received."""
    body = b'{"question": 1}'
    await stream.send_all(client.send(h11.Request(method="POST", target=path, headers=[
        ("host", "x"), ("content-type", "application/json"), ("content-length", str(len(body)))])))
    await stream.send_all(client.send(h11.Data(data=body)) + client.send(h11.EndOfMessage()))
    received = b""
    with trio.fail_after(10):
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some()
                received += data
                client.receive_data(data)
            elif isinstance(event, h11.EndOfMessage):
                client.start_next_cycle()
                return received


def without_date(raw: bytes) -> bytes:
    return re.sub(rb"(?im)^date: [^\r\n]*\r\n", b"", raw)


async def test_an_edge_server_writes_each_body_message_once_with_the_head_and_the_end_joined(nursery, writes):
    answers = {}
    for name, config in CONFIGS.items():
        stream = await start(nursery, app, config())
        client = h11.Connection(h11.CLIENT)
        async with stream:
            for path in ("/sse", "/json", "/sse"):  # one connection, reused for each
                writes.clear()
                answers[name, path] = (await exchange(stream, client, path), len(writes))
    # hypercorn's own: the head, each body message, the chunked terminator, each a write.
    assert answers["plain", "/sse"][1] == 5 and answers["plain", "/json"][1] == 2
    # The head goes with the first body message, the terminator with the last.
    assert answers["edge", "/sse"][1] == 3 and answers["edge", "/json"][1] == 1
    for path in ("/sse", "/json"):
        assert without_date(answers["edge", path][0]) == without_date(answers["plain", path][0])
    assert answers["edge", "/sse"][0].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


@pytest.mark.parametrize("kind", sorted(CONFIGS))
async def test_a_client_hanging_up_ends_the_watch(nursery, kind):
    """Under an edge server the watch is the server's callback and nothing reads `receive`; under
    a plain one the watch's task finds the `http.disconnect` there."""
    watching, done = trio.Event(), trio.Event()
    seen = {}

    async def waiting_app(scope, receive, send) -> None:
        if await lifespan(scope, receive, send):
            return
        while (await receive()).get("more_body"):
            pass
        reads = 0

        async def counted_receive():
            nonlocal reads
            reads += 1
            return await receive()

        async with watch_disconnect(counted_receive, scope) as watch:
            watching.set()
            await trio.sleep_forever()
        seen.update(gone=watch.client_gone, reads=reads, notice=scope["extensions"].get(CLIENT_GONE))
        done.set()

    stream = await start(nursery, waiting_app, CONFIGS[kind]())
    body = b"{}"
    await stream.send_all(b"POST /wait HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n" + body)
    with trio.fail_after(10):
        await watching.wait()
        await stream.aclose()
        await done.wait()
    assert seen["gone"]
    if kind == "edge":
        assert isinstance(seen["notice"], ClientGone) and seen["notice"].gone and seen["reads"] == 0
    else:
        assert seen["notice"] is None and seen["reads"] >= 1
