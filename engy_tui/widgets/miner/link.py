"""The gateway link block: does the gateway route requests to this miner?

Its legs (admitted of those dialled), its eligibility at the gateway (active, probing, pulled,
new) and for how long, in flight over its slots, the oldest heartbeat, the qualifying round's
progress, the served window, and what is wrong with the link and its fix (legs down, pulled and
the cooldown, a first-party worker that would have been pulled).

Where the facts come from: the miner's component (`engy_node.miner.link.GatewayLink.publish`:
legs_up, legs, inflight; `role.run_miner`: max_inflight, model); on a gateway node, the
"traffic" worker whose `miner` is this miner's hotkey (`engy_node.gateway.traffic.TrafficState
.to_json`: state, since, reason, first_party, until, round, window, history) and the "gateway"
state's `legs` (`MinerPool.snapshot`) of that hotkey, for heartbeats; the "network" state's
`miner_ws` for the URL. Not published, so not shown: the URL of a remote gateway, when it
admitted the miner, and requests served per day.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from engy_node.protocol.standing import SERVED_WINDOW_S
from engy_tui.widgets.cells import NA, Cell, format_age, format_duration
from engy_tui.widgets.cells import as_int as _int
from engy_tui.widgets.cells import as_list as _list
from engy_tui.widgets.cells import as_map as _map
from engy_tui.widgets.cells import as_number as _num
from engy_tui.widgets.cells import as_text as _text
from engy_tui.widgets.miner.common import BAD, NA_CELL, OK, SEP, WARN, Line, count_text, plural
from engy_tui.widgets.miner.proofs import gateway_proof_line

__all__ = [
    "HEARTBEAT_LATE_S",
    "eligibility_cell",
    "heartbeat_cell",
    "legs_cell",
    "legs_of",
    "link_lines",
    "link_notes",
    "link_summary",
    "link_title",
    "served_line",
    "worker_of",
]

HEARTBEAT_LATE_S = 45.0
"""A miner beats every 30 s and the gateway republishes its legs every 10 s, so up to about 40 s
is normal; past 45 s one beat is late (the gateway drops a leg after 90 s)."""


_BREAKER_CODES = frozenset({"failures-in-a-row", "failure-rate", "slow-ttft", "slow-tpot", "unproven-rate", "cheat"})

_PULL_FIXES: dict[str, str] = {
    "cheat": "serve the catalog checkpoint unmodified, with the command the plan gives; it qualifies again after "
    "the cooldown",
    "failures-in-a-row": "requests failed: see the model server box and its log; it qualifies again after the cooldown",
    "failure-rate": "requests failed: see the model server box and its log; it qualifies again after the cooldown",
    "slow-ttft": "too slow for the model's latency ceiling: lower --max-running-requests (fewer requests at once)",
    "slow-tpot": "too slow for the model's latency ceiling: lower --max-running-requests (fewer requests at once)",
    "unproven-rate": "too many proofs could not be checked: keep the planned flags (--enable-return-hidden-states, "
    "--enable-deterministic-inference) and the catalog checkpoint",
    "not-qualified": "the qualification round was lost (the reason names the bar missed); it retries after the cooldown",
    "round-timeout": "the qualification round ran out of time (a verifier may be behind); it retries after the cooldown",
}
_PULL_FIX = "it qualifies again after the cooldown; the reason names what the gateway saw"


def worker_of(traffic: Any, hotkey: str | None, model: str | None) -> Mapping[Any, Any] | None:
    """The control plane's worker for this miner: its hotkey, and its model when one matches."""
    if hotkey is None:
        return None
    workers = [w for w in _list(_map(traffic).get("workers")) if isinstance(w, Mapping) and w.get("miner") == hotkey]
    return next((w for w in workers if w.get("model") == model), workers[0] if workers else None)


def legs_of(gateway: Any, hotkey: str | None) -> list[Mapping[Any, Any]]:
    if hotkey is None:
        return []
    return [leg for leg in _list(_map(gateway).get("legs")) if isinstance(leg, Mapping) and leg.get("miner") == hotkey]


def legs_cell(miner: Any) -> Cell:
    """Legs admitted of those dialled: "4 legs ✔", "3/4 legs ⚠", "0/4 legs ✘", "dialling"."""
    miner = _map(miner)
    up, legs = _int(miner.get("legs_up")), _int(miner.get("legs"))
    if up is None or legs is None:
        return Cell(f"legs {NA}", "na")
    if legs <= 0:
        return Cell("dialling the gateway …")
    if up >= legs:
        return Cell(f"{plural(legs, 'leg')} {OK}", "ok")
    return Cell(f"{up:,}/{legs:,} legs {BAD if up <= 0 else WARN}", "error" if up <= 0 else "warning")


