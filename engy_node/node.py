"""Run a node's services under one trio nursery and stop them cleanly on SIGINT/SIGTERM.

Each service is an async callable taking `task_status`; the node starts them in order with
`nursery.start`, so a service that fails before it is ready stops the start-up with its own
error instead of leaving half a node running. Once every service is ready the node logs it
and waits.

The first SIGINT/SIGTERM cancels the root scope: services run their `finally` blocks (abort
in-flight requests, stop threads, tell peers) under their own short shielded deadlines. A second
signal during that shutdown exits at once — an operator pressing Ctrl-C twice means it.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from engy_node.errors import single_failure

log = logging.getLogger("engy.node")

Service = Callable[..., Awaitable[Any]]
"""`async def service(*, task_status)`: calls `task_status.started(value)` once it serves."""

FORCED_EXIT_CODE = 130


async def run_services(
    services: Sequence[tuple[str, Service]], *, handle_signals: bool = True, exit_on_second_signal: bool = True
) -> None:
    """Run `services` until cancelled. A single failure is re-raised as itself rather than
    inside an exception group, so `cli.py` can report a user error (`EngyError`) plainly.

    The signal watcher sits outside the services' scope, so it is still listening while they
    shut down: a second signal then exits at once (`exit_on_second_signal`) or is ignored (a
    helper process, whose parent decides when it has waited long enough)."""
    with single_failure():
        async with trio.open_nursery() as watchers:
            services_scope = trio.CancelScope()
            if handle_signals:
                await watchers.start(_stop_on_signals, services_scope, exit_on_second_signal)
            try:
                with services_scope:
                    async with trio.open_nursery() as nursery:
                        for name, service in services:
                            value = await nursery.start(service)
                            log.info("%s ready%s", name, f": {value}" if value is not None else "")
                        freeze_startup_objects()
                        log.info(
                            "node running (%s); Ctrl-C or SIGTERM stops it", ", ".join(name for name, _ in services)
                        )
            finally:
                watchers.cancel_scope.cancel(reason="the services stopped")


def freeze_startup_objects() -> None:
    """Exclude everything start-up created from the garbage collector's full passes.

    A node with a tokenizer loaded holds ~300,000 long-lived objects (transformers, torch), and
    a full collection walks all of them: ~165 ms on this project's machine, a pause every
    request in flight waits out (it was the gateway's p99 at 16 streams). The models, apps and
    settings loaded at start-up live as long as the process, so the collector never needs to
    look at them again; what requests create is still collected as usual."""
    gc.collect()
    gc.freeze()


async def _stop_on_signals(
    scope: trio.CancelScope, exit_on_second_signal: bool, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if scope.cancel_called:
                if exit_on_second_signal:
                    log.warning("second %s during shutdown; exiting now", name)
                    os._exit(FORCED_EXIT_CODE)
                log.info("%s during shutdown; still shutting down", name)
                continue
            log.info("%s received; shutting down", name)
            scope.cancel(reason=f"{name} received")


def run(services: Sequence[tuple[str, Service]], *, exit_on_second_signal: bool = True) -> int:
    """Run until a signal or a service failure. Returns the process exit code."""
    trio.run(functools.partial(run_services, services, exit_on_second_signal=exit_on_second_signal))
    return 0
