"""The light loop's heartbeat file, and the watchdog's one decision (docs/validator.md): has the loop
stopped completing ticks?

Why a heartbeat and not the state file. A restart policy recovers a process that exits, not one
wedged inside a chain call that stays "running" while it submits nothing. The state file cannot
tell the two apart: it advances only on a confirmed submission, and most ticks rightly skip
because the resubmit interval spans several polls. So every tick stamps this file whatever its
outcome; liveness is not success. A watchdog turns a stall (`stalled`) into an exit, and
`engy-node health` reads the same file (`health`).

The file is one JSON object, `{"ts": <unix time of the tick>, ...detail}`, where the detail is the
tick's outcome (for example `{"outcome": "applied", "epoch": 7, "block": 1234}`) so `health` can
show what the loop last did, not only when.

Failure posture. Writing is best-effort: `write_heartbeat` never raises, it returns what went
wrong for the caller to log, because a full disk must not stop a validator from submitting.
Reading is defensive: anything but an object with a finite numeric `ts` counts as no heartbeat.
A heartbeat from the future (the clock jumped back) reads as zero seconds old rather than as a
stall; the next tick stamps the corrected time.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engy_node.validator.schedule import stall_limit
from engy_node.validator.state import atomic_write_json


def write_heartbeat(path: str | os.PathLike[str], *, now: float, detail: Mapping[str, Any] | None = None) -> str | None:
    """Stamp the heartbeat at `path` with the tick time `now` and the tick's `detail`, atomically.

    Returns None on success, else a one-line description of the failure; it never raises. A "ts"
    key in `detail` is ignored: the tick time is `now`.
    """
    if _timestamp(now) is None:
        return f"heartbeat not written to {path}: the tick time {now!r} is not a finite number"
    document: dict[str, Any] = {"ts": float(now)}
    document.update((key, value) for key, value in (detail or {}).items() if key != "ts")
    try:
        atomic_write_json(path, document)
    except Exception as error:
        # Broad on purpose: disk errors and an unserialisable detail alike must not end the loop;
        # the type name keeps a local bug from reading as a disk problem.
        return f"heartbeat not written to {path}: {type(error).__name__}: {error}"
    return None


def read_heartbeat(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The heartbeat at `path` with `ts` as a float, or None if there is none or it is unusable."""
    try:
        document = json.loads(Path(path).read_bytes())
    # RecursionError: absurdly nested JSON. ValueError covers bad JSON and bad UTF-8.
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(document, dict):
        return None
    ts = _timestamp(document.get("ts"))
    if ts is None:
        return None
    return {**document, "ts": ts}


def stalled(age_s: float, poll_s: float) -> bool:
    """Whether a loop whose last completed tick is `age_s` old counts as wedged."""
    return age_s > stall_limit(poll_s)


def health(path: str | os.PathLike[str], *, now: float, poll_s: float) -> tuple[bool, str]:
    """Whether the loop writing the heartbeat at `path` is still ticking, and a one-line message
    saying so: "ok: last tick 12 s ago (outcome=applied epoch=7 block=1234)", "no heartbeat yet
    at PATH", "stale: last tick 1234 s ago, limit 900 s (...)"."""
    heartbeat = read_heartbeat(path)
    if heartbeat is None:
        if os.path.lexists(path):
            return False, f"unusable heartbeat at {path} (not a JSON object with a numeric ts)"
        return False, f"no heartbeat yet at {path}"
    age_s = max(0.0, now - heartbeat["ts"])
    last_tick = f"last tick {age_s:.0f} s ago"
    outcome = _describe_detail(heartbeat)
    if stalled(age_s, poll_s):
        return False, f"stale: {last_tick}, limit {stall_limit(poll_s):.0f} s{outcome}"
    return True, f"ok: {last_tick}{outcome}"


def _timestamp(raw: Any) -> float | None:
    # bool is an int subclass and Python's json reads NaN and Infinity: none of them is a time.
    if isinstance(raw, (int, float)) and not isinstance(raw, bool) and math.isfinite(raw):
        return float(raw)
    return None


def _describe_detail(heartbeat: Mapping[str, Any]) -> str:
    """The detail as " (key=value ...)" on one line, or "" when there is none. Null values are
    left out: a tick that failed before it knew its epoch or block has nothing to say about them."""
    parts = [f"{_show(key)}={_show(value)}" for key, value in heartbeat.items() if key != "ts" and value is not None]
    return f" ({' '.join(parts)})" if parts else ""


def _show(value: Any) -> str:
    # Plain printable text as it is; anything else as JSON, whose escapes keep it on one line.
    if isinstance(value, str) and value.isprintable():
        return value
    return json.dumps(value, ensure_ascii=True)
