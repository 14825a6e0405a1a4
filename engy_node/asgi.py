"""Small pieces both HTTP servers (the reference server and the gateway) need from ASGI and hypercorn.

A handler that waits for long work (a generation, a miner's answer) must notice a client that
hung up, or the work runs on for nobody. Starlette's streaming responses watch for that
themselves; these helpers do it for handlers that wait before responding, and for raw ASGI
handlers that wait and then stream under one watch. ASGI tells an app that its client left only
through `receive`, which costs a task blocked there for each request; a server that says so
directly (`CLIENT_GONE`, which the gateway's hypercorn offers: `hypercorn_edges`) spares it.

Every app served through `start_listener` or `serve_listener` takes what is already queued for
it without a scheduler step (`receive_queued_first`). A JSON body is read within a size, a time
and a nesting limit (`read_json_object`, `MAX_JSON_DEPTH`), each refused with a `BodyError` that
says which.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

import trio

from engy_node.errors import ConfigError, collapse, single_failure

if TYPE_CHECKING:
    from hypercorn.typing import ASGIFramework

T = TypeVar("T")
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class BodyError(ValueError):
    """A request body that cannot be used; `status` is 413 (too large), 408 (too slow) or 400."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


MAX_JSON_DEPTH = 128
"""The deepest nesting of arrays and objects a request body may have (the body itself is level 1).
Real requests stay far under it (a tool's parameter schema nested ten levels is some 25); far
deeper ones pass the parser (orjson allows 1,023 levels) and then overflow Python's recursion
limit in whatever walks them next (the chat template that renders a tool's schema), which
would answer a bare `RecursionError`."""


