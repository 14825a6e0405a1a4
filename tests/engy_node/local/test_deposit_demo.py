"""`engy-node up`'s deposit demo (engy_node/local/deposit_demo.py) on the dev chain with the real SDK:
the buyer's coldkey is linked and sends its deposit once per home, and the gateway's settings
watch the local gateway wallet's coldkey."""

from __future__ import annotations

import bittensor as bt
import pytest

from engy_node.config import GatewaySection
from engy_node.gateway.store import Store
from engy_node.local import deposit_demo
from engy_node.local.devchain import DevChain


@pytest.fixture(autouse=True)
def sdk_files_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(tmp_path / "token_symbols.json"))
    monkeypatch.setenv("BITTENSOR_RUNTIME_CACHE_DIR", str(tmp_path / "runtime-cache"))


def test_the_demo_deposit_is_linked_sent_once_and_watched_at_the_gateway_wallet(tmp_path):
    chain = DevChain(clock=lambda: 0.0, start_block=1000)
    wallets, store_file = tmp_path / "wallets", tmp_path / "gateway.sqlite3"
    with Store(store_file) as store:
        account_id, _ = store.create_buyer("local-buyer")
    gateway = deposit_demo.with_deposits(GatewaySection(), wallets, start_block=chain.block)
    assert gateway.deposit_address == deposit_demo.coldkey_address(wallets, deposit_demo.GATEWAY_WALLET)
    assert (gateway.deposit_confirmations, gateway.deposit_start_block) == (deposit_demo.CONFIRMATIONS, 1000)
    linked = deposit_demo.link_buyer(store_file, account_id=account_id, wallets_path=wallets)
    sent = deposit_demo.send_once(
        chain,
        wallets_path=wallets,
        deposit_address=gateway.deposit_address,
        previous=None,
    )
    buyer = bt.Wallet(deposit_demo.BUYER_WALLET, "default", path=str(wallets)).coldkeypub.ss58_address
    assert sent["from"] == buyer == linked and chain.free_balance(gateway.deposit_address) == 10**9
    again = deposit_demo.send_once(
        chain,
        wallets_path=wallets,
        deposit_address=gateway.deposit_address,
        previous=sent,
    )
    assert again == sent and chain.free_balance(gateway.deposit_address) == 10**9, "sent once per home"
    with Store(store_file) as store:
        assert store.coldkey_links() == {buyer: account_id}
