"""What hypercorn does by itself at the edges of a request, made to do what the app needs.

Two answers hypercorn 0.18 writes on its own cannot be changed through its `Config`:

* An HTTP/1.1 request that h11 cannot parse (a head larger than `h11_max_incomplete_size` is
  answered 431, a malformed request line or header 400) gets a status line and an empty body
  (`H11Protocol._send_error_response`), so a client has nothing to show its user but a number.
* A websocket message larger than `websocket_max_message_size` is refused with close code 1009
  and no reason; the app is not told (its `receive` waits until the peer goes away), and what
  the peer keeps sending of that message is still buffered (`WSStream._handle_events`), so the
  limit stops bounding memory once it has been hit.

And costs it puts on every HTTP/1.1 request, which matter on the gateway's hot path (a short
completion is a few small writes, each a system call with trio checkpoints around it, and a few
dozen scheduler steps):

* It writes the status line and headers as soon as the app sends `http.response.start`, then
  each body message in a write of its own, then the chunked terminator (`0\r\n\r\n`) in
  another: a short streamed answer in three body messages is five writes.
* A client hanging up reaches the app only as an `http.disconnect` from `receive`, so an app
  that must notice it while it waits for something else (the gateway, for a miner's output)
  keeps a task blocked in `receive` for each request.
* Its keep-alive timer is a task started when a response is done and cancelled when the next
  request comes: a task, a cancellation and a few scheduler steps per request.
* A body that arrives whole reaches the app as two messages (the data, then its end), and the
  `http.disconnect` after a complete response is queued with a scheduler step of its own; so is
  each websocket message.
* Every write, to a buyer or to a miner's websocket, takes the server's send lock and then
  sends: two scheduler steps even when the socket has room for the bytes at once.
* It formats the `date` header anew for every response, though the header changes once a second.
* Its read loop tries each read before waiting for the socket, and on a keep-alive connection
  that read nearly always finds nothing: a failed system call and three context managers per
  read.
* h11, under it, rebuilds and re-validates a streamed response's header list twice to settle
  its framing headers.

Hypercorn has no hook for any of these, so `install()` (run by creating an `EdgeConfig`) puts
subclasses where hypercorn looks its classes up for each new connection, the module globals
`TCPServer` in `hypercorn.trio.run`, `hypercorn.protocol.H11Protocol`, `HTTPStream` in
`hypercorn.protocol.h11`, and `WSStream` in `hypercorn.protocol.h11` and `.h2`:

* `EdgeTCPServer` waits for the socket to have data before each read (`_read_data`), on a plain
  socket and with no `read_timeout` (which hypercorn's own loop keeps).
* `EdgeH11Protocol`'s connection is an `EdgeConnection`, which settles a plain answer's framing
  headers in one pass, to the same headers h11 would send, and frames each chunk of a chunked
  body without h11's state machine, to the same bytes.
* `EdgeH11Protocol` answers a request h11 refused with the body `EdgeConfig.protocol_error_body`
  builds from the status and the request's path (read from the unparsed head h11 keeps, its
  public `trailing_data`; None when the request line itself is unreadable). It can also gather
  the bytes of several events into one write (`hold_writes`), and from a connection's first
  request on it keeps the keep-alive time itself, in one task per connection whose deadline
  moves (`_keeps_time`). While no write holds the server's send lock it writes bytes straight
  to the socket, as many as it takes without waiting (`_write_now`); only the rest goes through
  the server, which waits for the socket under its lock as before.
* `EdgeHTTPStream` holds the response's start until the first body message (ASGI itself says a
  server must not start the response before it) and writes what each body message makes (the
  head, the data, after the last one the terminator) in one write: a short streamed answer is
  two or three writes. Nothing the app has sent waits: each body message is written before its
  `send` returns, as before. It passes the request body on a piece behind, so that a body that
  arrives whole is one message, and queues messages without a step where the app's queue has
  room. An answer that starts before the request's body has arrived whole (a body refused for
  its size or pace) carries `Connection: close`: hypercorn closes such a connection once the
  response is done, the rest of the body unread, and the client is told so. It also puts a
  `ClientGone` (`asgi.CLIENT_GONE`) in the scope's extensions and calls its
  callback, from the connection's task, when the connection closes before the response is
  complete, so `asgi.watch_disconnect` cancels the app's work at once without a task of its
  own. (Over HTTP/2, which no gateway client is offered, hypercorn's own stream serves, and the
  watch falls back on its task.)
* `EdgeWSStream` counts a message's UTF-8 bytes as its frames arrive and refuses it before
  storing more than the limit: it closes with 1009 and the reason "frame exceeds N bytes", tells
  the app at once with a `websocket.disconnect` carrying that code and reason, and drops
  whatever else the peer sends. It queues each message for the app without a step where the
  app's queue has room.

They behave exactly as hypercorn's own classes unless the server's config is an `EdgeConfig`,
so other servers in the process are unchanged. What they override is private hypercorn API:
pyproject pins hypercorn's and h11's minor versions, and tests/engy_node/test_hypercorn_edges.py and
test_hypercorn_http.py fail when the upstream code these classes copy or rely on changes, so an
upgrade is re-read, not assumed.

Why it is kept despite that cost (docs/performance.md, gateway overhead, 2026-12-02 and -03): on a
short streamed completion at 16 concurrent, 2–3 writes to the buyer's socket instead of 4–5,
scheduler steps per request 22.4 → 13.5, no failed `recvfrom` (2.15 per request before), and a
streamed answer's framing headers in 2.1 µs instead of h11's 24.5; together with the rest of
that work the gateway's CPU per streamed request went from 2.45 to 1.40 ms (0.568× of
`3d558d1`). And two behaviours no configuration gives: a refused request is answered with a
body that says why, and an oversized websocket message stops being buffered at the limit.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

import h11
import hypercorn.protocol
import hypercorn.protocol.h2
import hypercorn.protocol.h11
import hypercorn.trio.run
import trio
from h11._headers import Headers
from h11._writers import ChunkedWriter
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.events import Body, EndBody, Request, StreamClosed
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.protocol.ws_stream import WSStream
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.typing import ASGIReceiveEvent, ASGISendEvent, HTTPResponseStartEvent
from wsproto.connection import ConnectionState
from wsproto.events import BytesMessage, CloseConnection, Ping, TextMessage
from wsproto.frame_protocol import CloseReason

from engy_node.asgi import CLIENT_GONE, ClientGone

ProtocolErrorBody = Callable[[int, str | None], tuple[list[tuple[bytes, bytes]], bytes]]
"""(status, request path or None) -> (headers, body) of the answer to a request h11 refused.
The headers must include `content-type` and `content-length`; `connection: close` is added."""


class EdgeConfig(Config):
    """A hypercorn `Config` whose server answers protocol errors with a body and refuses an
    oversized websocket message with its limit named, and which builds the headers it adds to
    every response once a second. Creating one installs the classes."""

    def __init__(self, *, protocol_error_body: ProtocolErrorBody) -> None:
        super().__init__()
        self.protocol_error_body = protocol_error_body
        self._response_headers: dict[str, tuple[int, list[tuple[bytes, bytes]]]] = {}
        install()

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        # The date header has a resolution of one second, so one second's responses share it.
        second = int(time.time())
        built = self._response_headers.get(protocol)
        if built is None or built[0] != second:
            built = self._response_headers[protocol] = (second, super().response_headers(protocol))
        return list(built[1])


def request_path(head: bytes) -> str | None:
    """The path of the request whose (possibly partial) head is `head`, or None when its request
    line cannot be read (`METHOD SP target SP version`, the target starting with "/")."""
    line = head.split(b"\n", 1)[0].rstrip(b"\r")
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[1].startswith(b"/"):
        return None
    return parts[1].split(b"?", 1)[0].decode("latin-1")


def frame_refusal(limit: int) -> str:
    """The close reason for a websocket message over `limit` bytes."""
    return f"frame exceeds {limit} bytes"


class EdgeConnection(h11.Connection):
    """h11's server connection, which settles a response's framing headers in one pass where the
    answer is plain: a keep-alive HTTP/1.1 client and no `transfer-encoding` from the app.

    h11 rebuilds and re-validates the whole header list twice for every response of unknown
    length (to drop a `content-length`, then to add `transfer-encoding: chunked`) and works out
    the framing from the headers once more: about a third of what a response costs h11, though
    for such an answer it only appends the one header. Here the same outcome, the same headers
    in the same order, is reached by looking at each header's name once; anything else (an
    HTTP/1.0 client, a connection that must close, a `transfer-encoding` to rewrite) goes h11's
    own way.

    A chunk of a chunked body is framed here too: h11 runs its state machine for every `Data`
    event (copying the states, firing transitions that for body data never fire) to frame it as
    `ChunkedWriter` does, and a streamed answer is mostly such chunks. Only while our side is
    sending a chunked body; any other event or framing goes through h11."""

    # h11's own overloads, so that callers keep its return types.
    @overload
    def send(self, event: h11.ConnectionClosed) -> None: ...
    @overload
    def send(
        self, event: h11.Request | h11.InformationalResponse | h11.Response | h11.Data | h11.EndOfMessage
    ) -> bytes: ...
    @overload
    def send(self, event: h11.Event) -> bytes | None: ...
    def send(self, event: h11.Event) -> bytes | None:
        if type(event) is h11.Data and self.our_state is h11.SEND_BODY and type(self._writer) is ChunkedWriter:
            data = event.data
            # Empty data would read as the end of the body: h11 sends nothing for it.
            return b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        return super().send(event)

    def _clean_up_response_headers_for_sending(self, response: h11.Response) -> h11.Response:
        version = self.their_http_version
        if not self._cstate.keep_alive or version is None or version < b"1.1":
            return super()._clean_up_response_headers_for_sending(response)
        items = response.headers._full_items
        has_length = False
        for _, name, _ in items:
            if name == b"transfer-encoding":
                return super()._clean_up_response_headers_for_sending(response)
            has_length = has_length or name == b"content-length"
        status = response.status_code
        if has_length or status in (204, 304) or (self._request_method == b"CONNECT" and 200 <= status < 300):
            return response  # its length is known: h11 changes nothing
        return h11.Response(
            headers=Headers([*items, (b"Transfer-Encoding", b"transfer-encoding", b"chunked")]),
            status_code=status,
            http_version=response.http_version,
            reason=response.reason,
        )


class EdgeH11Protocol(H11Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held: list[bytes] | None = None
        """Bytes gathered for one write while `hold_writes` is on (None: off)."""
        self._idle_timer: trio.CancelScope | None = None
        """The connection's keep-alive timer once its first request came (`_keep_alive`)."""
        self._idle_deadline = math.inf
        self._closed = False
        self._socket: trio.socket.SocketType | None = None
        """The connection's socket where bytes may be written to it without waiting (see
        `_write_now`); None: every write goes through the server."""
        self._server_lock: trio.Lock | None = None
        if isinstance(self.config, EdgeConfig):
            self.connection = EdgeConnection(h11.SERVER, max_incomplete_event_size=self.config.h11_max_incomplete_size)
            self._write = self.send
            self.send = self._send_or_hold
            # `send` is the trio server's `protocol_send` (`TCPServer.run`), which writes under the
            # server's `send_lock` to its `stream`: a plain `SocketStream` unless TLS wraps it.
            server = getattr(self._write, "__self__", None)
            stream = getattr(server, "stream", None)
            lock = getattr(server, "send_lock", None)
            if os.name == "posix" and isinstance(stream, trio.SocketStream) and isinstance(lock, trio.Lock):
                self._socket, self._server_lock = stream.socket, lock

    async def handle(self, event: Event) -> None:
        if type(event) is Closed:
            self._stop_keep_alive()
        await super().handle(event)

    def hold_writes(self) -> None:
        """Gather the bytes of what follows into one write, until `release_writes` (only with an
        `EdgeConfig`; anything but bytes, such as closing the connection, releases them first)."""
        if isinstance(self.config, EdgeConfig):
            self._held = []

    async def release_writes(self) -> None:
        held, self._held = self._held, None
        if held:
            await self._write_now(RawData(data=b"".join(held)))

    async def _maybe_recycle(self) -> None:
        # The response is complete: write it before deciding whether the connection can take the
        # next request, as hypercorn does, so that the request's body still arriving (a client
        # answered before it sent all of it) has the same chance to be read first.
        await self.release_writes()
        await super()._maybe_recycle()

    async def _send_or_hold(self, event: Event) -> None:
        # Exact type tests here and below: hypercorn's and wsproto's events are `ABC`s, whose
        # `isinstance` goes through `ABCMeta` (several per write, on every request), and none
        # of these has subclasses.
        if type(event) is Updated and self._keeps_time(idle=event.idle):
            return
        if self._held is not None:
            if type(event) is RawData:
                self._held.append(event.data)
                return
            await self.release_writes()
        if type(event) is Closed:
            self._stop_keep_alive()
        await self._write_now(event)

    async def _write_now(self, event: Event) -> None:
        """Write `event`'s bytes to the socket at once, as far as its buffer takes them, and
        only what is left through the server (which waits for the socket under its lock).

        The server's way costs two scheduler steps per write even when the socket can take the
        bytes at once (its lock's and the send's checkpoints), and a streamed answer is several
        writes to the buyer and one to the miner's websocket. Writing directly keeps the order:
        it is taken only while no write holds the server's lock, and nothing between the check
        and the write yields. A socket already closed, or an error, goes the server's way, which
        raises or reports it as it always has."""
        if type(event) is RawData:
            written = self._write_directly(event.data)
            if written == len(event.data):
                return
            if written:
                event = RawData(data=event.data[written:])
        await self._write(event)

    def _write_directly(self, data: bytes) -> int:
        """How many of `data`'s bytes the socket took without waiting (0: none, or not now)."""
        if self._socket is None or self._server_lock is None or self._server_lock.locked():
            return 0
        fd = self._socket.fileno()
        if fd < 0:
            return 0
        try:
            return os.write(fd, data)
        except OSError:  # it would block, or the peer is gone: the server's way waits or tells
            return 0

    def _keeps_time(self, *, idle: bool) -> bool:
        """Whether this protocol, rather than hypercorn's server, times the connection's idleness.

        Hypercorn's server stops a task when a request arrives and starts a new one when the
        response is done (`TCPServer.protocol_send` on `Updated`): a task, a cancellation and
        four scheduler steps per request. Here one task per connection (`_keep_alive`) keeps the
        time, and each change between busy and idle only notes when the connection may be closed;
        the task's timer is not moved for it (a change of a cancel scope's deadline reorders
        the run's deadlines, twice per request), but checks that note when it fires and sets
        itself again. The server's own task still times the wait for the first request (a client
        that connects and sends nothing, or a head a byte at a time); the first request's
        `Updated` stops it as before."""
        if self._idle_timer is None:
            self._idle_timer = trio.CancelScope(deadline=trio.current_time() + self.config.keep_alive_timeout)
            self.task_group.spawn(self._keep_alive)
            return False
        self._idle_deadline = trio.current_time() + self.config.keep_alive_timeout if idle else math.inf
        return True

    async def _keep_alive(self) -> None:
        """Close the connection when it has been idle (between requests) for the config's
        `keep_alive_timeout`, or at once when idle while the server is stopping: what hypercorn's
        idle task does. A stopping server with a request in flight closes the connection when
        the response is done (`H11Protocol._maybe_recycle`), as before.

        The timer fires no later than the idle deadline: it is set, at the latest, one
        `keep_alive_timeout` after it last looked, and a connection that went idle since then
        has its deadline at least that far off. Fired early (the connection went busy, or busy
        and idle again, since), it sets itself for the deadline now noted, or, while a request
        is in flight, for one more timeout."""
        while not self._closed:
            assert self._idle_timer is not None, "set before this task is started (`_keeps_time`)"
            with self._idle_timer:
                await self.context.terminated.wait()
            idle = self._idle_deadline != math.inf
            if self._closed or (not idle and self.context.terminated.is_set()):
                return
            now = trio.current_time()
            if idle and (self.context.terminated.is_set() or now >= self._idle_deadline):
                with trio.CancelScope(shield=True):
                    await self.send(Closed())
                return
            self._idle_timer = trio.CancelScope(
                deadline=self._idle_deadline if idle else now + self.config.keep_alive_timeout
            )

    def _stop_keep_alive(self) -> None:
        self._closed = True
        if self._idle_timer is not None:
            self._idle_timer.cancel()

    async def _send_error_response(self, status_code: int) -> None:
        if not isinstance(self.config, EdgeConfig):
            await super()._send_error_response(status_code)
            return
        head = self.connection.trailing_data[0] if isinstance(self.connection, h11.Connection) else b""
        headers, body = self.config.protocol_error_body(status_code, request_path(head))
        await self._send_h11_event(
            h11.Response(
                status_code=status_code,
                headers=[*headers, (b"connection", b"close"), *self.config.response_headers("h11")],
            )
        )
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


