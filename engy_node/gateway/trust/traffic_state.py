"""The traffic control plane's data (docs/trust.md): what it is fed, its numbers, what it keeps.

The observations `traffic.step` folds in (a worker connected or went away, a probe or a paid
request finished, a verdict arrived), `TrafficPolicy` (every threshold, each with the reasoning
for its default), `TrafficState` (one (miner, model)'s state and the windows the breaker reads),
the `Transition`s reported, and the two ways a state begins: `initial_state` for a worker just
learned of, `resumed_state` for one a restarted control plane finds in the store. `eligible` reads
a state for the router. The state machine itself, and why it is shaped so, is `traffic.py`.

Pure, like `traffic.py`: plain frozen data and its validation, stdlib only. Malformed values raise
ValueError naming the field: they are gateway bugs.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Literal, Protocol

from engy_node.proof import VerdictKind
from engy_node.protocol import standing

__all__ = [
    "Eligibility",
    "Judged",
    "LatencyCeilings",
    "Observation",
    "PaidFinished",
    "PaidVerdict",
    "ProbeFinished",
    "ProbeOutcome",
    "ProbeVerdict",
    "Served",
    "TrafficPolicy",
    "TrafficState",
    "Transition",
    "TransitionCode",
    "WorkerConnected",
    "WorkerDisconnected",
    "checked_count",
    "eligible",
    "initial_state",
    "resumed_state",
]


class Eligibility(enum.StrEnum):
    """The eligibility state of one (miner, model). The values are stable names for logs,
    metrics and the hub."""

    NEW = "new"
    PROBING = "probing"
    ACTIVE = "active"
    PULLED = "pulled"


TransitionCode = Literal[
    "connected",
    "disconnected",
    "qualified",
    "not-qualified",
    "round-timeout",
    "cheat",
    "failures-in-a-row",
    "failure-rate",
    "slow-ttft",
    "slow-tpot",
    "unproven-rate",
    "cooldown-over",
]
"""Why a transition happened, as a short stable code for metrics; `Transition.reason` says it
in words, with the numbers."""

_VERDICTS = ("pass", "cheat", "unproven")


class LatencyCeilings(Protocol):
    """The per-model latency ceilings qualification and the breaker compare against.
    `engy_node.models.ModelSpec` satisfies this as is."""

    @property
    def qual_ttft_p99_ms(self) -> int: ...

    @property
    def qual_tpot_p99_ms(self) -> int: ...


# --- validation helpers -------------------------------------------------------------------------


def checked_count(name: str, value: object, *, minimum: int = 0) -> int:
    """`value` as a whole count of at least `minimum`, or ValueError naming `name` (shared with
    `traffic_probes`, whose buyer mix holds counts too)."""
    # bool is an int subclass; a True latency is always a bug.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def _request_id(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"request_id must be a non-empty string, got {value!r}")
    return value


def _latency(name: str, value: object) -> None:
    # Whole milliseconds, so percentiles are exact; the shell rounds its float timings.
    if value is not None:
        checked_count(name, value)


def _verdict(value: object) -> None:
    if value not in _VERDICTS:
        raise ValueError(f"verdict must be one of {', '.join(_VERDICTS)}, got {value!r}")


# --- observations ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerConnected:
    """The (miner, model) now has at least one live leg. The shell sends this when the first leg
    serving the model is admitted, not for every leg."""


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerDisconnected:
    """The last live leg of the (miner, model) went away."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Finished:
    request_id: str
    ok: bool
    """The answer completed (what a buyer would have got as a 2xx with a full body)."""
    ttft_ms: int | None = None
    """Time to first token, whole milliseconds; None when none came."""
    tpot_ms: int | None = None
    """Time per output token after the first, whole milliseconds; None with fewer than two."""

    def __post_init__(self) -> None:
        _request_id(self.request_id)
        if not isinstance(self.ok, bool):
            raise ValueError(f"ok must be a bool, got {self.ok!r}")
        _latency("ttft_ms", self.ttft_ms)
        _latency("tpot_ms", self.tpot_ms)


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeFinished(_Finished):
    """A probe's response ended, well or not. Its verdict, if it is audited, comes later."""


@dataclasses.dataclass(frozen=True, slots=True)
class PaidFinished(_Finished):
    """A paid request the worker served ended. Not sent for a buyer hang-up (499): that says
    nothing about the miner. A gateway timeout (504) or a miner error (502) is `ok=False`."""


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """A verifier's verdict on one of this worker's probes (docs/verification.md)."""

    request_id: str
    verdict: VerdictKind

    def __post_init__(self) -> None:
        _request_id(self.request_id)
        _verdict(self.verdict)


