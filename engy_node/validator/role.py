"""`engy-node --role validator`: the light loop with its chain client, wallet and watchdog.

The process stays small (no torch, no transformers: the target is ≤ 150 MB resident, docs/performance.md), so it can
run beside a miner or on a small VPS. `substrate` replaces the chain transport with an in-process
dev chain (`engy-node up`, tests); everything else is the same code a finney validator runs.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from engy_node import keys
from engy_node.config import Config
from engy_node.errors import ConfigError
from engy_node.hub import Hub
from engy_node.validator import liveness, schedule
from engy_node.validator.chain import ChainClient, check_network, isolate_sdk_caches
from engy_node.validator.light import LightSettings, LightValidator, Watchdog
from engy_node.validator.state import read_state

log = logging.getLogger("engy.validator")


def validator_dir(config: Config) -> Path:
    return config.paths.data_dir / "validator"


def state_path(config: Config) -> Path:
    return validator_dir(config) / "state.json"


def heartbeat_path(config: Config) -> Path:
    return validator_dir(config) / "heartbeat.json"


def light_settings(config: Config) -> LightSettings:
    settings = config.validator
    if not settings.provider_url:
        raise ConfigError("validator.provider_url is empty: set the provider API URL, e.g. https://provider.engy.ai")
    if not settings.master_hotkey:
        raise ConfigError(
            "validator.master_hotkey is empty: pin the ss58 of the master hotkey that signs the "
            "provider's epoch results"
        )
    return LightSettings(
        provider_url=settings.provider_url,
        master_hotkey=settings.master_hotkey,
        netuid=config.node.netuid,
        state_path=state_path(config),
        heartbeat_path=heartbeat_path(config),
        poll_s=settings.poll_s,
        resubmit_blocks=settings.resubmit_blocks,
        block_s=settings.block_s,
        provider_heartbeat=settings.provider_heartbeat,
    )


def preflight(config: Config, *, substrate: Any = None) -> None:
    """The settings a validator cannot start without, checked before anything runs."""
    settings = config.validator
    if substrate is None:
        check_network(settings.network)
    if not settings.wallet_name or not settings.wallet_hotkey:
        raise ConfigError(
            "the validator needs its hotkey: pass --validator-wallet NAME --validator-hotkey HOTKEY "
            "(or set validator.wallet_name and validator.wallet_hotkey); it signs the weights"
        )
    light_settings(config)


async def run_validator(
    config: Config, hub: Hub, *, substrate: Any = None, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    preflight(config, substrate=substrate)
    settings = config.validator
    signer = await trio.to_thread.run_sync(
        keys.load_hotkey, settings.wallets_path, settings.wallet_name, settings.wallet_hotkey
    )
    isolate_sdk_caches(config.paths.data_dir)
    chain = ChainClient(settings.network, substrate=substrate)
    hub.set_state(
        "validator",
        hotkey=signer.ss58_address,
        network=settings.network if substrate is None else "dev chain",
        provider=settings.provider_url,
        netuid=config.node.netuid,
        resubmit_blocks=settings.resubmit_blocks,
        poll_s=settings.poll_s,
    )
    light = light_settings(config)
    try:
        # Connections are not kept between polls: a server closing an idle keep-alive just as the
        # next poll reuses it (hypercorn's default is 5 s) fails the fetch for nothing.
        async with httpx.AsyncClient(
            headers={"User-Agent": "engy-node validator"}, limits=httpx.Limits(keepalive_expiry=1.0)
        ) as http:
            loop = LightValidator(light, chain=chain, signer=signer, http=http, hub=hub)
            watchdog = Watchdog(loop, limit_s=schedule.stall_limit(light.poll_s))
            watchdog.start()
            try:
                await loop.run(task_status=task_status)
            finally:
                watchdog.stop()
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            await trio.to_thread.run_sync(chain.close, abandon_on_cancel=True)


HEALTH_OK = 0
HEALTH_STALLED = 1
"""No heartbeat, or the loop stopped completing ticks."""
HEALTH_NO_WEIGHTS = 3
"""The loop ticks, but no weights landed within the activity cutoff (or none ever, once it has
run longer than the cutoff)."""


def health_report(config: Config, *, now: float | None = None) -> tuple[int, str]:
    """What `engy-node health` prints and its exit code: whether the validator's loop is still
    completing ticks (`HEALTH_STALLED` if not), then whether it is doing its job, weights
    landing within the activity cutoff (`HEALTH_NO_WEIGHTS` if not); `HEALTH_OK` and when
    weights last landed otherwise."""
    now = time.time() if now is None else now
    poll_s = config.validator.poll_s
    path = heartbeat_path(config)
    alive, message = liveness.health(path, now=now, poll_s=poll_s)
    heartbeat = liveness.read_heartbeat(path)
    if not alive or heartbeat is None:
        return HEALTH_STALLED, message
    state, _ = read_state(state_path(config))
    problem = liveness.weights_problem(heartbeat, now=now, last_submit_ts=state.last_submit_ts, poll_s=poll_s)
    if problem is not None:
        return HEALTH_NO_WEIGHTS, problem
    return HEALTH_OK, f"{message}; {liveness.last_weights(now=now, last_submit_ts=state.last_submit_ts)}"