_Message = TypeVar("_Message")


async def put_for_app(app_put: Callable[[_Message], Awaitable[object]], message: _Message) -> None:
    """Queue `message` for the app without a scheduler step where its queue has room (the queue
    is a trio memory channel, `app_put` its `send`), as `app_put` does otherwise."""
    channel = getattr(app_put, "__self__", None)
    if type(channel) is trio.MemorySendChannel:
        try:
            channel.send_nowait(message)
            return
        except trio.WouldBlock:
            pass
    await app_put(message)


class EdgeHTTPStream(HTTPStream):
    """An HTTP/1.1 request's stream: the response's start goes out with its first body message,
    each body message in one write, and the app is told at once when the client hangs up before
    the response is complete (the module docstring says why)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.client_gone = ClientGone()
        self._start: HTTPResponseStartEvent | None = None
        """The app's `http.response.start`, held until its first body message."""
        self._body: bytes | None = None
        """The request body's latest piece, held until the next one or the body's end."""
        self._body_ended = False
        """The request body has arrived whole: the connection can take the next request once
        the response is done."""
        protocol = getattr(self.send, "__self__", None)
        # The stream's `send` is its protocol's `stream_send` (`H11Protocol._create_stream`).
        self._protocol = protocol if isinstance(protocol, EdgeH11Protocol) else None

    async def handle(self, event: StreamEvent) -> None:
        if not isinstance(self.config, EdgeConfig) or self.closed:
            await super().handle(event)
            return
        if isinstance(event, EndBody):
            self._body_ended = True
        if isinstance(event, Body):
            # The body goes on a piece behind, so that one that arrives whole (nearly every
            # request's) reaches the app in one message with its end: one `receive`, not two.
            if self._body is not None:
                await super().handle(Body(stream_id=self.stream_id, data=self._body))
            self._body = bytes(event.data)
            return
        if isinstance(event, EndBody) and self._body is not None:
            body, self._body = self._body, None
            await self._put({"type": "http.request", "body": body, "more_body": False})
            return
        if isinstance(event, StreamClosed):
            self._body = None
            if self.state != ASGIHTTPState.CLOSED:
                # Before the `http.disconnect` is queued: putting it may wait for an app that
                # reads nothing, and this must not.
                self.client_gone.notify()
            else:
                # The response is complete, so there is nothing to log (hypercorn logs a
                # response when it ends): only the `http.disconnect` to queue.
                self.closed = True
                await self._put({"type": "http.disconnect"})
                return
        await super().handle(event)
        if isinstance(event, Request) and not self.closed:
            # The app's task has only been scheduled (`spawn_app` does not yield): it finds this
            # in its scope when it starts.
            # hypercorn types an extension's value as a dict (the ASGI spec's are); this one is an object.
            self.scope["extensions"][CLIENT_GONE] = self.client_gone  # type: ignore[assignment]

    async def _put(self, message: ASGIReceiveEvent) -> None:
        await put_for_app(self.app_put, message)

    async def app_send(self, message: ASGISendEvent | None) -> None:
        if not isinstance(self.config, EdgeConfig):
            await super().app_send(message)
            return
        if message is not None and message["type"] == "http.response.start" and not self._body_ended:
            # Answered before its body arrived (refused for its size, its pace, its key): the rest
            # is never read, so hypercorn closes the connection after the response. Say so.
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        if (
            message is not None
            and message["type"] == "http.response.start"
            and self.state == ASGIHTTPState.REQUEST
            and self._start is None
        ):
            self._start = message
            return
        if (
            message is None
            or message["type"] != "http.response.body"
            or self._protocol is None
            or (self._start is None and message.get("more_body", False))
        ):
            await self._send_start()
            await super().app_send(message)
            return
        self._protocol.hold_writes()
        try:
            await self._send_start()
            await super().app_send(message)
        finally:
            await self._protocol.release_writes()

    async def _send_start(self) -> None:
        if self._start is not None:
            start, self._start = self._start, None
            await super().app_send(start)


