"""The gateway link block: does the gateway route requests to this miner?

Its legs (admitted of those dialled), its eligibility at the gateway (active, probing, pulled,
new) and for how long, in flight over its slots, the oldest heartbeat, the qualifying round's
progress, what it has served since the gateway started and the breaker's view of the last
minute, and what is wrong with the link and its fix (the gateway's deny reason or the last dial
error, quoted; legs down, pulled and the cooldown, a first-party worker that would have been
pulled).

Where the facts come from: the miner's component, `MinerState` (`engy_node.miner.link
.GatewayLink.publish`: legs_up, legs, inflight; `_set_trouble`: link_error, denied;
`role.run_miner`: max_inflight, model); on a
gateway node, the traffic worker (`TrafficStanding`) whose `miner` is this miner's hotkey
(`engy_node.gateway.trust.traffic_state.TrafficState.to_json`: state, since, reason, first_party, until,
round, window, lifetime, history) and the gateway's `legs` (`GatewayLeg`, `MinerPool.snapshot`)
of that hotkey, for heartbeats; the network's `miner_ws` for the URL. Not published, so not
shown: the URL of a remote gateway, when it admitted the miner, and requests served per day.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from engy_node.protocol.standing import SERVED_WINDOW_S
from engy_node.snapshots import (
    GatewayLeg,
    GatewayState,
    MinerState,
    StandingChange,
    TrafficPolicyState,
    TrafficStanding,
)
from engy_tui.widgets.cells import NA, Cell, format_age, format_duration
from engy_tui.widgets.cells import as_number as _num
from engy_tui.widgets.cells import as_text as _text
from engy_tui.widgets.miner.common import BAD, OK, SEP, WARN, Line, count_text, plural
from engy_tui.widgets.miner.proofs import audited_cells, verdict_breaker_cell

__all__ = [
    "HEARTBEAT_LATE_S",
    "eligibility_cell",
    "heartbeat_cell",
    "legs_cell",
    "legs_of",
    "link_lines",
    "link_notes",
    "link_summary",
    "link_trouble",
    "link_title",
    "served_breaker_cell",
    "served_line",
    "work_summary",
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


def worker_of(traffic: TrafficPolicyState | None, hotkey: str | None, model: str | None) -> TrafficStanding | None:
    """The control plane's worker for this miner: its hotkey, and its model when one matches."""
    if hotkey is None or traffic is None:
        return None
    workers = [w for w in traffic.workers if w.miner == hotkey]
    return next((w for w in workers if w.model == model), workers[0] if workers else None)


def legs_of(gateway: GatewayState | None, hotkey: str | None) -> list[GatewayLeg]:
    if hotkey is None or gateway is None:
        return []
    return [leg for leg in gateway.legs if leg.miner == hotkey]


def link_trouble(miner: MinerState | None) -> tuple[str, str] | None:
    """Why no leg is up, as the link published it: ("denied", the gateway's reason) or ("down",
    the last dial error); None when it published neither (or a leg is up again)."""
    if miner is None:
        return None
    denied, error = _text(miner.denied), _text(miner.link_error)
    return ("denied", denied) if denied else ("down", error) if error else None


def legs_cell(miner: MinerState | None) -> Cell:
    """Legs admitted of those dialled: "4 legs ✔", "3/4 legs ⚠", "0/4 legs ✘", "dialling"; before
    any leg is planned, "denied ✘" or "link down ✘" when the link says why."""
    up, legs = (miner.legs_up, miner.legs) if miner else (None, None)
    trouble = link_trouble(miner)
    if trouble is not None and (up is None or legs is None or legs <= 0):
        return Cell(f"{'denied by the gateway' if trouble[0] == 'denied' else 'link down'} {BAD}", "error")
    if up is None or legs is None:
        return Cell(f"legs {NA}", "na")
    if legs <= 0:
        return Cell("dialling the gateway …")
    if up >= legs:
        return Cell(f"{plural(legs, 'leg')} {OK}", "ok")
    return Cell(f"{up:,}/{legs:,} legs {BAD if up <= 0 else WARN}", "error" if up <= 0 else "warning")


def eligibility_cell(worker: TrafficStanding | None, *, has_traffic: bool, hotkey: str | None) -> Cell:
    """The gateway's verdict on this miner: active ✔, probing, pulled ✘, new; "own" for a
    first-party worker (eligible whatever its state); n/a when this node cannot see it."""
    if hotkey is None:
        return Cell(f"eligibility {NA} (hotkey not known)", "na")
    if not has_traffic:
        return Cell(f"eligibility {NA} (decided at the gateway)", "na")
    if worker is None:
        return Cell("eligibility: not known to the gateway yet", "na")
    state = _text(worker.state)
    own = " own" if worker.first_party else ""
    if state == "active":
        return Cell(f"eligibility: active{own} {OK}", "ok")
    if state == "pulled":
        return Cell(f"eligibility: pulled{own} {BAD}", "error")
    if state == "probing":
        return Cell(f"eligibility: probing{own} (qualifying)", "info")
    if state == "new":
        return Cell(f"eligibility: new{own} (not connected)", "na")
    return Cell(f"eligibility: {state or NA}{own}", "" if state else "na")


