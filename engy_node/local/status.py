"""`engy-node status`: a running node's state as a page of text, from its control API snapshot.

Pure: `format_status` turns the `/v1/status` document (hub states by component) into lines, and
says "n/a" for what the node does not report rather than guessing. Whatever roles the node runs,
each section appears only when its component does: the chain and the validator's weights, the
published epochs, the miners with their eligibility, the verifier, the demo traffic.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any


def format_status(status: Mapping[str, Any], *, now: float | None = None) -> str:
    now = time.time() if now is None else now
    states = _map(status.get("states"))
    node = _map(status.get("node"))
    lines = [_header(node, now)]
    names = _hotkey_names(node)
    if "network" in states:
        network = _map(states["network"])
        lines += [
            f"buyer API  {_show(network.get('buyer_api'))}   (key in {_show(network.get('details'))})",
            f"provider   {_show(network.get('provider_api'))} · miners dial {_show(network.get('miner_ws'))}",
        ]
    if "chain" in states:
        lines += _chain(_map(states["chain"]), names)
    if "validator" in states:
        lines += _validator(_map(states["validator"]), names, now)
    if "epochs" in states:
        lines += _epochs(_map(states["epochs"]), names)
    if "gateway" in states:
        lines += _gateway(_map(states["gateway"]))
    if "traffic" in states:
        lines += _miners(_map(states["traffic"]), names, now)
    if "verifier" in states:
        verifier = _map(states["verifier"])
        verdicts = _map(verifier.get("verdicts"))
        tally = (
            ", ".join(f"{kind} {count}" for kind, count in sorted(verdicts.items(), key=lambda item: str(item[0])))
            or "none yet"
        )
        lines += ["", f"verifier   {_show(verifier.get('state'))}; verdicts: {tally}"]
    if "traffic_generator" in states:
        demo = _map(states["traffic_generator"])
        lines += [
            "",
            f"demo traffic  {'paused' if demo.get('paused') else 'running'}: {_show(demo.get('sent'), '0')} sent, "
            f"{_show(demo.get('succeeded'), '0')} ok, {_show(demo.get('failed'), '0')} failed"
            + (f" (last error: {demo['last_error']})" if demo.get("last_error") and demo.get("failed") else ""),
        ]
    return "\n".join(lines)


def _gateway(gateway: Mapping[str, Any]) -> list[str]:
    """The gateway's legs and how much of the prompts its miners served from their caches (what
    prefix-affinity routing earns)."""
    legs = _list(gateway.get("legs"))
    cache = _map(gateway.get("prompt_cache"))
    rate = cache.get("hit_rate")
    hit = (
        f"{100 * rate:.1f} % of {cache.get('prompt_tokens')} prompt tokens from the miners' caches"
        if isinstance(rate, (int, float))
        else "no prompts settled yet"
    )
    return ["", f"gateway    {_show(gateway.get('state'))}; {len(legs)} miner leg(s); prefix cache: {hit}"]


def _header(node: Mapping[str, Any], now: float) -> str:
    roles = ", ".join(str(role) for role in _list(node.get("roles"))) or "n/a"
    started = _elapsed(now, node.get("started_at"))
    uptime = f", up {started}" if started is not None else ""
    return f"engy-node {_show(node.get('version'), '?')} (pid {_show(node.get('pid'), '?')}): {roles}{uptime}"


def _hotkey_names(node: Mapping[str, Any]) -> dict[str, str]:
    """ss58 -> the local name (`miner-1`, `validator`, …) a local network gave it."""
    return {ss58: str(name) for name, ss58 in _map(node.get("hotkeys")).items() if isinstance(ss58, str)}


def _who(hotkey: Any, names: Mapping[str, str]) -> str:
    if not isinstance(hotkey, str):
        return "n/a"
    return names.get(hotkey) or f"{hotkey[:10]}…"


def _chain(chain: Mapping[str, Any], names: Mapping[str, str]) -> list[str]:
    lines = [
        "",
        f"chain      {_show(chain.get('network'))}, netuid {_show(chain.get('netuid'))}, block {_show(chain.get('block'))}"
        f" ({_show(chain.get('block_time_s'))} s blocks), tempo {_show(chain.get('tempo'))}, "
        f"epochs run {_show(chain.get('epochs_run'))}",
    ]
    neurons = [_map(neuron) for neuron in _list(chain.get("neurons"))]
    if neurons:
        lines.append(
            f"  {'uid':>3}  {'name':<12} {'stake':>10}  {'permit':<6} {'last_update':>11}  {'incentive':>9}  {'emission':>10}"
        )
        for neuron in neurons:
            lines.append(
                f"  {_show(neuron.get('uid')):>3}  {_who(neuron.get('hotkey'), names):<12} {_num(neuron.get('stake')):>10}  "
                f"{'yes' if neuron.get('permit') else 'no':<6} {_show(neuron.get('last_update')):>11}  "
                f"{_num(neuron.get('incentive'), 4):>9}  {_num(neuron.get('emission'), 4):>10}"
            )
    weights = _map(chain.get("weights"))
    for validator_uid, row in sorted(weights.items(), key=lambda item: str(item[0])):
        shown = ", ".join(
            f"uid {uid}: {_show(value)}" for uid, value in sorted(_map(row).items(), key=lambda item: str(item[0]))
        )
        lines.append(f"  weights on chain from uid {validator_uid}: {shown or 'none'}")
    return lines


def _validator(validator: Mapping[str, Any], names: Mapping[str, str], now: float) -> list[str]:
    permit = validator.get("permit")
    lines = [
        "",
        f"validator  {_who(validator.get('hotkey'), names)} uid {_show(validator.get('uid'))}, "
        f"permit {'yes' if permit else 'no' if permit is not None else 'n/a'}, provider {_show(validator.get('provider'))}",
    ]
    applied = validator.get("last_applied")
    if applied is None:
        lines.append("  nothing submitted yet")
    else:
        since = validator.get("blocks_since_submit")
        lines.append(
            f"  epoch {applied} on chain, last submit at block {_show(validator.get('last_submit_block'))}"
            + (
                f" ({since} blocks ago, next resubmit in {_show(validator.get('next_resubmit_in_blocks'))} blocks)"
                if since is not None
                else ""
            )
        )
    tick = _elapsed(now, validator.get("last_tick"))
    if tick is not None:
        lines.append(f"  last tick {tick} ago: {_show(validator.get('last_outcome'))}")
    return lines


def _epochs(epochs: Mapping[str, Any], names: Mapping[str, str]) -> list[str]:
    weights = [
        (pair[0], pair[1])
        for pair in _list(epochs.get("weights"))
        if isinstance(pair, (list, tuple)) and len(pair) == 2 and _is_number(pair[1])
    ]
    total = sum(weight for _, weight in weights) or 1
    shown = ", ".join(f"{_who(hotkey, names)} {_share(weight, total)}" for hotkey, weight in weights)
    digest = epochs.get("digest")
    digest = digest if isinstance(digest, str) else ""
    return [
        "",
        f"epoch      latest published {_show(epochs.get('latest'))} (digest {digest[:12]}…): {shown or 'no weights'}",
    ]


def _miners(traffic: Mapping[str, Any], names: Mapping[str, str], now: float) -> list[str]:
    workers = [_map(worker) for worker in _list(traffic.get("workers"))]
    lines = ["", "miners     eligibility at the gateway"]
    if not workers:
        lines.append("  none connected yet")
    for worker in workers:
        since = _elapsed(now, worker.get("since"))
        age = f" for {since}" if since is not None else ""
        lines.append(
            f"  {_who(worker.get('miner'), names):<12} {_show(worker.get('model')):<14} {_show(worker.get('state'))}{age}: "
            f"{_show(worker.get('reason'), '')}"
        )
    return lines


def _map(value: Any) -> Mapping[Any, Any]:
    """`value` if the document has an object there, else nothing: a malformed part reads as missing."""
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, (list, tuple)) else ()


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
        return age_text(now - then)
    except (OverflowError, ValueError):  # an integer too large for a float; inf or nan
        return None


def age_text(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"
