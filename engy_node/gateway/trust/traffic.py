"""Which miner workers may serve paid traffic: the traffic control plane's decisions (docs/trust.md).

Per (miner, model), an eligibility state machine fed with observations: the worker connected or
went away, a probe or a paid request finished, a verifier's verdict on one of them arrived.
`step` folds one observation into the state and returns the state changes it caused, each with
a human-readable reason; `tick` makes the changes that only time causes (a cooldown ends, a
disconnected worker stays away too long, a qualification round runs out of time). The
observations, the policy's numbers and the state are `traffic_state.py`'s (with `eligible`,
whether the router may see the worker); when to send the next probe and what it looks like,
`traffic_probes.py`'s. This module is the state machine's edges.

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
from collections.abc import Sequence
from typing import Any

from engy_node.gateway.trust.traffic_state import (
    Eligibility,
    Judged,
    LatencyCeilings,
    Observation,
    PaidFinished,
    PaidVerdict,
    ProbeFinished,
    ProbeOutcome,
    ProbeVerdict,
    Served,
    TrafficPolicy,
    TrafficState,
    Transition,
    TransitionCode,
    WorkerConnected,
    WorkerDisconnected,
)
from engy_node.percentile import nearest_rank

__all__ = ["step", "tick"]


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
    return float(min(policy.cooldown_s * 2 ** min(strikes - 1, 32), policy.max_cooldown_s))


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
