"""`engy-node status`: a running node's state as a page of text, from its control API snapshot.

Pure: `format_status` decodes the `/v1/status` document into the snapshot types
(`snapshots.decode_states`, liberal: a part it cannot read reads as missing) and turns them into
lines, saying "n/a" for what the node does not report rather than guessing. Whatever roles the
node runs, each section appears only when its component does: the chain and the validator's
weights (and why the chain or the provider is unreachable), the published epochs, the miners with
their eligibility and their verdicts by the proof that judged them (a miner that announced no
GEMM audits is flagged as judged by TOPLOC alone), the verifier's verdicts likewise, the demo
traffic, and this node's own miners: each one's plan,
its model server (and why it stopped), its link to the gateway (legs, in flight, and the dial
error or the gateway's deny reason, quoted, with the fix), and the `weights_root` of the
checkpoint it hands its model server with whether it is the one the catalog pins (and, loudly,
a cheat it was told to simulate), and its newest published epoch: its weight, or the settlement
gate that zeroed it, by how much, the fix and when the next epoch ends; a reference server run on
its own (`engy-node serve`) likewise, with its checkpoint's `weights_root`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from engy_node.durations import duration_text
from engy_node.protocol.epoch import WEIGHT_MAX
from engy_node.protocol.gates import MinerEpoch, block_time_s, finding_text, restore_text
from engy_node.snapshots import (
    GEMM_AND_TOPLOC,
    AlertsState,
    ChainState,
    EpochsState,
    GatewayLeg,
    GatewayState,
    MinerState,
    ModelServerState,
    NodeInfo,
    NodeStates,
    ProofVerdicts,
    ServeState,
    TrafficPolicyState,
    TrafficStanding,
    ValidatorState,
    decode,
    decode_states,
    gemm_audited,
)


def format_status(status: Mapping[str, Any], *, now: float | None = None) -> str:
    """The `/v1/status` document as text."""
    states = decode_states(_map(status.get("states")))
    return status_text(decode(NodeInfo, _map(status.get("node"))), states, now=now)


def status_text(node: NodeInfo, states: NodeStates, *, now: float | None = None) -> str:
    """A node's info and decoded states as text (what the TUI's overview shows)."""
    now = time.time() if now is None else now
    lines = [_header(node, now), *_alerts(states.alerts)]
    names = {ss58: name for name, ss58 in node.hotkeys.items()}
    if states.network is not None:
        network = states.network
        lines += [
            f"buyer API  {_show(network.buyer_api)}   (key in {_show(network.details)})",
            f"provider   {_show(network.provider_api)} · miners dial {_show(network.miner_ws)}",
        ]
    if states.chain is not None:
        lines += _chain(states.chain, names)
    if states.validator is not None:
        lines += _validator(states.validator, names, now)
    if states.epochs is not None:
        lines += _epochs(states.epochs, names)
    if states.gateway is not None:
        lines += _gateway(states.gateway)
    if states.traffic is not None:
        lines += _miners(states.traffic, states.gateway.legs if states.gateway is not None else (), names, now)
    if states.miners:
        lines += _serving(states, now)
    if states.serve is not None:
        lines += _reference_server(states.serve)
    if states.verifier is not None:
        verifier = states.verifier
        verdicts = verifier.verdicts
        tally = (
            f"pass {verdicts.passed}, cheat {verdicts.cheat}, unproven {verdicts.unproven}"
            if verdicts.total
            else "none yet"
        )
        lines += ["", f"verifier   {_show(verifier.state)}; verdicts: {tally}"]
        if verifier.proofs != ProofVerdicts():
            lines.append(f"  by proof  {verifier.proofs.summary()}")
    if states.traffic_generator is not None:
        demo = states.traffic_generator
        lines += [
            "",
            f"demo traffic  {'paused' if demo.paused else 'running'}: {demo.sent} sent by the demo buyer, "
            f"{demo.succeeded} ok, {demo.failed} failed"
            + (f" (last error: {demo.last_error})" if demo.last_error and demo.failed else ""),
        ]
    return "\n".join(lines)


def _alerts(alerts: AlertsState | None) -> list[str]:
    """The alerts firing now, first, since they are what an operator came to see (none: no line,
    unless posting them to a webhook failed)."""
    if alerts is None:
        return []
    lines = [f"⚠ alert {alert.rule}: {alert.text}" for alert in alerts.firing]
    if alerts.failed and alerts.last_error:
        lines.append(f"⚠ {alerts.failed} alert notification(s) not delivered: {alerts.last_error}")
    return lines


def _gateway(gateway: GatewayState) -> list[str]:
    """The gateway's legs and how much of the prompts its miners served from their caches (what
    prefix-affinity routing earns)."""
    cache = gateway.prompt_cache
    hit = (
        f"{100 * cache.hit_rate:.1f} % of {cache.prompt_tokens} prompt tokens from the miners' caches"
        if cache is not None and cache.hit_rate is not None
        else "no prompts settled yet"
    )
    return ["", f"gateway    {_show(gateway.state)}; {len(gateway.legs)} miner leg(s); prefix cache: {hit}"]


def _header(node: NodeInfo, now: float) -> str:
    roles = ", ".join(node.roles) or "n/a"
    started = _elapsed(now, node.started_at)
    uptime = f", up {started}" if started is not None else ""
    return f"engy-node {_show(node.version, '?')} (pid {_show(node.pid, '?')}): {roles}{uptime}"


def _who(hotkey: str | None, names: Mapping[str, str]) -> str:
    if hotkey is None:
        return "n/a"
    return names.get(hotkey) or f"{hotkey[:10]}…"


def _chain(chain: ChainState, names: Mapping[str, str]) -> list[str]:
    lines = [
        "",
        f"chain      {_show(chain.network)}, netuid {_show(chain.netuid)}, block {_show(chain.block)}"
        f" ({_show(chain.block_time_s)} s blocks), tempo {_show(chain.tempo)}, "
        f"epochs run {_show(chain.epochs_run)}",
    ]
    if chain.neurons:
        lines.append(
            f"  {'uid':>3}  {'name':<12} {'stake':>10}  {'permit':<6} {'last_update':>11}  {'incentive':>9}  {'emission':>10}"
        )
        for neuron in chain.neurons:
            lines.append(
                f"  {_show(neuron.uid):>3}  {_who(neuron.hotkey, names):<12} {_num(neuron.stake):>10}  "
                f"{'yes' if neuron.permit else 'no':<6} {_show(neuron.last_update):>11}  "
                f"{_num(neuron.incentive, 4):>9}  {_num(neuron.emission, 4):>10}"
            )
    for validator_uid, row in sorted(chain.weights.items()):
        shown = ", ".join(f"uid {uid}: {value}" for uid, value in sorted(row.items()))
        lines.append(f"  weights on chain from uid {validator_uid}: {shown or 'none'}")
    return lines


def _validator(validator: ValidatorState, names: Mapping[str, str], now: float) -> list[str]:
    permit = validator.permit
    lines = [
        "",
        f"validator  {_who(validator.hotkey, names)} uid {_show(validator.uid)}, "
        f"permit {'yes' if permit else 'no' if permit is not None else 'n/a'}, provider {_show(validator.provider)}",
    ]
    if validator.last_applied is None:
        lines.append("  nothing submitted yet")
    else:
        since = validator.blocks_since_submit
        lines.append(
            f"  epoch {validator.last_applied} on chain, last submit at block {_show(validator.last_submit_block)}"
            + (
                f" ({since} blocks ago, next resubmit in {_show(validator.next_resubmit_in_blocks)} blocks)"
                if since is not None
                else ""
            )
        )
    tick = _elapsed(now, validator.last_tick)
    if tick is not None:
        lines.append(f"  last tick {tick} ago: {_show(validator.last_outcome)}")
    if validator.chain_error:
        lines.append(f"  ✘ chain unreachable: {validator.chain_error} → check validator.network and the connection")
    if validator.provider_error:
        cache = {True: "the cached vector stands in", False: "no cached vector: nothing is submitted"}
        stands_in = cache.get(validator.cached_vector) if isinstance(validator.cached_vector, bool) else None
        lines.append(
            f"  ⚠ provider gave no usable payload: {validator.provider_error}"
            + (f" ({stands_in})" if stands_in else "")
            + " → check validator.provider_url and the provider"
        )
    return lines


def _epochs(epochs: EpochsState, names: Mapping[str, str]) -> list[str]:
    total = sum(weight for _, weight in epochs.weights) or 1
    shown = ", ".join(f"{_who(hotkey, names)} {_share(weight, total)}" for hotkey, weight in epochs.weights)
    digest = epochs.digest or ""
    return [
        "",
        f"epoch      latest published {_show(epochs.latest)} (digest {digest[:12]}…): {shown or 'no weights'}",
    ]


TOPLOC_ALONE = "TOPLOC alone ⚠ (its hello announces no GEMM audits: a miner on altered weights may pass)"


def _miners(traffic: TrafficPolicyState, legs: Sequence[GatewayLeg], names: Mapping[str, str], now: float) -> list[str]:
    lines = ["", "miners     eligibility at the gateway"]
    if not traffic.workers:
        lines.append("  none connected yet")
    for worker in traffic.workers:
        since = _elapsed(now, worker.since)
        age = f" for {since}" if since is not None else ""
        lines.append(
            f"  {_who(worker.miner, names):<12} {_show(worker.model):<14} {_show(worker.state)}{age}: "
            f"{_show(worker.reason, '')}"
        )
        lines += _proofs(worker, [leg for leg in legs if (leg.miner, leg.model) == (worker.miner, worker.model)])
    return lines


def _proofs(worker: TrafficStanding, legs: Sequence[GatewayLeg]) -> list[str]:
    """Which proofs judge this (miner, model), and its verdicts since the gateway started by the
    proof that judged them; nothing while no leg says and no verdict came."""
    announced = gemm_audited(leg.gemm_audit for leg in legs)
    judged = worker.lifetime.proofs if worker.lifetime is not None else None
    if announced is None and (judged is None or judged == ProofVerdicts()):
        return []
    proofs = {True: GEMM_AND_TOPLOC, False: TOPLOC_ALONE, None: "n/a"}[announced]
    return [f"  {'':<12} proofs {proofs}; verdicts {judged.summary() if judged is not None else 'n/a'}"]


LINK_DOWN_FIX = "check the gateway URL (GW, miner.gateway_url) and this machine's network and DNS"
LINK_DENIED_FIX = "change what the reason names (the miner key, or the hotkey and its registration)"


def _serving(states: NodeStates, now: float) -> list[str]:
    """This node's own miners, each with its plan, model server, link, weights and newest epoch."""
    lines = ["", "serving    this node's miners"]
    for name in states.miner_names():
        miner = states.miners.get(name) or MinerState()
        lines.append(f"  {name} · {_show(miner.model)} · plan {_show(miner.plan)}")
        lines.append(f"    model server  {_server(states.model_servers.get(name))}")
        lines += [
            f"    link          {line}" if i == 0 else f"                  {line}"
            for i, line in enumerate(_link(miner))
        ]
        lines += _weights(
            "    ", miner.weights_root, miner.weights_pinned, miner.simulated_cheat, "miner.simulate_cheat"
        )
        if miner.proofs:
            detail = f": {miner.proofs_detail}" if miner.proofs_detail else ""
            lines.append(f"    proofs        {miner.proofs}{detail}")
        # Blocks of its gateway's chain where the gateway told them, else of the chain this node reads.
        lines += _epoch(miner.epoch, now, block_time_s(miner.epoch, states.chain, states.validator))
    return lines