def link_title(
    miner: MinerState | None,
    worker: TrafficStanding | None,
    *,
    has_traffic: bool,
    hotkey: str | None,
    url: str | None = None,
) -> str:
    """ "wss://… · 4 legs ✔ · eligibility: active ✔"."""
    parts = [url, legs_cell(miner).text, eligibility_cell(worker, has_traffic=has_traffic, hotkey=hotkey).text]
    return SEP.join(p for p in parts if p)


def heartbeat_cell(legs: Sequence[GatewayLeg]) -> Cell | None:
    """The oldest heartbeat the gateway holds from this miner's legs (a local gateway's view),
    ⚠ past `HEARTBEAT_LATE_S`; None without legs."""
    ages = [age for age in (_num(leg.heartbeat_age_s) for leg in legs) if age is not None]
    if not legs:
        return None
    if not ages:
        return Cell(f"heartbeat {NA}", "na")
    oldest = max(ages)
    if oldest > HEARTBEAT_LATE_S:
        return Cell(f"heartbeat {format_duration(oldest)} ago {WARN}", "warning")
    return Cell(f"heartbeat {format_duration(oldest)} ago")


def served_breaker_cell(worker: TrafficStanding) -> Cell:
    """The served requests the breaker weighs now, labelled as its view: "breaker, last 60 s:
    14 served, 0 failed"; a failure in it is ⚠ (failures in a row, or too many, pull)."""
    window = worker.window
    failed = window.failed
    return Cell(
        f"breaker, last {format_duration(SERVED_WINDOW_S)}: {window.requests:,} served, "
        f"{failed:,} failed{f' {WARN}' if failed else ''}",
        "warning" if failed else "",
    )


def _served_cell(worker: TrafficStanding) -> Cell:
    life = worker.lifetime
    if life is None:
        return Cell(f"served {NA}", "na")
    return Cell(f"served {life.served:,} ({life.failed:,} failed)")


def served_line(worker: TrafficStanding | None) -> Line | None:
    """What the gateway served this miner since it started, then the breaker's window:
    "served 120 (2 failed) · breaker, last 60 s: 14 served, 0 failed"; None without a worker."""
    if worker is None:
        return None
    return (_served_cell(worker), Cell(SEP), served_breaker_cell(worker))


def _round_text(worker: TrafficStanding) -> str | None:
    rnd = worker.round
    probes = rnd.probes
    if probes <= 0:
        return None
    parts = [f"{count_text(rnd.ok)}/{probes:,} probes ok", f"{count_text(rnd.passed)} pass"]
    for word, count in (("unproven", rnd.unproven), ("cheat", rnd.cheat)):
        if count:
            parts.append(f"{count_text(count)} {word}")
    return ", ".join(parts)


def _inflight_cell(miner: MinerState | None) -> Cell:
    inflight, most = (miner.inflight, miner.max_inflight) if miner else (None, None)
    return Cell(f"{count_text(inflight)}/{count_text(most)}", "" if inflight is not None else "na")


def link_lines(
    miner: MinerState | None,
    worker: TrafficStanding | None,
    legs: Sequence[GatewayLeg],
    *,
    now: float,
    has_traffic: bool,
) -> list[Line]:
    """In flight over the miner's slots and the heartbeat; how long it has been in its
    eligibility state and the control plane's own reason; what it served, and the breaker's
    window of it."""
    first: list[Cell] = [Cell("in flight "), _inflight_cell(miner)]
    beat = heartbeat_cell(legs)
    if beat is not None:
        first += [Cell(SEP), beat]
    lines: list[Line] = [tuple(first)]
    if worker is not None:
        state = _text(worker.state) or NA
        since = format_age(now, worker.since)
        reason = _text(worker.reason)
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
    miner: MinerState | None,
    worker: TrafficStanding | None,
    legs: Sequence[GatewayLeg],
    *,
    now: float,
    has_traffic: bool,
    hotkey: str | None,
) -> Line:
    """The link on one line, for a compact block: legs, eligibility and for how long, in flight
    and heartbeat (`work_summary` says what it served and had audited)."""
    eligibility = eligibility_cell(worker, has_traffic=has_traffic, hotkey=hotkey)
    # Under the "gateway:" label the state word says it ("active own ✔"); n/a keeps its why.
    eligibility = eligibility._replace(text=eligibility.text.removeprefix("eligibility: "))
    cells: list[Cell] = [legs_cell(miner), Cell(SEP), eligibility]
    since = format_age(now, worker.since) if worker else None
    if since:
        cells.append(Cell(f" for {since}"))
    cells += [Cell(f"{SEP}in flight "), _inflight_cell(miner)]
    beat = heartbeat_cell(legs)
    if beat is not None:
        cells += [Cell(SEP), beat]
    return tuple(cells)


