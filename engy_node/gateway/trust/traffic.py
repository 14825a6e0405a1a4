"""Which miner workers may serve paid traffic: the traffic control plane's decisions (docs/trust.md).

Per (miner, model), an eligibility state machine fed with observations: the worker connected or
went away, a probe or a paid request finished, a verifier's verdict on one of them arrived.
`step` folds one observation into the state and returns the state changes it caused, each with
a human-readable reason; `tick` makes the changes that only time causes (a cooldown ends, a
disconnected worker stays away too long, a qualification round runs out of time). `eligible`
says whether the router may see the worker. `next_probe_at` and `probe_plan` say when to send
the next probe and what it looks like.

Pure: no IO, no clock reads, no randomness, stdlib only. `now` (seconds on the gateway's
monotonic clock) and every random draw come in as arguments. The gateway shell owns the
connections, sends the probes, feeds each outcome and verdict to `step`, stores the returned
state, logs every `Transition` and publishes it to the hub. Keeping the decisions here means the
tests can drive every path, and every reachable sequence, without a network, a model or a clock,
and a decision in the log can be replayed from its inputs.

States and their edges::

    new      ── connect ─────────────────────────────────▶ probing
    probing  ── round qualifies ─────────────────────────▶ active
    probing  ── cheat verdict, round lost, round timeout ▶ pulled
    active   ── breaker trips, cheat verdict ────────────▶ pulled
    pulled   ── cooldown over, while connected ──────────▶ probing
    probing  ── disconnect (round dropped) ──────────────▶ new
    active   ── no leg for reconnect_grace_s ────────────▶ new
    new      ── cheat verdict ───────────────────────────▶ pulled
    first-party: new ── connect ──▶ active, and never pulled

* `new`: known, never qualified (or it came back after being away too long). Gets nothing.
* `probing`: one qualification round is running. Gets probes only.
* `active`: qualified; serves paid traffic, still receives an occasional probe, and every
  outcome feeds the circuit breaker.
* `pulled`: taken out by the breaker, a cheat verdict or a failed round. Gets nothing until its
  cooldown is over, then qualifies again from scratch. A pulled worker that disconnects stays
  pulled, so reconnecting never skips a cooldown.

What it trusts. Outcomes and latencies are the gateway's own measurements of what it relayed,
so they are trusted as given; the shell reports no outcome for a request the buyer hung up on
(that says nothing about the miner, settlement's 499 rule). Verdicts come from allow-listed
verifiers (docs/trust.md, "Audit") and are trusted as given: `cheat` is affirmatively established
misbehaviour and pulls at once; `unproven` has honest causes (docs/verification.md), so a single one never
pulls, but it never counts as a pass either, and a rising share of them on served traffic pulls.

What probes can and cannot hide. A worker in `probing` receives nothing but probes, so it can
tell that it is being tested however the probes look; qualification is therefore a gate against
broken, slow and wrong-model workers, not proof of honesty. What keeps a qualified miner honest is
that probes continue at a low rate once it is `active`, mixed into paid traffic and shaped like
it (`probe_plan` draws buyer-like settings; the shell sends them in the same frames with no
marker, at times drawn by `next_probe_at`), and that paid traffic is audited too. A shipped
corpus is public, so a miner could learn its prompts; the corpus must be large and varied enough
that recognising them costs more than serving honestly. That is the corpus's job, not this
module's.

Failure posture. Malformed observations or policies (a negative latency, a verdict that is not
one of the three, a gap range upside down) raise ValueError naming the field: they are gateway
bugs. Observations that merely arrive late or out of place (a probe finishing after its round was
dropped, a verdict for a request outside every window, a duplicate) are ignored, except that a
`cheat` verdict is always acted on, whatever request it names and whatever the state. One verdict
per request counts: a second one for the same request (a re-audit, a replayed message) is
ignored unless it says `cheat`, so a later `unproven` cannot undo a pass that qualified a round.

The cheaper mistake. Pulling an honest worker costs it a cooldown and a few minutes of probes;
leaving a broken or cheating worker in rotation costs buyers failed or wrong answers and the
subnet its reputation. So ambiguity resolves toward pulling: a round with one failed probe is
lost, an `unproven` probe verdict is not a pass, a round that cannot finish in time is lost, and
a verdict that never arrives blocks qualification rather than being assumed good. The few
tolerances there are (two unproven probes a round, the breaker's minimum samples) are each derived
next to their default in `TrafficPolicy`.

First-party workers (configured by the operator) are always eligible: `eligible` says yes
whatever the state, and they skip qualification (`new` goes straight to `active` on connect). The
breaker and verdicts still judge them, so the operator sees degradation: where another worker
would be pulled, a first-party worker gets a `Transition` whose `from_state` equals its
`to_state`, carrying the reason, and its breaker windows start afresh so the report repeats only
on new evidence. The operator, not this module, decides what to do about their own machine.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from engy_node.percentile import nearest_rank
from engy_node.proof import VerdictKind
from engy_node.protocol import standing

__all__ = [
    "DEFAULT_MAX_TOKENS_MIX",
    "DEFAULT_SAMPLING_MIX",
    "PROBE_PLAN_DRAWS",
    "BuyerMix",
    "Eligibility",
    "Judged",
    "LatencyCeilings",
    "Observation",
    "PaidFinished",
    "PaidVerdict",
    "ProbeFinished",
    "ProbeOutcome",
    "ProbePlan",
    "ProbeVerdict",
    "SamplingShape",
    "Served",
    "TrafficPolicy",
    "TrafficState",
    "Transition",
    "TransitionCode",
    "WorkerConnected",
    "WorkerDisconnected",
    "eligible",
    "initial_state",
    "next_probe_at",
    "probe_plan",
    "step",
    "tick",
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


def _count(name: str, value: object, *, minimum: int = 0) -> int:
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
        _count(name, value)


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
            _count(name, getattr(self, name), minimum=1)
        _count("max_unproven_probes", self.max_unproven_probes)
        for name in ("min_success_pct", "max_failure_pct", "max_unproven_pct"):
            if _count(name, getattr(self, name)) > 100:
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


# --- the decisions ------------------------------------------------------------------------------


def tick(
    state: TrafficState, *, now: float, policy: TrafficPolicy = TrafficPolicy()
) -> tuple[TrafficState, list[Transition]]:
    """The changes time alone makes, at `now`. The shell calls it every few seconds (once a
    second is plenty); `step` calls it first too, so a late tick never lets an observation meet a
    stale state.

    * The breaker's windows drop entries older than their span (no transition: the breaker
      judges only when new evidence arrives, so every pull names what it saw).
    * `pulled`, connected, cooldown over: `probing`, with a fresh round.
    * `active`, no leg for `reconnect_grace_s` (not first-party): `new`.
    * `probing` for `round_timeout_s` without qualifying: `pulled` (code `round-timeout`).
    """
    state = _prune(state, now=now, policy=policy)
    if state.state is Eligibility.PULLED and state.connected and state.until is not None and now >= state.until:
        return _start_round(
            state,
            now=now,
            code="cooldown-over",
            reason=f"cooldown over after {_secs(now - state.since)}: qualifying again",
        )
    if (
        state.state is Eligibility.ACTIVE
        and not state.first_party
        and not state.connected
        and state.disconnected_at is not None
        and now - state.disconnected_at >= policy.reconnect_grace_s
    ):
        gone = _secs(now - state.disconnected_at)
        return _move(
            state,
            Eligibility.NEW,
            now=now,
            code="disconnected",
            reason=f"disconnected for {gone} (grace {_secs(policy.reconnect_grace_s)}): must qualify again",
            disconnected_at=None,
            round_started=None,
            probes=(),
            served=(),
            verdicts=(),
        )
    if (
        state.state is Eligibility.PROBING
        and state.round_started is not None
        and now - state.round_started >= policy.round_timeout_s
    ):
        tally = _Tally.of(state.probes)
        detail = (
            f"did not qualify within {_secs(policy.round_timeout_s)}: {tally.passed}/{policy.min_probes} "
            f"verdicts pass, {tally.pending} pending, {tally.finished} probes finished"
        )
        return _pull(state, now=now, policy=policy, code="round-timeout", detail=detail)
    return state, []


def step(
    state: TrafficState,
    observation: Observation,
    *,
    now: float,
    policy: TrafficPolicy = TrafficPolicy(),
    model_terms: LatencyCeilings,
) -> tuple[TrafficState, list[Transition]]:
    """Fold one observation into the state at `now`; return the new state and what changed.

    `tick` runs first, then the observation:

    * `WorkerConnected`: `new` → `probing` (first-party: `new` → `active`); a `pulled` worker
      whose cooldown is over starts probing; an active worker inside its grace just reconnects.
    * `WorkerDisconnected`: `probing` → `new`, the round dropped (probes cannot reach it, and
      probes cut by the disconnect would count as failures); `active` waits out the grace in
      `tick`; `pulled` stays pulled.
    * `ProbeFinished` / `ProbeVerdict` while `probing`: recorded in the round, which then
      qualifies (→ `active`), is lost (→ `pulled`, code `not-qualified`) once it cannot qualify
      within `max_probes`, or goes on.
    * `ProbeFinished` / `PaidFinished` / verdicts while `active`: into the breaker's windows,
      then the breaker rules, in order: `failures-in-a-row`, `failure-rate`, `slow-ttft`,
      `slow-tpot`, `unproven-rate`. The first that holds pulls.
    * A `cheat` verdict on any request of this worker, in any state: `pulled` at once (code
      `cheat`), with `cheat_cooldown_s`; if already pulled, the cooldown is extended.

    Qualification, all at once over the round: at least `min_probes` finished probes, successes
    at least `min_success_pct` of them, at least `min_probes` `pass` verdicts, no `cheat`, at
    most `max_unproven_probes` `unproven`, and the nearest-rank p99 of the successful probes'
    TTFT and TPOT at most the model's ceilings (a measure no probe carried is not judged).
    Verdicts still pending do not block a round that already has its passes; if one of them
    later says `cheat`, the worker is pulled from `active`.
    """
    state, transitions = tick(state, now=now, policy=policy)
    if isinstance(observation, WorkerConnected):
        state, more = _connected(state, now=now, policy=policy)
    elif isinstance(observation, WorkerDisconnected):
        state, more = _disconnected(state, now=now)
    elif isinstance(observation, (ProbeFinished, PaidFinished)):
        state, more = _finished(state, observation, now=now, policy=policy, terms=model_terms)
    elif isinstance(observation, (ProbeVerdict, PaidVerdict)):
        state, more = _judged(state, observation, now=now, policy=policy, terms=model_terms)
    else:
        raise ValueError(f"not a traffic observation: {type(observation).__name__}")
    return state, transitions + more


def next_probe_at(
    state: TrafficState, *, now: float, policy: TrafficPolicy = TrafficPolicy(), rng_value: float
) -> float | None:
    """When the shell should send this worker its next probe, or None for no probe now.

    `probing` workers are probed until the round has `max_probes` finished probes; connected
    `active` workers (first-party too) keep getting the occasional probe; `new` and `pulled`
    workers get none. The shell calls this after each probe is sent and after each transition.

    The gap is the phase's `*_gap_min_s` plus an exponential draw of scale `*_gap_scale_s`,
    truncated at `*_gap_max_s` by inverting its distribution function at `rng_value` (uniform in
    [0, 1), drawn by the shell). Exponential gaps are memoryless, as independent buyers' arrivals
    are, so the times of past probes say nothing about the next one; the minimum keeps probes from
    bunching and the truncation bounds how long a round can take. The result is always after `now`
    and within [now + min, now + max].
    """
    if isinstance(rng_value, bool) or not isinstance(rng_value, (int, float)) or not 0.0 <= rng_value < 1.0:
        raise ValueError(f"rng_value must be a float in [0, 1), got {rng_value!r}")
    if state.state is Eligibility.PROBING and len(state.probes) < policy.max_probes:
        low, scale, high = policy.qualifying_gap_min_s, policy.qualifying_gap_scale_s, policy.qualifying_gap_max_s
    elif state.state is Eligibility.ACTIVE and state.connected:
        low, scale, high = policy.active_gap_min_s, policy.active_gap_scale_s, policy.active_gap_max_s
    else:
        return None
    # F(x) = (1 - e^(-x/scale)) / (1 - e^(-span/scale)) on [0, span]; x = F^-1(u).
    span = high - low
    gap = low - scale * math.log1p(-rng_value * -math.expm1(-span / scale))
    gap = min(max(gap, low), high)
    return max(now + gap, math.nextafter(now, math.inf))


# --- probe shapes -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingShape:
    """One sampling setting buyers send, with its share of requests."""

    weight: int
    temperature: float | None
    """None: the buyer sent none (the model's default applies)."""
    top_p: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class ProbePlan:
    """The shape of one probe request, as plain data; the shell builds the request from it."""

    prompt_index: int
    """Which corpus entry to send."""
    max_tokens: int
    temperature: float | None
    top_p: float | None
    stream: bool


# Not measured yet: common client behaviour, to be replaced by the mix the request log shows
# (the shell can build a `BuyerMix` from recent paid requests). Most SDK calls send no sampling
# at all; agents and evaluations pin greedy; chat front-ends favour 0.7 and 0.6/0.95.
DEFAULT_SAMPLING_MIX: tuple[SamplingShape, ...] = (
    SamplingShape(weight=35, temperature=None, top_p=None),
    SamplingShape(weight=10, temperature=0.0, top_p=None),
    SamplingShape(weight=25, temperature=0.7, top_p=None),
    SamplingShape(weight=10, temperature=0.7, top_p=0.95),
    SamplingShape(weight=10, temperature=0.6, top_p=0.95),
    SamplingShape(weight=10, temperature=1.0, top_p=None),
)

# (weight, max_tokens); None is a buyer that sends none, which the buyer APIs resolve to the
# model's maximum (`openai_api._max_tokens`). Values past the model's maximum are clamped to it,
# since a buyer sending more is refused and a probe must look like an accepted request.
DEFAULT_MAX_TOKENS_MIX: tuple[tuple[int, int | None], ...] = (
    (30, None),
    (10, 256),
    (15, 512),
    (20, 1024),
    (10, 2048),
    (10, 4096),
    (5, 8192),
)

PROBE_PLAN_DRAWS = 4
"""Random values `probe_plan` takes: prompt, max_tokens, sampling, stream, in that order."""


@dataclasses.dataclass(frozen=True, slots=True)
class BuyerMix:
    """How buyers shape their requests, for probes to copy."""

    sampling: tuple[SamplingShape, ...] = DEFAULT_SAMPLING_MIX
    max_tokens: tuple[tuple[int, int | None], ...] = DEFAULT_MAX_TOKENS_MIX
    stream_pct: int = 80
    """Whole percent of requests that stream; not measured yet (chat front-ends and agents stream)."""

    def __post_init__(self) -> None:
        if not self.sampling or not self.max_tokens:
            raise ValueError("a buyer mix needs at least one sampling shape and one max_tokens value")
        for shape in self.sampling:
            _count("sampling weight", shape.weight)
        for weight, value in self.max_tokens:
            _count("max_tokens weight", weight)
            if value is not None:
                _count("max_tokens", value, minimum=1)
        if sum(shape.weight for shape in self.sampling) == 0 or sum(weight for weight, _ in self.max_tokens) == 0:
            raise ValueError("a buyer mix's weights must not all be zero")
        if _count("stream_pct", self.stream_pct) > 100:
            raise ValueError(f"stream_pct is a whole percentage, 0 to 100, got {self.stream_pct!r}")


def probe_plan(
    *, corpus: Sequence[object], draws: Sequence[float], max_output_tokens: int, mix: BuyerMix = BuyerMix()
) -> ProbePlan:
    """A buyer-like probe: a corpus prompt and settings drawn from `mix`.

    Args:
        corpus: the probe prompts; only its length is read here (the index comes back).
        draws: `PROBE_PLAN_DRAWS` values, each uniform in [0, 1), drawn by the shell:
            prompt, max_tokens, sampling, stream.
        max_output_tokens: the model's limit; `max_tokens` never exceeds it.
        mix: the buyer mix to copy.

    Each draw picks one thing, by inverting a weighted choice, so equal draws give equal plans
    and each setting appears in proportion to its weight.

    Raises:
        ValueError: an empty corpus, the wrong number of draws, a draw outside [0, 1), or a
            `max_output_tokens` below 1.
    """
    if not corpus:
        raise ValueError("the probe corpus is empty; ship at least one prompt")
    if len(draws) != PROBE_PLAN_DRAWS:
        raise ValueError(
            f"draws must hold {PROBE_PLAN_DRAWS} values (prompt, max_tokens, sampling, stream), got {len(draws)}"
        )
    for index, value in enumerate(draws):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
            raise ValueError(f"draws[{index}] must be a float in [0, 1), got {value!r}")
    _count("max_output_tokens", max_output_tokens, minimum=1)
    prompt_draw, tokens_draw, sampling_draw, stream_draw = draws
    prompt_index = min(int(prompt_draw * len(corpus)), len(corpus) - 1)
    requested = _weighted([value for _, value in mix.max_tokens], [weight for weight, _ in mix.max_tokens], tokens_draw)
    shape = _weighted(list(mix.sampling), [shape.weight for shape in mix.sampling], sampling_draw)
    return ProbePlan(
        prompt_index=prompt_index,
        max_tokens=max_output_tokens if requested is None else min(requested, max_output_tokens),
        temperature=shape.temperature,
        top_p=shape.top_p,
        stream=stream_draw * 100 < mix.stream_pct,
    )


def _weighted(values: list, weights: list[int], draw: float):
    target = min(int(draw * sum(weights)), sum(weights) - 1)
    for value, weight in zip(values, weights):
        if target < weight:
            return value
        target -= weight
    raise AssertionError("unreachable: target < sum(weights)")


# --- internals ------------------------------------------------------------------------------------


def _secs(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


def _move(
    state: TrafficState, to: Eligibility, *, now: float, code: TransitionCode, reason: str, **changes: Any
) -> tuple[TrafficState, list[Transition]]:
    moved = dataclasses.replace(state, state=to, since=now, reason=reason, **changes)
    return moved, [Transition(state.state, to, reason, now, code)]


def _report(
    state: TrafficState, *, now: float, code: TransitionCode, reason: str, **changes: Any
) -> tuple[TrafficState, list[Transition]]:
    reported = dataclasses.replace(state, reason=reason, **changes)
    return reported, [Transition(state.state, state.state, reason, now, code)]


def _start_round(
    state: TrafficState, *, now: float, code: TransitionCode, reason: str
) -> tuple[TrafficState, list[Transition]]:
    return _move(
        state,
        Eligibility.PROBING,
        now=now,
        code=code,
        reason=reason,
        until=None,
        round_started=now,
        probes=(),
        served=(),
        verdicts=(),
    )


def _cooldown(strikes: int, policy: TrafficPolicy) -> float:
    # Doubling stops at the cap long before 2**strikes could overflow a float.
    return min(policy.cooldown_s * 2 ** min(strikes - 1, 32), policy.max_cooldown_s)


def _pull(
    state: TrafficState, *, now: float, policy: TrafficPolicy, code: TransitionCode, detail: str
) -> tuple[TrafficState, list[Transition]]:
    """Pull the worker (or report, for a first-party worker or one already pulled)."""
    cheat = code == "cheat"
    if state.first_party:
        return _report(
            state,
            now=now,
            code=code,
            reason=f"degraded (first-party, stays eligible): {detail}",
            served=(),
            verdicts=(),
        )
    if state.state is Eligibility.PULLED:
        # Only a cheat reaches a pulled worker: its cooldown runs to the later of the two ends.
        until = max(state.until if state.until is not None else now, now + policy.cheat_cooldown_s)
        return _report(
            state,
            now=now,
            code=code,
            until=until,
            reason=f"still pulled: {detail}; cooldown ends in {_secs(until - now)}",
        )
    fresh = state.state is Eligibility.ACTIVE and now - state.since >= policy.strike_reset_s
    strikes = 1 if fresh else state.strikes + 1
    cooldown = _cooldown(strikes, policy)
    if cheat:
        cooldown = max(cooldown, policy.cheat_cooldown_s)
    return _move(
        state,
        Eligibility.PULLED,
        now=now,
        code=code,
        until=now + cooldown,
        strikes=strikes,
        round_started=None,
        served=(),
        verdicts=(),
        disconnected_at=None,
        reason=f"pulled: {detail}; qualifies again after {_secs(cooldown)} (strike {strikes})",
    )


def _prune(state: TrafficState, *, now: float, policy: TrafficPolicy) -> TrafficState:
    served = state.served
    if served and served[0].at <= now - policy.window_s:
        served = tuple(entry for entry in served if entry.at > now - policy.window_s)
    verdicts = state.verdicts
    if verdicts and verdicts[0].at <= now - policy.verdict_window_s:
        verdicts = tuple(entry for entry in verdicts if entry.at > now - policy.verdict_window_s)
    if served is state.served and verdicts is state.verdicts:
        return state
    return dataclasses.replace(state, served=served, verdicts=verdicts)


def _connected(state: TrafficState, *, now: float, policy: TrafficPolicy) -> tuple[TrafficState, list[Transition]]:
    state = dataclasses.replace(state, connected=True, disconnected_at=None)
    if state.state is Eligibility.NEW:
        if state.first_party:
            return _move(
                state,
                Eligibility.ACTIVE,
                now=now,
                code="connected",
                reason="connected: first-party, eligible without qualification",
            )
        return _start_round(state, now=now, code="connected", reason="connected: qualifying with probes")
    if state.state is Eligibility.PULLED:
        # A cooldown that ended while the worker was away: the tick that would have started the
        # round waited for a connection.
        return tick(state, now=now, policy=policy)
    return state, []


def _disconnected(state: TrafficState, *, now: float) -> tuple[TrafficState, list[Transition]]:
    if state.state is Eligibility.PROBING:
        finished = len(state.probes)
        return _move(
            state,
            Eligibility.NEW,
            now=now,
            code="disconnected",
            connected=False,
            round_started=None,
            probes=(),
            reason=f"disconnected during qualification: round dropped after {finished} probes",
        )
    if state.state is Eligibility.ACTIVE and state.connected:
        return dataclasses.replace(state, connected=False, disconnected_at=now), []
    return dataclasses.replace(state, connected=False), []


def _finished(
    state: TrafficState,
    observation: ProbeFinished | PaidFinished,
    *,
    now: float,
    policy: TrafficPolicy,
    terms: LatencyCeilings,
) -> tuple[TrafficState, list[Transition]]:
    probe = isinstance(observation, ProbeFinished)
    if state.state is Eligibility.PROBING and probe:
        if any(entry.request_id == observation.request_id for entry in state.probes):
            return state, []
        outcome = ProbeOutcome(observation.request_id, observation.ok, observation.ttft_ms, observation.tpot_ms)
        return _judge_round(
            dataclasses.replace(state, probes=state.probes + (outcome,)), now=now, policy=policy, terms=terms
        )
    if state.state is Eligibility.ACTIVE:
        entry = Served(observation.request_id, now, observation.ok, observation.ttft_ms, observation.tpot_ms, probe)
        served = (state.served + (entry,))[-policy.max_window_entries :]
        return _judge_breaker(dataclasses.replace(state, served=served), now=now, policy=policy, terms=terms)
    # A request that ends after its worker left the state that counts it (pulled, dropped round).
    return state, []


def _judged(
    state: TrafficState,
    observation: ProbeVerdict | PaidVerdict,
    *,
    now: float,
    policy: TrafficPolicy,
    terms: LatencyCeilings,
) -> tuple[TrafficState, list[Transition]]:
    probe = isinstance(observation, ProbeVerdict)
    in_round = probe and any(entry.request_id == observation.request_id for entry in state.probes)
    if in_round:
        state = dataclasses.replace(
            state,
            probes=tuple(
                dataclasses.replace(entry, verdict=observation.verdict)
                if entry.request_id == observation.request_id
                and (entry.verdict is None or observation.verdict == "cheat")
                else entry
                for entry in state.probes
            ),
        )
    if observation.verdict == "cheat":
        what = "probe" if probe else "request"
        return _pull(
            state, now=now, policy=policy, code="cheat", detail=f"cheat verdict on {what} {observation.request_id}"
        )
    if state.state is Eligibility.PROBING and in_round:
        return _judge_round(state, now=now, policy=policy, terms=terms)
    if state.state is Eligibility.ACTIVE and not in_round:
        if any(entry.request_id == observation.request_id for entry in state.verdicts):
            return state, []
        entry = Judged(observation.request_id, now, observation.verdict)
        verdicts = (state.verdicts + (entry,))[-policy.max_window_entries :]
        return _judge_breaker(dataclasses.replace(state, verdicts=verdicts), now=now, policy=policy, terms=terms)
    return state, []


@dataclasses.dataclass(frozen=True, slots=True)
class _Tally:
    finished: int
    ok: int
    passed: int
    unproven: int
    cheat: int
    pending: int

    @classmethod
    def of(cls, probes: Sequence[ProbeOutcome]) -> _Tally:
        verdicts = [probe.verdict for probe in probes]
        ok = sum(1 for probe in probes if probe.ok)
        return cls(
            finished=len(probes),
            ok=ok,
            passed=verdicts.count("pass"),
            unproven=verdicts.count("unproven"),
            cheat=verdicts.count("cheat"),
            pending=sum(1 for probe in probes if probe.ok and probe.verdict is None),
        )


def _p99_tolerance(samples: int) -> int:
    # Samples that may exceed a ceiling while the nearest-rank p99 stays at or under it: the
    # p99 is the value at rank ceil(0.99 n), so n - ceil(0.99 n) values may sit above it.
    return samples - (99 * samples + 99) // 100


def _latency_line(name: str, samples: list[int], ceiling: int) -> str:
    if not samples:
        return f"no {name} sample"
    return f"{name} p99 {nearest_rank(sorted(samples), 99)} ms ≤ {ceiling} ms"


def _judge_round(
    state: TrafficState, *, now: float, policy: TrafficPolicy, terms: LatencyCeilings
) -> tuple[TrafficState, list[Transition]]:
    tally = _Tally.of(state.probes)
    ttft_ceiling, tpot_ceiling = terms.qual_ttft_p99_ms, terms.qual_tpot_p99_ms
    ttft = [probe.ttft_ms for probe in state.probes if probe.ok and probe.ttft_ms is not None]
    tpot = [probe.tpot_ms for probe in state.probes if probe.ok and probe.tpot_ms is not None]
    remaining = max(policy.max_probes - tally.finished, 0)
    last = state.probes[-1].request_id if state.probes else "-"

    # Lost: even if every probe still to come succeeds fast and every pending verdict passes, the
    # round cannot meet the bar within max_probes.
    final_size = max(tally.finished, policy.max_probes)
    failed = tally.finished - tally.ok
    lost: str | None = None
    if failed * 100 > (100 - policy.min_success_pct) * final_size:
        allowed = (100 - policy.min_success_pct) * final_size // 100
        lost = (
            f"{failed} of {tally.finished} probes failed (last {last}); {policy.min_success_pct} % success "
            f"over up to {final_size} probes allows {allowed}"
        )
    elif tally.unproven > policy.max_unproven_probes:
        lost = f"{tally.unproven} unproven probe verdicts (tolerates {policy.max_unproven_probes})"
    elif tally.passed + tally.pending + remaining < policy.min_probes:
        lost = (
            f"at most {tally.passed + tally.pending + remaining} verdicts can still pass of {policy.min_probes} needed"
        )
    else:
        for name, samples, ceiling in (("ttft", ttft, ttft_ceiling), ("tpot", tpot, tpot_ceiling)):
            slow = sum(1 for value in samples if value > ceiling)
            allowed = _p99_tolerance(len(samples) + remaining)
            if slow > allowed:
                lost = (
                    f"{slow} of {len(samples)} probes over the {name} ceiling of {ceiling} ms "
                    f"(slowest {max(samples)} ms); "
                    f"a p99 over up to {len(samples) + remaining} probes allows {allowed}"
                )
                break
    if lost is not None:
        return _pull(state, now=now, policy=policy, code="not-qualified", detail=f"did not qualify: {lost}")

    qualified = (
        tally.finished >= policy.min_probes
        and tally.ok * 100 >= policy.min_success_pct * tally.finished
        and tally.passed >= policy.min_probes
        and tally.cheat == 0
        and tally.unproven <= policy.max_unproven_probes
        and (not ttft or nearest_rank(sorted(ttft), 99) <= ttft_ceiling)
        and (not tpot or nearest_rank(sorted(tpot), 99) <= tpot_ceiling)
    )
    if not qualified:
        return state, []
    unproven = f", {tally.unproven} unproven" if tally.unproven else ""
    pending = f", {tally.pending} pending" if tally.pending else ""
    reason = (
        f"qualified: {tally.ok}/{tally.finished} probes ok, {tally.passed} verdicts pass{unproven}{pending}, "
        f"{_latency_line('ttft', ttft, ttft_ceiling)}, {_latency_line('tpot', tpot, tpot_ceiling)}"
    )
    return _move(
        state, Eligibility.ACTIVE, now=now, code="qualified", reason=reason, round_started=None, served=(), verdicts=()
    )


def _judge_breaker(
    state: TrafficState, *, now: float, policy: TrafficPolicy, terms: LatencyCeilings
) -> tuple[TrafficState, list[Transition]]:
    window = _secs(policy.window_s)
    served = state.served
    failed = sum(1 for entry in served if not entry.ok)
    streak = served[-policy.failures_in_a_row :]
    if len(streak) == policy.failures_in_a_row and not any(entry.ok for entry in streak):
        return _pull(
            state,
            now=now,
            policy=policy,
            code="failures-in-a-row",
            detail=f"{policy.failures_in_a_row} failures in a row within {window} (last {streak[-1].request_id})",
        )
    if len(served) >= policy.min_requests and failed * 100 > policy.max_failure_pct * len(served):
        return _pull(
            state,
            now=now,
            policy=policy,
            code="failure-rate",
            detail=f"{failed}/{len(served)} requests failed within {window} (over {policy.max_failure_pct} %)",
        )
    latencies: tuple[tuple[TransitionCode, str, int], ...] = (
        ("slow-ttft", "ttft", terms.qual_ttft_p99_ms),
        ("slow-tpot", "tpot", terms.qual_tpot_p99_ms),
    )
    for code, name, ceiling in latencies:
        samples = [
            getattr(entry, f"{name}_ms") for entry in served if entry.ok and getattr(entry, f"{name}_ms") is not None
        ]
        slow = sum(1 for value in samples if value > ceiling)
        if slow >= policy.min_slow and nearest_rank(sorted(samples), 99) > ceiling:
            return _pull(
                state,
                now=now,
                policy=policy,
                code=code,
                detail=f"{name} p99 {nearest_rank(sorted(samples), 99)} ms > {ceiling} ms over {len(samples)} requests "
                f"within {window} ({slow} slow)",
            )
    judged = len(state.verdicts)
    unproven = sum(1 for entry in state.verdicts if entry.verdict == "unproven")
    if judged >= policy.min_verdicts and unproven * 100 > policy.max_unproven_pct * judged:
        return _pull(
            state,
            now=now,
            policy=policy,
            code="unproven-rate",
            detail=f"{unproven}/{judged} verdicts unproven within {_secs(policy.verdict_window_s)} "
            f"(over {policy.max_unproven_pct} %)",
        )
    return state, []
