"""Small pieces both HTTP servers (the reference server and the gateway) need from ASGI.

A handler that waits for long work (a generation, a miner's answer) must notice a client that
hung up, or the work runs on for nobody. Starlette's streaming responses watch for that
themselves; these helpers do it for handlers that wait before responding.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
from starlette.requests import Request

from engy_node.errors import collapse

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