def _reference_server(serve: ServeState) -> list[str]:
    """A reference server run on its own (`engy-node serve`): its state, model and the root of
    the checkpoint it loaded."""
    where = f" at {serve.url}" if serve.url and serve.state == "ready" else ""
    return [
        "",
        f"serve      the reference server: {_show(serve.state)}{where}",
        f"  model         {_show(serve.model)}" + (f" on {serve.device}, {_show(serve.dtype)}" if serve.device else ""),
        *_weights("  ", serve.weights_root, serve.weights_pinned, serve.simulated_cheat, "serve.simulate_cheat"),
    ]


def _weights(indent: str, root: str | None, pinned: bool | None, cheat: str | None, setting: str) -> list[str]:
    """The served checkpoint's weight commitment and whether the catalog pins it; loudly, a cheat
    the server was told to simulate."""
    pin = "n/a" if pinned is None else "the catalog's pin" if pinned else "the catalog pins none"
    lines = [f"{indent}weights_root  {f'{root[:12]}… ({pin})' if root else 'not checked yet'}"]
    if cheat:
        lines.append(
            f"{indent}⚠ SIMULATED CHEAT  serves weights altered by {cheat} while claiming this root "
            f"({setting}: demos and tests only)"
        )
    return lines


def _epoch(epoch: MinerEpoch | None, now: float, block_s: float) -> list[str]:
    """The miner's newest published epoch as its gateway told it: its weight, or each gate that
    zeroed a row with the measurement against its bar and the fix, and the next chance (how far
    off in blocks of the chain's `block_s` seconds)."""
    if epoch is None:
        return []
    if epoch.index is None:
        return [f"    epoch         n/a: {epoch.error or 'not published yet'}"]
    weight = "n/a" if epoch.weight is None else f"{epoch.weight:,}"
    verdict = "✘ gated" if epoch.gated else "no paid traffic" if epoch.rows == 0 else "✔"
    lines = [f"    epoch         {epoch.index}: weight {weight} of {WEIGHT_MAX:,} {verdict}"]
    for finding in epoch.gated:
        lines += [f"      ✘ {finding_text(finding)}", f"        → fix: {finding.fix}"]
    restore = restore_text(epoch, now=now, block_s=block_s) if epoch.gated else None
    if restore:
        lines.append(f"      next chance: {restore}")
    if epoch.error:
        lines.append(f"      ⚠ the last look failed: {epoch.error}")
    return lines


