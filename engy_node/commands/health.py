"""`engy-node health [--role ROLE]`: is each role of the node in this home doing its job? For a
service manager and a container's health check, so the answer is the exit code:

* 0 — every role is doing its job;
* 1 — the node (or the validator's loop) is not running, or stalled;
* 3 — it runs, but a role is not doing its job, and the line printed for it says why and what
  to change.

The validator is judged from its heartbeat and state files (`validator.role.health_report`), so
its check works even while its control API cannot be reached, and, when the node answers, also
by `validator_outage`: one that never landed weights and cannot reach the chain (or the provider)
is not doing its job from the first failed read. The other roles are judged from the running
node's states (`/v1/status`), by `judge`, which is pure. With no `--role`, the roles are the
running node's (`judged_roles`; or the validator alone when no node answers, the container's
case). `engy-node status` reports the same verdicts (`role_verdicts`). Apart from `cli.py`'s
dispatch because it has flags and a judge per role.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from engy_node.config import Config
from engy_node.snapshots import NodeStates, ValidatorState, decode_states

HEALTH_OK = 0
HEALTH_DOWN = 1
HEALTH_NOT_WORKING = 3
SERVER_DOWN_STATES = frozenset({"failed", "restarting", "stopped"})
JUDGED_ROLES = ("miner", "validator", "gateway", "verifier")


def add_parser(sub: argparse._SubParsersAction, roles: Sequence[str]) -> None:
    health = sub.add_parser(
        "health",
        help="is each role of the node in this home doing its job? (exit 0 yes, 1 not running or stalled, 3 a "
        "role is not doing its job: the validator landed no weights within the activity cutoff, a miner has "
        "no leg up, a gateway no eligible miner, a verifier is not running)",
    )
    health.add_argument(
        "--role", dest="health_roles", action="append", choices=roles, help="judge this role (repeatable)"
    )


def judge(role: str, states: NodeStates) -> tuple[int, str]:
    """Whether `role` does its job in `states` (a running node's), and one line saying why."""
    if role == "miner":
        return _miner(states)
    if role == "gateway":
        return _gateway(states)
    if role == "verifier":
        verifier = states.verifier
        if verifier is None or verifier.state != "running":
            state = "has not reported" if verifier is None else f"is {verifier.state or 'starting'}"
            return HEALTH_NOT_WORKING, f"the verifier {state}; see the node's log (engy-node status)"
        return HEALTH_OK, f"ok: leasing from {verifier.gateway}, {verifier.verdicts.total} verdict(s)"
    raise ValueError(f"no judge for role {role!r}")


def _miner(states: NodeStates) -> tuple[int, str]:
    if not states.miners:
        return HEALTH_NOT_WORKING, "no miner has reported yet (starting?); see engy-node status"
    problems, good = [], []
    for name in states.miner_names():
        miner = states.miners.get(name)
        server = states.model_servers.get(name)
        if server is not None and server.state in SERVER_DOWN_STATES:
            failure = server.last_failure
            why = f": {failure.summary} — {failure.fix}" if failure is not None and failure.summary else ""
            problems.append(f"{name}: its model server is {server.state}{why}")
        elif miner is None or not miner.legs_up:
            reason = (miner.denied or miner.link_error) if miner is not None else None
            problems.append(f"{name}: no leg up at the gateway" + (f": {reason}" if reason else " yet"))
        else:
            good.append(f"{name}: {miner.legs_up}/{miner.legs} legs up")
    if problems:
        return HEALTH_NOT_WORKING, "; ".join(problems)
    return HEALTH_OK, "ok: " + "; ".join(good)


def _gateway(states: NodeStates) -> tuple[int, str]:
    gateway = states.gateway
    if gateway is None:
        return HEALTH_NOT_WORKING, "the gateway has not reported (starting?); see engy-node status"
    if gateway.state != "ready":
        return HEALTH_NOT_WORKING, f"the gateway is {gateway.state or 'starting'}, not serving buyers"
    if not gateway.legs:
        return HEALTH_NOT_WORKING, "no miner is connected: buyers get no answers; miners dial gateway.miner_port"
    workers = states.traffic.workers if states.traffic is not None else ()
    if workers and not any(worker.eligible and worker.connected for worker in workers):
        held = ", ".join(f"{w.miner} {w.state}" for w in workers[:5])
        return HEALTH_NOT_WORKING, f"no connected miner is eligible for paid traffic ({held}); see engy-node status"
    return HEALTH_OK, f"ok: {len(gateway.legs)} miner leg(s)"


def judged_roles(node_roles: Sequence[str]) -> list[str]:
    """The roles a node's info lists, as the judges know them: a local network's `miner-1` and
    `miner-2` are its miner role, and its `chain` is no role of an operator's (no judge)."""
    judged = ("miner" if role.startswith("miner-") else role for role in node_roles)
    return list(dict.fromkeys(role for role in judged if role in JUDGED_ROLES))


def role_verdicts(config: Config, states: NodeStates, roles: Sequence[str]) -> list[tuple[str, int, str]]:
    """(role, code, line) for each of `roles` of the node that answered with `states`: the
    validator by its heartbeat and state files, then by `validator_outage`, the others by
    `judge`. `engy-node status` reports the same verdicts."""
    from engy_node.validator.role import health_report

    results = []
    for role in roles:
        if role != "validator":
            results.append((role, *judge(role, states)))
            continue
        code, line = health_report(config)
        outage = validator_outage(states.validator) if code == HEALTH_OK else None
        results.append((role, HEALTH_NOT_WORKING, outage) if outage else (role, code, line))
    return results


def validator_outage(validator: ValidatorState | None) -> str | None:
    """Why a validator that has never landed weights cannot land any now: the chain, or the
    provider with no cached vector to stand in, unreachable. One that landed weights is judged
    by the activity cutoff alone (`validator.role.health_report`), so a short outage after that
    is no alarm; one that never did is not doing its job from the first failed read."""
    if validator is None or validator.last_submit_ts is not None:
        return None
    if validator.chain_error:
        return (
            f"no weights set yet, and the chain is unreachable: {validator.chain_error} "
            "→ check validator.network and the connection"
        )
    if validator.provider_error and not validator.cached_vector:
        return (
            f"no weights set yet, and the provider gives no usable payload: {validator.provider_error} "
            "→ check validator.provider_url and the provider"
        )
    return None


def run(config: Config, args: argparse.Namespace) -> int:
    """Print one line per role judged and return the worst code (1 before 3: down is worse)."""
    from engy_node.control import ControlError, fetch_status, read_endpoint, read_token

    roles = list(args.health_roles or ())
    states: NodeStates | None = None
    unreachable = ""
    try:
        endpoint = read_endpoint(config.paths.data_dir)
        document = fetch_status(endpoint.url, read_token(endpoint.token_file))
        states = decode_states(document.get("states") or {})
        roles = roles or judged_roles(states.node.roles or document.get("node", {}).get("roles") or ())
    except ControlError as error:
        unreachable = str(error)
    roles = roles or ["validator"]
    results = []
    if states is not None:
        results = role_verdicts(config, states, roles)
    else:
        from engy_node.validator.role import health_report

        for role in roles:
            if role == "validator":
                results.append((role, *health_report(config)))
            else:
                results.append((role, HEALTH_DOWN, f"not running: {unreachable}"))
    for role, _, message in results:
        print(message if len(results) == 1 else f"{role}: {message}")
    codes = {code for _, code, _ in results}
    return HEALTH_DOWN if HEALTH_DOWN in codes else max(codes)
