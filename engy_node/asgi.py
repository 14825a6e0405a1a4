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
