"""hypercorn_edges' HTTP/1.1 protocol and stream: the upstream code they rely on is the code they
were written against; with an `EdgeConfig` a response takes fewer writes and reaches the client
byte for byte as hypercorn's own would, a request body that arrives whole reaches the app in
one message (and one in pieces still whole), connections are still reused, a client hanging up
cancels an app's `watch_disconnect` through the scope's `ClientGone` with no task reading
`receive` (under a plain `Config` the watch falls back on reading it), and the keep-alive timer
is one task per connection that closes an idle connection as hypercorn's does: after the
timeout, at once when the server stops, never during a request. An edge connection reads only
once its socket has data (none of its reads finds nothing), a peer resetting its connection ends
only that one, and a server given a `read_timeout` keeps hypercorn's read loop, which keeps it.

The gateway's use of them (a buyer hanging up mid-stream, shutdown, the queue) is tested end to
end in tests/engy_node/gateway/test_gateway.py and test_hostile.py.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
import socket as stdlib_socket
import struct

import h11
import hypercorn.protocol.h11
import hypercorn.protocol.http_stream
import hypercorn.trio.task_group
import hypercorn.trio.tcp_server
import pytest
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.events import RawData
from hypercorn.trio import serve
from hypercorn.trio.tcp_server import TCPServer
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket
from trio_websocket import open_websocket_url

from engy_node.asgi import CLIENT_GONE, ClientGone, watch_disconnect
from engy_node.hypercorn_edges import EdgeConfig, EdgeH11Protocol, EdgeHTTPStream, EdgeTCPServer

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
    # A write to a connection the client closed tells the protocol (and so the app) at once; the
    # idle task it starts and stops on `Updated`, which EdgeH11Protocol's timer replaces after the
    # first request; where the first one starts and a closed connection is handled. Every write
    # it makes is under its `send_lock` to its `stream`, which EdgeH11Protocol writes to directly
    # while that lock is free.
    "trio.tcp_server.TCPServer.__init__": (hypercorn.trio.tcp_server.TCPServer.__init__, "4c1d42457bc197b2"),
    "trio.tcp_server.TCPServer.protocol_send": (hypercorn.trio.tcp_server.TCPServer.protocol_send, "225856426bff7be0"),
    "trio.tcp_server.TCPServer._idle_timeout": (hypercorn.trio.tcp_server.TCPServer._idle_timeout, "210ce1014d98e1cb"),
    "trio.tcp_server.TCPServer.run": (hypercorn.trio.tcp_server.TCPServer.run, "fd34b021d1a86c98"),
    "h11.H11Protocol._handle_events": (hypercorn.protocol.h11.H11Protocol._handle_events, "bd4a76b2837e8722"),
    "h11.H11Protocol.handle": (hypercorn.protocol.h11.H11Protocol.handle, "3b56e067447488df"),
}

SSE = [b"data: one\n\n", b"data: two\n\n", b"data: three\n\ndata: [DONE]\n\n"]
JSON = b'{"answer": 42}'
KEEP_ALIVE_S = 0.2
SLOW_S = 3 * KEEP_ALIVE_S
"""A request that takes longer than the keep-alive timeout: the connection is busy, not idle."""


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
    """`/sse`: a streamed answer in three body messages; `/slow`: JSON after `SLOW_S`; anything
    else: JSON at once."""
    if await lifespan(scope, receive, send):
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/slow":
        await trio.sleep(SLOW_S)
    if scope["path"] == "/sse":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for index, event in enumerate(SSE):
            await send({"type": "http.response.body", "body": event, "more_body": index < len(SSE) - 1})
    else:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(JSON)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": JSON, "more_body": False})


@pytest.fixture
def writes(monkeypatch) -> list[int]:
    """The size of every non-empty write the server makes to a connection: through hypercorn's
    server, or straight to the socket (an edge connection's, when the socket can take it)."""
    sizes: list[int] = []
    through_server = TCPServer.protocol_send
    straight = EdgeH11Protocol._write_directly

    async def counting(self, event) -> None:
        if isinstance(event, RawData) and event.data:
            sizes.append(len(event.data))
        await through_server(self, event)

    def counting_straight(self, data: bytes) -> int:
        written = straight(self, data)
        if written:
            sizes.append(written)
        return written

    monkeypatch.setattr(TCPServer, "protocol_send", counting)
    monkeypatch.setattr(EdgeH11Protocol, "_write_directly", counting_straight)
    return sizes


async def start(nursery, served, config: Config, **serving) -> trio.SocketStream:
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    url = (await nursery.start(functools.partial(serve, served, config, **serving)))[0]
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def exchange(stream: trio.SocketStream, client: h11.Connection, path: str) -> bytes:
    """Send a POST to `path` on the connection, read the whole answer; its bytes as received."""
    body = b'{"question": 1}'
    await stream.send_all(
        client.send(
            h11.Request(
                method="POST",
                target=path,
                headers=[("host", "x"), ("content-type", "application/json"), ("content-length", str(len(body)))],
            )
        )
    )
    await stream.send_all(client.send(h11.Data(data=body)) + client.send(h11.EndOfMessage()))
    return await read_answer(stream, client)


async def read_answer(stream: trio.SocketStream, client: h11.Connection) -> bytes:
    """Read one whole answer on the connection; its bytes as received."""
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
            elif isinstance(event, h11.ConnectionClosed):
                raise AssertionError(f"the server closed the connection before the answer's end: {received!r}")


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


async def closed_by_the_server(stream: trio.SocketStream) -> bool:
    """Read until the server closes the connection (True), bounded."""
    with trio.fail_after(10):
        while data := await stream.receive_some():
            raise AssertionError(f"unexpected bytes from the server: {data!r}")
    return True


@pytest.mark.parametrize("kind", sorted(CONFIGS))
async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout_and_a_busy_one_is_not(nursery, kind):
    config = CONFIGS[kind]()
    config.keep_alive_timeout = KEEP_ALIVE_S
    stream = await start(nursery, app, config)
    client = h11.Connection(h11.CLIENT)
    async with stream:
        for path in ("/json", "/slow", "/json"):
            assert (await exchange(stream, client, path)).endswith(JSON)
        assert await closed_by_the_server(stream)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
async def test_a_stopping_server_closes_an_idle_connection_at_once(nursery, kind):
    config = CONFIGS[kind]()
    config.keep_alive_timeout = config.graceful_timeout = 3600  # only the stop can close it
    stop = trio.Event()
    stream = await start(nursery, app, config, shutdown_trigger=stop.wait)
    client = h11.Connection(h11.CLIENT)
    async with stream:
        await exchange(stream, client, "/json")
        stop.set()
        assert await closed_by_the_server(stream)


class Spawns(trio.abc.Instrument):
    def __init__(self) -> None:
        self.names: list[str] = []

    def task_spawned(self, task) -> None:
        self.names.append(task.name)


async def test_after_the_first_request_an_edge_connection_spawns_only_each_requests_app_task(nursery):
    spawned = {}
    for kind, config in CONFIGS.items():
        stream = await start(nursery, app, config())
        client = h11.Connection(h11.CLIENT)
        async with stream:
            await exchange(stream, client, "/json")
            spawns = Spawns()
            trio.lowlevel.add_instrument(spawns)
            try:
                for _ in range(5):
                    await exchange(stream, client, "/json")
            finally:
                trio.lowlevel.remove_instrument(spawns)
        spawned[kind] = spawns.names
    assert len(spawned["edge"]) == 5 and all(name.endswith("_handle") for name in spawned["edge"])
    # hypercorn's own starts an idle task after every response, besides the app's task
    assert len(spawned["plain"]) == 10


async def body_app(scope, receive, send) -> None:
    """Answers the request body it read and the number of messages it came in."""
    if await lifespan(scope, receive, send):
        return
    body, messages = b"", 0
    while True:
        message = await receive()
        body += message.get("body", b"")
        messages += 1
        if not message.get("more_body"):
            break
    answer = b"%d:%s" % (messages, body)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(answer)).encode())]}
    )
    await send({"type": "http.response.body", "body": answer, "more_body": False})


