"""`engy-node status --json`'s `summary`: the facts an operator's script needs about each role of
a node, under names and types that stay put (docs/control-api.md has the table).

Why a summary beside the states: the states (`/v1/status`'s `states`, `engy_node.snapshots`) are
what each component publishes, shaped for the TUI and free to grow; a script reading them has to
know which component holds what (a miner's pass rate is in the gateway's traffic standing of its
hotkey, its incentive in the chain's neurons, its TTFT in a histogram of the metrics) and to join
them itself. The summary does those joins once, here, and says `null` for what this node cannot
know (a standalone miner has no gateway to ask for its verdicts, only a local network publishes a
chain), never 0. The states and their `schema` are unchanged, so `decode_states` readers are not
affected; a field of the summary is removed or changes type only with `SUMMARY_SCHEMA` raised.

Pure: `summarize` takes the decoded states, the metrics snapshot and the roles' verdicts (the
same judges as `engy-node health`, which read files and the clock, so `commands.health` runs
them), and returns plain dataclasses; `encode` makes them JSON and `summary_lines` the text
`engy-node status` prints, so the text and the JSON show the same facts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

from engy_node.alerts.rules import BREAKER_CODES
from engy_node.protocol.gates import finding_text
from engy_node.snapshots import (
    PROOFS,
    ChainState,
    MinerState,
    NodeInfo,
    NodeStates,
    TrafficStanding,
    VerdictCounts,
)

SUMMARY_SCHEMA = 1
"""The version of the summary's shape. Raise it when a field is removed or renamed, changes type
or meaning; adding a field does not need it (readers ignore what they do not know)."""

STATUS_OK = 0
STATUS_STALLED = 1
"""A role's loop is not running (the validator's heartbeat is missing or stale): `health`'s 1."""
STATUS_UNREACHABLE = 2
"""No node answered (not running, another --home, the control port or token refused)."""
STATUS_NOT_WORKING = 3
"""A role runs but does not do its job: `health`'s 3."""

TTFT_METRIC = "engy_miner_ttft_seconds"
TPOT_METRIC = "engy_miner_tpot_seconds"
REQUESTS_METRIC = "engy_miner_requests_total"


@dataclasses.dataclass(frozen=True, slots=True)
class RoleVerdict:
    """Whether one role does its job: `engy-node health`'s judge of it."""

    role: str
    code: int
    """0 doing its job, 1 its loop stalled, 3 running but not doing its job."""
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class AlertSummary:
    rule: str
    level: str
    subject: str
    text: str
    since: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class MinerSummary:
    """One miner of this node (`miner`, or `miner-N` in a local network)."""

    name: str
    model: str | None
    plan: str | None
    hotkey: str | None
    server_state: str | None
    """Its supervised model server's state; null when it uses servers it did not launch."""
    server_restarts: int | None
    server_failure: str | None
    """Why its model server last stopped, and the fix."""
    legs_up: int | None
    legs: int | None
    inflight: int | None
    max_inflight: int | None
    link_error: str | None
    denied: str | None
    traffic_state: str | None
    """Its standing at a gateway on this node (new, qualifying, active, probation, pulled)."""
    served: int | None
    failed: int | None
    audited: int | None
    pass_rate: float | None
    """Passed verdicts over audited ones at that gateway; null before the first verdict."""
    incentive: float | None
    """Its incentive on the chain this node publishes (a local network's dev chain)."""
    weighted_by: int | None
    """Validators whose weights on that chain give it a share."""
    epoch: int | None
    """Its newest published epoch as its gateway told it (null before the first answer, or for a
    miner with no hotkey)."""
    epoch_weight: int | None
    """Its u16 weight in that epoch."""
    gated: tuple[str, ...]
    """Each settlement gate that zeroed a row of that epoch: the gate, the model, the measurement
    against its bar (`protocol.gates.finding_text`); empty when none."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServingSummary:
    """What this node's miners served, from their own metrics (all its miners together)."""

    requests_ok: int | None
    requests_failed: int | None
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None


@dataclasses.dataclass(frozen=True, slots=True)
class ValidatorSummary:
    hotkey: str | None
    uid: int | None
    permit: bool | None
    block: int | None
    last_epoch: int | None
    """The epoch whose weights it last put on chain."""
    last_submit_block: int | None
    blocks_since_submit: int | None
    last_outcome: str | None
    chain_error: str | None
    provider_error: str | None
    cached_vector: bool | None


