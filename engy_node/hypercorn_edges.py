"""What hypercorn answers by itself, before an app runs, made to answer as the app would.

Two answers hypercorn 0.18 writes on its own cannot be changed through its `Config`:

* An HTTP/1.1 request that h11 cannot parse (a head larger than `h11_max_incomplete_size` is
  answered 431, a malformed request line or header 400) gets a status line and an empty body
  (`H11Protocol._send_error_response`), so a client has nothing to show its user but a number.
* A websocket message larger than `websocket_max_message_size` is refused with close code 1009
  and no reason; the app is not told (its `receive` waits until the peer goes away), and what
  the peer keeps sending of that message is still buffered (`WSStream._handle_events`), so the
  limit stops bounding memory once it has been hit.

Hypercorn has no hook for either, so `install()` (run by creating an `EdgeConfig`) puts two
subclasses where hypercorn looks its protocol classes up for each new connection, the module
globals `hypercorn.protocol.H11Protocol` and `WSStream` in `hypercorn.protocol.h11` and `.h2`:

* `EdgeH11Protocol` answers a request h11 refused with the body `EdgeConfig.protocol_error_body`
  builds from the status and the request's path (read from the unparsed head h11 keeps, its
  public `trailing_data`; None when the request line itself is unreadable).
* `EdgeWSStream` counts a message's UTF-8 bytes as its frames arrive and refuses it before
  storing more than the limit: it closes with 1009 and the reason "frame exceeds N bytes", tells
  the app at once with a `websocket.disconnect` carrying that code and reason, and drops
  whatever else the peer sends.

Both behave exactly as hypercorn's own classes unless the server's config is an `EdgeConfig`,
so other servers in the process are unchanged. What they override is private hypercorn API:
pyproject pins hypercorn's minor version, and tests/engy_node/test_hypercorn_edges.py fails when
the upstream code these classes copy or rely on changes, so an upgrade is re-read, not assumed.
"""

from __future__ import annotations

from collections.abc import Callable

import h11
import hypercorn.protocol
import hypercorn.protocol.h2
import hypercorn.protocol.h11
from hypercorn.config import Config
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.ws_stream import WSStream
from wsproto.connection import ConnectionState
from wsproto.events import CloseConnection, Message, Ping
from wsproto.frame_protocol import CloseReason

ProtocolErrorBody = Callable[[int, str | None], tuple[list[tuple[bytes, bytes]], bytes]]
"""(status, request path or None) -> (headers, body) of the answer to a request h11 refused.
The headers must include `content-type` and `content-length`; `connection: close` is added."""


class EdgeConfig(Config):
    """A hypercorn `Config` whose server answers protocol errors with a body and refuses an
    oversized websocket message with its limit named. Creating one installs the classes."""

    def __init__(self, *, protocol_error_body: ProtocolErrorBody) -> None:
        super().__init__()
        self.protocol_error_body = protocol_error_body
        install()


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


class EdgeH11Protocol(H11Protocol):
    async def _send_error_response(self, status_code: int) -> None:
        if not isinstance(self.config, EdgeConfig):
            await super()._send_error_response(status_code)
            return
        head = self.connection.trailing_data[0] if isinstance(self.connection, h11.Connection) else b""
        headers, body = self.config.protocol_error_body(status_code, request_path(head))
        await self._send_h11_event(h11.Response(
            status_code=status_code, headers=[*headers, (b"connection", b"close"), *self.config.response_headers("h11")]))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


class EdgeWSStream(WSStream):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.message_bytes = 0
        """UTF-8 bytes of the message being received so far (hypercorn counts characters)."""
        self.refused = False

    async def _handle_events(self) -> None:
        """hypercorn's loop, except for a message over the limit (see the module docstring)."""
        if not isinstance(self.config, EdgeConfig):
            await super()._handle_events()
            return
        for event in self.connection.events():
            if isinstance(event, Message):
                if self.refused:
                    continue
                data = event.data
                self.message_bytes += len(data) if isinstance(data, bytes) or data.isascii() else len(data.encode())
                if self.message_bytes > self.config.websocket_max_message_size:
                    await self._refuse_message()
                    continue
                self.buffer.extend(event)
                if event.message_finished:
                    await self.app_put(self.buffer.to_message())
                    self.buffer.clear()
                    self.message_bytes = 0
            elif isinstance(event, Ping):
                await self._send_wsproto_event(event.response())
            elif isinstance(event, CloseConnection):
                if self.connection.state == ConnectionState.REMOTE_CLOSING:
                    await self._send_wsproto_event(event.response())
                await self.send(StreamClosed(stream_id=self.stream_id))

    async def _refuse_message(self) -> None:
        self.refused = True
        self.buffer.clear()
        reason = frame_refusal(self.config.websocket_max_message_size)
        await self._send_wsproto_event(CloseConnection(code=CloseReason.MESSAGE_TOO_BIG, reason=reason))
        await self.app_put({"type": "websocket.disconnect", "code": int(CloseReason.MESSAGE_TOO_BIG), "reason": reason})


def install() -> None:
    """Make new connections use the classes above (idempotent)."""
    hypercorn.protocol.H11Protocol = EdgeH11Protocol
    hypercorn.protocol.h11.WSStream = EdgeWSStream
    hypercorn.protocol.h2.WSStream = EdgeWSStream