async def test_a_body_that_arrives_whole_reaches_the_app_in_one_message_and_one_in_pieces_whole(nursery):
    answers = {}
    for kind, config in CONFIGS.items():
        stream = await start(nursery, body_app, config())
        client = h11.Connection(h11.CLIENT)
        async with stream:
            answers[kind] = (await exchange(stream, client, "/whole")).rsplit(b"\r\n\r\n", 1)[1]
            pieces = [b'{"a": ', b'"b", "c"', b": 3}"]
            await stream.send_all(
                client.send(
                    h11.Request(
                        method="POST",
                        target="/pieces",
                        headers=[("host", "x"), ("content-length", str(sum(map(len, pieces))))],
                    )
                )
            )
            for piece in pieces:
                await stream.send_all(client.send(h11.Data(data=piece)))
            with trio.fail_after(10):
                received = b""
                while not received.endswith(b'{"a": "b", "c": 3}'):
                    received += await stream.receive_some()
    assert answers == {"edge": b'1:{"question": 1}', "plain": b'2:{"question": 1}'}


LARGE = [bytes([ord("a") + index % 26]) * 65536 for index in range(160)]
"""An answer of 10 MiB in 64 KiB messages: more than loopback's socket buffers take while the
client is not reading, so some writes must wait for the socket."""


