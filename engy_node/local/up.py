"""`engy-node up`: the whole SN53 network on one machine (docs/architecture.md, "The local network").

One command on a laptop with no GPU and no chain access brings up, on loopback:

* a dev chain (`local/devchain.py`, netuid 53, 1 s blocks, short tempo) driven by the real
  bittensor SDK, with the owner, the validator (staked, so it holds a permit) and the two miners
  registered;
* a gateway with a credited buyer key, its provider API and an epoch publisher signing short
  epochs with the local master hotkey; the buyer also pays 1 TAO from a coldkey of its own to
  the gateway's deposit address on the dev chain (once per home), which the gateway's deposit
  watcher credits after 3 blocks (`local/deposit_demo.py`);
* two miners, each supervising its own reference server on the embedded SmolLM2 and admitted by
  a signed hotkey hello;
* a validator running the light loop against the provider API and the dev chain, and a verifier
  judging the gateway's audit jobs;
* with `--traffic`, a buyer that keeps requests flowing so the dashboards move;
* the control API (`engy-node status`, the TUI) on its own port.

Buyers pay, miners serve with proofs, the verifier judges, an epoch closes, the validator puts
its weights on the dev chain, and the chain's epoch turns them into incentive per miner uid.

State. Everything it creates once — wallets (bittensor's layout under `data/wallets`), the buyer
account and its credit (`data/local/buyer.json` keeps its key), miner registrations, the dev chain (`data/local/devchain.json`, saved
after every change, so blocks continue after a restart) — is reused on every later start, so a
restart keeps keys, balances, epochs and chain history.

`data/local/network.json` says where everything is: every endpoint, the buyer key and the
hotkeys. It is written atomically, readable only by its owner (it holds a key), and removed on a
clean exit so no script reads a dead network's file.

A simulated cheat. `--cheat miner-2=noise-1%` has that local miner's reference server serve
weights altered by that cheat (`miner.simulate_cheat`, `engy_node.calibration.SIMULATED_CHEATS`)
while reporting the real checkpoint's root, as a lying miner would: a demo (and the test) of the
GEMM audit pulling it while the honest miner stays active.

Ports. `--port-base N` puts the buyer API on N, the miner websocket on N+1, the provider API on
N+2 and the control API on N+3 (0: free ports everywhere); the single-port flags override it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import trio

from engy_node import __version__, keys
from engy_node.alerts.task import run_alerts
from engy_node.config import Config
from engy_node.control import Actions, node_actions, serve_control
from engy_node.errors import EngyError
from engy_node.gateway.role import GatewayUrls, run_gateway, store_path
from engy_node.gateway.store import Store
from engy_node.hardware.monitor import run_gpu_monitor
from engy_node.hub import Hub
from engy_node.local import deposit_demo
from engy_node.local.devchain import DevChain
from engy_node.local.devchain_state import SubnetParams
from engy_node.miner.role import run_miner
from engy_node.models import DEFAULT_LOCAL_MODEL
from engy_node.simulated_cheats import check_simulated_cheat
from engy_node.validator.role import run_validator
from engy_node.verifier.role import run_local_verifier, run_verifier_role

log = logging.getLogger("engy.local")

LOCAL_CREDIT_USD = 10
"""Starting balance of the local buyer: at SmolLM2's local price card that is millions of tokens."""
LOCAL_WALLET = "engy-local"
MINERS = ("miner-1", "miner-2")
HOTKEY_NAMES = ("owner", "master", "validator", "verifier", *MINERS)
VALIDATOR_STAKE = 1000.0

CHAIN_BLOCK_S = 1.0
CHAIN_PARAMS = SubnetParams(tempo=30, weights_rate_limit=10)
"""A tempo of 30 one-second blocks turns weights into incentive within half a minute; the rate
limit stays below the validator's resubmit interval, as on finney (100 vs 120)."""
CHAIN_PUBLISH_S = 1.0

EPOCH_S = 120
EPOCH_GRACE_S = 20
"""Two-minute epochs closing 20 s after they end: the first weights land within five minutes."""


@dataclasses.dataclass(frozen=True, slots=True)
class LocalIdentities:
    buyer_account: int
    buyer_key: str
    hotkeys: dict[str, str]
    """Local name (`owner`, `miner-1`, ...) -> ss58."""


def network_file(config: Config) -> Path:
    return config.paths.data_dir / "local" / "network.json"


def chain_file(config: Config) -> Path:
    return config.paths.data_dir / "local" / "devchain.json"


