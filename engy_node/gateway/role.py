"""`engy-node --role gateway`: the buyer API and the miner endpoint on hypercorn under trio.

Start-up loads each served model's tokenizer (the gateway tokenises every request itself),
opens the store and releases holds a crash left open, then binds the miner endpoint, the buyer
API and the provider API. `task_status.started` reports the URLs once all listen. With
`gateway.workers` > 1 the first process binds the shared ports once and starts the other workers
(`workers.py`); only it releases holds at start-up, and it also sweeps, periodically, holds older
than any request can be (a worker that died mid-request leaves its holds open).

The trust pipeline lives in the first process: the audit queue and desk (fed by every worker,
`audit_link.py`), the provider API on its own port, the traffic control plane
(`control_plane.py`) and the epoch publisher (`publisher.py`), and with
`gateway.local_verifier` a verifier judging on this machine. Every process routes paid traffic
only to miners the control plane made eligible.

Shutdown drains: miners are told to `reconnect` (to another gateway process, or to this one
after a restart) while their legs are still open, then the servers stop and in-flight requests
are cancelled, which settles them for what was relayed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from engy_node.asgi import serve_listener, start_listener
from engy_node.config import Config, GatewaySection, checkpoint_pairs, comma_list
from engy_node.errors import ConfigError
from engy_node.gateway.api.app import Handlers, build_buyer_app, build_miner_app, hypercorn_config
from engy_node.gateway.billing import orphans
from engy_node.gateway.billing.deposit_watcher import run_deposit_watcher
from engy_node.gateway.billing.epochs import EpochClock
from engy_node.gateway.billing.miner_epoch import MinerEpochs
from engy_node.gateway.fleet.leadership import Leadership
from engy_node.gateway.fleet.workers import MinerListener, Seat, SharedSockets, miner_legs_cap, run_worker_process
from engy_node.gateway.request.lifecycle import Gateway, GatewaySettings, longest_request_s
from engy_node.gateway.request.request_log import RequestLogWriter
from engy_node.gateway.routing.pool import MinerPool, PoolSettings
from engy_node.gateway.store import Store, StoreError
from engy_node.gateway.trust.trust_plane import TrustPlane
from engy_node.hub import Hub
from engy_node.models import CATALOG, get_model
from engy_node.private_files import private_dir
from engy_node.protocol.audit import LocalVerifier
from engy_node.protocol.gates import GateTerms
from engy_node.serve.checkpoint import resolve_checkpoint
from engy_node.served_model import ServedModel, load_served_model

log = logging.getLogger("engy.gateway")

STALE_SWEEP_S = 10.0
"""How often legs are checked for missing heartbeats (a leg goes stale after 90 s)."""
DRAIN_S = 5.0
"""How long stopping waits for the miners to be told to re-dial."""
CUTOFF_WAIT_S = 5.0
"""After the drain's deadline, how long the requests it ends have to send their last bytes and
settle before the servers stop regardless."""
ORPHAN_SWEEP_S = 60.0
"""How often the first process releases holds older than any request can be."""


@dataclasses.dataclass(frozen=True, slots=True)
class GatewayUrls:
    buyer_url: str
    miner_url: str
    provider_url: str | None = None
    """The provider API; served by the first process only."""


BUYERS_PUBLISH_S = 5.0


async def _publish_buyers(store: Store, hub: Hub) -> None:
    """The buyer accounts that spent most, with their balances, for the dashboards (never a key)."""
    while True:
        try:
            count, top = await store.run(store.account_summaries, limit=10)
        except StoreError as error:
            log.warning("could not read buyer balances for the dashboard (%s); retrying", error)
        else:
            hub.set_state("buyers", accounts=count, top=[dataclasses.asdict(account) for account in top])
        await trio.sleep(BUYERS_PUBLISH_S)


def store_path(config: Config) -> Path:
    return config.paths.data_dir / "gateway.sqlite3"


def store_location(config: Config) -> str | Path:
    """The gateway's store: the fleet's PostgreSQL database, or this host's SQLite file."""
    return config.gateway.store_url or store_path(config)


def fleet_host_name(config: Config) -> str:
    """This host's name as the fleet's leases know it: `gateway.host_name`, or the hostname and
    this process's id (a restarted host takes the lease again once its old claim lapses, or at
    once when it stopped cleanly and handed the claim back)."""
    return config.gateway.host_name or f"{socket.gethostname()}-{os.getpid()}"


