"""`engy-node up`'s deposit from the chain: the demo buyer pays TAO from a coldkey of its own and
the gateway credits it (docs/billing.md, "Deposits from the chain").

Once per home, at the network's first start, and with the real bittensor SDK on the dev chain:
the buyer's coldkey (wallet `engy-local-buyer`, unencrypted, a local network's only) is endowed
on the dev chain and linked to the buyer account, and it sends `DEMO_DEPOSIT_TAO` with
`bt.Transfer` to the gateway's deposit address (wallet `engy-local-gateway`'s coldkey). The
gateway's deposit watcher, reading the same dev chain, credits it after `CONFIRMATIONS` blocks
at `DEMO_USD_PER_TAO`. `buyer.json` remembers the extrinsic, so a restart never sends it again,
and the store's cursor and unique (block hash, extrinsic index) make the credit happen once.

Blocking: call it in a worker thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from engy_node.config import GatewaySection
from engy_node.errors import EngyError
from engy_node.gateway.store import Store
from engy_node.local.devchain import DevChain

log = logging.getLogger("engy.local")

BUYER_WALLET = "engy-local-buyer"
GATEWAY_WALLET = "engy-local-gateway"
DEMO_USD_PER_TAO = "400"
"""A made-up rate for the demo: 1 TAO credits $400."""
CONFIRMATIONS = 3
"""Three one-second dev chain blocks: the deposit is credited within seconds."""
DEMO_DEPOSIT_TAO = 1
ENDOWMENT_TAO = 100
"""What the dev chain gives the buyer's coldkey at genesis, enough for the demo and more."""


def coldkey_address(wallets_path: str | os.PathLike[str], name: str) -> str:
    """The ss58 coldkey of local wallet `name`, created unencrypted when missing."""
    return _coldkey_wallet(wallets_path, name).coldkeypub.ss58_address


def _coldkey_wallet(wallets_path: str | os.PathLike[str], name: str) -> Any:
    import bittensor as bt
    from bittensor.sp_core import KeyfileError

    wallet = bt.Wallet(name, "default", path=str(wallets_path))
    if not wallet.coldkey_file.exists_on_device():
        try:
            wallet.create_new_coldkey(use_password=False, suppress=True)
        except (OSError, KeyfileError) as error:
            raise EngyError(f"cannot create the coldkey of wallet {name!r} under {wallets_path}: {error}") from error
    return wallet


def with_deposits(gateway: GatewaySection, wallets_path: str | os.PathLike[str], *, start_block: int) -> GatewaySection:
    """`gateway` watching deposits to the local gateway wallet's coldkey on the dev chain, from
    `start_block` on when the store has no cursor yet."""
    return dataclasses.replace(
        gateway,
        deposit_address=coldkey_address(wallets_path, GATEWAY_WALLET),
        deposit_usd_per_tao=DEMO_USD_PER_TAO,
        deposit_confirmations=CONFIRMATIONS,
        deposit_network="local",
        deposit_start_block=start_block,
    )


def link_buyer(store_location: str | Path, *, account_id: int, wallets_path: str | os.PathLike[str]) -> str:
    """Link the buyer's coldkey to `account_id`; returns the coldkey. Call it before the gateway
    opens the store: a second SQLite connection opened and closed in the gateway's process while
    the gateway's is open left the gateway writing a WAL other processes no longer read (its
    charges were invisible to `engy-node gateway balance` until it stopped)."""
    sender: str = _coldkey_wallet(wallets_path, BUYER_WALLET).coldkeypub.ss58_address
    with Store.open(store_location) as store:
        store.link_coldkey(account_id, sender)
    return sender


def send_once(
    chain: DevChain,
    *,
    wallets_path: str | os.PathLike[str],
    deposit_address: str,
    previous: dict[str, Any] | None,
) -> dict[str, Any]:
    """Unless `previous` (what an earlier start recorded) says it was sent, send the demo deposit
    from the buyer's coldkey (linked by `link_buyer`); returns what to record."""
    wallet = _coldkey_wallet(wallets_path, BUYER_WALLET)
    sender = wallet.coldkeypub.ss58_address
    if previous and previous.get("extrinsic_id"):
        return previous
    import bittensor as bt

    if chain.free_balance(sender) < (DEMO_DEPOSIT_TAO + 1) * 10**9:
        chain.fund(sender, ENDOWMENT_TAO)
    client = bt.SyncClient("local", substrate=chain, fallback_endpoints=[])
    try:
        intent = bt.Transfer(dest_ss58=deposit_address, amount_tao=DEMO_DEPOSIT_TAO)
        result = client.execute(intent, wallet, wait_for_finalization=False)
    finally:
        client.close()
    if not result.success:
        raise EngyError(f"the demo deposit from {sender} failed on the dev chain: {result.message}")
    log.info(
        "demo deposit: %d TAO from the buyer's coldkey %s to the gateway's deposit address %s in extrinsic %s; "
        "credited after %d blocks at $%s per TAO (engy-node gateway deposits)",
        DEMO_DEPOSIT_TAO,
        sender,
        deposit_address,
        result.extrinsic_id,
        CONFIRMATIONS,
        DEMO_USD_PER_TAO,
    )
    return {
        "extrinsic_id": result.extrinsic_id,
        "tao": DEMO_DEPOSIT_TAO,
        "from": sender,
        "to": deposit_address,
    }