class EdgeWSStream(WSStream):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.message_bytes = 0
        """UTF-8 bytes of the message being received so far (hypercorn counts characters)."""
        self.refused = False

    async def _handle_events(self) -> None:
        """hypercorn's loop, except for a message over the limit (see the module docstring)."""
        if not isinstance(self.config, EdgeConfig):
            await super()._handle_events()
            return
        # Events are read once the app accepted the handshake, so it has been started.
        assert self.app_put is not None
        for event in self.connection.events():
            # wsproto's `Message` events: its only two kinds (exact type tests, as in `EdgeH11Protocol`).
            if type(event) is TextMessage or type(event) is BytesMessage:
                if self.refused:
                    continue
                data = event.data
                self.message_bytes += len(data.encode()) if isinstance(data, str) and not data.isascii() else len(data)
                if self.message_bytes > self.config.websocket_max_message_size:
                    await self._refuse_message()
                    continue
                self.buffer.extend(event)
                if event.message_finished:
                    await put_for_app(self.app_put, self.buffer.to_message())
                    self.buffer.clear()
                    self.message_bytes = 0
            elif type(event) is Ping:
                await self._send_wsproto_event(event.response())
            elif type(event) is CloseConnection:
                if self.connection.state == ConnectionState.REMOTE_CLOSING:
                    await self._send_wsproto_event(event.response())
                await self.send(StreamClosed(stream_id=self.stream_id))

    async def _refuse_message(self) -> None:
        self.refused = True
        self.buffer.clear()
        reason = frame_refusal(self.config.websocket_max_message_size)
        await self._send_wsproto_event(CloseConnection(code=CloseReason.MESSAGE_TOO_BIG, reason=reason))
        assert self.app_put is not None  # a message came, so the app has been started (`_handle_events`)
        await self.app_put({"type": "websocket.disconnect", "code": int(CloseReason.MESSAGE_TOO_BIG), "reason": reason})


