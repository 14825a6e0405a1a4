"""`engy-node up`: a gateway and a miner on loopback, with a credited buyer key.

First version of SPEC §11: one command brings up a working network on a laptop with no GPU and no
chain access — a gateway, and a miner supervising the reference server on the embedded SmolLM2
model, admitted by a signed hotkey hello. It creates what it needs once (a local wallet, a buyer
account credited with `LOCAL_CREDIT_USD`, the miner's registration) and reuses it on every later
start, so a restart keeps the same key and balance.

`local/network.json` under the data dir says where everything is, for people and for tools: the
buyer API URL, the miner websocket URL, the buyer key and the hotkeys. It is written atomically
(temp file + rename) and readable only by its owner, since it holds a key.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import trio

from engy_node import keys
from engy_node.config import Config
from engy_node.gateway.role import GatewayUrls, run_gateway, store_path
from engy_node.gateway.store import Store
from engy_node.hub import Hub
from engy_node.miner.role import run_miner
from engy_node.models import DEFAULT_LOCAL_MODEL

log = logging.getLogger("engy.local")

LOCAL_CREDIT_USD = 10
"""Starting balance of the local buyer: at SmolLM2's local price card that is millions of tokens."""
LOCAL_WALLET = "engy-local"
MINER_HOTKEY = "miner-1"


@dataclasses.dataclass(frozen=True, slots=True)
class LocalIdentities:
    buyer_account: int
    buyer_key: str
    miner_hotkey: str


def network_file(config: Config) -> Path:
    return config.paths.data_dir / "local" / "network.json"


def wallets_dir(config: Config) -> Path:
    return config.paths.data_dir / "wallets"


def read_network(config: Config) -> dict[str, Any]:
    try:
        return json.loads(network_file(config).read_text())
    except (OSError, ValueError):
        return {}


def write_network(config: Config, document: dict[str, Any]) -> None:
    path = network_file(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=".network-", dir=path.parent)
    with os.fdopen(fd, "w") as handle:
        json.dump(document, handle, indent=2)
        handle.write("\n")
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)


def prepare_identities(config: Config) -> LocalIdentities:
    """Wallet, buyer account and miner registration: created once, reused after (blocking)."""
    hotkey = keys.create_wallet(wallets_dir(config), LOCAL_WALLET, MINER_HOTKEY)
    previous = read_network(config)
    config.paths.data_dir.mkdir(parents=True, exist_ok=True)
    with Store.open(store_path(config)) as store:
        account = store.authenticate(previous.get("buyer_key", "")) if previous.get("buyer_key") else None
        if account is None:
            account_id, buyer_key = store.create_buyer("local-buyer")
            store.credit(account_id, micro_usd=LOCAL_CREDIT_USD * 1_000_000, memo="engy-node up: starting credit")
            log.info("created the local buyer account %d with $%d of credit", account_id, LOCAL_CREDIT_USD)
        else:
            account_id, buyer_key = account.account_id, previous["buyer_key"]
        if not any(record.hotkey == hotkey for record in store.list_miners()):
            store.register_miner(f"local-{MINER_HOTKEY}", hotkey=hotkey)
    return LocalIdentities(account_id, buyer_key, hotkey)


def banner(document: dict[str, Any], network_path: Path) -> str:
    """What a person needs to start calling the network (printed to stdout, never logged)."""
    api, key, model = document["buyer_api"], document["buyer_key"], document["models"][0]
    return f"""
engy local network is up.
  buyer API   {api}   (OpenAI and Anthropic routes)
  buyer key   {key}
  miners dial {document["miner_ws"]}
  details     {network_path}

  curl -s {api}/chat/completions -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{api}', api_key='{key}'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"

Ctrl-C stops everything.
"""


async def run_up(config: Config, hub: Hub, *, on_ready=None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    identities = await trio.to_thread.run_sync(prepare_identities, config)
    # The local miner is the operator's own: serving at once, still judged by the control plane.
    config = dataclasses.replace(config, gateway=dataclasses.replace(config.gateway, first_party=identities.miner_hotkey))
    async with trio.open_nursery() as nursery:
        urls: GatewayUrls = await nursery.start(run_gateway, config, hub)
        miner_config = dataclasses.replace(config, miner=dataclasses.replace(
            config.miner, gateway_url=urls.miner_url, model=DEFAULT_LOCAL_MODEL, miner_key="",
            wallets_path=str(wallets_dir(config)), wallet_name=LOCAL_WALLET, wallet_hotkey=MINER_HOTKEY,
        ))
        await nursery.start(functools.partial(run_miner, miner_config, hub, ready_when_admitted=True))
        document = {
            "buyer_api": f"{urls.buyer_url}/v1",
            "buyer_key": identities.buyer_key,
            "buyer_account": identities.buyer_account,
            "miner_ws": urls.miner_url,
            "provider_api": urls.provider_url,
            "models": [DEFAULT_LOCAL_MODEL],
            "hotkeys": {MINER_HOTKEY: identities.miner_hotkey},
            "control_api": None,
        }
        await trio.to_thread.run_sync(write_network, config, document)
        if on_ready is not None:
            on_ready(document)
        task_status.started(document["buyer_api"])