@dataclasses.dataclass(frozen=True, slots=True)
class PaidVerdict:
    """A verifier's verdict on one of this worker's audited paid requests (docs/verification.md)."""

    request_id: str
    verdict: VerdictKind

    def __post_init__(self) -> None:
        _request_id(self.request_id)
        _verdict(self.verdict)


Observation = WorkerConnected | WorkerDisconnected | ProbeFinished | PaidFinished | ProbeVerdict | PaidVerdict


# --- policy ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class TrafficPolicy:
    """The numbers of the traffic control plane. One policy serves every model; the latency
    ceilings are per model and come from the catalog (`LatencyCeilings`)."""

    # Qualification ------------------------------------------------------------------------------
    min_probes: int = 20
    """Finished probes and, separately, `pass` verdicts a round needs before the worker is active.
    Twenty catches what qualification is for, broken and wrong-model workers, with certainty (they
    fail or cheat on every probe). It is not the guard against a miner that cheats on a fraction f
    of requests: such a miner passes 20 audited probes with probability (1 - f)^20, 36 % at
    f = 5 %, 1 % at f = 20 %; audits of paid traffic and active-phase probes catch it later. At
    the default gaps (mean about 6.9 s) a round takes about 2.3 minutes plus the verifier's lag."""
    max_probes: int = 40
    """A round that has not qualified by this many finished probes stops being probed; once it can
    no longer qualify it is lost. Twice `min_probes` leaves room for `max_unproven_probes` and for
    verdicts still in flight. Up to 100 probes, 99 % success means no failure at all and a
    nearest-rank p99 is the maximum, so at the default one failed or slow probe loses the round."""
    min_success_pct: int = 99
    """Finished probes that succeeded, in whole percent of the round (docs/trust.md)."""
    max_unproven_probes: int = 2
    """`unproven` probe verdicts a round tolerates. They never count as a pass (qualification asks
    for every probe's proof verified, docs/trust.md), so the round still needs `min_probes`
    passes, but one honest audit failure (an evicted tee entry, a failed recompute) does not lose
    it. Two is 10 % of
    `min_probes`, ten times the rate honest causes should reach; the third loses the round."""
    round_timeout_s: float = 1800.0
    """A round that has not qualified this long after it started is lost. The worst case of
    probing, `max_probes` at the longest gap (40 × 30 s = 20 min), plus ten minutes of verifier
    lag. A verifier that is down therefore blocks qualification rather than waving workers in."""

    # Circuit breaker ----------------------------------------------------------------------------
    window_s: float = standing.SERVED_WINDOW_S
    """Served requests (paid, and probes while active) count for the breaker this long after they
    end: docs/trust.md's "within about a minute"."""
    failures_in_a_row: int = 3
    """This many failed requests in a row within the window pull the worker whatever the sample
    size, so a dead worker on a quiet model goes within three requests. An honest worker at the
    99 % bar fails three in a row with probability 10^-6 per request."""
    min_requests: int = 10
    """Served requests in the window before the failure rate is judged."""
    max_failure_pct: int = 10
    """The worker is pulled when more than this share (whole percent) of the window's requests
    failed. With 10 to 19 requests that means two failures; an honest worker at 1 % fails twice in
    ten with probability 0.4 %."""
    min_slow: int = 2
    """Requests over the model's latency ceiling in the window before slowness pulls, besides the
    window's nearest-rank p99 being over the ceiling. Below 100 samples the p99 is the maximum,
    so one outlier (one very long prompt) would pull; at 100 samples the p99 first goes over the
    ceiling with the second slow request, and requiring two keeps that tolerance on small samples."""
    verdict_window_s: float = standing.VERDICT_WINDOW_S
    """Verdicts count for the unproven rate this long after they arrive. Longer than `window_s`
    because only a sample of paid traffic is audited and verdicts trickle in after the verifier's
    lag, so a minute would rarely hold `min_verdicts`."""
    min_verdicts: int = 10
    """Verdicts in the verdict window before the unproven rate is judged."""
    max_unproven_pct: int = standing.MAX_UNPROVEN_PCT
    """The worker is pulled when more than this share (whole percent) of its recent verdicts are
    `unproven` (docs/verification.md: a miner must not hide behind unusable proofs). Honest causes stay near
    zero; 20 % leaves room for a verifier hiccup over a short window."""
    max_window_entries: int = 1000
    """Most recent served requests (and, separately, verdicts) the windows keep, so a busy worker's
    state stays bounded; 1,000 requests a minute is past any one worker's throughput today."""

    # Cooldown -----------------------------------------------------------------------------------
    cooldown_s: float = 300.0
    """A pulled worker waits this long before qualifying again, doubled for each further pull in a
    row up to `max_cooldown_s`, so a flapping worker spends less and less time in rotation."""
    max_cooldown_s: float = 3600.0
    cheat_cooldown_s: float = 3600.0
    """The cooldown after a cheat verdict, whatever the strikes. A cheat is established
    misbehaviour, not bad luck; the epoch's cheat gate (docs/trust.md, "Settlement") is the lasting penalty."""
    strike_reset_s: float = 3600.0
    """A worker pulled after this long in `active` starts its strikes afresh: it was not
    flapping."""
    reconnect_grace_s: float = 30.0
    """An active worker whose legs all went away keeps `active` for this long, so a reconnecting
    link does not cost a whole qualification round. The grace gives a miner nothing it lacks
    anyway: what runs behind a live connection can change at any moment too, which is why the
    breaker and audits keep judging active workers. Past the grace the worker is `new`."""

    # Probe pacing -------------------------------------------------------------------------------
    qualifying_gap_min_s: float = 1.0
    qualifying_gap_scale_s: float = 6.0
    qualifying_gap_max_s: float = 30.0
    """Gaps between probes while `probing`: the minimum plus an exponential draw of this scale,
    truncated at the maximum (see `next_probe_at`)."""
    active_gap_min_s: float = 5.0
    active_gap_scale_s: float = 120.0
    active_gap_max_s: float = 600.0
    """Gaps between probes while `active`: a probe every two minutes or so, a small share of a
    busy worker's traffic and enough evidence for the breaker on a quiet one."""

    def __post_init__(self) -> None:
        for name in (
            "min_probes",
            "max_probes",
            "failures_in_a_row",
            "min_requests",
            "min_slow",
            "min_verdicts",
            "max_window_entries",
        ):
            checked_count(name, getattr(self, name), minimum=1)
        checked_count("max_unproven_probes", self.max_unproven_probes)
        for name in ("min_success_pct", "max_failure_pct", "max_unproven_pct"):
            if checked_count(name, getattr(self, name)) > 100:
                raise ValueError(f"{name} is a whole percentage, 0 to 100, got {getattr(self, name)!r}")
        for field in dataclasses.fields(self):
            if field.name.endswith("_s"):
                _seconds(field.name, getattr(self, field.name))
        if self.max_probes < self.min_probes:
            raise ValueError(f"max_probes ({self.max_probes}) must be >= min_probes ({self.min_probes})")
        if self.max_cooldown_s < self.cooldown_s:
            raise ValueError(f"max_cooldown_s ({self.max_cooldown_s}) must be >= cooldown_s ({self.cooldown_s})")
        for phase in ("qualifying", "active"):
            low, high = getattr(self, f"{phase}_gap_min_s"), getattr(self, f"{phase}_gap_max_s")
            if high < low:
                raise ValueError(f"{phase}_gap_max_s ({high}) must be >= {phase}_gap_min_s ({low})")