class EdgeTCPServer(TCPServer):
    async def _read_data(self) -> None:
        """hypercorn's read loop, except that it waits for the socket before reading from it.

        hypercorn reads first (trio's `receive_some`, under a `fail_after` scope for the config's
        `read_timeout`, which is unset) and waits only when nothing is there. On a keep-alive
        connection nothing is there nearly every time (a buyer sends its next request after the
        answer; a miner's frames come as it generates), so each read was a failed system call,
        and three cancel scopes and context managers around it. Waiting first, then reading what
        the socket has, costs one wait and one read. What ends the loop is what ended hypercorn's:
        end of file, the peer resetting the connection, or the socket closed under it (then the
        wait raises `ClosedResourceError`, or the read finds no descriptor)."""
        stream = self.stream
        if (
            not isinstance(self.config, EdgeConfig)
            or self.config.read_timeout is not None
            or os.name != "posix"
            or not isinstance(stream, trio.SocketStream)
        ):
            await super()._read_data()
            return
        socket = stream.socket
        while socket.fileno() >= 0:  # -1: closed here, after an answer that ended the connection
            try:
                await trio.lowlevel.wait_readable(socket)
                data = self._read_now(socket)
            except BlockingIOError:
                continue  # woken with nothing to read after all
            except (trio.ClosedResourceError, OSError):
                break
            await self.protocol.handle(RawData(data))
            if not data:
                break
        await self.protocol.handle(Closed())

    def _read_now(self, socket: trio.socket.SocketType) -> bytes:
        return os.read(socket.fileno(), MAX_RECV)


def install() -> None:
    """Make new connections use the classes above (idempotent)."""
    # setattr: a module's class is not a variable to mypy, though hypercorn looks it up as one.
    for module, name, edge in (
        (hypercorn.trio.run, "TCPServer", EdgeTCPServer),
        (hypercorn.protocol, "H11Protocol", EdgeH11Protocol),
        (hypercorn.protocol.h11, "HTTPStream", EdgeHTTPStream),
        (hypercorn.protocol.h11, "WSStream", EdgeWSStream),
        (hypercorn.protocol.h2, "WSStream", EdgeWSStream),
    ):
        setattr(module, name, edge)