async def large_app(scope, receive, send) -> None:
    if await lifespan(scope, receive, send):
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for index, piece in enumerate(LARGE):
        await send({"type": "http.response.body", "body": piece, "more_body": index < len(LARGE) - 1})


@pytest.mark.parametrize("kind", sorted(CONFIGS))
async def test_an_answer_larger_than_the_socket_takes_at_once_arrives_whole_and_in_order(nursery, kind, monkeypatch):
    waited = []
    through_server = TCPServer.protocol_send

    async def counting(self, event) -> None:
        if isinstance(event, RawData) and event.data:
            waited.append(len(event.data))
        await through_server(self, event)

    monkeypatch.setattr(TCPServer, "protocol_send", counting)
    stream = await start(nursery, large_app, CONFIGS[kind]())
    client = h11.Connection(h11.CLIENT)
    body = b""
    async with stream:
        await stream.send_all(
            client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
            + client.send(h11.EndOfMessage())
        )
        await trio.testing.wait_all_tasks_blocked()  # the server has filled the socket and waits to write the rest
        with trio.fail_after(20):
            while not isinstance(event := client.next_event(), h11.EndOfMessage):
                if event is h11.NEED_DATA:
                    client.receive_data(await stream.receive_some())
                elif isinstance(event, h11.Data):
                    body += event.data
    assert body == b"".join(LARGE)
    if kind == "edge":
        # Straight to the socket while it had room, the rest through the server's waiting write.
        assert 0 < len(waited) < len(LARGE)


@pytest.mark.parametrize("kind", sorted(CONFIGS))
async def test_websocket_messages_sent_by_several_tasks_at_once_each_arrive_whole_and_in_order(nursery, kind):
    """What the gateway's miner legs do: dispatch and cancel send on one websocket from several
    tasks, with no lock of their own."""
    senders, messages, size = 4, 25, 40_000

    async def sending(websocket: WebSocket) -> None:
        await websocket.accept()

        async def send_all(sender: int) -> None:
            for index in range(messages):
                await websocket.send_text(f"{sender}:{index}:" + chr(ord("a") + sender) * size)

        async with trio.open_nursery() as senders_nursery:
            for sender in range(senders):
                senders_nursery.start_soon(send_all, sender)
        await websocket.receive_text()

    config = CONFIGS[kind]()
    config.bind, config.accesslog = ["127.0.0.1:0"], None
    url = (await nursery.start(serve, Starlette(routes=[WebSocketRoute("/ws", sending)]), config))[0]
    seen: dict[int, list[int]] = {sender: [] for sender in range(senders)}
    async with open_websocket_url(url.replace("http://", "ws://") + "/ws", max_message_size=2 * size) as websocket:
        await trio.testing.wait_all_tasks_blocked()  # the server's writes have filled the socket while nothing is read
        with trio.fail_after(20):
            for _ in range(senders * messages):
                sender, index, text = (await websocket.get_message()).split(":", 2)
                assert text == chr(ord("a") + int(sender)) * size
                seen[int(sender)].append(int(index))
        await websocket.send_message("done")
    assert seen == {sender: list(range(messages)) for sender in range(senders)}