# --- state ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeOutcome:
    """One probe of the current qualification round."""

    request_id: str
    ok: bool
    ttft_ms: int | None
    tpot_ms: int | None
    verdict: VerdictKind | None = None
    """None until the verifier answers. The first verdict stands; only a `cheat` replaces it."""


@dataclasses.dataclass(frozen=True, slots=True)
class Served:
    """One request in the breaker's window: a paid request, or a probe sent while active."""

    request_id: str
    at: float
    ok: bool
    ttft_ms: int | None
    tpot_ms: int | None
    probe: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Judged:
    """One verdict in the breaker's verdict window (`pass` or `unproven`; a cheat acts at once)."""

    request_id: str
    at: float
    verdict: VerdictKind


@dataclasses.dataclass(frozen=True, slots=True)
class TrafficState:
    """Everything the decisions about one (miner, model) read. Build it with `initial_state`;
    advance it only with `step` and `tick`."""

    miner: str
    model: str
    state: Eligibility
    since: float
    """When `state` was entered."""
    reason: str
    """Why, in words: the reason of the last transition or report."""
    first_party: bool = False
    """The operator's own worker: always eligible, never pulled (module docstring)."""
    connected: bool = False
    disconnected_at: float | None = None
    """When an active worker lost its last leg; None while connected."""
    until: float | None = None
    """While `pulled`: when the cooldown ends."""
    strikes: int = 0
    """Pulls in a row (see `TrafficPolicy.strike_reset_s`); sets the length of the next cooldown."""
    round_started: float | None = None
    """When the current qualification round began; None outside `probing`."""
    probes: tuple[ProbeOutcome, ...] = ()
    """The current qualification round, in the order the probes finished. Kept after the round
    qualifies, so a late verdict on one of its probes is still matched (a late cheat pulls)."""
    served: tuple[Served, ...] = ()
    """The breaker's window of served requests, oldest first."""
    verdicts: tuple[Judged, ...] = ()
    """The breaker's window of verdicts, oldest first."""

    def to_json(self) -> dict[str, object]:
        """A summary for the hub: the state and why, and counts rather than the windows."""
        round_verdicts = [probe.verdict for probe in self.probes]
        return {
            "miner": self.miner,
            "model": self.model,
            "state": self.state.value,
            "since": self.since,
            "reason": self.reason,
            "eligible": eligible(self),
            "first_party": self.first_party,
            "connected": self.connected,
            "until": self.until,
            "strikes": self.strikes,
            "round": {
                "probes": len(self.probes),
                "ok": sum(1 for probe in self.probes if probe.ok),
                "pass": round_verdicts.count("pass"),
                "unproven": round_verdicts.count("unproven"),
                "cheat": round_verdicts.count("cheat"),
            },
            "window": {
                "requests": len(self.served),
                "failed": sum(1 for entry in self.served if not entry.ok),
                "verdicts": len(self.verdicts),
                "unproven": sum(1 for entry in self.verdicts if entry.verdict == "unproven"),
            },
        }


