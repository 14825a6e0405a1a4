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
show what the loop last did, not only when, plus when the loop started (`started`) and the
subnet's activity cutoff in seconds as the loop last read it (`activity_cutoff_s`).

Liveness is not the job. A loop that ticks but never lands weights (provider down with no cache,
chain unreachable, weights refused) keeps the heartbeat fresh while the validator drops out of
consensus. `weights_problem` says so from the heartbeat and the state file's last landed submit:
no weights within the activity cutoff, or none at all once the loop has run longer than the
cutoff (its grace: the first epoch may take that long to be published). A restarted loop whose
last landing is already older than the cutoff gets the stall limit to land one before it counts.

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

from engy_node.durations import duration_text
from engy_node.validator.schedule import BLOCK_S, stall_limit
from engy_node.validator.state import atomic_write_json

DEFAULT_ACTIVITY_CUTOFF_BLOCKS = 5000
"""The activity cutoff `weights_problem` assumes when the loop has not read the chain's."""

LOOP_KEYS = ("started", "activity_cutoff_s")
"""Heartbeat keys about the loop rather than its last tick: not shown as the tick's detail."""

OUTCOME_FIXES: dict[str, str] = {
    "fetch-failed": "the provider does not answer and no cached vector exists: check validator.provider_url "
    "and the provider",
    "no-epoch-yet": "the provider has published no epoch yet: check validator.provider_url points at the "
    "subnet's provider",
    "chain-failed": "the chain does not answer: check validator.network and the connection",
    "submit-failed": "the chain refuses the weights: `engy-node status` and the validator log name the refusal "
    "(registration, validator permit, stake, rate limit)",
}
"""Why a ticking loop lands no weights, by its last outcome, and what to do."""


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


def weights_problem(
    heartbeat: Mapping[str, Any], *, now: float, last_submit_ts: float | None, poll_s: float
) -> str | None:
    """Why a loop that is ticking is still not doing its job, naming the cause and the fix, or
    None: no weights landed within the activity cutoff (after the stall limit's grace for a
    loop that just started), or none ever once the loop has run longer than the cutoff."""
    cutoff_s = _timestamp(heartbeat.get("activity_cutoff_s"))
    cutoff_s = cutoff_s if cutoff_s is not None and cutoff_s > 0 else DEFAULT_ACTIVITY_CUTOFF_BLOCKS * BLOCK_S
    started = _timestamp(heartbeat.get("started"))
    up_s = max(0.0, now - started) if started is not None else None
    cutoff = f"the activity cutoff ({duration_text(cutoff_s)})"
    if last_submit_ts is None:
        if up_s is None or up_s <= cutoff_s:
            return None
        problem = f"no weights set: the loop has run {duration_text(up_s)}, longer than {cutoff}, without landing any"
    else:
        since = max(0.0, now - last_submit_ts)
        if since <= cutoff_s or (up_s is not None and up_s <= stall_limit(poll_s)):
            return None
        problem = f"no weights landed for {duration_text(since)}, past {cutoff}: out of consensus, earning nothing"
    outcome = heartbeat.get("outcome")
    fix = OUTCOME_FIXES.get(outcome) if isinstance(outcome, str) else None
    if fix is None and isinstance(outcome, str) and outcome.startswith("rejected:"):
        fix = "the provider's payload is rejected: check validator.master_hotkey and node.netuid match the provider"
    fix = fix or "the validator log and `engy-node status` say why each tick did not submit"
    return f"{problem}; last tick: {_show(outcome)}; {fix}"


def last_weights(*, now: float, last_submit_ts: float | None) -> str:
    """ "weights landed 12 min ago", or "no weights set yet", for a healthy loop's message."""
    if last_submit_ts is None:
        return "no weights set yet"
    return f"weights landed {duration_text(max(0.0, now - last_submit_ts))} ago"


def _timestamp(raw: Any) -> float | None:
    # bool is an int subclass and Python's json reads NaN and Infinity: none of them is a time.
    if isinstance(raw, (int, float)) and not isinstance(raw, bool) and math.isfinite(raw):
        return float(raw)
    return None


def _describe_detail(heartbeat: Mapping[str, Any]) -> str:
    """The detail as " (key=value ...)" on one line, or "" when there is none. Null values are
    left out: a tick that failed before it knew its epoch or block has nothing to say about them."""
    parts = [
        f"{_show(key)}={_show(value)}"
        for key, value in heartbeat.items()
        if key != "ts" and key not in LOOP_KEYS and value is not None
    ]
    return f" ({' '.join(parts)})" if parts else ""


def _show(value: Any) -> str:
    # Plain printable text as it is; anything else as JSON, whose escapes keep it on one line.
    if isinstance(value, str) and value.isprintable():
        return value
    return json.dumps(value, ensure_ascii=True)