@dataclasses.dataclass(frozen=True, slots=True)
class GatewaySummary:
    state: str | None
    miners: int
    """Distinct miners holding at least one leg."""
    legs: int
    in_flight: int | None
    eligible: int | None
    """Connected (miner, model)s eligible for paid traffic; null without a traffic policy."""
    requests: int | None
    """Served plus failed since the gateway started, every (miner, model) together."""
    errors: int | None
    audited: int | None
    breaker_open: tuple[str, ...]
    """`miner/model` of each one the circuit breaker pulled."""
    pulled: tuple[str, ...]
    """`miner/model` of each one pulled for another reason (a cheat, a lost round)."""


@dataclasses.dataclass(frozen=True, slots=True)
class VerdictTally:
    passed: int = dataclasses.field(metadata={"key": "pass"})
    cheat: int
    unproven: int


@dataclasses.dataclass(frozen=True, slots=True)
class VerifierSummary:
    state: str | None
    gateway: str | None
    verdicts: VerdictTally
    by_proof: dict[str, VerdictTally]
    """The same verdicts by the proof that judged them (toploc, gemm, recompute)."""


@dataclasses.dataclass(frozen=True, slots=True)
class StatusSummary:
    schema: int
    exit_code: int
    error: str | None
    """Why the node could not be read (exit 2); null when it answered."""
    roles: tuple[RoleVerdict, ...]
    alerts: tuple[AlertSummary, ...]
    miners: tuple[MinerSummary, ...]
    serving: ServingSummary | None
    validator: ValidatorSummary | None
    gateway: GatewaySummary | None
    verifier: VerifierSummary | None


def exit_code(verdicts: Sequence[RoleVerdict]) -> int:
    """The worst verdict: a stalled loop (1) before a role not doing its job (3)."""
    codes = {verdict.code for verdict in verdicts}
    if STATUS_STALLED in codes:
        return STATUS_STALLED
    return max(codes, default=STATUS_OK)


def unreachable(error: str) -> StatusSummary:
    """The summary of a node that could not be read."""
    return StatusSummary(SUMMARY_SCHEMA, STATUS_UNREACHABLE, error, (), (), (), None, None, None, None)


def summarize(
    node: NodeInfo, states: NodeStates, metrics: Mapping[str, Any], verdicts: Sequence[RoleVerdict]
) -> StatusSummary:
    """The summary of a node that answered with `node` (its info), `states` and `metrics`
    (`/v1/status`), whose roles were judged `verdicts`."""
    names = {**states.node.hotkeys, **node.hotkeys}
    alerts = states.alerts.firing if states.alerts is not None else ()
    return StatusSummary(
        schema=SUMMARY_SCHEMA,
        exit_code=exit_code(verdicts),
        error=None,
        roles=tuple(verdicts),
        alerts=tuple(AlertSummary(a.rule, a.level, a.subject, a.text, a.since) for a in alerts),
        miners=tuple(_miner(name, states, names) for name in states.miner_names()),
        serving=_serving(metrics) if states.miners else None,
        validator=_validator(states),
        gateway=_gateway(states),
        verifier=_verifier(states),
    )


def _miner(name: str, states: NodeStates, names: Mapping[str, str]) -> MinerSummary:
    miner = states.miners.get(name) or MinerState()
    server = states.model_servers.get(name)
    hotkey = names.get(name) or miner.hotkey
    worker = _worker(states, hotkey, miner.model)
    lifetime = worker.lifetime if worker is not None else None
    failure = server.last_failure if server is not None else None
    incentive, weighted_by = _chain_standing(states.chain, hotkey)
    epoch = miner.epoch
    return MinerSummary(
        name=name,
        model=miner.model,
        plan=miner.plan,
        hotkey=hotkey,
        server_state=server.state if server is not None else None,
        server_restarts=server.restarts if server is not None else None,
        server_failure=(f"{failure.summary} — {failure.fix}" if failure.fix else failure.summary) or failure.kind
        if failure is not None
        else None,
        legs_up=miner.legs_up,
        legs=miner.legs,
        inflight=miner.inflight,
        max_inflight=miner.max_inflight,
        link_error=miner.link_error,
        denied=miner.denied,
        traffic_state=worker.state if worker is not None else None,
        served=lifetime.served if lifetime is not None else None,
        failed=lifetime.failed if lifetime is not None else None,
        audited=lifetime.audited if lifetime is not None else None,
        pass_rate=lifetime.passed / lifetime.audited if lifetime is not None and lifetime.audited else None,
        incentive=incentive,
        weighted_by=weighted_by,
        epoch=epoch.index if epoch is not None else None,
        epoch_weight=epoch.weight if epoch is not None else None,
        gated=tuple(finding_text(finding) for finding in epoch.gated) if epoch is not None else (),
    )


