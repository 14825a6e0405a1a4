"""`engy-node status [--json]`: the running node's state, each role's verdict, and an exit code a
script can branch on (docs/control-api.md, "engy-node status --json"):

* 0 — every role of the node is doing its job;
* 1 — a role's loop is not running (the validator's heartbeat is missing or stale);
* 2 — no node could be read: none runs with this `--home`, or its control port or token was
  refused; the message says which and what to do;
* 3 — the node runs, but a role is not doing its job (the role's line says why).

The verdicts are `engy-node health`'s judges (`commands.health.role_verdicts`), so the two
commands never disagree; `health` keeps 1 for "not running" because a container's health check
reserves 2. `--json` prints the control API's `/v1/status` document unchanged plus a `summary`
(`engy_node.status_summary`), and prints a summary with `error` even when no node answers, so a
script always reads JSON; the text is the states' page followed by the same summary.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import Any

from engy_node.commands.health import judged_roles, role_verdicts
from engy_node.config import Config
from engy_node.errors import ConfigError
from engy_node.snapshots import NodeInfo, decode, decode_states
from engy_node.status_summary import RoleVerdict, encode, summarize, summary_lines, unreachable


def run(config: Config, *, as_json: bool) -> int:
    from engy_node.control import ControlError, fetch_status, read_endpoint, read_token
    from engy_node.local.status import format_status

    try:
        endpoint = read_endpoint(config.paths.data_dir)
        document = fetch_status(endpoint.url, read_token(endpoint.token_file))
    except (ControlError, ConfigError) as error:
        summary = unreachable(str(error))
        if as_json:
            print(json.dumps({"summary": encode(summary)}, indent=2))
        print(f"engy-node: {error.title}: {error}", file=sys.stderr)
        return summary.exit_code
    states = decode_states(_map(document.get("states")))
    node = decode(NodeInfo, _map(document.get("node")))
    roles = judged_roles(node.roles or states.node.roles)
    verdicts = [RoleVerdict(*verdict) for verdict in role_verdicts(config, states, roles)]
    summary = summarize(node, states, _map(document.get("metrics")), verdicts)
    if as_json:
        print(json.dumps({**document, "summary": encode(summary)}, indent=2, default=str))
    else:
        print("\n".join([format_status(document), *summary_lines(summary)]))
    return summary.exit_code


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