def _server(server: ModelServerState | None) -> str:
    if server is None:
        return "n/a"
    restarts = f"{server.restarts} restart{'s' if server.restarts != 1 else ''}"
    shown = f"{_show(server.state)} ({_show(server.kind)}, {restarts})"
    failure = server.last_failure
    if failure is not None and server.state != "ready":
        shown += f" ✘ {failure.summary or failure.kind}" + (f" → {failure.fix}" if failure.fix else "")
    return shown


def _link(miner: MinerState) -> list[str]:
    """The legs and what is in flight, then why the link is down and the fix, quoted as published."""
    up, legs = miner.legs_up, miner.legs
    shown = f"{up}/{legs} legs up" if up is not None and legs is not None else "legs n/a"
    lines = [f"{shown} · in flight {_show(miner.inflight)}/{_show(miner.max_inflight)}"]
    if up and legs and up >= legs:
        return lines
    if miner.denied:
        lines += [f'✘ the gateway denies this miner: "{miner.denied}"', f"→ {LINK_DENIED_FIX}"]
    elif miner.link_error:
        lines += [f'✘ cannot reach the gateway: "{miner.link_error}"', f"→ {LINK_DOWN_FIX}"]
    return lines


def _map(value: Any) -> Mapping[Any, Any]:
    """`value` if the document has an object there, else nothing: a malformed part reads as missing."""
    return value if isinstance(value, Mapping) else {}


def _show(value: Any, missing: str = "n/a") -> str:
    return missing if value is None else str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _num(value: Any, digits: int = 2) -> str:
    if not _is_number(value):
        return "n/a"
    try:
        return f"{value:.{digits}f}"
    except OverflowError:  # an integer too large for a float
        return "n/a"


def _share(weight: float, total: float) -> str:
    try:
        return f"{weight / total:.1%}"
    except (OverflowError, ZeroDivisionError):
        return "n/a"


def _elapsed(now: float, then: Any) -> str | None:
    """How long ago `then` was, or None when it is not a usable timestamp."""
    if not _is_number(then):
        return None
    try:
        return duration_text(now - then)
    except (OverflowError, ValueError):  # an integer too large for a float; inf or nan
        return None