def eligibility_cell(worker: Any, *, has_traffic: bool, hotkey: str | None) -> Cell:
    """The gateway's verdict on this miner: active ✔, probing, pulled ✘, new; "own" for a
    first-party worker (eligible whatever its state); n/a when this node cannot see it."""
    if hotkey is None:
        return Cell(f"eligibility {NA} (hotkey not known)", "na")
    if not has_traffic:
        return Cell(f"eligibility {NA} (decided at the gateway)", "na")
    worker = _map(worker)
    if not worker:
        return Cell("eligibility: not known to the gateway yet", "na")
    state = _text(worker.get("state"))
    own = " own" if worker.get("first_party") is True else ""
    if state == "active":
        return Cell(f"eligibility: active{own} {OK}", "ok")
    if state == "pulled":
        return Cell(f"eligibility: pulled{own} {BAD}", "error")
    if state == "probing":
        return Cell(f"eligibility: probing{own} (qualifying)", "info")
    if state == "new":
        return Cell(f"eligibility: new{own} (not connected)", "na")
    return Cell(f"eligibility: {state or NA}{own}", "" if state else "na")


def link_title(miner: Any, worker: Any, *, has_traffic: bool, hotkey: str | None, url: str | None = None) -> str:
    """ "wss://… · 4 legs ✔ · eligibility: active ✔"."""
    parts = [url, legs_cell(miner).text, eligibility_cell(worker, has_traffic=has_traffic, hotkey=hotkey).text]
    return SEP.join(p for p in parts if p)


def heartbeat_cell(legs: Sequence[Mapping[Any, Any]]) -> Cell | None:
    """The oldest heartbeat the gateway holds from this miner's legs (a local gateway's view),
    ⚠ past `HEARTBEAT_LATE_S`; None without legs."""
    ages = [age for age in (_num(leg.get("heartbeat_age_s")) for leg in legs) if age is not None]
    if not legs:
        return None
    if not ages:
        return Cell(f"heartbeat {NA}", "na")
    oldest = max(ages)
    if oldest > HEARTBEAT_LATE_S:
        return Cell(f"heartbeat {format_duration(oldest)} ago {WARN}", "warning")
    return Cell(f"heartbeat {format_duration(oldest)} ago")


def served_line(worker: Any) -> Line | None:
    """The breaker's window of served requests at the gateway: "served 120 (0 failed) in 60 s"."""
    window = _map(_map(worker).get("window"))
    if not window:
        return None
    requests, failed = _int(window.get("requests")), _int(window.get("failed"))
    span = format_duration(SERVED_WINDOW_S)
    if requests is None:
        return (Cell("served "), NA_CELL)
    if failed is None:
        return (Cell(f"served {requests:,} ({NA} failed) in {span}"),)
    return (
        Cell(
            f"served {requests:,} ({failed:,} failed{f' {WARN}' if failed else ''}) in {span}",
            "warning" if failed else "",
        ),
    )


def _round_text(worker: Mapping[Any, Any]) -> str | None:
    rnd = _map(worker.get("round"))
    probes = _int(rnd.get("probes"))
    if not probes:
        return None
    parts = [f"{count_text(rnd.get('ok'))}/{probes:,} probes ok", f"{count_text(rnd.get('pass'))} pass"]
    for key in ("unproven", "cheat"):
        if _int(rnd.get(key)):
            parts.append(f"{count_text(rnd.get(key))} {key}")
    return ", ".join(parts)


def link_lines(
    miner: Any, worker: Any, legs: Sequence[Mapping[Any, Any]], *, now: float, has_traffic: bool
) -> list[Line]:
    """In flight over the miner's slots and the heartbeat; how long it has been in its
    eligibility state and the control plane's own reason; the served window."""
    miner, worker = _map(miner), _map(worker)
    first: list[Cell] = [
        Cell("in flight "),
        Cell(f"{count_text(miner.get('inflight'))}/{count_text(miner.get('max_inflight'))}"),
    ]
    if _int(miner.get("inflight")) is None:
        first[1] = Cell(first[1].text, "na")
    beat = heartbeat_cell(legs)
    if beat is not None:
        first += [Cell(SEP), beat]
    lines: list[Line] = [tuple(first)]
    if worker:
        state = _text(worker.get("state")) or NA
        since = format_age(now, worker.get("since"))
        reason = _text(worker.get("reason"))
        text = f"{state} for {since}" if since else state
        lines.append((Cell(text + (f": {reason}" if reason else "")),))
        if state == "probing":
            progress = _round_text(worker)
            lines.append(
                (Cell(f"qualifying round: {progress or 'no probe finished yet'}", "info" if progress else "na"),)
            )
        served = served_line(worker)
        if served is not None:
            lines.append(served)
    elif has_traffic:
        lines.append((Cell("the gateway on this node has not seen this miner yet", "na"),))
    return lines