def buyer_file(config: Config) -> Path:
    """The local buyer's account and key, kept across restarts (network.json is not)."""
    return config.paths.data_dir / "local" / "buyer.json"


def wallets_dir(config: Config) -> Path:
    return config.paths.data_dir / "wallets"


def read_network(config: Config) -> dict[str, Any]:
    return _read_json(network_file(config))


def write_network(config: Config, document: dict[str, Any]) -> None:
    _write_private_json(network_file(config), document)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return document if isinstance(document, dict) else {}


def _write_private_json(path: Path, document: dict[str, Any]) -> None:
    """Atomically (temp file + rename) and readable only by its owner: these files hold a key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.stem}-", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)


def remove_network(config: Config, pid: int) -> None:
    """Remove network.json if it is still this process's (a second `up` may have replaced it)."""
    path = network_file(config)
    if read_network(config).get("pid") == pid:
        path.unlink(missing_ok=True)


def port_plan(
    base: int | None, *, buyer: int | None, miner: int | None, provider: int | None, control: int | None
) -> dict[str, int | None]:
    """The four ports from `--port-base` and the single-port flags (which win). None leaves the
    configured value."""
    derived: dict[str, int | None] = {"buyer": None, "miner": None, "provider": None, "control": None}
    if base is not None:
        if base != 0 and not 1 <= base <= 65532:
            raise EngyError(
                f"--port-base {base}: the network takes ports N..N+3, so N must be 1..65532 (0: free ports)"
            )
        derived = {
            name: 0 if base == 0 else base + offset
            for offset, name in enumerate(("buyer", "miner", "provider", "control"))
        }
    chosen = {"buyer": buyer, "miner": miner, "provider": provider, "control": control}
    return {name: chosen[name] if chosen[name] is not None else derived[name] for name in derived}


def parse_cheats(specs: Sequence[str]) -> dict[str, str]:
    """`--cheat MINER=NAME` flags as {local miner: cheat}; a flag that names no local miner, no
    known cheat, or a miner twice raises `EngyError` with the names there are."""

    cheats: dict[str, str] = {}
    for spec in specs:
        miner, equals, cheat = spec.partition("=")
        miner, cheat = miner.strip(), cheat.strip()
        if not equals or not miner or not cheat:
            raise EngyError(f"--cheat {spec!r}: write it as MINER=CHEAT, e.g. --cheat {MINERS[-1]}=noise-1%")
        if miner not in MINERS:
            raise EngyError(f"--cheat {spec!r}: no local miner {miner!r}; the local miners are {', '.join(MINERS)}")
        if miner in cheats:
            raise EngyError(f"--cheat {spec!r}: {miner} already simulates {cheats[miner]!r}; give one cheat per miner")
        check_simulated_cheat(cheat, where=f"--cheat {miner}=")
        cheats[miner] = cheat
    return cheats


def prepare_identities(config: Config) -> LocalIdentities:
    """Wallets, the buyer account and the miner registrations: created once, reused after (blocking)."""
    hotkeys = {name: keys.create_wallet(wallets_dir(config), LOCAL_WALLET, name) for name in HOTKEY_NAMES}
    # Homes from before buyer.json kept the key only in network.json.
    previous = _read_json(buyer_file(config)) or read_network(config)
    config.paths.data_dir.mkdir(parents=True, exist_ok=True)
    with Store.open(store_path(config)) as store:
        key = previous.get("buyer_key")
        account = store.authenticate(key) if isinstance(key, str) and key else None
        if account is None:
            account_id, buyer_key = store.create_buyer("local-buyer")
            store.credit(account_id, micro_usd=LOCAL_CREDIT_USD * 1_000_000, memo="engy-node up: starting credit")
            _write_private_json(buyer_file(config), {"buyer_account": account_id, "buyer_key": buyer_key})
            log.info("created the local buyer account %d with $%d of credit", account_id, LOCAL_CREDIT_USD)
        else:
            assert isinstance(key, str)  # the account was found by it
            account_id, buyer_key = account.account_id, key
            if not buyer_file(config).exists():
                _write_private_json(buyer_file(config), {"buyer_account": account_id, "buyer_key": buyer_key})
        registered = {record.hotkey for record in store.list_miners()}
        for name in MINERS:
            if hotkeys[name] not in registered:
                store.register_miner(f"local-{name}", hotkey=hotkeys[name])
    return LocalIdentities(account_id, buyer_key, hotkeys)


