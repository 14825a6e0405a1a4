"""The deposit watcher (engy_node/gateway/billing/deposit_watcher.py) against the dev chain, driven
by the REAL bittensor SDK: a buyer's wallet signs `bt.Transfer` to the deposit address, the watcher
reads the blocks and their `System.Events` through `bt.SyncClient`, and the deposit is credited
once its confirmations are in, once and only once across a restart of the watcher on the same
store."""

from __future__ import annotations

import functools
import os

import bittensor as bt
import httpx
import pytest
import trio

from engy_node.config import load_config
from engy_node.gateway import admin
from engy_node.gateway.billing.deposit_watcher import run_deposit_watcher
from engy_node.gateway.role import store_path
from engy_node.gateway.store import Store
from engy_node.local.devchain import DevChain
from tests.engy_node.gateway.conftest import StoppableGateway
from tests.waiting import logged, wait_until_async

DEPOSIT_ADDRESS = "5DAAnrj7VHTznn2AWBemMuyBwZWs6FNFjdyVXUeYum3PTXFy"  # //Dave
CONFIRMATIONS = 3
RATE = "400"  # USD per TAO


@pytest.fixture(autouse=True)
def sdk_files_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("BTCLI_TOKEN_SYMBOLS_CACHE", str(tmp_path / "token_symbols.json"))
    monkeypatch.setenv("BITTENSOR_RUNTIME_CACHE_DIR", str(tmp_path / "runtime-cache"))


@pytest.fixture
def chain():
    return DevChain(clock=lambda: 0.0, start_block=1000)


@pytest.fixture
def buyer(tmp_path, chain):
    wallet = bt.Wallet("buyer", "hotkey", path=str(tmp_path / "wallets"))
    wallet.create_new_coldkey(use_password=False, suppress=True)
    chain.fund(wallet.coldkeypub.ss58_address, 10)
    return wallet


@pytest.fixture
def store_file(tmp_path):
    return tmp_path / "gateway.sqlite3"


@pytest.fixture
def account_id(store_file, buyer):
    with Store(store_file) as store:
        account, _ = store.create_buyer("buyer")
        store.link_coldkey(account, buyer.coldkeypub.ss58_address)
    return account


def send(chain: DevChain, wallet: bt.Wallet, tao: float) -> bt.ExtrinsicResult:
    client = bt.SyncClient("local", substrate=chain, fallback_endpoints=[])
    try:
        return client.execute(
            bt.Transfer(dest_ss58=DEPOSIT_ADDRESS, amount_tao=tao), wallet, wait_for_finalization=False
        )
    finally:
        client.close()


def watcher(store: Store, chain: DevChain, **overrides):
    options = dict(
        address=DEPOSIT_ADDRESS,
        usd_per_tao=RATE,
        confirmations=CONFIRMATIONS,
        network="local",
        substrate=chain,
        poll_s=0.01,
    )
    return functools.partial(run_deposit_watcher, store, **{**options, **overrides})


async def scanned_through(store: Store, block: int) -> None:
    # The cursor is the watcher's only record of a pass that credited nothing; it announces none.
    def cursor() -> int:
        cursor = store.deposit_cursor(DEPOSIT_ADDRESS)
        return -1 if cursor is None else cursor.number

    await wait_until_async(lambda: cursor() >= block, timeout_s=30, what=f"the watcher to scan through block {block}")


async def test_a_dev_chain_deposit_is_credited_after_its_confirmations_once_across_a_restart(
    chain, buyer, store_file, account_id
):
    store = Store(store_file)
    try:
        async with trio.open_nursery() as nursery:
            with logged("engy.gateway.deposits", "credited to account") as credited:
                await nursery.start(watcher(store, chain))
                result = await trio.to_thread.run_sync(send, chain, buyer, 1.25)
                assert result.success, result
                await trio.to_thread.run_sync(chain.advance, CONFIRMATIONS - 1)
                with trio.fail_after(30):
                    await credited.seen.wait()
            nursery.cancel_scope.cancel()
    finally:
        store.close()
    # The restart: a new watcher on the same store, while the chain moves on.
    store = Store(store_file)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(watcher(store, chain))
            head = await trio.to_thread.run_sync(chain.advance, 10)
            await scanned_through(store, head - CONFIRMATIONS + 1)
            nursery.cancel_scope.cancel()
        (deposit,) = store.deposits_of(account_id)
        assert (deposit.extrinsic_id, deposit.amount_rao, deposit.micro_usd) == (
            result.extrinsic_id,
            1_250_000_000,
            500_000_000,
        )
        balance = store.balance(account_id)
        assert balance.credited == balance.available == 500_000_000
        assert store.check_books() == []
        listed = admin.list_deposits(store, account_id=account_id)
        assert (
            f"deposit {result.extrinsic_id}  1.250000000 TAO  $500.000000  from {buyer.coldkeypub.ss58_address}"
            in listed
        )
        assert "deposits  1 from the chain, $500.000000" in admin.show_balance(store, account_id=account_id)
    finally:
        store.close()