def work_summary(worker: TrafficStanding | None) -> Line | None:
    """What the gateway served and had audited of this miner since it started, and the
    breaker's verdict window, on one line for a compact block: "served 9 (0 failed) · audited
    21: 21 pass, 0 cheat, 0 unproven · breaker, last 5 min: 21 verdicts, 0 unproven ✔". The
    breaker's served window joins only when a request in it failed (⚠). None without a worker."""
    if worker is None:
        return None
    cells: list[Cell] = [_served_cell(worker)]
    if worker.window.failed:
        cells += [Cell(SEP), served_breaker_cell(worker)]
    cells += [Cell(SEP), *audited_cells(worker), Cell(SEP), verdict_breaker_cell(worker)]
    return tuple(cells)


def _report(worker: TrafficStanding) -> StandingChange | None:
    """A first-party worker's latest transition when it is a breaker report (it would have been
    pulled: `from == to`), else None."""
    if not worker.first_party or not worker.history:
        return None
    last = worker.history[-1]
    return last if last.from_state == last.to_state and last.code in _BREAKER_CODES else None


DENIED_FIX = (
    "change what the gateway's reason names (the miner key, or the hotkey and its registration on the "
    "subnet); the legs ask again by themselves every minute"
)
DOWN_FIX = (
    "check the gateway URL (GW, miner.gateway_url) and this machine's network and DNS; the link re-dials "
    "by itself with backoff"
)


def link_notes(miner: MinerState | None, worker: TrafficStanding | None, *, now: float) -> list[Line]:
    """What is wrong with the link, and what to do: denied (the gateway's reason, quoted) or down
    (the last dial error, quoted) with no leg admitted, legs down, pulled (with the control
    plane's reason and the cooldown), a first-party worker that would have been pulled."""
    notes: list[Line] = []
    up, legs = (miner.legs_up, miner.legs) if miner else (None, None)
    trouble = link_trouble(miner)
    none_up = up is None or legs is None or legs <= 0 or up <= 0
    if trouble is not None and none_up:
        kind, why = trouble
        what = "the gateway denies this miner" if kind == "denied" else "cannot reach the gateway"
        notes += [
            (Cell(f"{BAD} {what}: “{why}”; it routes no request here", "error"),),
            (Cell("  → fix: ", "error"), Cell(DENIED_FIX if kind == "denied" else DOWN_FIX)),
        ]
    elif up is not None and legs is not None and legs > 0:
        if up <= 0:
            notes += [
                (Cell(f"{BAD} no leg to the gateway is admitted: it routes no request here", "error"),),
                (Cell("  → fix: ", "error"), Cell("the miner.link log says why; a lost leg re-dials with backoff")),
            ]
        elif up < legs:
            last = f" (last error: “{trouble[1]}”)" if trouble is not None else ""
            notes.append(
                (
                    Cell(
                        f"{WARN} {legs - up:,} of {legs:,} legs down: the gateway workers behind them route "
                        f"nothing here; they re-dial by themselves{last}",
                        "warning",
                    ),
                )
            )
    if worker is None:
        return notes
    if worker.state == "pulled":
        pull = next((entry for entry in reversed(worker.history) if entry.to_state == "pulled"), None)
        code = _text(pull.code) if pull else None
        until = _num(worker.until)
        left = ""
        if until is not None and math.isfinite(now):
            left = f" · {format_duration(until - now)} of cooldown left" if until > now else " · cooldown over"
        notes.append(
            (
                Cell(
                    f"{BAD} pulled by the gateway{f' ({code})' if code else ''}{left}: "
                    f"{_text(worker.reason) or 'no reason given'}",
                    "error",
                ),
            )
        )
        notes.append((Cell("  → fix: ", "error"), Cell(_PULL_FIXES.get(code or "", _PULL_FIX))))
    report = _report(worker)
    if report is not None:
        code = _text(report.code) or ""
        notes.append(
            (
                Cell(
                    f"{WARN} would have been pulled ({code}), kept as first-party: {_text(report.reason) or code}",
                    "warning",
                ),
            )
        )
        notes.append((Cell("  → fix: ", "warning"), Cell(_PULL_FIXES.get(code, _PULL_FIX))))
    return notes