@dataclasses.dataclass(frozen=True, slots=True)
class Transition:
    """One decision for the log and the hub. `from_state == to_state` marks a report that changes
    no state: a first-party worker that would have been pulled, or a cheat verdict that extends a
    pulled worker's cooldown."""

    from_state: Eligibility
    to_state: Eligibility
    reason: str
    at: float
    code: TransitionCode

    def to_json(self) -> dict[str, object]:
        return {
            "from": self.from_state.value,
            "to": self.to_state.value,
            "reason": self.reason,
            "at": self.at,
            "code": self.code,
        }


def initial_state(*, miner: str, model: str, now: float, first_party: bool = False) -> TrafficState:
    """The state of a (miner, model) the gateway has just learned of: `new`, not connected."""
    for name, value in (("miner", miner), ("model", model)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    if not isinstance(first_party, bool):
        raise ValueError(f"first_party must be a bool, got {first_party!r}")
    reason = "configured first-party worker: eligible without qualification" if first_party else "not yet connected"
    return TrafficState(
        miner=miner, model=model, state=Eligibility.NEW, since=now, reason=reason, first_party=first_party
    )


def resumed_state(
    *,
    miner: str,
    model: str,
    stored: Eligibility,
    since: float,
    reason: str,
    now: float,
    policy: TrafficPolicy = TrafficPolicy(),
    first_party: bool = False,
) -> TrafficState:
    """The state of a (miner, model) as a control plane starting up finds it in the store (a
    restarted gateway, or another host of a fleet taking over as leader), not yet connected.

    * `active` stays active, as if its leg had just dropped: it keeps its eligibility when it
      reconnects within `reconnect_grace_s` (miners re-dial within seconds), and must qualify
      again otherwise.
    * `pulled` stays pulled. The store keeps when the pull began, not when its cooldown ends, so
      the resumed cooldown is the longest any pull can have (`max_cooldown_s`, or
      `cheat_cooldown_s` if longer) from that beginning: a restart errs toward keeping a suspect
      miner out, never toward letting a cheat back early.
    * `new` and `probing` start afresh: a qualification round's probes are not in the store.
    """
    state = initial_state(miner=miner, model=model, now=now, first_party=first_party)
    if first_party or stored not in (Eligibility.ACTIVE, Eligibility.PULLED):
        return state
    reason = reason if reason.startswith(_RESUMED) else _RESUMED + reason
    if stored is Eligibility.ACTIVE:
        return dataclasses.replace(state, state=Eligibility.ACTIVE, since=since, disconnected_at=now, reason=reason)
    until = since + max(policy.max_cooldown_s, policy.cheat_cooldown_s)
    return dataclasses.replace(state, state=Eligibility.PULLED, since=since, until=until, strikes=1, reason=reason)


_RESUMED = "resumed from the store: "


def eligible(state: TrafficState) -> bool:
    """Whether the router may send this worker paid traffic: it is `active`, or first-party.

    Whether it has a free slot, or a live leg at all, is the pool's and the router's concern."""
    return state.first_party or state.state is Eligibility.ACTIVE