def link_summary(
    miner: Any, worker: Any, legs: Sequence[Mapping[Any, Any]], *, now: float, has_traffic: bool, hotkey: str | None
) -> Line:
    """The link on one line, for a compact block: legs, eligibility and for how long, in flight,
    heartbeat, and the gateway's served and audited windows."""
    miner, worker = _map(miner), _map(worker)
    eligibility = eligibility_cell(worker, has_traffic=has_traffic, hotkey=hotkey)
    # Under the "gateway:" label the state word says it ("active own ✔"); n/a keeps its why.
    eligibility = eligibility._replace(text=eligibility.text.removeprefix("eligibility: "))
    cells: list[Cell] = [legs_cell(miner), Cell(SEP), eligibility]
    since = format_age(now, worker.get("since")) if worker else None
    if since:
        cells.append(Cell(f" for {since}"))
    inflight = _int(miner.get("inflight"))
    cells += [
        Cell(f"{SEP}in flight "),
        Cell(f"{count_text(inflight)}/{count_text(miner.get('max_inflight'))}", "" if inflight is not None else "na"),
    ]
    beat = heartbeat_cell(legs)
    if beat is not None:
        cells += [Cell(SEP), beat]
    for line in (served_line(worker), gateway_proof_line(worker)):
        if line is not None:
            cells += [Cell(SEP), *line]
    return tuple(cells)


def _report(worker: Mapping[Any, Any]) -> Mapping[Any, Any] | None:
    """A first-party worker's latest transition when it is a breaker report (it would have been
    pulled: `from == to`), else None."""
    history = [entry for entry in _list(worker.get("history")) if isinstance(entry, Mapping)]
    if worker.get("first_party") is not True or not history:
        return None
    last = history[-1]
    return last if last.get("from") == last.get("to") and last.get("code") in _BREAKER_CODES else None


def link_notes(miner: Any, worker: Any, *, now: float) -> list[Line]:
    """What is wrong with the link, and what to do: no leg admitted, legs down, pulled (with the
    control plane's reason and the cooldown), a first-party worker that would have been pulled."""
    miner, worker = _map(miner), _map(worker)
    notes: list[Line] = []
    up, legs = _int(miner.get("legs_up")), _int(miner.get("legs"))
    if up is not None and legs is not None and legs > 0:
        if up <= 0:
            notes += [
                (Cell(f"{BAD} no leg to the gateway is admitted: it routes no request here", "error"),),
                (
                    Cell("  → fix: ", "error"),
                    Cell(
                        "the miner.link log says why: a deny names the refused key or "
                        "hotkey; a lost leg re-dials by itself with backoff"
                    ),
                ),
            ]
        elif up < legs:
            notes.append(
                (
                    Cell(
                        f"{WARN} {legs - up:,} of {legs:,} legs down: the gateway workers behind them route "
                        "nothing here; they re-dial by themselves (the miner.link log says why)",
                        "warning",
                    ),
                )
            )
    if _text(worker.get("state")) == "pulled":
        history = [entry for entry in _list(worker.get("history")) if isinstance(entry, Mapping)]
        pull = next((entry for entry in reversed(history) if entry.get("to") == "pulled"), {})
        code = _text(pull.get("code"))
        until = _num(worker.get("until"))
        left = ""
        if until is not None and math.isfinite(now):
            left = f" · {format_duration(until - now)} of cooldown left" if until > now else " · cooldown over"
        notes.append(
            (
                Cell(
                    f"{BAD} pulled by the gateway{f' ({code})' if code else ''}{left}: "
                    f"{_text(worker.get('reason')) or 'no reason given'}",
                    "error",
                ),
            )
        )
        notes.append((Cell("  → fix: ", "error"), Cell(_PULL_FIXES.get(code or "", _PULL_FIX))))
    report = _report(worker)
    if report is not None:
        code = _text(report.get("code")) or ""
        notes.append(
            (
                Cell(
                    f"{WARN} would have been pulled ({code}), kept as first-party: "
                    f"{_text(report.get('reason')) or code}",
                    "warning",
                ),
            )
        )
        notes.append((Cell("  → fix: ", "warning"), Cell(_PULL_FIXES.get(code, _PULL_FIX))))
    return notes
