"""Waiting in tests: on what the code under test says, never on the clock.

Each wait is bounded and fails the test with an `AssertionError` naming what did not happen.

- `Changes`: code that reports each change of its state (a callback such as `GatewayLink.on_state`,
  or a method a test wraps) wakes a waiting test, which then re-checks its condition.
- `logged`: the first record of an in-process logger that contains a fragment, as a `trio.Event`.
- `ProcessOutput`: a child process's output, read line by line by a thread as it is written; a test
  waits for the line that says where the child is, or for the output to end (every process
  holding the pipe has exited).
- `wait_until` / `wait_until_async`: a bounded poll, only for state another process keeps and
  announces nowhere a test can listen (the reference server's request counters, a gateway worker
  process's log file). Every caller says in a comment why nothing better is available.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import trio

POLL_INTERVAL_S = 0.05
"""How often `wait_until` re-reads another process's state: often enough that a test does not
wait noticeably past the change, rarely enough not to load the process it asks."""


class Changes:
    """Wakes waiting tasks each time `notify` is called. Call `notify` from trio tasks of the
    test's own run (a `trio.Event` is not thread-safe); it takes and ignores any arguments, so it
    can stand in for a callback."""

    def __init__(self) -> None:
        self._changed = trio.Event()

    def notify(self, *args: object, **kwargs: object) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, condition: Callable[[], bool], *, timeout_s: float, what: str) -> None:
        """Return once `condition` holds, checking it now and after each change."""
        with trio.move_on_after(timeout_s):
            while not condition():
                await self._changed.wait()
            return
        raise AssertionError(f"not {what} within {timeout_s} s")


class LoggedLine(logging.Handler):
    """Sets `seen` at the first record whose message contains `fragment`, and keeps that message.
    The records must come from trio tasks of the test's own run."""

    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment
        self.message: str | None = None
        self.seen = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.message is None and self.fragment in message:
            self.message = message
            self.seen.set()

    async def wait(self, *, timeout_s: float, what: str) -> str:
        with trio.move_on_after(timeout_s):
            await self.seen.wait()
            return self.message
        raise AssertionError(f"not {what} within {timeout_s} s (no log record containing {self.fragment!r})")


@contextlib.contextmanager
def logged(logger_name: str, fragment: str) -> Iterator[LoggedLine]:
    """A `LoggedLine` on `logger_name`, which logs every level while the block runs (a test process
    has not set up the node's logging, so info records would otherwise be dropped)."""
    handler = LoggedLine(fragment)
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class ProcessOutput:
    """Everything `process` writes to its stdout pipe (start it with `stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT, text=True`), read by a thread of its own as it comes and copied to
    `log_path`. The thread keeps the pipe drained, so the child never blocks on a full pipe.

    The output ends when every process holding the pipe's write end has exited or closed it: the
    child, and any child of its that inherited its stdout or stderr."""

    def __init__(self, process: subprocess.Popen, log_path: Path) -> None:
        self.process = process
        self.log_path = log_path
        self._lines: list[str] = []
        self._ended = False
        self._condition = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"output of pid {process.pid}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            with self.process.stdout as stream, self.log_path.open("a") as log:
                for line in stream:
                    log.write(line)
                    log.flush()
                    with self._condition:
                        self._lines.append(line)
                        self._condition.notify_all()
        finally:
            with self._condition:
                self._ended = True
                self._condition.notify_all()

    def text(self) -> str:
        with self._condition:
            return "".join(self._lines)

    def wait_for(self, pattern: str | re.Pattern[str], *, timeout_s: float, what: str) -> re.Match[str]:
        """The first line that matches `pattern` (`re.search`). Fails once the output ends without
        one (the process exited), or after `timeout_s`; either way with everything it wrote."""
        deadline = time.monotonic() + timeout_s
        checked = 0
        with self._condition:
            while True:
                for line in self._lines[checked:]:
                    if match := re.search(pattern, line):
                        return match
                checked = len(self._lines)
                if self._ended:
                    raise AssertionError(
                        f"not {what}: the process ended its output first ({self._exit_status()}):\n"
                        + "".join(self._lines)
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"not {what} within {timeout_s} s:\n" + "".join(self._lines))
                self._condition.wait(remaining)

    def wait_ended(self, *, timeout_s: float, what: str) -> None:
        """Return once the output has ended and all of it is in `log_path`."""
        self._reader.join(timeout_s)
        if self._reader.is_alive():
            raise AssertionError(
                f"not {what} within {timeout_s} s: something still holds the output pipe open:\n" + self.text()
            )

    def _exit_status(self) -> str:
        try:
            return f"exit status {self.process.wait(timeout=5)}"
        except subprocess.TimeoutExpired:
            return "still running"


def wait_until(condition: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds. Only for another process's state that nothing announces."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not {what} within {timeout_s} s")
        time.sleep(POLL_INTERVAL_S)


async def wait_until_async(condition: Callable[[], bool | Awaitable[bool]], *, timeout_s: float, what: str) -> None:
    """`wait_until` for trio tests; `condition` may be a coroutine function."""
    with trio.move_on_after(timeout_s):
        while True:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return
            await trio.sleep(POLL_INTERVAL_S)
    raise AssertionError(f"not {what} within {timeout_s} s")