async def test_the_gateway_credits_a_dev_chain_deposit_once_across_its_restart(
    nursery, chain, buyer, tmp_path, checkpoint
):
    """The gateway role as `engy-node` runs it, its deposit watcher reading the dev chain: the
    deposit is credited once, and a restarted gateway rescanning the chain on the same store
    credits nothing more."""
    deposits = {
        "deposit_address": DEPOSIT_ADDRESS,
        "deposit_usd_per_tao": RATE,
        "deposit_confirmations": CONFIRMATIONS,
        "deposit_network": "local",
        "deposit_start_block": chain.block,
    }
    config = load_config(
        home=tmp_path / "home",
        env={k: v for k, v in os.environ.items() if k == "ENGY_MODEL_CACHE"},
        overrides={"gateway": {"port": 0, "miner_port": 0, "provider_port": 0, "qualification": False, **deposits}},
    )
    store = Store.open(store_path(config))
    try:
        account_id, api_key = store.create_buyer("buyer")
        store.link_coldkey(account_id, buyer.coldkeypub.ss58_address)
        gateway = StoppableGateway()
        with logged("engy.gateway.deposits", "credited to account") as credited:
            await nursery.start(functools.partial(gateway.run, config, deposit_chain=chain))
            result = await trio.to_thread.run_sync(send, chain, buyer, 1.25)
            assert result.success, result
            await trio.to_thread.run_sync(chain.advance, CONFIRMATIONS - 1)
            with trio.fail_after(30):
                await credited.seen.wait()
        await gateway.stop()
        assert store.balance(account_id).credited == 500_000_000
        # The restart: a new gateway on the same store rescans from its cursor while the chain moves on.
        gateway = StoppableGateway()
        urls = await nursery.start(functools.partial(gateway.run, config, deposit_chain=chain))
        head = await trio.to_thread.run_sync(chain.advance, 10)
        await scanned_through(store, head - CONFIRMATIONS + 1)
        # The buyer's usage report, from the restarted gateway: the one deposit, as its own kind.
        report = (
            await trio.to_thread.run_sync(
                lambda: httpx.get(
                    urls.buyer_url + "/v1/usage", headers={"authorization": f"Bearer {api_key}"}, timeout=60
                )
            )
        ).json()
        await gateway.stop()
        (listed,) = report["credits"]
        assert (listed["kind"], listed["extrinsic_id"], listed["micro_usd"]) == (
            "deposit",
            result.extrinsic_id,
            500_000_000,
        )
        assert report["ledger"]["deposited_micro_usd"] == report["ledger"]["credited_micro_usd"] == 500_000_000
        (deposit,) = store.deposits_of(account_id)
        assert (deposit.extrinsic_id, deposit.micro_usd) == (result.extrinsic_id, 500_000_000)
        balance = store.balance(account_id)
        assert (balance.credited, balance.available, balance.held, balance.charged) == (500_000_000, 500_000_000, 0, 0)
        assert store.check_books() == []
        assert admin.list_deposits(store, account_id=account_id).count(f"deposit {result.extrinsic_id}") == 1
        assert "deposits  1 from the chain, $500.000000" in admin.show_balance(store, account_id=account_id)
    finally:
        store.close()


async def test_a_watcher_stopped_before_the_confirmations_credits_the_deposit_once_after_its_restart(
    chain, buyer, store_file, account_id
):
    store = Store(store_file)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(watcher(store, chain))
            result = await trio.to_thread.run_sync(send, chain, buyer, 2)
            await trio.to_thread.run_sync(chain.advance, 1)
            await scanned_through(store, int(result.extrinsic_id.split("-")[0]) - 1)
            nursery.cancel_scope.cancel()
    finally:
        store.close()
    await trio.to_thread.run_sync(chain.advance, 5)
    store = Store(store_file)
    try:
        async with trio.open_nursery() as nursery:
            with logged("engy.gateway.deposits", "credited to account") as credited:
                await nursery.start(watcher(store, chain, start_block=1))  # ignored: the cursor is stored
                with trio.fail_after(30):
                    await credited.seen.wait()
                await scanned_through(store, chain.block - CONFIRMATIONS + 1)
            nursery.cancel_scope.cancel()
        assert [d.extrinsic_id for d in store.deposits_of(account_id)] == [result.extrinsic_id]
        assert store.balance(account_id).credited == 800_000_000
    finally:
        store.close()


async def test_transfers_from_an_unlinked_coldkey_or_elsewhere_are_skipped_and_logged(
    chain, buyer, store_file, account_id, tmp_path
):
    stranger = bt.Wallet("stranger", "hotkey", path=str(tmp_path / "wallets"))
    stranger.create_new_coldkey(use_password=False, suppress=True)
    chain.fund(stranger.coldkeypub.ss58_address, 5)
    store = Store(store_file)
    try:
        async with trio.open_nursery() as nursery:
            with logged("engy.gateway.deposits", "linked to no account") as skipped:
                await nursery.start(watcher(store, chain))
                await trio.to_thread.run_sync(send, chain, stranger, 1)
                await trio.to_thread.run_sync(chain.advance, CONFIRMATIONS)
                with trio.fail_after(30):
                    await skipped.seen.wait()
            nursery.cancel_scope.cancel()
        assert store.deposits_of(account_id) == [] and store.balance(account_id).credited == 0
    finally:
        store.close()


async def test_a_first_start_with_a_start_block_credits_a_deposit_made_before_it(chain, buyer, store_file, account_id):
    result = await trio.to_thread.run_sync(send, chain, buyer, 1)
    block = int(result.extrinsic_id.split("-")[0])
    await trio.to_thread.run_sync(chain.advance, CONFIRMATIONS)
    store = Store(store_file)
    try:
        async with trio.open_nursery() as nursery:
            with logged("engy.gateway.deposits", "credited to account") as credited:
                await nursery.start(watcher(store, chain, start_block=block))
                with trio.fail_after(30):
                    await credited.seen.wait()
            nursery.cancel_scope.cancel()
        assert [d.extrinsic_id for d in store.deposits_of(account_id)] == [result.extrinsic_id]
    finally:
        store.close()