def open_chain(config: Config, hotkeys: dict[str, str]) -> DevChain:
    """The local dev chain, continued from its saved state, with every local neuron registered
    (blocking). A saved chain that cannot be read is moved aside, not silently replaced."""
    path = chain_file(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    chain = None
    if path.exists():
        try:
            chain = DevChain.load(path)
        except (OSError, ValueError, KeyError, TypeError) as err:
            aside = path.with_suffix(".unreadable.json")
            os.replace(path, aside)
            log.warning(
                "the saved dev chain %s could not be read (%s); moved it to %s and started a new chain",
                path,
                err,
                aside,
            )
    if chain is None:
        chain = DevChain(
            netuid=config.node.netuid,
            params=CHAIN_PARAMS,
            owner_hotkey=hotkeys["owner"],
            block_time_s=CHAIN_BLOCK_S,
            state_path=path,
        )
        log.info(
            "started a dev chain for netuid %d (%.0f s blocks, tempo %d, weights rate limit %d)",
            config.node.netuid,
            CHAIN_BLOCK_S,
            CHAIN_PARAMS.tempo,
            CHAIN_PARAMS.weights_rate_limit,
        )
    chain.register(hotkeys["validator"], stake_tao=VALIDATOR_STAKE)
    for name in MINERS:
        chain.register(hotkeys[name])
    return chain


def local_config(
    config: Config, identities: LocalIdentities, ports: dict[str, int | None], cheats: Mapping[str, str] | None = None
) -> Config:
    """The settings of a short CPU-only local network (docs/trust.md's profile), over `config`;
    a miner in `cheats` is not the operator's own, so it qualifies and can be pulled."""
    hotkeys = identities.hotkeys
    gateway = dataclasses.replace(
        config.gateway,
        workers=1,
        port=_pick(ports.get("buyer"), config.gateway.port),
        miner_port=_pick(ports.get("miner"), config.gateway.miner_port),
        provider_port=_pick(ports.get("provider"), config.gateway.provider_port),
        # The local miners are the operator's own: serving at once, still judged by the control plane.
        # One simulating a cheat is treated as anyone's, or nothing could ever pull it.
        first_party=",".join(hotkeys[name] for name in MINERS if name not in (cheats or {})),
        verifiers=hotkeys["verifier"],
        owner_hotkey=hotkeys["owner"],
        master_wallet=f"{LOCAL_WALLET}/master",
        wallets_path=str(wallets_dir(config)),
        epoch_s=EPOCH_S,
        epoch_grace_s=EPOCH_GRACE_S,
        gate_min_samples=1,
        traffic_time_scale=0.1,
        qualify_probes=3,
        probe_max_tokens=40,
        probe_concurrency=2,
        audit_paid_pct=25.0,
    )
    control = dataclasses.replace(config.control, port=_pick(ports.get("control"), config.control.port))
    return dataclasses.replace(config, gateway=gateway, control=control)


def _pick(chosen: int | None, configured: int) -> int:
    return configured if chosen is None else chosen


def banner(document: dict[str, Any], network_path: Path) -> str:
    """What a person needs to start calling the network (printed to stdout, never logged)."""
    api, key, model = document["buyer_api"], document["buyer_key"], document["models"][0]
    return f"""
engy local network is up.
  buyer API   {api}   (OpenAI and Anthropic routes)
  buyer key   {key}
  miners dial {document["miner_ws"]}
  provider    {document["provider_api"]}   (epochs, audit)
  control     {document["control_api"]["url"]}   (engy-node status, engy-tui --attach)
  details     {network_path}

  curl -s {api}/chat/completions -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{api}', api_key='{key}'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"

Epochs close every {EPOCH_S // 60} min ({EPOCH_GRACE_S} s grace); the validator then puts the weights on the dev chain.
`engy-node status` shows the network. Ctrl-C stops everything.
"""


async def run_up(
    config: Config,
    hub: Hub,
    *,
    ports: dict[str, int | None] | None = None,
    traffic: bool = False,
    cheats: Mapping[str, str] | None = None,
    actions: Actions | None = None,
    on_ready: Callable[[dict[str, Any]], None] | None = None,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the local network until cancelled. `actions` is the registry its control API serves
    (the TUI passes its own, to call them in-process); `cheats` ({local miner: cheat}, from
    `parse_cheats`) has those miners serve altered weights."""
    cheats = cheats or {}
    identities = await trio.to_thread.run_sync(prepare_identities, config)
    config = local_config(config, identities, ports or {}, cheats)
    chain = await trio.to_thread.run_sync(open_chain, config, identities.hotkeys)
    config = await trio.to_thread.run_sync(_watch_deposits, config, identities, chain)
    hotkeys = identities.hotkeys
    actions = actions if actions is not None else node_actions()
    hub.set_state("node", **_node_info(config, hotkeys))
    try:
        async with trio.open_nursery() as nursery:
            control = await nursery.start(
                functools.partial(
                    serve_control,
                    hub,
                    data_dir=config.paths.data_dir,
                    actions=actions,
                    node_info=_node_info(config, hotkeys),
                    host=config.control.host,
                    port=config.control.port,
                )
            )
            await nursery.start(_publish_chain, chain, hub, config.node.netuid)
            await nursery.start(run_gpu_monitor, hub)
            await nursery.start(run_alerts, config.alerts, hub)
            urls: GatewayUrls = await nursery.start(
                functools.partial(run_gateway, config, hub, local_verifier=run_local_verifier, deposit_chain=chain)
            )
            deposit = await trio.to_thread.run_sync(_demo_deposit, config, chain)
            await _start_together(
                nursery, [_miner_service(config, hub, name, urls, actions, cheats.get(name, "")) for name in MINERS]
            )
            await nursery.start(
                functools.partial(run_validator, _validator_config(config, urls, hotkeys), hub, substrate=chain)
            )
            await nursery.start(run_verifier_role, _verifier_config(config, urls), hub)
            document = {
                "pid": os.getpid(),
                "buyer_api": f"{urls.buyer_url}/v1",
                "buyer_key": identities.buyer_key,
                "buyer_account": identities.buyer_account,
                "miner_ws": urls.miner_url,
                "provider_api": urls.provider_url,
                "control_api": {"url": control.url, "token_file": str(control.token_file)},
                "models": [DEFAULT_LOCAL_MODEL],
                "hotkeys": hotkeys,
                "chain": {
                    "kind": "dev",
                    "netuid": config.node.netuid,
                    "block_time_s": CHAIN_BLOCK_S,
                    "tempo": CHAIN_PARAMS.tempo,
                    "state": str(chain_file(config)),
                },
                "epoch_s": EPOCH_S,
                "deposit": deposit,
            }
            if traffic:
                await nursery.start(_run_traffic, document, hub, actions)
            await trio.to_thread.run_sync(write_network, config, document)
            # Where to call it, for the dashboards; the key itself stays in the file (0600).
            hub.set_state(
                "network",
                buyer_api=document["buyer_api"],
                provider_api=urls.provider_url,
                miner_ws=urls.miner_url,
                control_api=control.url,
                details=str(network_file(config)),
            )
            if on_ready is not None:
                on_ready(document)
            task_status.started(document["buyer_api"])
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(remove_network, config, os.getpid())
            await trio.to_thread.run_sync(chain.save)


def _watch_deposits(config: Config, identities: LocalIdentities, chain: DevChain) -> Config:
    """`config` with the gateway watching the dev chain for the demo buyer's deposits (from the
    head now, when the store has no deposit cursor yet), the buyer's coldkey linked to its
    account before the gateway opens the store."""
    deposit_demo.link_buyer(store_path(config), account_id=identities.buyer_account, wallets_path=wallets_dir(config))
    gateway = deposit_demo.with_deposits(config.gateway, wallets_dir(config), start_block=chain.block)
    return dataclasses.replace(config, gateway=gateway)


def _demo_deposit(config: Config, chain: DevChain) -> dict[str, Any]:
    """Send the demo buyer's deposit once per home (`deposit_demo`); buyer.json remembers it."""
    recorded = _read_json(buyer_file(config))
    deposit = deposit_demo.send_once(
        chain,
        wallets_path=wallets_dir(config),
        deposit_address=config.gateway.deposit_address,
        previous=recorded.get("demo_deposit"),
    )
    if recorded.get("demo_deposit") != deposit:
        _write_private_json(buyer_file(config), {**recorded, "demo_deposit": deposit})
    return deposit


def _node_info(config: Config, hotkeys: dict[str, str]) -> dict[str, Any]:
    return {
        "version": __version__,
        "pid": os.getpid(),
        "roles": ["chain", "gateway", *MINERS, "validator", "verifier"],
        "started_at": time.time(),
        "home": str(config.paths.data_dir),
        "netuid": config.node.netuid,
        "network": "local",
        "hotkeys": hotkeys,
    }


def _miner_service(
    config: Config, hub: Hub, name: str, urls: GatewayUrls, actions: Actions, cheat: str = ""
) -> Callable[..., Awaitable[Any]]:
    # Each miner gets a home of its own inside ours, for its model server's home and logs.
    paths = dataclasses.replace(config.paths, data_dir=config.paths.data_dir / "local" / name)
    miner_config = dataclasses.replace(
        config,
        paths=paths,
        miner=dataclasses.replace(
            config.miner,
            gateway_url=urls.miner_url,
            model=DEFAULT_LOCAL_MODEL,
            miner_key="",
            serve_urls="",
            wallets_path=str(wallets_dir(config)),
            wallet_name=LOCAL_WALLET,
            wallet_hotkey=name,
            worker_name=name,
            simulate_cheat=cheat,
        ),
    )
    return functools.partial(
        run_miner,
        miner_config,
        hub,
        ready_when_admitted=True,
        hub_component=name,
        server_hub_component=f"model_server.{name}",
        actions=actions,
    )


def _validator_config(config: Config, urls: GatewayUrls, hotkeys: dict[str, str]) -> Config:
    return dataclasses.replace(
        config,
        validator=dataclasses.replace(
            config.validator,
            network="local",
            provider_url=urls.provider_url or "",
            master_hotkey=hotkeys["master"],
            wallets_path=str(wallets_dir(config)),
            wallet_name=LOCAL_WALLET,
            wallet_hotkey="validator",
            poll_s=5.0,
            resubmit_blocks=CHAIN_PARAMS.weights_rate_limit + 2,
            block_s=CHAIN_BLOCK_S,
        ),
    )


def _verifier_config(config: Config, urls: GatewayUrls) -> Config:
    return dataclasses.replace(
        config,
        verifier=dataclasses.replace(
            config.verifier,
            gateway_url=urls.provider_url or "",
            wallets_path=str(wallets_dir(config)),
            wallet_name=LOCAL_WALLET,
            wallet_hotkey="verifier",
            threads=1,
        ),
    )


async def _start_together(nursery: trio.Nursery, services: Sequence[Callable[..., Awaitable[Any]]]) -> None:
    """Start `services` in `nursery` concurrently (two miners load their models side by side) and
    return once all are ready; the first that fails to start fails the start-up."""

    async def start_one(service: Callable[..., Awaitable[Any]]) -> None:
        await nursery.start(service)

    async with trio.open_nursery() as starters:
        for service in services:
            starters.start_soon(start_one, service)


async def _publish_chain(chain: DevChain, hub: Hub, netuid: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Keep the dev chain's clock turning (an epoch runs when the chain catches up) and its state
    in the hub for `engy-node status` and the TUI."""
    task_status.started()
    while True:
        snapshot = await trio.to_thread.run_sync(_chain_snapshot, chain, netuid)
        hub.set_state("chain", **snapshot)
        await trio.sleep(CHAIN_PUBLISH_S)


def _chain_snapshot(chain: DevChain, netuid: int) -> dict[str, Any]:
    return {
        "network": "dev chain",
        "netuid": netuid,
        "block": chain.block,
        "block_time_s": chain.block_time_s,
        "tempo": CHAIN_PARAMS.tempo,
        "epochs_run": chain.epochs_run,
        "neurons": [
            {
                "uid": n.uid,
                "hotkey": n.hotkey,
                "stake": n.stake,
                "permit": n.permit,
                "active": n.active,
                "last_update": n.last_update,
                "incentive": n.incentive,
                "dividends": n.dividends,
                "emission": n.emission,
            }
            for n in chain.neurons(netuid)
        ],
        "weights": {
            str(uid): {str(target): value for target, value in row.items()}
            for uid, row in chain.weights(netuid).items()
        },
    }


async def _run_traffic(
    document: dict[str, Any], hub: Hub, actions: Actions, *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    from engy_node.local.traffic import TrafficGenerator

    generator = TrafficGenerator(
        buyer_api=document["buyer_api"],
        buyer_key=document["buyer_key"],
        models=document["models"],
        hub=hub,
        gap_s=3.0,
        max_tokens=48,
    )

    async def pause(params: dict[str, Any]) -> dict[str, Any]:
        generator.pause()
        return {"paused": True}

    async def resume(params: dict[str, Any]) -> dict[str, Any]:
        generator.resume()
        return {"paused": False}

    actions.register("pause-traffic", "pause the demo buyer traffic", pause)
    actions.register("resume-traffic", "resume the demo buyer traffic", resume)
    await generator.run(task_status=task_status)