def nesting_exceeds(value: Any, limit: int) -> bool:
    """Whether parsed JSON `value` nests arrays and objects more than `limit` levels deep (a
    scalar is level 0, `[]` and `{}` level 1). Iterative, so that any depth can be measured."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if level > limit:
            return True
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _too_deep(limit: int) -> BodyError:
    return BodyError(
        400,
        f"request body nests JSON arrays and objects more than {limit} levels deep; "
        "flatten it (a tool's parameter schema is the usual place)",
    )


async def read_json_object(
    receive: Receive,
    *,
    max_bytes: int,
    allow_empty: bool = False,
    timeout_s: float = math.inf,
    on_chunk: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The request body, read from ASGI `receive`, as a JSON object, read no further than
    `max_bytes` and for no longer than `timeout_s` (408). Each server turns a `BodyError` into its
    own API's error shape (499: the client hung up before sending all of it). `on_chunk` is told
    the size of each piece before it is kept, and may refuse it by raising.

    What is already queued for the app (`receive_queued_first`) is taken without waiting, and
    the timer starts only when a wait does: a body that came with its head, nearly every one,
    costs no cancel scope (several microseconds in trio, on every request)."""
    import orjson

    chunks, size = [], 0
    deadline = None
    while True:
        message = take_queued(receive)
        if message is None:
            if deadline is None:
                deadline = trio.current_time() + timeout_s
            with trio.move_on_at(deadline) as waiting:
                message = await receive()
            if waiting.cancelled_caught:
                raise BodyError(408, f"the request body did not arrive within {timeout_s:g} s")
            assert message is not None  # the wait was not cancelled, so receive() returned
        if message["type"] == "http.disconnect":
            raise BodyError(499, "the client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise BodyError(413, f"request body exceeds {max_bytes} bytes")
        if on_chunk is not None and chunk:
            on_chunk(len(chunk))
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    raw = b"".join(chunks)
    if not raw.strip():
        if allow_empty:
            return {}
        raise BodyError(400, "request body is empty; send a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        if str(error).startswith(_ORJSON_TOO_DEEP):
            raise _too_deep(MAX_JSON_DEPTH) from None
        raise BodyError(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise BodyError(400, "request body must be a JSON object")
    # Counting the brackets is a memchr-speed pass that clears nearly every body without a walk.
    if raw.count(b"{") + raw.count(b"[") > MAX_JSON_DEPTH and nesting_exceeds(body, MAX_JSON_DEPTH):
        raise _too_deep(MAX_JSON_DEPTH)
    return body


_ORJSON_TOO_DEEP = "depth limit exceeded"
"""How orjson's error for a document nested deeper than it parses begins."""


CLIENT_GONE = "engy.client_gone"
"""The scope extension (`scope["extensions"][CLIENT_GONE]`, a `ClientGone`) of a server that tells
the app directly when the client hangs up (`hypercorn_edges`), so that watching for it needs no
task blocked in `receive`."""


class ClientGone:
    """A server's word that the client hung up before the response was complete: `gone` is set
    and `callback` (the app's, None while nobody watches) is called from the server's task."""

    __slots__ = ("gone", "callback")

    def __init__(self) -> None:
        self.gone = False
        self.callback: Callable[[], None] | None = None

    def notify(self) -> None:
        self.gone = True
        if self.callback is not None:
            self.callback()


class DisconnectWatch:
    """What `watch_disconnect` yields: whether the client hung up while it was watching."""

    __slots__ = ("client_gone",)

    def __init__(self) -> None:
        self.client_gone = False


def watch_disconnect(
    receive: Receive, scope: MutableMapping[str, Any] | None = None
) -> contextlib.AbstractAsyncContextManager[DisconnectWatch]:
    """Run the body in a scope that is cancelled if the client hangs up (the request body must
    already be read). Leaving the block stops the watch; a single failure of the body is raised
    as itself, not inside an exception group. One watch can span a whole response, so a handler
    that waits, then streams, pays for one watch rather than one per phase. Given the request's
    `scope` from a server that offers `CLIENT_GONE`, the watch is that server's callback and
    costs no task; otherwise a task waits in `receive` for the `http.disconnect`."""
    notice = ((scope or {}).get("extensions") or {}).get(CLIENT_GONE)
    if notice is not None:
        return _NoticeWatch(notice)
    return _receiving_watch(receive)


class _NoticeWatch:
    """A watch that is the server's `ClientGone` callback. A class rather than a generator-based
    context manager, which would cost as much again: it spans every buyer request."""

    __slots__ = ("_notice", "_scope", "_watch")

    def __init__(self, notice: ClientGone) -> None:
        self._notice = notice
        self._scope = trio.CancelScope()
        self._watch = DisconnectWatch()

    async def __aenter__(self) -> DisconnectWatch:
        self._scope.__enter__()
        self._notice.callback = self._gone
        if self._notice.gone:
            self._gone()
        return self._watch

    async def __aexit__(self, *exc_info: Any) -> bool:
        self._notice.callback = None
        return self._scope.__exit__(*exc_info)

    def _gone(self) -> None:
        self._watch.client_gone = True
        self._scope.cancel(reason="client disconnected")


@contextlib.asynccontextmanager
async def _receiving_watch(receive: Receive) -> AsyncIterator[DisconnectWatch]:
    watch = DisconnectWatch()

    async def watcher(scope: trio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        watch.client_gone = True
        scope.cancel(reason="client disconnected")

    with single_failure():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watcher, nursery.cancel_scope)
            yield watch
            nursery.cancel_scope.cancel(reason="response finished")


async def watching_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `work()` while watching for the client hanging up: (True, result), or (False, None)
    when the client left first (the work is cancelled)."""
    result: Any = None
    async with watch_disconnect(receive) as watch:
        result = await work()
    return (False, None) if watch.client_gone else (True, result)


def receive_queued_first(receive: Receive) -> Receive:
    """`receive`, except that a message already queued for the app is taken without a scheduler
    step, and that one can be asked for without waiting (`take_queued`).

    Hypercorn's trio worker hands an app the `receive` of a trio memory channel, which yields to
    the scheduler even when a message is waiting: a step for every request body that arrived
    with its head, and for every websocket message (a gateway's miner leg carries three per
    request). The queue is bounded (the config's `max_app_queue_size`) and filled only while the
    app yields, so a loop over it still yields every few messages. Any other `receive` is
    returned as it is."""
    channel = getattr(receive, "__self__", None)
    if type(channel) is not trio.MemoryReceiveChannel:  # a final class; `isinstance` would go through ABCMeta
        return receive
    return _QueuedFirst(channel)


class _QueuedFirst:
    """`receive_queued_first`'s `receive`: a queued message at once, else a wait for one."""

    __slots__ = ("_channel",)

    def __init__(self, channel: trio.MemoryReceiveChannel[MutableMapping[str, Any]]) -> None:
        self._channel = channel

    async def __call__(self) -> MutableMapping[str, Any]:
        message = self.queued()
        return message if message is not None else await self._channel.receive()

    def queued(self) -> MutableMapping[str, Any] | None:
        try:
            return self._channel.receive_nowait()
        except trio.WouldBlock:
            return None


def take_queued(receive: Receive) -> MutableMapping[str, Any] | None:
    """The next message if `receive` (`receive_queued_first`'s) has one queued, else None, at
    once; always None for any other `receive`."""
    return receive.queued() if type(receive) is _QueuedFirst else None


class QueuedFirst:
    """An ASGI app whose `receive` is `receive_queued_first`'s (what `start_listener` and
    `serve_listener` serve)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        await self.app(scope, receive_queued_first(receive), send)

    def for_hypercorn(self) -> ASGIFramework:
        """Itself, as hypercorn's type: hypercorn types the scope and messages as TypedDicts, our
        apps (as Starlette's) as plain mappings; they are the same dicts at run time."""
        return cast("ASGIFramework", self)


async def start_listener(
    nursery: trio.Nursery,
    app,
    config,
    *,
    what: str,
    flag: str,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
) -> list[str]:
    """Start a hypercorn listener in `nursery`; returns its bound URLs once it accepts.
    A port in use is the operator's to fix, so it becomes a `ConfigError` naming the flag.
    When `shutdown_trigger` returns, the listener stops accepting and closes idle connections;
    requests in flight go on for up to the config's `graceful_timeout`."""
    from hypercorn.trio import serve

    try:
        return await nursery.start(
            functools.partial(serve, QueuedFirst(app).for_hypercorn(), config, shutdown_trigger=shutdown_trigger)
        )
    except (OSError, BaseExceptionGroup) as raised:
        error = collapse(raised)
        if not isinstance(error, OSError):
            raise
        raise ConfigError(
            f"cannot listen for the {what} on {config.bind[0]} ({error.strerror or error}); "
            f"stop whatever uses that port or choose another with {flag}"
        ) from None


async def serve_listener(
    app, config, listener: trio.abc.Listener[trio.SocketStream], *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """Serve `app` with hypercorn's trio connection handler on connections from `listener`.

    `hypercorn.trio.serve` only accepts from sockets it binds or is given as file descriptors;
    a gateway worker's miner endpoint must also serve connections another process accepted and
    passed over (`gateway.workers`). This is the part of hypercorn's `worker_serve` after the
    sockets (no lifespan: our apps have none), which is why pyproject pins hypercorn's minor
    version. Cancelling it closes every connection at once: drain first (the gateway tells its
    miners to re-dial while their legs are open)."""
    from hypercorn.trio import run
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.typing import ConnectionState
    from hypercorn.utils import wrap_app

    # `run.TCPServer`, looked up now as `worker_serve` does: the connection handler a server's
    # config may have put there (`hypercorn_edges.install`).
    handler = functools.partial(
        run.TCPServer,
        wrap_app(QueuedFirst(app).for_hypercorn(), config.wsgi_max_body_size, "asgi"),
        config,
        WorkerContext(None),
        ConnectionState({}),
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handler, [listener])
        task_status.started()
