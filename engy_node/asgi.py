"""Small pieces both HTTP servers (the reference server and the gateway) need from ASGI and hypercorn.

A handler that waits for long work (a generation, a miner's answer) must notice a client that
hung up, or the work runs on for nobody. Starlette's streaming responses watch for that
themselves; these helpers do it for handlers that wait before responding.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
from starlette.requests import Request

from engy_node.errors import ConfigError, collapse

T = TypeVar("T")


class BodyError(ValueError):
    """A request body that cannot be used; `status` is 413 (too large) or 400."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_json_object(request: Request, *, max_bytes: int, allow_empty: bool = False) -> dict[str, Any]:
    """The request body as a JSON object, read no further than `max_bytes`. Each server turns a
    `BodyError` into its own API's error shape."""
    import orjson

    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyError(413, f"request body exceeds {max_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        if allow_empty:
            return {}
        raise BodyError(400, "request body is empty; send a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise BodyError(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise BodyError(400, "request body must be a JSON object")
    return body


async def cancel_on_disconnect(request: Request, scope: trio.CancelScope, *, reason: str = "client disconnected") -> None:
    """Cancel `scope` when the client closes the connection; returns after cancelling."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel(reason=reason)
            return


async def watching_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `work()` while watching for the client hanging up: (True, result), or (False, None)
    when the client left first (the work is cancelled). A single failure of `work` is raised as
    itself, not inside an exception group."""
    result: Any = None
    finished = False
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_on_disconnect, request, nursery.cancel_scope)
            result = await work()
            finished = True
            nursery.cancel_scope.cancel(reason="work finished")
    except BaseExceptionGroup as group:
        leaf = collapse(group)
        if leaf is group:
            raise
        raise leaf from None
    return finished, result


async def start_listener(nursery: trio.Nursery, app, config, *, what: str, flag: str) -> list[str]:
    """Start a hypercorn listener in `nursery`; returns its bound URLs once it accepts.
    A port in use is the operator's to fix, so it becomes a `ConfigError` naming the flag."""
    from hypercorn.trio import serve

    try:
        return await nursery.start(serve, app, config)
    except (OSError, BaseExceptionGroup) as raised:
        error = collapse(raised)
        if not isinstance(error, OSError):
            raise
        raise ConfigError(f"cannot listen for the {what} on {config.bind[0]} ({error.strerror or error}); "
                          f"stop whatever uses that port or choose another with {flag}") from None