def fleet_legs(config: Config) -> int:
    """Legs a miner opens across the fleet (`/gw/meta`): `gateway.fleet_legs`, or this host's workers."""
    return config.gateway.fleet_legs or config.gateway.workers


def load_models(config: Config) -> dict[str, ServedModel]:
    """Each served model's tokenizer and identity (blocking)."""
    settings = config.gateway
    pairs = checkpoint_pairs(settings.checkpoints)
    models: dict[str, ServedModel] = {}
    for model_id in comma_list(settings.models):
        spec = get_model(model_id)
        if not spec.embedded and model_id not in pairs:
            raise ConfigError(
                f"gateway serves {model_id} but has no checkpoint for its tokenizer: set "
                f'gateway.checkpoints = "{model_id}=/path/to/checkpoint"'
            )
        checkpoint = resolve_checkpoint(
            model_id=model_id,
            checkpoint=pairs.get(model_id, ""),
            models_dir=config.paths.models_dir,
            cache_dir=config.paths.model_cache_dir,
        )
        models[model_id] = load_served_model(spec, checkpoint, with_token_floor=True)
    if not models:
        raise ConfigError("gateway.models is empty; name at least one catalog model")
    return models


async def run_gateway(
    config: Config,
    hub: Hub,
    *,
    local_verifier: LocalVerifier | None = None,
    deposit_chain: Any = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """The gateway role: one process, or the first of `gateway.workers`, which binds the shared
    sockets, serves as worker 0 and starts the others (`workers.py`). `local_verifier` runs on
    the audit desk with `gateway.local_verifier` (the node passes the verifier role's);
    `deposit_chain` is an in-process chain the deposit watcher reads instead of
    `gateway.deposit_network` (`engy-node up`'s dev chain); miners are told its block time with
    their epochs."""
    settings = config.gateway
    if settings.workers == 1:
        await serve_gateway(
            config, hub, local_verifier=local_verifier, deposit_chain=deposit_chain, task_status=task_status
        )
        return
    if not sys.platform.startswith("linux"):
        raise ConfigError(
            f"gateway.workers = {settings.workers} needs Linux (SO_REUSEPORT balancing and abstract Unix "
            "sockets); set gateway.workers = 1 here"
        )
    shared = SharedSockets.bind(settings)
    seat = shared.seat(0)
    buyer_socket = shared.take_buyer()
    try:
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(
                functools.partial(
                    serve_gateway,
                    config,
                    hub,
                    seat=seat,
                    buyer_socket=buyer_socket,
                    local_verifier=local_verifier,
                    deposit_chain=deposit_chain,
                )
            )
            for index in range(1, settings.workers):
                await nursery.start(run_worker_process, config, shared.seat(index))
            log.info(
                "gateway ready: buyer API %s, miners dial %s (%d worker processes)",
                urls.buyer_url,
                urls.miner_url,
                settings.workers,
            )
            task_status.started(urls)
    finally:
        if buyer_socket.fileno() != -1:  # start-up failed before worker 0 took it over
            buyer_socket.close()
        shared.close()


async def serve_gateway(
    config: Config,
    hub: Hub,
    *,
    seat: Seat | None = None,
    buyer_socket: socket.socket | None = None,
    local_verifier: LocalVerifier | None = None,
    deposit_chain: Any = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """One gateway process: on its own ports, or as worker `seat.index` of several (listening
    for buyers on `buyer_socket`, which it then owns, or on a socket of its own)."""
    settings = config.gateway
    first = seat is None or seat.index == 0
    models = await trio.to_thread.run_sync(load_models, config)
    private_dir(config.paths.data_dir)  # the store, the logs and the wallets: this user's only
    store = await trio.to_thread.run_sync(Store.open, store_location(config))
    if first:
        # Only the first process: the others start while it serves, and their holds are live.
        # Other hosts sharing the store serve while this one starts: only holds older than any
        # request can run are theirs to lose (a live sibling settles its own in time).
        older_than = time.time() - _longest_request_s(models, settings) if settings.store_url else None
        await store.run(store.recover_open_holds, older_than=older_than)

    async def miner_key_lookup(key: str) -> str | None:
        record = await store.run(store.authenticate_miner, key)
        return None if record is None else str(record.miner_id)

    registered_hotkeys: set[str] = set()

    pool = MinerPool(
        served_models={model_id: model.model_root for model_id, model in models.items()},
        authenticate_key=miner_key_lookup,
        allowed_hotkeys=lambda: registered_hotkeys,
        settings=PoolSettings(
            stale_after_s=settings.stale_after_s,
            netuid=config.node.netuid,
            max_legs_per_miner=miner_legs_cap(
                rigs=settings.max_rigs_per_miner, fleet_legs=fleet_legs(config), workers=settings.workers
            ),
            gemm_audit=settings.gemm_audit,
        ),
    )
    registered_hotkeys.update(record.hotkey for record in await store.run(store.list_miners) if record.hotkey)
    link_token = None if seat is None or seat.workers == 1 else seat.token
    if first:
        leadership = (
            Leadership(
                store,
                holder=fleet_host_name(config),
                ttl_s=settings.leader_lease_s,
                renew_s=settings.leader_lease_s / 3,
                safety_s=settings.leader_lease_s / 6,
            )
            if settings.store_url
            else None
        )
        trust = await trio.to_thread.run_sync(
            functools.partial(
                TrustPlane.first_process,
                config,
                store=store,
                models=models,
                hub=hub,
                link_token=link_token,
                leadership=leadership,
                local_verifier=local_verifier,
                challenge=pool.challenge,
            )
        )
    else:
        assert link_token is not None, "a worker other than the first has siblings, so a link token"
        trust = TrustPlane.other_process(config, store=store, link_token=link_token)

    # The HTTP servers run in a scope of their own, shielded from the node's cancellation: on
    # the way out the miners are told to re-dial while their legs are still open, and only then
    # do the servers stop (cancelling requests in flight, which settles them for what was relayed).
    servers = trio.CancelScope(shield=True)
    stop_taking_buyers = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            request_log = RequestLogWriter(store)
            await nursery.start(request_log.run)
            gateway = Gateway(
                store=store,
                pool=pool,
                models=models,
                audit=trust.audit,
                eligible=trust.eligible,
                request_log=request_log,
                settings=GatewaySettings.from_section(settings),
                registry=hub.registry,
            )
            await nursery.start(gateway.accountant.keep_proofs)
            if first:
                trust.start_traffic_control(config, gateway=gateway, store=store, hub=hub)
            miner_epochs = MinerEpochs(
                store=store,
                clock=EpochClock(settings.epoch_genesis, settings.epoch_s, settings.epoch_grace_s),
                terms={model_id: GateTerms.of(spec) for model_id, spec in CATALOG.items()},
                # The only chain whose block time this gateway knows is an in-process one: it is the
                # network's (`engy-node up` runs one worker). A gateway on a public network reads none,
                # and its miners count subtensor's 12 s blocks, which is what finney and test make.
                block_time_s=None if deposit_chain is None else float(deposit_chain.block_time_s),
            )
            miner_app = build_miner_app(pool, workers=fleet_legs(config), epochs=miner_epochs)
            buyer_app = build_buyer_app(Handlers(gateway))

            async def start_servers(http: trio.Nursery) -> GatewayUrls:
                if seat is None:
                    miner_binds = await start_listener(
                        http,
                        miner_app,
                        hypercorn_config(f"{settings.host}:{settings.miner_port}"),
                        what="miner endpoint",
                        flag="--miner-port / gateway.miner_port",
                    )
                    miner_url = miner_binds[0].replace("http://", "ws://") + "/gw"
                    buyer_bind = f"{settings.host}:{settings.port}"
                else:
                    listener = MinerListener(seat, fleet_offset=settings.fleet_offset, fleet_legs=settings.fleet_legs)
                    await http.start(listener.run)
                    await http.start(serve_listener, miner_app, hypercorn_config(None), listener)
                    miner_url = seat.miner_url
                    buyer_bind = f"fd://{(buyer_socket or seat.buyer_socket()).detach()}"
                buyer_config = hypercorn_config(buyer_bind)
                # hypercorn's own deadline for requests still open once the buyer listener stops
                # is only the backstop: the drain ends them first, in-band (`Gateway.drain`).
                buyer_config.graceful_timeout = settings.drain_s + CUTOFF_WAIT_S + 5.0
                buyer_binds = await start_listener(
                    http,
                    buyer_app,
                    buyer_config,
                    what="buyer API",
                    flag="--port / gateway.port",
                    shutdown_trigger=stop_taking_buyers.wait,
                )
                provider_url = None
                if trust.provider_app is not None:
                    provider_binds = await start_listener(
                        http,
                        trust.provider_app,
                        hypercorn_config(f"{settings.host}:{settings.provider_port}"),
                        what="provider API",
                        flag="gateway.provider_port",
                    )
                    provider_url = provider_binds[0]
                return GatewayUrls(buyer_url=buyer_binds[0], miner_url=miner_url, provider_url=provider_url)

            for service in trust.services:
                await nursery.start(service)
            urls = await nursery.start(_run_servers, servers, start_servers)
            try:
                nursery.start_soon(_sweep_stale, pool, gateway, hub)
                if first:
                    nursery.start_soon(_release_orphaned_holds, store, _longest_request_s(models, settings))
                    nursery.start_soon(_publish_buyers, store, hub)
                    if settings.deposit_address:
                        nursery.start_soon(_watch_deposits, store, settings, deposit_chain)
                hub.set_state(
                    "gateway",
                    state="ready",
                    buyer_url=urls.buyer_url,
                    miner_url=urls.miner_url,
                    provider_url=urls.provider_url,
                    models=sorted(models),
                    worker=0 if seat is None else seat.index,
                    workers=1 if seat is None else seat.workers,
                )
                log.info(
                    "gateway %s: buyer API %s, miners dial %s%s",
                    "ready" if seat is None else f"worker {seat.index} serving",
                    urls.buyer_url,
                    urls.miner_url,
                    f", provider API {urls.provider_url}" if urls.provider_url else "",
                )
                task_status.started(urls)
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):
                    # Buyers first: no new requests, the ones in flight run to their end (or are
                    # ended in-band at the deadline) while their miners' legs are still open; only
                    # then are the miners told to re-dial, since a re-dial drops what a leg serves.
                    stop_taking_buyers.set()
                    hub.set_state("gateway", state="draining", in_flight=gateway.in_flight)
                    log.info(
                        "gateway stopping: no new buyer requests; %d in flight get up to %g s to finish",
                        gateway.in_flight,
                        settings.drain_s,
                    )
                    await gateway.drain(grace_s=settings.drain_s, cutoff_wait_s=CUTOFF_WAIT_S)
                    with trio.move_on_after(DRAIN_S):
                        await pool.drain()
                    servers.cancel(reason="the gateway is stopping")
    finally:
        servers.cancel(reason="the gateway is stopping")
        hub.set_state("gateway", state="stopped")
        store.close()


async def _run_servers(
    scope: trio.CancelScope,
    start: Callable[[trio.Nursery], Awaitable[GatewayUrls]],
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the HTTP servers `start` starts, inside `scope` (cancelled by their owner)."""
    with scope:
        async with trio.open_nursery() as http:
            task_status.started(await start(http))


def _longest_request_s(models: dict[str, ServedModel], settings) -> float:
    """The longest a request can hold money (`lifecycle.longest_request_s`), for the slowest model."""
    return max(longest_request_s(settings, model) for model in models.values())


async def _release_orphaned_holds(store: Store, longest_request_s: float) -> None:
    """Release holds no live request can own: a worker process that died (or a bug) left them.
    A hold is an orphan once this loop has seen it open for twice the longest request time, so
    a slow settle is never raced; counted on trio's clock, never the wall clock, which can step
    (`orphans`)."""
    first_seen: dict[int, float] = {}
    while True:
        await trio.sleep(ORPHAN_SWEEP_S)
        try:
            release, first_seen = orphans.sweep(
                first_seen,
                await store.run(store.open_hold_ids),
                now=trio.current_time(),
                max_age_s=2 * longest_request_s,
            )
            await store.run(store.release_holds, release)
        except StoreError as error:
            log.error("could not sweep orphaned holds (%s); retrying in %.0f s", error, ORPHAN_SWEEP_S)


async def _watch_deposits(store: Store, settings: GatewaySection, chain: Any) -> None:
    await run_deposit_watcher(
        store,
        address=settings.deposit_address,
        usd_per_tao=settings.deposit_usd_per_tao,
        confirmations=settings.deposit_confirmations,
        network=settings.deposit_network,
        start_block=settings.deposit_start_block,
        substrate=chain,
    )


async def _sweep_stale(pool: MinerPool, gateway: Gateway, hub: Hub) -> None:
    while True:
        await trio.sleep(STALE_SWEEP_S)
        await pool.expire_stale()
        hub.set_state("gateway", legs=pool.snapshot(), prompt_cache=gateway.prompt_cache.to_state())