def _worker(states: NodeStates, hotkey: str | None, model: str | None) -> TrafficStanding | None:
    """The gateway's standing of this miner's hotkey, for its model when one matches."""
    if hotkey is None or states.traffic is None:
        return None
    workers = [worker for worker in states.traffic.workers if worker.miner == hotkey]
    return next((worker for worker in workers if worker.model == model), workers[0] if workers else None)


def _chain_standing(chain: ChainState | None, hotkey: str | None) -> tuple[float | None, int | None]:
    """Incentive and how many permit holders weight it; (None, None) when not known here."""
    if chain is None or hotkey is None:
        return None, None
    mine = next((neuron for neuron in chain.neurons if neuron.hotkey == hotkey), None)
    if mine is None or mine.uid is None:
        return None, None
    weighting = [
        neuron
        for neuron in chain.neurons
        if neuron.permit and neuron.uid is not None and chain.weights.get(neuron.uid, {}).get(mine.uid, 0) > 0
    ]
    return mine.incentive, len(weighting)


def _serving(metrics: Mapping[str, Any]) -> ServingSummary:
    outcomes = _counter(metrics, REQUESTS_METRIC)
    return ServingSummary(
        requests_ok=outcomes.get("ok", 0) if outcomes is not None else None,
        requests_failed=sum(n for o, n in outcomes.items() if o != "ok") if outcomes is not None else None,
        ttft_p99_ms=_p99_ms(metrics, TTFT_METRIC),
        tpot_p99_ms=_p99_ms(metrics, TPOT_METRIC),
    )


def _children(metrics: Mapping[str, Any], name: str) -> list[Mapping[str, Any]] | None:
    family = metrics.get(name)
    if not isinstance(family, Mapping) or not isinstance(family.get("children"), list):
        return None
    return [child for child in family["children"] if isinstance(child, Mapping)]


def _counter(metrics: Mapping[str, Any], name: str) -> dict[str, int] | None:
    """A counter's values by its `outcome` label; None when the snapshot has no such counter."""
    children = _children(metrics, name)
    if children is None:
        return None
    values: dict[str, int] = {}
    for child in children:
        labels, value = child.get("labels"), child.get("value")
        if isinstance(labels, Mapping) and _finite(value):
            key = str(labels.get("outcome"))
            values[key] = values.get(key, 0) + int(value)
    return values


def _p99_ms(metrics: Mapping[str, Any], name: str) -> float | None:
    """The recent window's p99 in ms, the worst over the histogram's series; None when empty."""
    children = _children(metrics, name) or []
    windows = [child.get("window") for child in children]
    values = [
        window.get("p99")
        for window in windows
        if isinstance(window, Mapping) and _finite(window.get("count")) and window.get("count")
    ]
    finite = [value for value in values if _finite(value)]
    return round(1000 * max(finite), 3) if finite else None