@pytest.fixture
def reads(monkeypatch) -> list[bytes | None]:
    """What every read of an edge connection's read loop returned (None: it found nothing)."""
    results: list[bytes | None] = []
    read = EdgeTCPServer._read_now

    def recording(self, socket) -> bytes:
        try:
            data = read(self, socket)
        except BlockingIOError:
            results.append(None)
            raise
        results.append(data)
        return data

    monkeypatch.setattr(EdgeTCPServer, "_read_now", recording)
    return results


async def test_an_edge_connection_reads_only_once_its_socket_has_data_and_answers_as_before(nursery, reads):
    """Each read follows a wait for the socket, so none finds nothing, also when a request comes
    in pieces a while apart, and the answers are hypercorn's own byte for byte."""
    body = b'{"question": 1}'
    answers = {}
    for name, config in CONFIGS.items():
        stream = await start(nursery, app, config())
        client = h11.Connection(h11.CLIENT)
        received = []
        async with stream:
            for cuts in ((), (7, 40, 90), ()):
                request = client.send(
                    h11.Request(
                        method="POST",
                        target="/sse",
                        headers=[
                            ("host", "x"),
                            ("content-type", "application/json"),
                            ("content-length", str(len(body))),
                        ],
                    )
                )
                request += client.send(h11.Data(data=body)) + client.send(h11.EndOfMessage())
                for start_at, end_at in zip((0, *cuts), (*cuts, len(request))):
                    await stream.send_all(request[start_at:end_at])
                    await trio.testing.wait_all_tasks_blocked()  # the server has taken the piece and waits for more
                received.append(without_date(await read_answer(stream, client)))
            await stream.send_eof()
            with trio.fail_after(10):
                assert await stream.receive_some() == b""  # the server closed its side in turn
        answers[name] = received
    assert answers["edge"] == answers["plain"]
    assert None not in reads and reads[-1] == b""
    assert len(reads) == 1 + 4 + 1 + 1  # one read per piece sent, then the end of the file


@pytest.mark.parametrize("kind", sorted(CONFIGS))
async def test_a_peer_resetting_its_connection_ends_that_connection_only(nursery, kind):
    stream = await start(nursery, app, CONFIGS[kind]())
    server = stream.socket.getpeername()[:2]
    await stream.send_all(b"POST /json HTTP/1.1\r\nhost: x\r\ncontent-length: 50\r\n\r\n{")
    await trio.testing.wait_all_tasks_blocked()  # the server has read the head and waits for the body
    # SO_LINGER with a zero timeout makes close() send a reset rather than a FIN.
    stream.socket.setsockopt(stdlib_socket.SOL_SOCKET, stdlib_socket.SO_LINGER, struct.pack("ii", 1, 0))
    await stream.aclose()
    await trio.testing.wait_all_tasks_blocked()  # the server has met the reset and ended that connection
    async with await trio.open_tcp_stream(*server) as other:
        assert (await exchange(other, h11.Connection(h11.CLIENT), "/json")).endswith(JSON)


async def test_an_edge_server_with_a_read_timeout_reads_as_hypercorn_does(nursery):
    """The timeout is hypercorn's to keep: such a server keeps hypercorn's read loop, and a client
    that stops halfway through its request is cut off after it."""
    config = edge_config()
    config.read_timeout = 0.3
    config.keep_alive_timeout = 30
    stream = await start(nursery, app, config)
    async with stream:
        await stream.send_all(b"POST /json HTTP/1.1\r\nhost: x\r\ncontent-length: 50\r\n\r\n{")
        with trio.fail_after(10):
            while await stream.receive_some():
                pass
