"""Live node state that the TUI, the control API and `engy-node diagnose` read.

The hub holds three things: a bounded ring of log records and events, the latest state of each
component (JSON-ready, merged field by field; each component's fields are those its snapshot type
in `snapshots.py` declares), and the metrics registry. Producers run
on trio tasks and on worker threads (the model engine, NVML polling), so every method is
thread-safe and none blocks for long.

Readers poll instead of subscribing: `events_since(seq)` returns what came after the sequence
number they last saw, and says how many they missed if they fell more than the ring behind. A
slow reader therefore costs the node nothing (no queue grows, no producer waits), and a reader
that renders at a fixed rate — the TUI at 2–5 Hz — reads whole batches, not one call per event.

The ring keeps debug records even when stderr shows only info and above: support staff read the
detail after the fact.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import logging.handlers
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from engy_node.metrics import Registry
from engy_node.private_files import PRIVATE_FILE_MODE, make_private, private_dir
from engy_node.snapshots import STATE_SCHEMA, SchemaError, state_type, wire_keys

LOGGER_ROOT = "engy"
LOG_FILE_BYTES = 10 * 1024 * 1024
LOG_FILE_BACKUPS = 3


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    seq: int
    ts: float
    level: str
    component: str
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class EventBatch:
    events: tuple[Event, ...]
    next_seq: int
    """Pass this to the next `events_since` call."""
    missed: int
    """Events that fell out of the ring before this reader got to them."""


class Hub:
    def __init__(self, *, ring_size: int = 10_000, registry: Registry | None = None) -> None:
        self.registry = registry if registry is not None else Registry()
        self._ring: collections.deque[Event] = collections.deque(maxlen=ring_size)
        self._next_seq = 0
        self._states: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def emit(self, level: str, component: str, message: str, *, ts: float | None = None) -> Event:
        with self._lock:
            event = Event(self._next_seq, time.time() if ts is None else ts, level, component, message)
            self._next_seq += 1
            self._ring.append(event)
        return event

    def events_since(self, seq: int, *, limit: int = 1000) -> EventBatch:
        with self._lock:
            oldest = self._ring[0].seq if self._ring else self._next_seq
            if seq > self._next_seq:
                # The reader saw a previous run of this node (sequence numbers restart at 0);
                # everything retained is new to it.
                seq = oldest
            start = max(seq, oldest)
            skip = start - oldest
            events = tuple(self._ring[i] for i in range(skip, min(len(self._ring), skip + limit)))
        missed = start - seq
        next_seq = start + len(events)
        return EventBatch(events, next_seq, missed)

    def set_state(self, component: str, **values: Any) -> None:
        """Replace what `component` reports about itself (merged over its previous state). Each
        field must be one that `component`'s snapshot type declares (`engy_node.snapshots`): a
        renamed or new field fails here, where it is written, not in a dashboard that reads it."""
        kind = state_type(component)
        if kind is None:
            raise SchemaError(f"hub component {component!r} has no snapshot type: declare one in engy_node.snapshots")
        undeclared = sorted(set(values) - wire_keys(kind))
        if undeclared:
            raise SchemaError(
                f"hub component {component!r}: {', '.join(undeclared)} not declared by {kind.__name__} "
                "(engy_node.snapshots); add the field there"
            )
        with self._lock:
            merged = dict(self._states.get(component, {}))
            merged.update(values)
            self._states[component] = merged

    def states(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {name: dict(values) for name, values in self._states.items()}

    def snapshot(self) -> dict[str, Any]:
        """Everything a dashboard frame needs, as plain JSON-ready data."""
        with self._lock:
            last_seq = self._next_seq - 1
        return {
            "schema": STATE_SCHEMA,
            "states": self.states(),
            "metrics": self.registry.snapshot(),
            "last_seq": last_seq,
        }


class HubHandler(logging.Handler):
    """Copies every `engy.*` log record into the hub's ring."""

    def __init__(self, hub: Hub) -> None:
        super().__init__(level=logging.DEBUG)
        self.hub = hub

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info and record.exc_info[0] is not None:
                message = f"{message} ({record.exc_info[0].__name__}: {record.exc_info[1]})"
            component = record.name.removeprefix(f"{LOGGER_ROOT}.") if record.name != LOGGER_ROOT else "node"
            self.hub.emit(record.levelname.lower(), component, message, ts=record.created)
        except Exception:  # broad on purpose: logging must never take the node down
            self.handleError(record)


class _TolerantFileHandler(logging.handlers.RotatingFileHandler):
    """A log file that survives a full or vanished disk: records are dropped and counted, and
    the first failure is reported once on stderr instead of a traceback per record. Readable by
    this user only (`private_files`), whatever the umask, and also when it already existed."""

    dropped = 0

    def _open(self):
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE_MODE)
        try:
            os.fchmod(fd, PRIVATE_FILE_MODE)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)

    def handleError(self, record: logging.LogRecord) -> None:
        self.dropped += 1
        if self.dropped == 1:
            exc = sys.exc_info()[1]
            print(
                f"engy: cannot write the log file {self.baseFilename} ({exc}); logging to stderr only", file=sys.stderr
            )


def install_logging(
    hub: Hub, *, level: str = "info", log_dir: Path | None = None, process: str | None = None, stderr: bool = True
) -> None:
    """Route `engy.*` loggers to the hub (everything), stderr and a rotating file (at `level`).
    A helper process (`process`, e.g. "gateway-1") tags its stderr lines and keeps its own file,
    since a rotating file cannot be shared between processes. A node inside the TUI passes
    `stderr=False`: the terminal is the TUI's, and the hub and the file have every line."""
    root = logging.getLogger(LOGGER_ROOT)
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.DEBUG)
    root.propagate = False
    root.addHandler(HubHandler(hub))
    tag = f"[{process}] " if process else ""
    formatter = logging.Formatter(f"%(asctime)s %(levelname)-7s {tag}%(name)s: %(message)s")
    if stderr:
        console = logging.StreamHandler(sys.stderr)
        console.setLevel(level.upper())
        console.setFormatter(formatter)
        root.addHandler(console)
    if log_dir is not None:
        try:
            private_dir(log_dir)
            file_name = f"engy-node-{process}.log" if process else "engy-node.log"
            for backup in log_dir.glob(f"{file_name}.*"):
                make_private(backup)  # written before the logs were private
            file_handler = _TolerantFileHandler(
                log_dir / file_name, maxBytes=LOG_FILE_BYTES, backupCount=LOG_FILE_BACKUPS, encoding="utf-8"
            )
        except OSError as err:
            print(f"engy: cannot open a log file in {log_dir} ({err}); logging to stderr only", file=sys.stderr)
        else:
            file_handler.setLevel(level.upper())
            file_handler.setFormatter(formatter)
            root.addHandler(file_handler)


LOG_LEVELS = ("debug", "info", "warning", "error")


def set_log_level(level: str) -> None:
    """Change what stderr and the log file receive, at run time (the hub keeps every record
    whatever the level). Raises ValueError for a level that is not one of `LOG_LEVELS`."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r}: choose one of {', '.join(LOG_LEVELS)}")
    for handler in logging.getLogger(LOGGER_ROOT).handlers:
        if not isinstance(handler, HubHandler):
            handler.setLevel(level.upper())