def _finite(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _validator(states: NodeStates) -> ValidatorSummary | None:
    validator = states.validator
    if validator is None:
        return None
    return ValidatorSummary(
        hotkey=validator.hotkey,
        uid=validator.uid,
        permit=validator.permit,
        block=validator.block,
        last_epoch=validator.last_applied,
        last_submit_block=validator.last_submit_block,
        blocks_since_submit=validator.blocks_since_submit,
        last_outcome=validator.last_outcome,
        chain_error=validator.chain_error,
        provider_error=validator.provider_error,
        cached_vector=validator.cached_vector,
    )


def _gateway(states: NodeStates) -> GatewaySummary | None:
    gateway = states.gateway
    if gateway is None:
        return None
    workers = states.traffic.workers if states.traffic is not None else None
    lifetimes = [worker.lifetime for worker in workers or ()]
    known = workers is not None and all(lifetime is not None for lifetime in lifetimes)
    counted = [lifetime for lifetime in lifetimes if lifetime is not None]
    pulled = [worker for worker in workers or () if worker.state == "pulled"]
    return GatewaySummary(
        state=gateway.state,
        miners=len({leg.miner for leg in gateway.legs if leg.miner is not None}),
        legs=len(gateway.legs),
        in_flight=gateway.in_flight,
        eligible=sum(1 for w in workers if w.eligible and w.connected) if workers is not None else None,
        requests=sum(lifetime.served + lifetime.failed for lifetime in counted) if known else None,
        errors=sum(lifetime.failed for lifetime in counted) if known else None,
        audited=sum(lifetime.audited for lifetime in counted) if known else None,
        breaker_open=tuple(_name(worker) for worker in pulled if _breaker(worker)),
        pulled=tuple(_name(worker) for worker in pulled if not _breaker(worker)),
    )


def _breaker(worker: TrafficStanding) -> bool:
    return bool(worker.history) and worker.history[-1].code in BREAKER_CODES


def _name(worker: TrafficStanding) -> str:
    return f"{worker.miner}/{worker.model}"


def _tally(counts: VerdictCounts) -> VerdictTally:
    return VerdictTally(counts.passed, counts.cheat, counts.unproven)


def _verifier(states: NodeStates) -> VerifierSummary | None:
    verifier = states.verifier
    if verifier is None:
        return None
    return VerifierSummary(
        state=verifier.state,
        gateway=verifier.gateway,
        verdicts=_tally(verifier.verdicts),
        by_proof={proof: _tally(getattr(verifier.proofs, proof)) for proof in PROOFS},
    )


def encode(value: Any) -> Any:
    """A summary (or any value inside one) as JSON-ready data, with wire keys (`pass`)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            str(field.metadata.get("key", field.name)): encode(getattr(value, field.name))
            for field in dataclasses.fields(value)
        }
    if isinstance(value, tuple | list):
        return [encode(item) for item in value]
    if isinstance(value, Mapping):
        return {key: encode(item) for key, item in value.items()}
    return value


# ---- the same facts as text ------------------------------------------------------------------


def summary_lines(summary: StatusSummary) -> list[str]:
    """The summary's verdicts and figures as `engy-node status` prints them (after the states'
    page, which shows the rest of each role)."""
    marks = {STATUS_OK: "✔", STATUS_STALLED: "✘", STATUS_NOT_WORKING: "✘"}
    lines = ["", f"roles      exit {summary.exit_code}"]
    lines += [f"  {marks.get(v.code, '?')} {v.role}: {v.reason}" for v in summary.roles]
    if not summary.roles:
        lines.append("  no role to judge")
    if summary.serving is not None:
        serving = summary.serving
        lines.append(
            f"  serving  requests {_show(serving.requests_ok)} ok, {_show(serving.requests_failed)} failed · "
            f"TTFT p99 {_ms(serving.ttft_p99_ms)} · TPOT p99 {_ms(serving.tpot_p99_ms)}"
        )
    for miner in summary.miners:
        rate = f"{100 * miner.pass_rate:.1f} %" if miner.pass_rate is not None else "n/a"
        work = (
            f"at the gateway {miner.traffic_state}: served {_show(miner.served)}, failed {_show(miner.failed)}, "
            f"audited {_show(miner.audited)}, pass rate {rate}"
            if miner.traffic_state is not None
            else "served at the gateway, pass rate: n/a (the gateway's, not on this node)"
        )
        earned = (
            f"incentive {miner.incentive:.4f} from {_show(miner.weighted_by)} validator(s)"
            if miner.incentive is not None
            else "incentive n/a (this node publishes no chain state)"
        )
        gated = f" · ✘ gated in epoch {miner.epoch}: {'; '.join(miner.gated)}" if miner.gated else ""
        lines.append(f"  {miner.name}  {work} · {earned}{gated}")
    if summary.gateway is not None:
        gateway = summary.gateway
        lines.append(
            f"  gateway  {gateway.miners} miner(s), {gateway.legs} leg(s), {_show(gateway.eligible)} eligible · "
            f"requests {_show(gateway.requests)}, errors {_show(gateway.errors)}, audited {_show(gateway.audited)} · "
            f"breaker open: {', '.join(gateway.breaker_open) or 'none'} · "
            f"pulled: {', '.join(gateway.pulled) or 'none'}"
        )
    if summary.verifier is not None:
        by_proof = " · ".join(
            f"{proof} {tally.passed}/{tally.cheat}/{tally.unproven}"
            for proof, tally in summary.verifier.by_proof.items()
        )
        lines.append(f"  verifier  pass/cheat/unproven by proof: {by_proof}")
    if summary.validator is not None:
        validator = summary.validator
        lines.append(
            f"  validator  block {_show(validator.block)} · last epoch {_show(validator.last_epoch)} at block "
            f"{_show(validator.last_submit_block)} · last outcome {_show(validator.last_outcome)}"
        )
    return lines


def _show(value: Any) -> str:
    return "n/a" if value is None else str(value)


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f} ms"
