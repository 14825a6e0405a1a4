"""Which services make up a node running some roles: one list, used by `engy-node --role …` and by
`engy-tui --role …` (the same node inside the TUI), so both always run the same thing.

`check_roles` runs every preflight a role has (a miner without a gateway, a validator without a
hotkey) before anything starts, so a user's mistake is one clear message, not a half-started
node. `role_services` returns `(name, service)` pairs in start order; `node.run_services` (or the
TUI's guest run) starts them. The control API is not in the list: its caller adds it, because
the TUI hosting a node in-process reads the hub directly.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from engy_node.config import Config
from engy_node.control import Actions
from engy_node.hub import Hub
from engy_node.node import Service


def check_roles(config: Config, roles: Sequence[str]) -> None:
    """Raise the `EngyError` a role would raise at start, before any role starts."""
    if "miner" in roles:
        from engy_node.miner.role import preflight

        preflight(config)
    if "validator" in roles:
        from engy_node.validator.role import preflight as validator_preflight

        validator_preflight(config)


def role_services(config: Config, hub: Hub, roles: Sequence[str], actions: Actions) -> list[tuple[str, Service]]:
    services: list[tuple[str, Service]] = []
    if "gateway" in roles:
        from engy_node.gateway.key_actions import register_key_actions
        from engy_node.gateway.role import run_gateway, store_location
        from engy_node.verifier.role import run_local_verifier

        register_key_actions(actions, store_location(config))
        services.append(("gateway", functools.partial(run_gateway, config, hub, local_verifier=run_local_verifier)))
    if "miner" in roles:
        from engy_node.hardware.monitor import run_gpu_monitor
        from engy_node.miner.role import run_miner

        services.append(("GPU monitor", functools.partial(run_gpu_monitor, hub)))
        services.append(("miner", functools.partial(run_miner, config, hub, actions=actions)))
    if "verifier" in roles:
        from engy_node.verifier.role import run_verifier_role

        services.append(("verifier", functools.partial(run_verifier_role, config, hub)))
    if "validator" in roles:
        from engy_node.validator.role import run_validator

        services.append(("validator", functools.partial(run_validator, config, hub)))
    if services:
        from engy_node.alerts.task import run_alerts

        services.append(("alerts", functools.partial(run_alerts, config.alerts, hub)))
    return services
